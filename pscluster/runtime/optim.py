"""The torch optimizer of a run: one typed, JSON-able spec of the optimizer, its parameter groups and its
learning-rate schedule, checked by the controller and built by every ps.

Call order:

1. Controller, at ``train()``: ``spec = OptimizerSpec(optimizer, kwargs, groups=..., scheduler=...,
   scheduler_options=...)``; classes and functions given as objects are named and registered in this
   process. Then ``check(model, spec, steps=steps)``; then ``register(shipped(spec))`` on every ps engine through
   ipyparallel (nothing to ship when the spec names torch classes and importable ``module:Class`` paths
   only); then INIT carries ``spec.to_dict()``.
2. ps, at INIT: ``opt = build(named_variables, OptimizerSpec.from_dict(d), sparse=flags, chunk_numel=sizes)``.
   At a restore to global step S: ``opt.load_state(param, state)`` per variable, then
   ``opt.restore(S, schedule_state)``.
3. ps, for the update from global step s to s + 1: ``lr = opt.plain_sgd_rate(s)``; given a rate, the ps adds
   ``-lr * grad`` to the variables itself; given None, it sets their ``.grad`` and calls ``opt.step(s)``. A
   large variable whose gradient arrives in chunks may instead be updated chunk by chunk as they arrive:
   ``opt.step_chunk(s, param, k, grad_chunk)`` for each chunk k of ``opt.chunk_numel(param)`` elements (with a
   rate, the ps adds ``-lr * grad_chunk`` to that chunk itself).
4. ps, at a checkpoint: ``opt.state(param)`` per variable and ``opt.schedule_state()`` (JSON).

A schedule is stepped on the global step: the update from step s uses the learning rate the schedule gives
for step s, as in a torch loop that calls ``scheduler.step()`` after each ``optimizer.step()``. Every ps
holds its own optimizer over its own variables and steps its own schedule on the same global steps, so the
ps tasks agree.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import importlib
import inspect
import json
import math
import re
import threading
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

import torch
from torch.optim import lr_scheduler

from ..errors import ConfigError
from . import update_guard
from .tagged import COUNTER, TENSOR, TUPLE, tag_of

# What the ps can apply sparse gradients with (Adam and AdamW as the lazy SparseAdam)
SPARSE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam, torch.optim.AdamW)
_SPARSE_ADAM_OPTIONS = ("lr", "betas", "eps")
_MAX_TENSOR_ELEMENTS = 1024  # an option given as a tensor travels in the INIT's JSON
# Schedulers whose learning rate is a function of the step alone: a fast-forward jumps to the step
_CLOSED_FORM = (lr_scheduler.LambdaLR, lr_scheduler.OneCycleLR, lr_scheduler.CyclicLR)
# torch warns when a scheduler steps before its optimizer ever did, as it does on the plain-SGD fast path
_STEP_ORDER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
_PART = re.compile(r"/part_\d+$")
_OPTIMIZER_FIX = "pass the optimizer's own options"
_SCHEDULE_FIX = "give a function of the global step that returns the learning-rate factor"
_STEP_SCHEDULES = ("use a schedule of the step: a torch.optim.lr_scheduler class such as StepLR, "
                   "CosineAnnealingLR or OneCycleLR, or a function of the step that returns the learning-rate factor")

# Optimizers whose update of an element depends on that element alone and on per-variable scalars (the step,
# the learning rate): stepping a variable chunk by chunk is stepping it whole
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
               torch.optim.Adadelta)

_registry: dict[str, object] = {}


def preload() -> None:
    """Import what the first torch optimizer built in a process imports (``torch._dynamo``: about 800 modules,
    1.2-1.5 s of CPU on this project's 2-core machines), so that a process pays it when it starts, not at a run's
    first ``check`` or INIT. Engines call it before they fork, the controller in a thread beside its start."""
    import torch._dynamo  # noqa: F401


def preload_in_background() -> None:
    """``preload`` in a daemon thread; a caller that builds an optimizer meanwhile waits on the import."""
    threading.Thread(target=preload, name="pscluster-preload", daemon=True).start()


def sparse_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's modules whose weight gets sparse gradients (``nn.Embedding`` / ``nn.EmbeddingBag`` with
    ``sparse=True``), by their weight's name: the ps applies those with a ``SPARSE_OPTIMIZERS`` class."""
    return {f"{prefix}.weight" if prefix else "weight": m for prefix, m in model.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}


# --- names -------------------------------------------------------------------------------------
def register(objects: dict[str, object]) -> None:
    """Make classes and functions resolvable by their spec names (``shipped`` gives both) in this process;
    names are looked up here before they are imported. The cluster calls it on each ps engine before INIT."""
    for name, obj in objects.items():
        if not isinstance(name, str) or ":" not in name or not callable(obj):
            raise ConfigError(f"register({name!r}: {obj!r}): give 'module:name' keys and classes or functions, "
                              "as shipped(spec) returns them")
    _registry.update(objects)


def shipped(spec: OptimizerSpec) -> dict[str, object]:
    """The objects of this process's registry that ``spec`` names: what to ``register`` on each ps before
    INIT. Classes and functions given to ``OptimizerSpec`` as objects are registered when it is built."""
    return {name: _registry[name] for name in (spec.optimizer, spec.scheduler) if name in _registry}


def _name(obj) -> str:
    """The spec name of a class or function given as an object, registered in this process: ``module:qualname``,
    plus ``@<id>`` when that path cannot tell it apart (a lambda, a local class, a partial)."""
    qualname = getattr(obj, "__qualname__", None)
    name = f"{getattr(obj, '__module__', None) or type(obj).__module__}:{qualname or type(obj).__qualname__}"
    if not qualname or "<" in qualname:
        name += f"@{id(obj):x}"  # unique while registered: the registry keeps the object alive
    _registry[name] = obj
    return name


def _lookup(name: str, kind: str):
    if name in _registry:
        return _registry[name]
    module, _, qualname = name.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"{kind} {name!r} not found: give an importable 'module:Name', or pass the object itself "
                          "so that it is shipped to the ps tasks") from None
    return obj


def _torch_classes(module, base) -> dict[str, type]:
    return {n.lower(): c for n, c in vars(module).items()
            if not n.startswith("_") and isinstance(c, type) and issubclass(c, base) and c is not base}


def _is_optimizer(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer


def resolve_optimizer(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class for a ``torch.optim`` class name (any case), a registered name or an importable
    ``module:Class`` path."""
    if ":" not in name:
        try:
            return _torch_classes(torch.optim, torch.optim.Optimizer)[name.lower()]
        except KeyError:
            raise ConfigError(f"unknown optimizer {name!r}: use a torch.optim class such as "
                              "SGD, Adam or Adagrad") from None
    obj = _lookup(name, "optimizer")
    if not _is_optimizer(obj):
        raise ConfigError(f"{name!r} is not an optimizer: give a torch.optim.Optimizer subclass")
    return obj


def check_keywords(optimizer, kwargs: dict, *, of, caller: str) -> None:
    """A one-line ConfigError for a keyword argument that function ``of`` (``caller``) passes on to the optimizer
    (a class, or a name ``resolve_optimizer`` takes) and the optimizer does not take, naming the closest of both
    their keywords: a misspelt ``steps`` is the caller's, not an option the optimizer refuses. Optimizers that take
    any keyword pass."""
    options = [name for name, p in inspect.signature(of).parameters.items() if p.kind is p.KEYWORD_ONLY
               or p.kind is p.POSITIONAL_OR_KEYWORD]
    try:
        cls = optimizer if _is_optimizer(optimizer) else resolve_optimizer(optimizer)
        parameters = inspect.signature(cls).parameters
    except (ConfigError, TypeError, ValueError):  # not resolvable here: built, and refused, where it is built
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    takes = [name for name in parameters if name != "params"]
    for name in kwargs:
        if name not in takes:
            close = difflib.get_close_matches(name, [*options, *takes], n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"use one of {cls.__name__}'s: {', '.join(takes)}"
            raise ConfigError(f"{caller} got unknown option {name!r}, neither its own nor {cls.__name__}'s: {hint}")


def optimizer_name(optimizer) -> str:
    """The spec's name for an optimizer given as a class or a name: a ``torch.optim`` class by its name as torch
    spells it (``sgd``: ``SGD``), another class as ``module:Class`` (registered in this process, see ``shipped``)."""
    if isinstance(optimizer, str):
        cls = resolve_optimizer(optimizer)
        return optimizer if ":" in optimizer else cls.__name__
    if _is_optimizer(optimizer):
        if getattr(torch.optim, optimizer.__name__, None) is optimizer:
            return optimizer.__name__
        return _name(optimizer)
    raise ConfigError(f"optimizer {optimizer!r}: pass a torch.optim class (e.g. torch.optim.SGD) or its name")


def _schedule(obj, name: str):
    """``obj`` as a schedule: a scheduler class stepped on the global step, or a function of the step."""
    if isinstance(obj, type) and issubclass(obj, lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(f"scheduler {name} needs a validation metric, which the ps tasks never see: "
                          f"{_STEP_SCHEDULES}")
    if isinstance(obj, type) and issubclass(obj, (lr_scheduler.SequentialLR, lr_scheduler.ChainedScheduler)):
        raise ConfigError(f"scheduler {name} composes scheduler objects, which cannot travel to a ps: give a "
                          "function of the step that returns the learning-rate factor (warmup, then decay)")
    is_scheduler = isinstance(obj, type) and issubclass(obj, lr_scheduler.LRScheduler) \
        and obj not in (lr_scheduler.LRScheduler, lr_scheduler._LRScheduler)
    if not is_scheduler and (isinstance(obj, type) or not callable(obj)):
        raise ConfigError(f"{name!r} is not a schedule: {_STEP_SCHEDULES}")
    return obj


def resolve_scheduler(name: str):
    """The scheduler class or schedule function for a ``torch.optim.lr_scheduler`` class name (any case), a
    registered name or an importable ``module:name`` path. Schedules that need a metric (ReduceLROnPlateau)
    or scheduler objects (SequentialLR, ChainedScheduler) are refused."""
    if ":" in name:
        return _schedule(_lookup(name, "scheduler"), name)
    found = _torch_classes(lr_scheduler, lr_scheduler.LRScheduler).get(name.lower())
    if found is None:
        raise ConfigError(f"unknown scheduler {name!r}: {_STEP_SCHEDULES}")
    return _schedule(found, name)


def _scheduler_name(scheduler) -> str:
    if isinstance(scheduler, str):
        if ":" not in scheduler:  # a torch name: checked now; other names are resolved where they are built
            resolve_scheduler(scheduler)
        return scheduler
    name = getattr(scheduler, "__name__", repr(scheduler))
    _schedule(scheduler, name)
    if getattr(lr_scheduler, name, None) is scheduler:
        return name
    return _name(scheduler)


# --- values as JSON ------------------------------------------------------------------------------
def _encode(value, what: str):
    """``value`` as JSON data, tuples, Counters and tensors tagged so that ``_decode`` gives them back.
    ConfigError for a NaN or an infinity: an option that is not finite makes every value it updates NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{what}={value}: give a finite number (a NaN or infinite option turns the values it "
                          "updates into NaN)")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() > _MAX_TENSOR_ELEMENTS or value.is_complex():
            raise ConfigError(f"{what}: a {tuple(value.shape)} {value.dtype} tensor; give a real tensor of at most "
                              f"{_MAX_TENSOR_ELEMENTS} elements, or a number")
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ConfigError(f"{what}: a tensor with NaN or infinite elements; give finite values")
        return {TENSOR: {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                            "data": value.detach().cpu().flatten().tolist()}}
    if isinstance(value, tuple):
        return {TUPLE: [_encode(v, what) for v in value]}
    if isinstance(value, list):
        return [_encode(v, what) for v in value]
    if isinstance(value, Counter):
        return {COUNTER: [[_encode(k, what), _encode(v, what)] for k, v in value.items()]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v, f"{what}[{k!r}]") for k, v in value.items()}
    raise ConfigError(f"{what}={value!r} has no JSON form (the ps tasks get the spec, and checkpoints keep the "
                      "schedule, as JSON): give numbers, bools, strings, None, tuples, lists, dicts or small tensors")


def _decode(data):
    """The values ``_encode`` was given (fresh tensors each time: a scheduler changes a tensor lr in place)."""
    if isinstance(data, list | tuple):
        return type(data)(_decode(v) for v in data)
    if not isinstance(data, dict):
        return data
    tagged = tag_of(data)
    if tagged is not None:
        tag, body = tagged
        if tag == TUPLE:
            return tuple(_decode(v) for v in body)
        if tag == COUNTER:
            return Counter({_decode(k): _decode(v) for k, v in body})
        if tag == TENSOR:
            dtype = getattr(torch, str(body["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"tensor of dtype {body['dtype']!r}: give a torch dtype name such as 'float32'")
            return torch.tensor(body["data"], dtype=dtype).reshape(body["shape"])
    return {k: _decode(v) for k, v in data.items()}


def _options(options, what: str) -> dict:
    """Keyword arguments in their JSON form (given as values, or as that form already)."""
    if not isinstance(options, dict) or not all(isinstance(k, str) and k.isidentifier() for k in options):
        raise ConfigError(f"{what}s {options!r}: give a dict of keyword arguments")
    return {k: _encode(v, f"{what} {k}") for k, v in _decode(options).items()}


def _group(group, i: int) -> dict:
    if not isinstance(group, dict) or "params" not in group:
        raise ConfigError(f"group {i} is a {type(group).__name__} without 'params': give a dict of 'params' "
                          "(parameter name patterns such as '*.bias') and the options that differ from the "
                          "optimizer's keyword arguments")
    patterns = [group["params"]] if isinstance(group["params"], str) else group["params"]
    if not isinstance(patterns, list | tuple) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError(f"group {i} params is {_kind(group['params'])}: give parameter name patterns such as "
                          "['*.bias', '*norm*'] (fnmatch, matched against model.named_parameters() names), or the "
                          "model's own parameter tensors with the model itself as model_fn")
    options = _options({k: v for k, v in group.items() if k != "params"}, f"group {i} option")
    return {"params": list(patterns), **options}


def _kind(value) -> str:
    """A short description of a value for an error line (never its repr: a tensor's runs to pages)."""
    if isinstance(value, list | tuple):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {len(value)} ({', '.join(kinds[:3]) or 'empty'})"
    return f"a {type(value).__name__}"


def literal_pattern(name: str) -> str:
    """An fnmatch pattern that matches ``name`` alone (its ``*``, ``?`` and ``[`` in brackets)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def named_groups(groups, named_parameters) -> tuple:
    """Parameter groups as torch builds them (``{"params": [tensors], **options}``, or a generator of tensors:
    what ``model.configure_optimizers()`` returns) with each tensor replaced by its name in ``named_parameters``
    (``(name, parameter)`` pairs, as ``model.named_parameters()`` gives them), as a pattern matching that name
    alone; groups given by name patterns are kept as they are. ConfigError naming the group of a tensor that is
    no parameter there."""
    names = {id(p): n for n, p in named_parameters}
    out = []
    for i, group in enumerate(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is not None and not isinstance(params, str | list | tuple):  # a generator, as torch takes
            params = list(params)
        if not isinstance(params, list | tuple) or not params or not all(isinstance(p, torch.Tensor) for p in params):
            out.append(group)
            continue
        missing = [k for k, p in enumerate(params) if id(p) not in names]
        if missing:
            raise ConfigError(f"group {i} params[{missing[0]}] (a tensor of shape {tuple(params[missing[0]].shape)}) "
                              "is no parameter of the model: build the groups from the model's own parameters")
        out.append({**group, "params": [literal_pattern(names[id(p)]) for p in params]})
    return tuple(out)


@dataclass(frozen=True)
class OptimizerSpec:
    """A run's optimizer, held as JSON data (the form ``to_dict`` gives and INIT carries).

    ``optimizer``: a ``torch.optim`` class or name, another optimizer class, or a ``module:Class`` name.
    ``kwargs``: its keyword arguments: numbers, bools, strings, None, tuples, lists, dicts, small tensors.
    ``groups``: ``{"params": [patterns], **options}`` dicts: a parameter joins the first group with a pattern
    (fnmatch) matching its parameter name (``emb.weight`` for the row shard ``emb.weight/part_1``), and
    that group's options override ``kwargs`` for it; parameters matching none are in the default group, with
    ``kwargs`` alone. The optimizer's param_groups are the groups in order, then the default group, on every ps
    (empty where a ps holds none of a group's parameters): a per-group list in ``scheduler_options`` has one
    entry per group and a last one for the default group.
    ``scheduler``: a ``torch.optim.lr_scheduler`` class or name (or ``module:Class``), built with
    ``scheduler_options``; or a function of the global step returning the learning-rate factor (as the
    ``lr_lambda`` of LambdaLR), called with ``scheduler_options`` as keyword arguments.
    Classes and functions given as objects are named and registered in this process (see ``shipped``).
    """

    optimizer: str = "SGD"
    kwargs: dict = field(default_factory=dict)
    groups: tuple = ()
    scheduler: str | None = None
    scheduler_options: dict = field(default_factory=dict)

    def __post_init__(self):
        optimizer = self.optimizer
        if not isinstance(optimizer, str):
            optimizer = optimizer_name(optimizer)
        elif ":" not in optimizer:  # a torch name, checked now and spelt as torch does; others resolve where built
            optimizer = resolve_optimizer(optimizer).__name__
        kwargs = _options(self.kwargs, "optimizer option")
        if "params" in kwargs:
            raise ConfigError("optimizer option 'params': each ps gives the optimizer its own variables; choose "
                              "parameters with groups=[{'params': ['*.bias'], ...}]")
        if not isinstance(self.groups, list | tuple):
            raise ConfigError(f"groups={self.groups!r}: give a list of {{'params': [patterns], **options}} dicts")
        scheduler = None if self.scheduler is None else _scheduler_name(self.scheduler)
        scheduler_options = _options(self.scheduler_options, "scheduler option")
        if scheduler is None and scheduler_options:
            raise ConfigError("scheduler_options without a scheduler: give scheduler=, e.g. 'StepLR'")
        for reserved in ("optimizer", "last_epoch"):
            if reserved in scheduler_options:
                raise ConfigError(f"scheduler option {reserved!r}: each ps builds its schedule on its own optimizer "
                                  "and steps it on the global step, restores included; drop it")
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "kwargs", kwargs)
        object.__setattr__(self, "groups", tuple(_group(g, i) for i, g in enumerate(self.groups)))
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "scheduler_options", scheduler_options)

    def to_dict(self) -> dict:
        return asdict(self) | {"groups": [dict(g) for g in self.groups]}

    @classmethod
    def from_dict(cls, d: dict) -> OptimizerSpec:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"optimizer spec keys {sorted(unknown)}: give those of OptimizerSpec.to_dict()")
        return cls(**d)


# --- building ------------------------------------------------------------------------------------
def _refusal(what: str, options: dict, error: Exception, fix: str) -> ConfigError:
    """One line: ``<what> refused <the options the error names, else all>: <its message> — <fix>``."""
    message = " ".join(str(error).split()) or type(error).__name__
    named = {k: v for k, v in options.items() if re.search(rf"\b{re.escape(k)}\b", message)} or options
    shown = f" refused {', '.join(f'{k}={v!r}' for k, v in named.items())}" if named else " failed"
    return ConfigError(f"{what}{shown}: {message} — {fix}")


def _fused(cls, groups, kwargs: dict) -> torch.optim.Optimizer:
    """``cls(groups(), **kwargs)``, fused where torch has a fused kernel for it and the user chose no
    implementation: one pass over each parameter per step, no temporaries of its size (a ps's memory)."""
    if "fused" not in kwargs and "foreach" not in kwargs and "fused" in inspect.signature(cls).parameters:
        try:
            return cls(groups(), **kwargs, fused=True)
        except (RuntimeError, ValueError):  # options or dtypes the fused kernel does not take
            pass
    return cls(groups(), **kwargs)  # fresh groups: torch fills the dicts it is given with its defaults


def _group_of(name: str, groups: tuple) -> int:
    parameter = _PART.sub("", name)
    for i, group in enumerate(groups):
        if any(fnmatch.fnmatchcase(parameter, pattern) for pattern in group["params"]):
            return i
    return len(groups)


def build(named_params: list[tuple[str, torch.nn.Parameter]], spec: OptimizerSpec, *,
          sparse: list[bool] | None = None, chunk_numel: list[int | None] | None = None) -> PsOptimizer:
    """The optimizer of one ps over its variables (``(name, parameter)``, names as the plan gives them, row
    shards as ``<param>/part_<k>``); ``sparse[i]``: variable i gets sparse gradients. The dense optimizer
    exists always (over empty groups where the ps holds no dense variable, so that it carries the schedule);
    the sparse one where there are sparse variables: SparseAdam for Adam and AdamW (lr, betas and eps only),
    SGD and Adagrad as they are. ``chunk_numel[i]``: the elements of each chunk variable i's gradient may arrive
    in; with an ``ELEMENTWISE`` optimizer, a dense variable of more elements is stepped as views of it of that
    many elements (``step_chunk``). Every refusal is a one-line ConfigError."""
    sparse = [False] * len(named_params) if sparse is None else [bool(s) for s in sparse]
    if len(sparse) != len(named_params):
        raise ConfigError(f"{len(sparse)} sparse flags for {len(named_params)} variables: give one per variable")
    cls = resolve_optimizer(spec.optimizer)
    kwargs = _decode(spec.kwargs)
    options = [{k: v for k, v in _decode(g).items() if k != "params"} for g in spec.groups] + [{}]
    place = [_group_of(name, spec.groups) for name, _ in named_params]
    chunks = {}
    if cls in ELEMENTWISE:
        for (_, p), s, n in zip(named_params, sparse, chunk_numel or [None] * len(named_params)):
            if n and not s and p.numel() > n:
                chunks[p] = _Chunks(p, n)

    def groups(want_sparse: bool, keep=None):
        return [{"params": [v for (_, p), g, s in zip(named_params, place, sparse) if g == i and s == want_sparse
                            for v in (chunks[p].views if p in chunks else [p])],
                 **{k: v for k, v in opts.items() if keep is None or k in keep}} for i, opts in enumerate(options)]

    try:
        dense = _fused(cls, functools.partial(groups, False), kwargs)
    except Exception as e:  # torch and user classes raise anything from a constructor; its message is kept
        raise _refusal(f"optimizer {spec.optimizer}", kwargs, e, _OPTIMIZER_FIX) from None
    for i, opts in enumerate(options[:-1]):  # torch checks the values of its defaults only: check each group's
        try:
            cls([torch.nn.Parameter(torch.zeros(1))], **{**kwargs, **opts})
        except Exception as e:
            raise _refusal(f"optimizer {spec.optimizer} group {i}", opts, e, _OPTIMIZER_FIX) from None
    optimizers = [dense]
    if any(sparse):
        if cls in (torch.optim.Adam, torch.optim.AdamW):
            keep = _SPARSE_ADAM_OPTIONS
            sparse_cls, sparse_kwargs = torch.optim.SparseAdam, {k: v for k, v in kwargs.items() if k in keep}
        elif cls in SPARSE_OPTIMIZERS:
            keep, sparse_cls, sparse_kwargs = None, cls, kwargs
        else:
            raise ConfigError(f"{cls.__name__} cannot update sparse embeddings: use SGD, Adagrad or Adam, "
                              "or build the embedding with sparse=False")
        try:
            optimizers.append(sparse_cls(groups(True, keep), **sparse_kwargs))
        except Exception as e:
            raise _refusal(f"sparse optimizer {sparse_cls.__name__}", sparse_kwargs, e, _OPTIMIZER_FIX) from None
    schedulers = [_scheduler(o, spec) for o in optimizers] if spec.scheduler else []
    return PsOptimizer(optimizers, schedulers, chunks)


def _scheduler(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> lr_scheduler.LRScheduler:
    schedule, options = resolve_scheduler(spec.scheduler), _decode(spec.scheduler_options)
    try:
        if isinstance(schedule, type):
            return schedule(optimizer, **options)
        return lr_scheduler.LambdaLR(optimizer, functools.partial(schedule, **options) if options else schedule)
    except ConfigError:
        raise
    except Exception as e:  # the user's function or scheduler class may raise anything
        if isinstance(schedule, type):
            raise _refusal(f"scheduler {spec.scheduler}", options, e, "pass the scheduler's own options") from None
        raise _refusal(f"schedule {spec.scheduler} (at step 0)", options, e, _SCHEDULE_FIX) from None


def group_options(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The numeric options of each of ``optimizer``'s param groups (its learning rate, betas...): what a push of a
    user's loop carries for the ps's update (``PsOptimizer.set_options``). ConfigError for one the loop made NaN
    or infinite (the ps would refuse it, and the loop's lr would be lost)."""
    groups = [{k: v for k, v in g.items() if k in optimizer.defaults and numeric_option(v, finite=False)}
              for g in optimizer.param_groups]
    for i, options in enumerate(groups):
        for key, value in options.items():
            if not numeric_option(value):
                raise ConfigError(f"param group {i} of {type(optimizer).__name__} has {key}={value}: the loop (or "
                                  "its scheduler) set it; give a finite number")
    return groups


def numeric_option(value, finite: bool = True) -> bool:
    """A number (not a bool), or a tuple or list of them, each finite where ``finite``: a group option a loop may
    change per step."""
    if isinstance(value, list | tuple):
        return bool(value) and all(_number(v, finite) for v in value)
    return _number(value, finite)


def _length(value) -> int | None:
    return len(value) if isinstance(value, list | tuple) else None


def _number(value, finite: bool = True) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and (math.isfinite(value) or not finite)


def spec_of(optimizer: torch.optim.Optimizer, named_parameters, cls: type | None = None) -> OptimizerSpec:
    """The OptimizerSpec of a torch optimizer built on the parameters ``named_parameters`` names (``(name,
    parameter)`` pairs): its class (``cls``, default its type), its defaults as the keyword arguments, and each of
    its param groups by the names of its parameters, with the options in which the group differs from the defaults. A ps builds the same optimizer
    over its own variables from it, with the same implementation (``foreach``, ``fused`` as given, not a ps's own
    choice: the user's loop is the reference). ConfigError for a parameter the optimizer updates that is not
    named."""
    cls = cls or type(optimizer)
    accepted = inspect.signature(cls).parameters  # AdamW's defaults hold an option it does not take
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        options = {k: v for k, v in group.items() if k in defaults and not _same(v, defaults[k])}
        trained = [p for p in group["params"] if p.requires_grad]  # frozen ones never change: the ps keeps them
        if not trained:
            raise ConfigError(f"group {i} of the optimizer holds no trainable parameter: leave it out, or set "
                              "requires_grad=True on those it should train")
        groups.append({"params": trained, **options})
    return OptimizerSpec(cls, defaults, groups=named_groups(groups, named_parameters))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool((a == b).all()))
    return type(a) is type(b) and a == b


class _Chunks:
    """The views of a large variable, ``numel`` elements each (the last one shorter), that its optimizer steps
    in its place: each view is a parameter of its own to the optimizer, with optimizer state of its own."""

    def __init__(self, param: torch.Tensor, numel: int):
        self.param, self.numel = param, numel
        self.bounds = [(a, min(a + numel, param.numel())) for a in range(0, param.numel(), numel)]
        self.views = [torch.nn.Parameter(self._slice(a, b)) for a, b in self.bounds]

    def _slice(self, a: int, b: int) -> torch.Tensor:
        return self.param.detach().view(-1)[a:b]

    def rebind(self) -> None:
        """Point the views at the variable's memory again (after its ``.data`` moved to new memory)."""
        for view, (a, b) in zip(self.views, self.bounds):
            view.data = self._slice(a, b)

    def set_grads(self, grad: torch.Tensor | None) -> None:
        """Give each view its slice of the variable's ``grad`` (None: clear them)."""
        flat = None if grad is None else grad.reshape(-1)
        for view, (a, b) in zip(self.views, self.bounds):
            view.grad = None if flat is None else flat[a:b]

    def merged(self, states: list[dict], join=None) -> dict:
        """The variable's optimizer state from its views' ``states``: per-element entries put together by
        ``join(pieces, shape)`` (default: concatenated in the variable's shape), per-variable ones (the step) as
        the first view has them; {} unless every view has state (one that has not been stepped yet)."""
        if not all(states):
            return {}
        join = join or (lambda pieces, shape: torch.cat(pieces).view(shape))
        return {key: join(tuple(s[key] for s in states), tuple(self.param.shape))
                if isinstance(value, torch.Tensor) and value.shape == self.views[0].shape else value
                for key, value in states[0].items()}

    def split(self, state: dict) -> list[dict]:
        """Per view, its optimizer state from the variable's ``state`` (per-element entries as views of it,
        per-variable ones copied: a view's step counts on its own)."""
        shape = self.param.shape
        return [{key: value.reshape(-1)[a:b] if isinstance(value, torch.Tensor) and value.shape == shape
                 else value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
                for a, b in self.bounds]


class PsOptimizer:
    """A ps's optimizers (``optimizers``: the dense one, then the sparse one if any) and their schedules, stepped
    on the global step; ``chunks``: the large variables the dense one steps as views of them (see ``build``)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], schedulers: list[lr_scheduler.LRScheduler],
                 chunks: dict | None = None):
        self.optimizers = tuple(optimizers)
        self._schedulers = schedulers
        self._chunks: dict[torch.Tensor, _Chunks] = chunks or {}
        self._owner = {p: o for o in self.optimizers for g in o.param_groups for p in g["params"]}
        self._owner.update({p: self.optimizers[0] for p in self._chunks})
        self._sets = [self.optimizers]  # the torch optimizers of each of a user's optimizers (``merged``)

    @classmethod
    def merged(cls, parts: list[PsOptimizer]) -> PsOptimizer:
        """One ps optimizer of several (a user's loop with several optimizers, each over its own variables): a
        step steps each, and each updates the variables that have gradients, those of the push alone."""
        merged = cls([o for part in parts for o in part.optimizers], [s for part in parts for s in part._schedulers],
                     {p: c for part in parts for p, c in part._chunks.items()})
        merged._owner = {p: o for part in parts for p, o in part._owner.items()}
        merged._sets = [part.optimizers for part in parts]
        return merged

    @property
    def lr(self) -> list[float]:
        """The learning rate of each group (the groups in order, then the default group) at the last step."""
        return [float(g["lr"]) for g in self.optimizers[0].param_groups]

    def step(self, global_step: int) -> None:
        """The update from ``global_step`` to the next, with the gradients set on the variables: the schedule
        set to ``global_step``, then each optimizer's ``step()``; NonFiniteUpdate, every value and slot as it was,
        when one would be NaN or infinite (``update_guard.kept``)."""
        self._advance(global_step)
        chunked = [c for c in self._chunks.values() if c.param.grad is not None]
        for c in chunked:
            c.set_grads(c.param.grad)
        try:
            with update_guard.kept(self.optimizers):
                for optimizer in self.optimizers:
                    optimizer.step()
        finally:
            for c in chunked:
                c.set_grads(None)

    def set_options(self, groups: list[dict], optimizer_set: int = 0) -> None:
        """Give group ``i`` of each torch optimizer of user's optimizer ``optimizer_set`` the numeric options
        ``groups[i]`` (what a user's loop set in its optimizer's ``param_groups``: the learning rate of a warmup,
        a schedule's momentum), from the next update on. Only options the group has, as numbers or tuples of
        numbers; ValueError for anything else (a push's options come from the network: checked before anything is
        changed)."""
        if isinstance(optimizer_set, bool) or not isinstance(optimizer_set, int) or \
                not 0 <= optimizer_set < len(self._sets):
            raise ValueError(f"optimizer {optimizer_set!r} of {len(self._sets)}")
        for optimizer in self._sets[optimizer_set]:
            if len(groups) > len(optimizer.param_groups):
                raise ValueError(f"options of {len(groups)} groups for an optimizer of {len(optimizer.param_groups)}")
            for group, options in zip(optimizer.param_groups, groups):
                if not isinstance(options, dict):
                    raise ValueError("group options must be objects of option names and numbers")
                for key, value in options.items():
                    if key not in group or key == "params" or not numeric_option(value) \
                            or not numeric_option(group[key]) or _length(value) != _length(group[key]):
                        raise ValueError(f"group option {key!r}={value!r}: only the numeric options a group has")
        for optimizer in self._sets[optimizer_set]:
            for group, options in zip(optimizer.param_groups, groups):
                group.update({k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if k in group})

    def chunk_numel(self, param: torch.Tensor) -> int | None:
        """The elements of each chunk ``param`` is stepped in by ``step_chunk``; None: it is stepped whole."""
        chunks = self._chunks.get(param)
        return None if chunks is None else chunks.numel

    def chunk_bounds(self, param: torch.Tensor) -> list[tuple[int, int]] | None:
        """The (start, end) elements of each chunk of ``param`` as ``step_chunk`` steps them; None: stepped whole."""
        chunks = self._chunks.get(param)
        return None if chunks is None else chunks.bounds

    def step_chunk(self, global_step: int, param: torch.Tensor, k: int, grad: torch.Tensor) -> None:
        """The update from ``global_step`` of chunk ``k`` of ``param`` alone, with ``grad`` (1-D, that chunk's
        gradient); every chunk updated once is the variable updated once, as by ``step``. NonFiniteUpdate, the
        chunk as it was, as for ``step``."""
        self._advance(global_step)
        view = self._chunks[param].views[k]
        view.grad = grad
        try:
            with update_guard.kept(self.optimizers[:1]):
                self.optimizers[0].step()
        finally:
            view.grad = None

    def moved(self, param: torch.Tensor) -> None:
        """``param.data`` was set to new memory: a variable stepped in chunks steps its new memory from now on."""
        if param in self._chunks:
            self._chunks[param].rebind()

    def plain_sgd_rate(self, global_step: int) -> float | None:
        """The learning rate of the update from ``global_step`` (the schedule set to it) when that update is
        plain SGD: ``param -= lr * grad`` (dense variables only, all in one group, no momentum, weight decay or
        maximize, at this step); None otherwise, and the ps calls ``step``."""
        self._advance(global_step)
        optimizer = self.optimizers[0]
        # the groups that hold variables: a user's loop's one group leaves the ps's default group empty
        groups = [g for g in optimizer.param_groups if g["params"]] or optimizer.param_groups[:1]
        if len(self.optimizers) > 1 or type(optimizer) is not torch.optim.SGD or len(groups) != 1:
            return None
        group = groups[0]
        if group["momentum"] or group["weight_decay"] or group["maximize"]:
            return None
        return float(group["lr"])

    def state(self, param: torch.Tensor, join=None) -> dict:
        """The optimizer state of ``param`` (the optimizer's own dict, or for a variable stepped in chunks one put
        together from theirs by ``join``, see ``_Chunks.merged``; empty before its first update)."""
        chunks = self._chunks.get(param)
        if chunks is not None:
            return chunks.merged([self.optimizers[0].state.get(v, {}) for v in chunks.views], join)
        return self._optimizer_of(param).state.get(param, {})

    def load_state(self, param: torch.Tensor, state: dict) -> None:
        """Give ``param`` the optimizer state ``state`` (as ``state`` returned it, e.g. from a checkpoint).
        ValueError when an ``ELEMENTWISE`` optimizer's state has a tensor (not a scalar) of another shape than
        ``param``'s: the state of another model (a fused kernel would read past its end)."""
        owner = self._optimizer_of(param)
        if type(owner) in ELEMENTWISE:
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                    raise ValueError(f"optimizer state {key!r} of shape {tuple(value.shape)} for a variable of shape "
                                     f"{tuple(param.shape)}: restore from a checkpoint of this model")
        chunks = self._chunks.get(param)
        if chunks is None:
            owner.state[param] = state
            return
        for view, view_state in zip(chunks.views, chunks.split(state)):
            self.optimizers[0].state[view] = view_state

    def _optimizer_of(self, param: torch.Tensor) -> torch.optim.Optimizer:
        try:
            return self._owner[param]
        except KeyError:
            raise ValueError("not a variable of this ps's optimizer") from None

    def schedule_state(self) -> dict:
        """The schedule's state as JSON data, for a checkpoint: the schedule's step, the numeric options of each
        group (the learning rate, and what a schedule changes besides: momentum, betas) and the scheduler's
        ``state_dict()``. The same on every ps, so any ps's copy restores any ps; ``{}`` without a schedule."""
        if not self._schedulers:
            return {}
        scheduler = self._schedulers[0]
        state = {k: v for k, v in scheduler.state_dict().items() if not callable(v)}  # functions: rebuilt
        numbers = [{k: v for k, v in g.items() if isinstance(v, int | float | tuple | torch.Tensor)
                    and not isinstance(v, bool)} for g in self.optimizers[0].param_groups]
        return {"step": scheduler.last_epoch, "groups": _encode(numbers, "group options"),
                "scheduler": _encode(state, f"state of scheduler {type(scheduler).__name__}")}

    def restore(self, global_step: int, state: dict | None = None) -> None:
        """Set the schedule as a ps that applied the updates from steps 0 to ``global_step - 1`` has it: from
        ``state`` (``schedule_state()`` of a checkpoint at ``global_step``) in O(1); without it by a fast-forward,
        O(1) for a function of the step, LambdaLR, OneCycleLR and CyclicLR, one scheduler step per global step
        for the others."""
        target = max(global_step - 1, 0)
        if not self._schedulers:
            return
        if state:
            groups = _decode(state["groups"])
            if state["step"] > target or len(groups) != len(self.optimizers[0].param_groups):
                raise ConfigError(f"schedule state of step {state['step']} with {len(groups)} groups for a restore at "
                                  f"step {global_step}: restore from a checkpoint of this step and optimizer spec")
            for optimizer, scheduler in zip(self.optimizers, self._schedulers):
                for group, saved in zip(optimizer.param_groups, groups):
                    group.update({k: v for k, v in saved.items() if k in group})
                scheduler.load_state_dict(_decode(state["scheduler"]))
        self._advance(target)

    def _advance(self, global_step: int) -> None:
        """Step the schedules to ``global_step`` (jumping there when the rate is a function of the step alone)."""
        for scheduler in self._schedulers:
            if global_step < scheduler.last_epoch:
                raise ValueError(f"global step {global_step} is behind the schedule's step {scheduler.last_epoch}: "
                                 "steps only go forward; a restarted ps calls restore()")
            if global_step == scheduler.last_epoch:
                continue
            if global_step - scheduler.last_epoch > 1 and type(scheduler) in _CLOSED_FORM:
                scheduler.last_epoch = global_step - 1
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_STEP_ORDER_WARNING, category=UserWarning)
                while scheduler.last_epoch < global_step:
                    scheduler.step()


# --- checking at train() ---------------------------------------------------------------------------
def check(model: torch.nn.Module, spec: OptimizerSpec, *, steps: int | None = None) -> None:
    """Build ``spec`` as the ps tasks will, on stand-ins of ``model``'s trainable parameters (requires_grad;
    their names and dtypes, one element each, on the CPU like a ps's variables), take two steps and restore
    from the schedule state as JSON: what torch refuses becomes a one-line ConfigError at ``train()``, not an
    error on a ps. A group pattern that matches no trainable parameter is refused (a typo would do nothing).
    With the run's ``steps``, a schedule that is a function of the step alone is also taken to the last step,
    so one that ends before the run (OneCycleLR's ``total_steps``) is refused now."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameters: set requires_grad=True on those to train")
    for i, group in enumerate(spec.groups):
        for pattern in group["params"]:
            if not any(fnmatch.fnmatchcase(n, pattern) for n, _ in trainable):
                raise ConfigError(f"group {i} pattern {pattern!r} matches no trainable parameter: use names as "
                                  f"model.named_parameters() gives them (e.g. {trainable[0][0]!r}), * and ? as "
                                  "wildcards")
    sparse = set(sparse_modules(model))
    stand_ins = [(n, torch.nn.Parameter(torch.zeros((1,) * p.dim(), dtype=p.dtype))) for n, p in trainable]
    flags = [n in sparse for n, _ in trainable]
    opt = build(stand_ins, spec, sparse=flags)
    try:
        for step in range(2):
            for (_, p), is_sparse in zip(stand_ins, flags):
                p.grad = torch.zeros_like(p).to_sparse() if is_sparse else torch.zeros_like(p)
            opt.step(step)
    except ConfigError:
        raise
    except Exception as e:  # the optimizer's or the schedule's own code
        raise _refusal(f"optimizer {spec.optimizer} step", {}, e,
                       "a ps calls step() without a closure on CPU tensors: pass an optimizer and options that "
                       "work so") from None
    state = opt.schedule_state()
    build(stand_ins, spec, sparse=flags).restore(2, json.loads(json.dumps(state)))
    if steps and opt._schedulers and type(opt._schedulers[0]) in _CLOSED_FORM:
        try:
            opt._advance(steps - 1)
        except Exception as e:  # the schedule's own code
            raise _refusal(f"schedule {spec.scheduler} at the run's last step {steps - 1}", {}, e,
                           f"make it cover the run's {steps} steps (e.g. OneCycleLR total_steps={steps})") from None
