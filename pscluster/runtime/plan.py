"""TrainPlan: the one thing that crosses from the control plane to the runtime.

A frozen, validated description of a training run with a JSON form, so the same
plan reaches engines through ipyparallel and plain processes through a file or
an environment variable.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import torch

from ..errors import ConfigError
from ..footprint import placement_line
from .data import LoaderOptions, training_input
from .options import DEFAULTS, OPTIONS, PLAN, RunOptions, defaults, split
from .optim import SPARSE_OPTIMIZERS, OptimizerSpec, check_keywords, named_groups, resolve_optimizer, sparse_modules
from .policies import POLICIES, policy_for
from .protocol import NO_TASK
from .seeding import build_model
from .sharding import Variable, shard_map

KINDS = ("param", "frozen", "buffer")


@dataclass(frozen=True)
class VariableSpec:
    """What one ps holds of a tensor of the model's ``state_dict()``: all of it, or rows
    ``[start, start + shape[0])`` of it (a shard, named ``<variable>/part_<k>``). ``kind``: ``param`` (trained:
    workers push its gradients, the ps's optimizer updates it), ``frozen`` (a parameter with
    ``requires_grad=False``: never pushed, never changed, kept for the state_dict) or ``buffer`` (workers push
    its value, kept by the run's buffer rule, see ``TrainPlan.buffers``). ``sparse``: the parameter of an
    ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``sparse=True``, pulled and pushed by rows."""

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    ps: int
    variable: str = ""   # the model parameter; "" means the same as name
    start: int = 0
    sparse: bool = False
    kind: str = "param"
    optimizer: int = 0  # a user's loop with several optimizers: the one whose steps push it (``more_optimizers``)

    @property
    def trainable(self) -> bool:
        return self.kind == "param"

    @property
    def exchanged(self) -> bool:
        """Dense and moved every step: a gradient (of a trained parameter) or a value (of a buffer)."""
        return not self.sparse and self.kind != "frozen"

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
                              self.nbytes, self.kind)


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, tuple[torch.Tensor, str]], tuple[tuple[str, str], ...]]:
    """The tensors of ``model.state_dict()``, each once: ``{name: (tensor, kind)}`` in state_dict order, named by
    the first key that holds it, and ``(key, name)`` for every key of the state_dict (a tied parameter has
    several keys for one tensor). Kinds as in ``VariableSpec``."""
    tensors: dict[str, tuple[torch.Tensor, str]] = {}
    first: dict[int, str] = {}
    keys = []
    for key, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"state_dict entry {key!r} is a {type(t).__name__}, not a tensor: keep extra state "
                              "out of the model's state_dict")
        if id(t) not in first:
            first[id(t)] = key
            kind = ("param" if t.requires_grad else "frozen") if isinstance(t, torch.nn.Parameter) else "buffer"
            tensors[key] = (t, kind)
        keys.append((key, first[id(t)]))
    return tensors, tuple(keys)


def describe_variables(model: torch.nn.Module, num_ps: int, placement=DEFAULTS.placement,
                       partition=None) -> tuple[VariableSpec, ...]:
    """The VariableSpecs of ``model``'s state (``model_tensors``: parameters, frozen parameters, buffers, in
    state_dict order), split by ``partition`` and placed by ``placement`` (see
    ``pscluster.runtime.sharding.shard_map``)."""
    tensors, _ = model_tensors(model)
    sparse = sparse_modules(model)
    shards = shard_map([Variable(n, tuple(t.shape), t.element_size()) for n, (t, _) in tensors.items()], num_ps,
                       placement, partition)
    return tuple(VariableSpec(id=i, name=s.name, shape=s.shape, ps=s.ps,
                              dtype=str(tensors[s.variable][0].dtype).removeprefix("torch."),
                              variable="" if s.part is None else s.variable, start=s.start,
                              sparse=s.variable in sparse, kind=tensors[s.variable][1])
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


def state_dict_of(state_keys, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` from its tensors by variable name (``assemble``'s result): every key of
    ``state_keys`` (``(key, name)`` pairs, see ``model_tensors``) in order, a tied tensor under each of its
    keys, as torch's own state_dict has it. Without ``state_keys`` (a plan of an older pscluster): ``values``."""
    if not state_keys:
        return dict(values)
    return {key: values[name] for key, name in state_keys}


class CarriesOptions:
    """A frozen dataclass with an ``options`` field: the run's options of scope ``PLAN`` (those the ps tasks and
    workers read), every one of them (those not given at their defaults; ``replicas_to_aggregate``, one per
    worker unless given). They read as its attributes
    (``plan.mode`` is ``plan.options.mode``) and are given and changed by name beside its own fields (``of``,
    ``replace``); its dict and JSON forms hold them as ``options``."""

    def _fill_options(self) -> None:
        given = RunOptions(self.options)
        stray = [name for name in given if OPTIONS[name].scope != PLAN]
        if stray:
            raise ValueError(f"{type(self).__name__} carries the run options the ps tasks and workers read, not "
                             f"{stray}")
        options = RunOptions({**defaults(PLAN), **given})
        if options.replicas_to_aggregate is None:  # one gradient per worker
            options = options.replace(replicas_to_aggregate=self.num_workers)
        object.__setattr__(self, "options", options)

    def __getattr__(self, name: str):
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"{type(self).__name__} has no {name!r}")

    @classmethod
    def _split(cls, settings: dict) -> tuple[dict, dict]:
        own = {f.name for f in fields(cls)} - {"options"}
        return {k: v for k, v in settings.items() if k in own}, {k: v for k, v in settings.items() if k not in own}

    @classmethod
    def of(cls, options=(), **settings):
        """One made of ``settings``, its own fields and run options by name, and of ``options`` (RunOptions or a
        dict) for the options not named."""
        own, named = cls._split(settings)
        return cls(**own, options=RunOptions({**dict(options), **named}))

    def replace(self, **changes):
        """This one with ``changes``: its own fields and run options by name."""
        own, options = self._split(changes)
        return dataclasses.replace(self, **own, options=self.options.replace(**options))

    def to_dict(self) -> dict:
        return {**asdict(self), "options": dict(self.options)}


@dataclass(frozen=True)
class TrainPlan(CarriesOptions):
    """Everything the ps and the workers need to know about one run: its options (``options``, read as attributes:
    ``plan.mode``, ``plan.steps``; see ``CarriesOptions``) and what the run made of the others. ``steps``: None for
    a user's loop that ends when every worker's loop returns; ``batch_size``: None for a user's loop, whose
    batches are its own (``ctx.shard``); ``replicas_to_aggregate``: resolved (one per worker unless given)."""

    run_id: int
    optimizer: str  # the optimizer of every ps: its name, options, parameter groups and schedule (``optim``)
    options: RunOptions = field(default_factory=RunOptions)
    optimizer_kwargs: dict = field(default_factory=dict)
    optimizer_groups: tuple = ()
    scheduler: str | None = None
    scheduler_options: dict = field(default_factory=dict)
    num_workers: int = 1
    variables: tuple[VariableSpec, ...] = ()
    metrics_address: str | None = None
    checkpoint_dir: str | None = None  # where the ps tasks write their shards (None: no checkpoints)
    eval_every: int = 0  # global steps between the checkpoints the controller evaluates (0: no evaluation)
    attempt: int = 0  # restarts of this run after a lost ps
    state_keys: tuple[tuple[str, str], ...] = ()  # every key of the model's state_dict and the variable it holds
    loader: LoaderOptions = LoaderOptions()  # how each worker reads its batches (loader processes, prefetch...)
    modules: tuple[str, ...] = ()  # a user's loop: the names of the modules it registers (``context``); () for train's
    session: bool = False  # a notebook's session: the workers' loop takes its batches from it (``session_worker``)
    # a user's loop with several optimizers: the specs (``OptimizerSpec.to_dict()``) of those after the first, whose
    # variables say so (``VariableSpec.optimizer``); the first one's steps are the global steps
    more_optimizers: tuple[dict, ...] = ()

    def __post_init__(self):
        self._fill_options()
        for name in ("replicas_to_aggregate", "num_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: use a positive integer")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"eval_every={self.eval_every!r}: use a number of global steps >= 1")
        if not 0 < self.run_id < 2**32:
            raise ConfigError("run_id must fit in 32 bits and be non-zero")
        if self.steps is None and self.batch_size is not None:
            raise ConfigError("steps=None: pscluster's own loop trains to a step target; give steps=N (a loop of "
                              "your own, cluster.run(train_fn), can end with its epochs instead)")
        if self.max_grad_norm is not None:
            if any(v.sparse for v in self.variables):
                raise ConfigError("max_grad_norm with sparse embeddings: torch clips dense gradients only; build "
                                  "the embedding with sparse=False, or train without max_grad_norm")
        if self.pipeline and not policy_for(self).allows_pipeline:
            allowed = " or ".join(f"mode={name!r}" for name, policy in POLICIES.items() if policy.allows_pipeline)
            raise ConfigError(f"pipeline=True with mode={self.mode!r}: use {allowed} (a {self.mode} step waits "
                              "for the other workers, so gradients computed ahead of it would be dropped as stale)")
        if self.pipeline and any(v.sparse for v in self.variables):
            raise ConfigError("pipeline=True with sparse embeddings: their rows are pulled during forward; build "
                              "them with sparse=False, or train without pipeline")
        spec = self.optimizer_spec  # checks the options, and holds them as JSON data from here on
        object.__setattr__(self, "optimizer", spec.optimizer)  # a torch name as torch spells it: one name everywhere
        object.__setattr__(self, "optimizer_kwargs", spec.kwargs)
        object.__setattr__(self, "optimizer_groups", spec.groups)
        object.__setattr__(self, "scheduler_options", spec.scheduler_options)
        cls = resolve_optimizer(self.optimizer) if ":" not in self.optimizer else None  # others: where built
        if any(v.sparse for v in self.variables) and cls is not None and cls not in SPARSE_OPTIMIZERS:
            raise ConfigError(f"{cls.__name__} cannot update sparse embeddings: use SGD, Adagrad or Adam, "
                              "or build the embedding with sparse=False")

    @classmethod
    def for_model(cls, model: torch.nn.Module, optimizer: OptimizerSpec, *, num_ps: int, placement=DEFAULTS.placement,
                  partition=None, **settings) -> "TrainPlan":
        """The plan of training ``model`` with ``optimizer`` on ``num_ps`` ps tasks: its state as variables placed by
        ``placement`` and ``partition`` (``describe_variables``), its state_dict keys, the optimizer's fields, and
        ``settings`` for the other fields and options (see ``of``)."""
        return cls.of(variables=describe_variables(model, num_ps, placement, partition),
                      state_keys=model_tensors(model)[1], optimizer=optimizer.optimizer,
                      optimizer_kwargs=optimizer.kwargs, optimizer_groups=optimizer.groups,
                      scheduler=optimizer.scheduler, scheduler_options=optimizer.scheduler_options, **settings)

    @property
    def optimizer_specs(self) -> list[OptimizerSpec]:
        """Every optimizer of the run, the one whose steps are the global steps first."""
        return [self.optimizer_spec, *(OptimizerSpec.from_dict(d) for d in self.more_optimizers)]

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        return OptimizerSpec(optimizer=self.optimizer, kwargs=self.optimizer_kwargs, groups=self.optimizer_groups,
                             scheduler=self.scheduler, scheduler_options=self.scheduler_options)

    def variables_on(self, ps: int) -> tuple[VariableSpec, ...]:
        return tuple(v for v in self.variables if v.ps == ps)

    def settings(self) -> dict:
        """The run's settings as the run store keeps them, its options among its other fields: the plan less its
        id and its model's variables."""
        d = self.to_dict()
        return {**d.pop("options"), **{k: v for k, v in d.items() if k not in ("run_id", "variables", "state_keys")}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "TrainPlan":
        d = json.loads(text)
        d["variables"] = tuple(VariableSpec(**{**v, "shape": tuple(v["shape"])}) for v in d["variables"])
        d["state_keys"] = tuple(tuple(k) for k in d.get("state_keys", ()))
        d["optimizer_groups"] = tuple(d.get("optimizer_groups", ()))
        d["modules"] = tuple(d.get("modules", ()))
        d["more_optimizers"] = tuple(d.get("more_optimizers", ()))
        d["loader"] = LoaderOptions(**d.get("loader", {}))
        d["options"] = RunOptions(d.get("options", {}))
        return cls(**d)


class Training(NamedTuple):
    """What ``training_plan`` makes of an entry's arguments."""

    plan: TrainPlan
    options: RunOptions  # every option of the entry, as given or at its default
    dataset: object  # a DataLoader given as the dataset: its dataset
    collate_fn: object
    model: torch.nn.Module  # as model_fn builds it under the run's seed


def training_plan(model_fn, dataset, keywords: dict, *, entry: str, of, num_ps: int, num_workers: int,
                  param_groups=None, scheduler=None, scheduler_options: dict | None = None,
                  collate_fn=None) -> Training:
    """The run of pscluster's own loop that ``of`` (``Cluster.train``, a script's ``train_from_environment``)
    was asked for: ``keywords`` are ``entry``'s options and the optimizer's keyword arguments; the optimizer is the
    ``optimizer`` option with them, ``param_groups`` (name patterns) and its schedule; a DataLoader given as
    ``dataset`` is taken apart. Checks the input, the options, the placement and the optimizer's keywords, each a
    one-line ConfigError; what torch refuses of the optimizer is ``optim.check``'s."""
    given, optimizer_kwargs = split(entry, keywords)
    options = RunOptions.take(entry, given, caller=f"{of.__name__}()")
    check_keywords(options.optimizer, optimizer_kwargs, of=of, caller=f"{of.__name__}()")
    dataset, batch_size, collate_fn, loader = training_input(dataset, options.batch_size, collate_fn,
                                                             options.loader_workers, options.prefetch_factor,
                                                             options.pin_memory)
    model = build_model(model_fn, options.seed)
    if not any(True for _ in model.parameters()):
        raise ConfigError("the model has no parameters to train: check model_fn")
    groups = named_groups(param_groups or (), (model_fn if isinstance(model_fn, torch.nn.Module) else model)
                          .named_parameters())
    optimizer = OptimizerSpec(options.optimizer, optimizer_kwargs, groups=groups, scheduler=scheduler,
                              scheduler_options=scheduler_options or {})
    plan = TrainPlan.for_model(model, optimizer, num_ps=num_ps, placement=options.placement,
                               partition=options.partition, run_id=1, num_workers=num_workers, loader=loader,
                               options=options.of(PLAN).replace(batch_size=batch_size))
    return Training(plan, options, dataset, collate_fn, model)


# the target a ps serves a run without one to: no run reaches it, and it fits the wire's signed 64-bit step
UNBOUNDED_STEPS = 2**62


@dataclass(frozen=True)
class PsConfig(CarriesOptions):
    """What the chief tells one ps at INIT (as JSON, beside the initial values): the run's options and settings,
    taken from its TrainPlan and nothing else (``for_ps``; a run without a step target has ``UNBOUNDED_STEPS``),
    the variables this ps holds, and for a restore the step it starts from, the names of the optimizer state
    tensors sent after the values and the schedule's state. Checked on construction, where the ps reads it too: a
    config out of bounds is a ValueError."""

    num_workers: int
    optimizer: dict  # optim.OptimizerSpec.to_dict()
    names: tuple[str, ...]
    options: RunOptions = field(default_factory=RunOptions)
    sparse: tuple[bool, ...] = ()
    kinds: tuple[str, ...] = ()
    more_optimizers: tuple[dict, ...] = ()  # a user's loop with several: the others' specs (``TrainPlan``)
    optimizer_of: tuple[int, ...] = ()  # per variable: the optimizer that trains it (0 for all when empty)
    metrics_address: str | None = None
    checkpoint_dir: str | None = None
    eval_every: int = 0  # a shard at every multiple of it too, for the controller's evaluations
    attempt: int = 0
    step: int = 0
    state: tuple[str, ...] = ()  # a restore: the optimizer slot of each state tensor after the values
    schedule_state: dict = field(default_factory=dict)

    def __post_init__(self):
        self._fill_options()
        if self.steps is None:
            raise ValueError("a ps serves a run to a step target: UNBOUNDED_STEPS for one without")
        n = len(self.names)
        object.__setattr__(self, "names", tuple(str(name) for name in self.names))
        object.__setattr__(self, "sparse", tuple(bool(x) for x in self.sparse) or (False,) * n)
        object.__setattr__(self, "kinds", tuple(str(k) for k in self.kinds) or ("param",) * n)
        object.__setattr__(self, "state", tuple(str(s) for s in self.state))
        object.__setattr__(self, "more_optimizers", tuple(self.more_optimizers))
        object.__setattr__(self, "optimizer_of", tuple(int(k) for k in self.optimizer_of) or (0,) * n)
        if len(self.optimizer_of) != n or not all(0 <= k <= len(self.more_optimizers) for k in self.optimizer_of):
            raise ValueError(f"optimizer_of {list(self.optimizer_of)} for {n} variables and "
                             f"{1 + len(self.more_optimizers)} optimizers")
        if len(self.sparse) != n or len(self.kinds) != n or not set(self.kinds) <= set(KINDS):
            raise ValueError(f"{len(self.sparse)} sparse flags and kinds {list(self.kinds)} for {n} variables: one "
                             f"each, kinds of {KINDS}")
        if not 1 <= self.num_workers <= NO_TASK or not 1 <= self.replicas_to_aggregate <= NO_TASK:
            raise ValueError(f"{self.num_workers} workers, {self.replicas_to_aggregate} replicas: 1 to {NO_TASK} "
                             "each")  # worker task ids are 16 bits, NO_TASK excepted
        if not 0 <= self.step <= self.steps or self.staleness_bound < 0 or min(self.checkpoint_every,
                                                                                 self.eval_every) < 0:
            raise ValueError(f"step {self.step} of {self.steps}, staleness bound {self.staleness_bound}, checkpoint "
                             f"every {self.checkpoint_every}: none may be negative, the step not past the end")

    @classmethod
    def for_ps(cls, plan: TrainPlan, ps: int) -> "PsConfig":
        """The config of ps ``ps`` for ``plan`` (a fresh start: step 0)."""
        mine = plan.variables_on(ps)
        return cls(options=plan.options.replace(steps=UNBOUNDED_STEPS if plan.steps is None else plan.steps),
                   num_workers=plan.num_workers, optimizer=plan.optimizer_spec.to_dict(),
                   more_optimizers=plan.more_optimizers, optimizer_of=tuple(v.optimizer for v in mine),
                   names=tuple(v.name for v in mine), sparse=tuple(v.sparse for v in mine),
                   kinds=tuple(v.kind for v in mine), metrics_address=plan.metrics_address,
                   checkpoint_dir=plan.checkpoint_dir, eval_every=plan.eval_every, attempt=plan.attempt)

    @classmethod
    def from_dict(cls, d: dict) -> "PsConfig":
        """The config an INIT carries; ValueError naming what does not fit."""
        try:
            return cls(**{**d, "options": RunOptions(d.get("options", {}))})
        except TypeError as e:
            raise ValueError(f"INIT config: {e}") from None
