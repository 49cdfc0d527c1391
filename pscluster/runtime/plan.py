"""TrainPlan: the one thing that crosses from the control plane to the runtime.

A frozen, validated description of a training run with a JSON form, so the same
plan reaches engines through ipyparallel and plain processes through a file or
an environment variable.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from ..errors import ConfigError

MODES = ("sync", "async")


@dataclass(frozen=True)
class VariableSpec:
    """A model parameter as the ps sees it: id, name, shape, dtype and home ps task."""

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    ps: int

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def placement(self) -> str:
        """The TF-style listing line, e.g. ``fc1.weight: /job:ps/task:0``."""
        return f"{self.name}: /job:ps/task:{self.ps}"


def describe_variables(model: torch.nn.Module, placement: dict[str, int]) -> tuple[VariableSpec, ...]:
    """The VariableSpecs of ``model``'s parameters, in ``named_parameters()`` order."""
    return tuple(VariableSpec(id=i, name=n, shape=tuple(p.shape), dtype=str(p.dtype).removeprefix("torch."),
                              ps=placement[n])
                 for i, (n, p) in enumerate(model.named_parameters()))


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

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}: use 'sync' or 'async'")
        for name in ("steps", "batch_size", "replicas_to_aggregate", "num_workers", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: use a positive integer")
        if not 0 < self.run_id < 2**32:
            raise ConfigError("run_id must fit in 32 bits and be non-zero")
        if self.request_timeout <= 0:
            raise ConfigError("request_timeout must be positive (seconds)")
        resolve_optimizer(self.optimizer)
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
