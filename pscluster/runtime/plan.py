"""TrainPlan: the one thing that crosses from the control plane to the runtime.

A frozen, validated description of a training run with a JSON form, so the same
plan reaches engines through ipyparallel and plain processes through a file or
an environment variable.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import torch

from ..errors import ConfigError
from .placement import Variable, placement_line, shard_map

MODES = ("sync", "async", "ssp")
# What the ps can apply sparse gradients with (Adam and AdamW as the lazy SparseAdam)
SPARSE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True)
class VariableSpec:
    """What one ps holds of a model parameter: all of it, or rows ``[start, start + shape[0])`` of it
    (a shard, named ``<variable>/part_<k>``). ``sparse``: the parameter of an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` with ``sparse=True``, pulled and pushed by rows."""

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    ps: int
    variable: str = ""   # the model parameter; "" means the same as name
    start: int = 0
    sparse: bool = False

    @property
    def parameter(self) -> str:
        return self.variable or self.name

    @property
    def partitioned(self) -> bool:
        return self.parameter != self.name

    @property
    def part(self) -> int | None:
        """k of a shard named ``<variable>/part_<k>``; None for a whole variable."""
        return int(self.name.rpartition("/part_")[2]) if self.partitioned else None

    @property
    def stop(self) -> int:
        return self.start + (self.shape[0] if self.shape else 1)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def placement(self) -> str:
        """The TF-style listing line, e.g. ``fc1.weight: /job:ps/task:0``."""
        return placement_line(self.name, self.ps, (self.start, self.stop) if self.partitioned else None,
                              self.nbytes)


def sparse_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``, by their weight's name."""
    return {f"{prefix}.weight" if prefix else "weight": m for prefix, m in model.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


def describe_variables(model: torch.nn.Module, num_ps: int, placement="round_robin",
                       partition=None) -> tuple[VariableSpec, ...]:
    """The VariableSpecs of ``model``'s parameters (``named_parameters()`` order), split by ``partition``
    and placed by ``placement`` (see ``pscluster.runtime.placement.shard_map``)."""
    params = dict(model.named_parameters())
    sparse = sparse_modules(model)
    shards = shard_map([Variable(n, tuple(p.shape), p.element_size()) for n, p in params.items()], num_ps,
                       placement, partition)
    return tuple(VariableSpec(id=i, name=s.name, shape=s.shape, ps=s.ps,
                              dtype=str(params[s.variable].dtype).removeprefix("torch."),
                              variable="" if s.part is None else s.variable, start=s.start,
                              sparse=s.variable in sparse)
                 for i, s in enumerate(shards))


def assemble(variables, messages) -> dict[str, torch.Tensor]:
    """Whole parameters by name from the (ids, tensors) of ``messages`` that hold every variable of
    ``variables``; the shards of a partitioned parameter are joined in row order."""
    received = {vid: t for m in messages for vid, t in zip(m.ids, m.tensors)}
    parts: dict[str, list] = {}
    for v in sorted(variables, key=lambda v: v.start):
        parts.setdefault(v.parameter, []).append(received[v.id])
    order = list(dict.fromkeys(v.parameter for v in variables))
    return {name: torch.cat(parts[name]).clone() if len(parts[name]) > 1 else parts[name][0].clone()
            for name in order}


def resolve_optimizer(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class for a ``torch.optim`` class name (any case) or a ``module:Class`` path."""
    if ":" in name:
        import importlib
        module, _, qualname = name.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            raise ConfigError(f"optimizer {name!r} not found: give an importable 'module:Class'") from None
        if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
                and obj is not torch.optim.Optimizer):
            raise ConfigError(f"{name!r} is not an optimizer: give a torch.optim.Optimizer subclass")
        return obj
    by_lower = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
                if isinstance(getattr(torch.optim, n), type)
                and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
                and getattr(torch.optim, n) is not torch.optim.Optimizer}
    try:
        return by_lower[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown optimizer {name!r}: use a torch.optim class such as "
                          "SGD, Adam or Adagrad") from None


def optimizer_name(optimizer) -> str:
    """The plan's name for an optimizer given as a class or a name."""
    if isinstance(optimizer, str):
        resolve_optimizer(optimizer)
        return optimizer
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        if getattr(torch.optim, optimizer.__name__, None) is optimizer:
            return optimizer.__name__
        return f"{optimizer.__module__}:{optimizer.__qualname__}"
    raise ConfigError(f"optimizer {optimizer!r}: pass a torch.optim class (e.g. torch.optim.SGD) or its name")


@dataclass(frozen=True)
class TrainPlan:
    """Everything the ps and the workers need to know about one run."""

    run_id: int
    mode: str
    steps: int
    batch_size: int
    optimizer: str
    optimizer_kwargs: dict = field(default_factory=dict)
    replicas_to_aggregate: int = 1
    num_workers: int = 1
    variables: tuple[VariableSpec, ...] = ()
    seed: int = 0
    log_every: int = 100
    metrics_address: str | None = None
    request_timeout: float = 120.0
    staleness_bound: int = 2  # ssp: how many steps a worker may run ahead of the slowest
    checkpoint_dir: str | None = None  # where the ps tasks write their shards (None: no checkpoints)
    checkpoint_every: int = 0  # global steps between checkpoints (0: only on demand and at the end)
    restore: bool = False  # the chief starts from the latest checkpoint in checkpoint_dir, if there is one
    attempt: int = 0  # restarts of this run after a lost ps
    shared_memory: bool = True  # workers exchange dense values with ps on their host through shared memory
    pipeline: bool = False  # async: a worker computes its next gradients while its push-pull is in flight

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}: use 'sync', 'async' or 'ssp'")
        if isinstance(self.staleness_bound, bool) or not isinstance(self.staleness_bound, int) \
                or self.staleness_bound < 0:
            raise ConfigError(f"staleness_bound={self.staleness_bound!r}: use an integer >= 0 (steps a worker "
                              "may run ahead of the slowest)")
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every!r}: use a number of global steps >= 1, "
                              "or 0 for checkpoints on demand and at the end only")
        for name in ("steps", "batch_size", "replicas_to_aggregate", "num_workers", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: use a positive integer")
        if not 0 < self.run_id < 2**32:
            raise ConfigError("run_id must fit in 32 bits and be non-zero")
        if self.request_timeout <= 0:
            raise ConfigError("request_timeout must be positive (seconds)")
        if self.pipeline and self.mode != "async":
            raise ConfigError(f"pipeline=True with mode={self.mode!r}: use mode='async' (a {self.mode} step waits "
                              "for the other workers, so gradients computed ahead of it would be dropped as stale)")
        if self.pipeline and any(v.sparse for v in self.variables):
            raise ConfigError("pipeline=True with sparse embeddings: their rows are pulled during forward; build "
                              "them with sparse=False, or train without pipeline")
        optimizer = resolve_optimizer(self.optimizer)
        if any(v.sparse for v in self.variables) and optimizer not in SPARSE_OPTIMIZERS:
            raise ConfigError(f"{optimizer.__name__} cannot update sparse embeddings: use SGD, Adagrad or Adam, "
                              "or build the embedding with sparse=False")
        try:
            json.dumps(self.optimizer_kwargs)
        except TypeError:
            raise ConfigError("optimizer keyword arguments must be plain numbers, strings, "
                              "lists or booleans: pass the optimizer's own options") from None

    def variables_on(self, ps: int) -> tuple[VariableSpec, ...]:
        return tuple(v for v in self.variables if v.ps == ps)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "TrainPlan":
        d = json.loads(text)
        d["variables"] = tuple(VariableSpec(**{**v, "shape": tuple(v["shape"])}) for v in d["variables"])
        return cls(**d)
