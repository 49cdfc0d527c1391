"""The options of a run, each defined once: its name, default, type, allowed values, help and who reads it.

Every way into a run takes its options from here into one value, ``RunOptions``: ``Cluster.train`` and
``%%pscluster train`` (``TRAIN``), ``Cluster.run`` and ``%%pscluster run`` (``RUN``), ``Cluster.session``
(``SESSION``), a script's loop, ``pscluster.init()`` and ``pscluster launch`` (``SCRIPT``), and a script trained by
``train_from_environment()`` (``TRAIN_SCRIPT``). The API's keyword parameters (``keywords``: its signature and
docstring, for completion and ``help()``), the magics' and ``pscluster launch``'s flags (``add_flags``) are made
from the table; the plan the ps tasks and workers get (``plan.TrainPlan``) carries the options of scope ``PLAN``,
the run's start (``run_start``) reads those of scope ``START``, and the store keeps them all.
A default is written here alone: a signature that names an option gets it from ``DEFAULTS``.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace

from ..errors import ConfigError
from .policies import POLICIES
from .sharding import STRATEGIES
from .steps import PRECISIONS

TRAIN, RUN, SESSION, SCRIPT, TRAIN_SCRIPT = "train", "run", "session", "script", "train_script"
TRAINS = frozenset({TRAIN, TRAIN_SCRIPT})  # pscluster's own loop
LOOPS = frozenset({*TRAINS, RUN, SCRIPT})  # the entries whose runs have a step target and a mode
EVERY = frozenset({*LOOPS, SESSION})

# who reads an option: the ps tasks and workers (it travels in the run's plan); the start of the run (its record,
# checkpoint folder, checkpoint timer and evaluation: ``run_start``); the maker of the plan (placement, optimizer,
# batches), which turns it into the plan's own fields
PLAN, START, BUILD = "plan", "start", "build"

MODES = tuple(POLICIES)  # the modes of a run: the aggregation policies
BUFFER_RULES = ("chief", "average")
NONFINITE = ("fail", "skip")
DIVERGENCE = ("flag", "stop", "fail")


@dataclass(frozen=True)
class Flag:
    """How a magic's flag takes an option whose value is not a plain number or word: ``parse`` turns one
    ``--flag VALUE`` into a value (an argparse type); ``many``: the flag repeats and its values make a dict;
    ``const``: a flag without a value that sets this one."""

    parse: object = None
    many: bool = False
    const: object = None
    metavar: str | None = None


@dataclass(frozen=True)
class Option:
    """One option of a run. ``kind``: the type its value has (``int``, ``float``, ``str``, ``bool``; None: any
    object, checked where it is used); ``least``: the smallest number allowed (``above``: the value must exceed
    it); ``optional``: None is allowed too (always where None is the default); ``choices``: the words allowed
    (for ``kind=None``, the words a flag takes); ``fix``: what the one-line error tells to use; ``flag``: how a
    magic's flag takes it where its kind does not say (see ``Flag``); ``scope``: who reads it (``PLAN``, ``START``,
    ``BUILD``); ``shown``: it tells runs apart, so the views show it beside each run."""

    name: str
    default: object
    help: str
    entries: frozenset
    kind: type | None = None
    choices: tuple = ()
    least: float | None = None
    above: bool = False
    optional: bool = False
    fix: str = ""
    flag: Flag = Flag()
    entry_defaults: tuple = ()  # (entry, default) pairs where an entry's default is not ``default``
    scope: str = PLAN
    shown: bool = False

    def default_for(self, entry: str):
        """The default of this option in ``entry``'s calls."""
        return dict(self.entry_defaults).get(entry, self.default)

    def check(self, value, *, as_flag: bool = False) -> None:
        """Raise a one-line ConfigError naming the fix unless ``value`` is one this option takes (``as_flag``: the
        error names the magic's flag)."""
        if value is None and self.takes_none:
            return
        kind = self.kind
        wrong_type = kind is not None and (
            isinstance(value, bool) != (kind is bool) or
            not isinstance(value, (int, float) if kind is float else kind))
        if kind is str and self.choices and isinstance(value, str):
            wrong_type = value not in self.choices
        bound = self.least is not None and not wrong_type and (value <= self.least if self.above else
                                                               value < self.least)
        if wrong_type or bound:
            given = f"{self.flag_name} {value}" if as_flag else f"{self.name}={value!r}"
            raise ConfigError(f"{given}: use {self.fix or self._wanted()}")

    def _wanted(self) -> str:
        if self.choices and self.kind is str:
            *first, last = (repr(c) for c in self.choices)
            return f"{', '.join(first)} or {last}"
        what = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}.get(self.kind, "a value")
        if self.least is not None:
            what += f" {'>' if self.above else '>='} {self.least:g}"
        return what + (", or None" if self.takes_none else "")

    @property
    def takes_none(self) -> bool:
        return self.optional or self.default is None

    @property
    def flag_name(self) -> str:
        """The magic's flag: ``--max-grad-norm``; a bool option true by default is turned off with ``--no-...``."""
        word = self.name.replace("_", "-")
        return f"--no-{word}" if self.kind is bool and self.default else f"--{word}"


def _options(*options: Option) -> dict[str, Option]:
    return {o.name: o for o in options}


def _partition(text: str) -> tuple[str, int]:
    """``embedding=2`` -> ``("embedding", 2)``: an argparse type, so a bad value is a one-line usage error."""
    name, sep, shards = text.rpartition("=")
    try:
        count = int(shards)
    except ValueError:
        count = 0
    if not sep or not name.strip() or count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME=SHARDS, e.g. --partition embedding=2 (a variable name "
                                         "or prefix, a shard count >= 1)")
    return name.strip(), count


OPTIONS: dict[str, Option] = _options(
    Option("mode", "sync", "sync: each global step averages the workers' gradients; async: each push is applied as "
           "it comes; ssp: bounded staleness (see staleness_bound)", LOOPS, str, MODES, shown=True),
    Option("steps", 1000, "the global step target (a user's loop: None, its default, for none: the run ends when "
           "every worker's loop has returned, its epochs deciding)", LOOPS, int, least=1, optional=True,
           fix="a number of global steps >= 1, or None to end when the loops end",
           entry_defaults=((RUN, None), (SCRIPT, None)), shown=True),
    Option("replicas_to_aggregate", None, "sync: the gradients averaged per global step (default: one per worker; "
           "fewer make the others backup workers)", LOOPS, int, least=1, shown=True),
    Option("seed", 0, "the run's seed: the model's initial values, each worker's random streams (from the seed, "
           "the worker and the attempt) and its data order", EVERY, int, shown=True),
    Option("log_every", 100, "global steps between a worker's progress lines", LOOPS, int, least=1),
    Option("request_timeout", 120.0, "seconds a worker waits for a ps's reply before it counts the ps as lost",
           EVERY, float, least=0, above=True, fix="a number of seconds > 0"),
    Option("staleness_bound", 2, "ssp: how many steps a worker may run ahead of the slowest", LOOPS, int, least=0,
           fix="an integer >= 0 (steps a worker may run ahead of the slowest)", shown=True),
    Option("max_lead", 0.25, "async: how much more a worker may push than the slowest live one, as a fraction of "
           "the slowest's pushes (0.25: a quarter more), so that a worker the OS gives less CPU still trains on its "
           "share of the data; None: no bound (workers of different speeds)", TRAINS, float, least=0, optional=True,
           fix="a fraction >= 0 (0.25: a quarter more pushes than the slowest worker), or None for no bound"),
    Option("placement", "round_robin", "which ps task holds each variable: round_robin (in model order), greedy "
           "(each to the least loaded ps, as TF's GreedyLoadBalancingStrategy), largest_first (the same, largest "
           "first), a {variable: ps} dict or a strategy from pscluster.placement", EVERY, None,
           tuple(STRATEGIES), scope=BUILD),
    Option("partition", None, "split variable NAME (or every variable under a prefix) into SHARDS shards along "
           "dim 0, across ps tasks: {name: shards or a partitioner}", EVERY, dict,
           flag=Flag(parse=_partition, many=True, metavar="NAME=SHARDS"), scope=BUILD),
    Option("checkpoint_dir", None, "where checkpoints go; the run starts from the latest one there (default: "
           "checkpoints/run-<id> next to the run store)", EVERY, (str, os.PathLike), fix="a folder's path",
           scope=START),
    Option("checkpoint_every", 0, "global steps between checkpoints (0: on demand and at the end only)", LOOPS, int,
           least=0, fix="a number of global steps >= 1, or 0 for checkpoints on demand and at the end only"),
    Option("checkpoint_secs", 600.0, "seconds between checkpoints (0 or None: off)", EVERY, float, least=0,
           optional=True, fix="a number of seconds, or 0 or None for none", scope=START),
    Option("keep_checkpoints", 5, "how many of the newest checkpoints are kept", EVERY, int, least=1, scope=START),
    Option("restore", True, "the chief starts from the latest checkpoint in checkpoint_dir when there is one",
           LOOPS, bool),
    Option("resume", None, "continue the newest earlier run of the same name (resume='latest') or the run of that "
           "id from its latest checkpoint (none yet: from scratch)", frozenset({TRAIN, RUN}), None,
           flag=Flag(const="latest"), scope=START),
    Option("name", None, "the run's name", EVERY, str, scope=START),
    Option("shared_memory", True, "a worker exchanges dense values with a ps on its own host through shared "
           "memory (off: always over the socket)", LOOPS, bool),
    Option("pipeline", False, "async: each worker computes its next gradients while its push-pull is in flight "
           "(every gradient one step stale)", LOOPS, bool),
    Option("overlap", True, "a worker's pushes leave during backward, and a GPU worker copies its gradients to the "
           "host during it", TRAINS, bool),
    Option("buffers", "chief", "the buffers (BatchNorm statistics...) the ps keeps: worker 0's (chief, as DDP's "
           "broadcast_buffers) or the mean of every worker's latest (average)", LOOPS, str, BUFFER_RULES),
    Option("max_grad_norm", None, "each worker clips its gradients to this total 2-norm before it pushes them",
           LOOPS, float, least=0, above=True,
           fix="a positive number (the total 2-norm each worker clips its gradients to), or None", shown=True),
    Option("on_nonfinite", "fail", "a non-finite loss or gradient fails the run at that step (fail) or leaves its "
           "batch out (skip)", LOOPS, str, NONFINITE),
    Option("on_divergence", "flag", "a loss that rises far above its level at the start and stays there "
           "(pscluster.metrics.divergence) marks the run diverging in every view (flag), and also stops it there "
           "(stop) or fails it (fail)", LOOPS, str, DIVERGENCE),
    Option("precision", "fp32", "the workers' mixed precision: bf16 (CPU and GPU) or fp16 (GPU, with loss "
           "scaling)", LOOPS, str, tuple(PRECISIONS), shown=True),
    Option("batch_size", None, "per worker (default 64, or the DataLoader's)", TRAINS, int, least=1, shown=True),
    Option("loader_workers", 0, "loader processes per worker that build the next batches ahead of the step",
           TRAINS, int, least=0, scope=BUILD),
    Option("prefetch_factor", None, "batches each loader process keeps ready", TRAINS, int, least=1, scope=BUILD),
    Option("pin_memory", False, "page-locked batches for GPU workers", TRAINS, bool, scope=BUILD),
    Option("eval_every", None, "global steps between evaluations of test_dataset (default: a tenth of steps)",
           TRAINS, int, least=1, scope=START),
    Option("optimizer", "sgd", "a torch.optim class or its name, or any optimizer class", TRAINS, None, scope=BUILD),
)

DEFAULTS = SimpleNamespace(**{name: o.default for name, o in OPTIONS.items()})


def names(entry: str, scope: str | None = None) -> tuple[str, ...]:
    """The options ``entry`` takes (of ``scope`` only, if given), in definition order."""
    return tuple(name for name, o in OPTIONS.items() if entry in o.entries and scope in (None, o.scope))


def defaults(scope: str) -> dict:
    """Every option of ``scope`` at its default."""
    return {name: o.default for name, o in OPTIONS.items() if o.scope == scope}


def check(**values) -> None:
    """Check each given option's value (see ``Option.check``)."""
    for name, value in values.items():
        OPTIONS[name].check(value)


class RunOptions(Mapping):
    """A run's options by name, each value checked against its definition (``Option.check``); read as
    ``options.mode`` or ``options["mode"]``, changed only into a new value (``replace``). Its JSON form is
    ``dict(options)``. ``take`` makes the options of one entry from what its caller gave."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping = (), /):
        values = dict(values)
        unknown = [name for name in values if name not in OPTIONS]
        if unknown:
            raise ConfigError(f"unknown run options {unknown}: use those of pscluster.runtime.options")
        check(**values)
        object.__setattr__(self, "_values", values)

    @classmethod
    def take(cls, entry: str, given: Mapping, *, caller: str, also: tuple[str, ...] = ()) -> "RunOptions":
        """The options ``entry`` takes, each given value checked and the others at their defaults. A name ``entry``
        does not take (nor one of ``also``, its caller's own) is a one-line ConfigError that names the closest."""
        known = (*names(entry), *also)
        for name in given:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(known)}"
                raise ConfigError(f"{caller} got unknown option {name!r}: {hint}")
        return cls({**{name: OPTIONS[name].default_for(entry) for name in names(entry)},
                    **{name: value for name, value in given.items() if name in OPTIONS}})

    def of(self, scope: str) -> "RunOptions":
        """Those of ``scope`` (``PLAN``, ``START``, ``BUILD``)."""
        return RunOptions({name: v for name, v in self._values.items() if OPTIONS[name].scope == scope})

    def replace(self, **changes) -> "RunOptions":
        return RunOptions({**self._values, **changes})

    def __getitem__(self, name: str):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no run option {name!r} here") from None

    def __setattr__(self, name, value):
        raise AttributeError("RunOptions cannot be changed: use replace()")

    def __reduce__(self):
        return RunOptions, (self._values,)

    def __repr__(self) -> str:
        return f"RunOptions({self._values!r})"


def split(entry: str, keywords: dict) -> tuple[dict, dict]:
    """``keywords`` of an entry that also passes the rest on (``Cluster.train``'s to its optimizer): ``(options,
    others)``, the options ``entry`` takes and the others."""
    taken = names(entry)
    return ({k: v for k, v in keywords.items() if k in taken}, {k: v for k, v in keywords.items() if k not in taken})


def keywords(entry: str):
    """Decorate a function that takes ``entry``'s options as ``**keywords``: its signature (``help()``, completion,
    ``inspect.signature``) lists each as a keyword-only parameter with its default, before ``**keywords``, and its
    docstring ends with each one's help."""
    def sign(function):
        signature = inspect.signature(function)
        *head, rest = signature.parameters.values()
        if rest.kind is not inspect.Parameter.VAR_KEYWORD:
            raise TypeError(f"{function.__qualname__} must take **keywords to take {entry}'s options")
        listed = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=OPTIONS[name].default_for(entry))
                  for name in names(entry) if name not in signature.parameters]
        function.__signature__ = signature.replace(parameters=[*head, *listed, rest])
        lines = "\n".join(f"    {name} (default {OPTIONS[name].default_for(entry)!r}): {OPTIONS[name].help}"
                          for name in names(entry))
        function.__doc__ = f"{inspect.getdoc(function) or ''}\n\nRun options:\n\n{lines}\n"
        return function
    return sign


def add_flags(parser: argparse.ArgumentParser, entry: str) -> argparse.ArgumentParser:
    """A magic's flag for every option ``entry`` takes, with the option's default and help."""
    for name in names(entry):
        o, spec, default = OPTIONS[name], OPTIONS[name].flag, OPTIONS[name].default_for(entry)
        if o.kind is bool:
            parser.add_argument(o.flag_name, dest=name, action="store_false" if o.default else "store_true",
                                help=o.help)
        elif spec.const is not None:
            parser.add_argument(o.flag_name, dest=name, action="store_const", const=spec.const, default=default,
                                help=o.help)
        elif spec.many:
            parser.add_argument(o.flag_name, dest=name, type=spec.parse, action="append", default=[],
                                metavar=spec.metavar, help=o.help + " (repeatable)")
        else:
            kind = o.kind if o.kind in (int, float) else None
            parser.add_argument(o.flag_name, dest=name, type=spec.parse or kind, choices=o.choices or None,
                                default=default, metavar=spec.metavar, help=o.help)
    return parser


def from_flags(args: argparse.Namespace, entry: str) -> dict:
    """The options ``add_flags`` parsed into ``args``, checked, as keyword arguments of ``entry``'s call."""
    values = {name: getattr(args, name) for name in names(entry)}
    values.update({name: dict(values[name]) or None for name in values if OPTIONS[name].flag.many})
    for name, value in values.items():
        OPTIONS[name].check(value, as_flag=True)
    return values
