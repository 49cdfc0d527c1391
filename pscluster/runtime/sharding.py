"""Sharding and placement: which ps task holds which variable, or which rows of it. Pure functions over plain
data.

A *strategy* is one function ``(items, num_ps) -> {name: ps}`` over items that have a ``name`` and
``nbytes`` (variables, or shards of partitioned variables): ``round_robin`` (the default, like TF's
``replica_device_setter``), ``greedy`` (in model order, each to the least loaded ps: TF's
``GreedyLoadBalancingStrategy`` with its byte-size load function), ``largest_first`` (the same, largest
first: a tighter balance), or ``explicit`` (named variables on given ps tasks, the rest by another
strategy). A *partitioner* says into how many
shards one variable is split along dim 0: ``fixed_shards(n)``, ``min_shard_bytes(b)``,
``max_shards(n)``. ``shard_map`` puts both together: the model's variables and the ps count in, a
list of ``Shard`` out.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..footprint import placement_line


@dataclass(frozen=True)
class Variable:
    """A model parameter as placement sees it: name, shape and bytes per element."""

    name: str
    shape: tuple[int, ...]
    itemsize: int = 4

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Shard:
    """A whole variable (``part`` None) or rows ``[start, stop)`` of it (part ``part``), on ps ``ps``."""

    variable: str
    shape: tuple[int, ...]   # of this shard
    itemsize: int
    ps: int = 0
    part: int | None = None
    start: int = 0           # first row of the variable in this shard

    @property
    def name(self) -> str:
        """``fc1.weight`` for a whole variable, ``embedding.weight/part_1`` for a shard of one."""
        return self.variable if self.part is None else f"{self.variable}/part_{self.part}"

    @property
    def stop(self) -> int:
        return self.start + (self.shape[0] if self.shape else 1)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def placement(self) -> str:
        return placement_line(self.name, self.ps, None if self.part is None else (self.start, self.stop),
                              self.nbytes)


# --- strategies ---------------------------------------------------------------------------------
Strategy = Callable[[Sequence, int], dict]


def round_robin(items: Sequence, num_ps: int) -> dict[str, int]:
    """Item ``i`` (in model order) goes to ps task ``i % num_ps``, like replica_device_setter."""
    _check_num_ps(num_ps)
    return {item.name: i % num_ps for i, item in enumerate(items)}


def greedy(items: Sequence, num_ps: int) -> dict[str, int]:
    """In model order (TF's creation order), each item to the ps task with the fewest bytes so far (ties: the
    lowest index): TF's ``GreedyLoadBalancingStrategy`` with ``byte_size_load_fn``, line for line.

    Optimizer state is proportional to a variable's bytes, so counting it changes no decision.
    """
    return _least_loaded(items, num_ps)


def largest_first(items: Sequence, num_ps: int) -> dict[str, int]:
    """Largest item first (model order among equal sizes), each to the ps task with the fewest bytes so far:
    the largest load is within 4/3 of the best possible (Graham's LPT bound), where ``greedy`` in model order
    can be up to twice it."""
    order = sorted(range(len(items)), key=lambda i: -items[i].nbytes)  # stable
    placed = _least_loaded([items[i] for i in order], num_ps)
    return {item.name: placed[item.name] for item in items}


def _least_loaded(items: Sequence, num_ps: int) -> dict[str, int]:
    """Each item, in the order given, to the ps task with the fewest bytes so far (ties: the lowest index)."""
    _check_num_ps(num_ps)
    loads = [(0, ps) for ps in range(num_ps)]
    placed = {}
    for item in items:
        load, ps = heapq.heappop(loads)
        placed[item.name] = ps
        heapq.heappush(loads, (load + item.nbytes, ps))
    return placed


def explicit(assignments: Mapping[str, int], rest: Strategy | str = "round_robin") -> Strategy:
    """A strategy that puts the named variables (or shards, or every shard of a partitioned variable)
    on the given ps tasks and the others by ``rest``."""
    rest = resolve_strategy(rest)
    assignments = dict(assignments)

    def place(items: Sequence, num_ps: int) -> dict[str, int]:
        for name, ps in assignments.items():
            if not isinstance(ps, int) or not 0 <= ps < num_ps:
                raise ConfigError(f"explicit placement {name!r} -> ps {ps!r}: use a ps task in 0..{num_ps - 1}")
        fixed = {it.name: assignments.get(it.name, assignments.get(getattr(it, "variable", None))) for it in items}
        unknown = set(assignments) - {it.name for it in items} - {getattr(it, "variable", None) for it in items}
        if unknown:
            raise ConfigError(f"explicit placement names {sorted(unknown)}, which the model does not have: "
                              "use names from model.named_parameters()")
        others = rest([it for it in items if fixed[it.name] is None], num_ps)
        return {it.name: others[it.name] if fixed[it.name] is None else fixed[it.name] for it in items}

    place.__name__ = f"explicit({assignments})"
    return place


STRATEGIES: dict[str, Strategy] = {"round_robin": round_robin, "greedy": greedy, "largest_first": largest_first}


def resolve_strategy(strategy: Strategy | str | Mapping[str, int]) -> Strategy:
    """A strategy from a name (``round_robin``, ``round-robin``, ``greedy``, ``largest_first``), a callable, or a
    ``{variable: ps}`` mapping (explicit, the rest round-robin)."""
    if isinstance(strategy, str):
        try:
            return STRATEGIES[strategy.replace("-", "_").lower()]
        except KeyError:
            raise ConfigError(f"unknown placement {strategy!r}: use one of {', '.join(STRATEGIES)}, "
                              "a {variable: ps} dict, or a function (items, num_ps) -> {name: ps}") from None
    if isinstance(strategy, Mapping):
        return explicit(strategy)
    if callable(strategy):
        return strategy
    raise ConfigError(f"placement {strategy!r}: give a strategy name, a {{variable: ps}} dict or a function")


def _check_num_ps(num_ps: int) -> None:
    if not isinstance(num_ps, int) or num_ps < 1:
        raise ConfigError(f"num_ps={num_ps!r}: use an integer >= 1")


# --- partitioners -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Partitioner:
    """Into how many shards to split a variable along dim 0 (never more than its rows)."""

    shards: int | None = None          # exactly this many
    min_bytes: int | None = None       # as many as keep every shard at least this big
    max_shards: int | None = None      # at most this many (by default one per ps task)

    def num_shards(self, variable: Variable, num_ps: int) -> int:
        rows = variable.shape[0] if variable.shape else 1
        if self.shards is not None:
            n = self.shards
        else:
            n = self.max_shards or num_ps
            if self.min_bytes is not None:
                n = min(n, max(1, variable.nbytes // self.min_bytes))
        return max(1, min(n, rows))


def fixed_shards(n: int) -> Partitioner:
    """Exactly ``n`` shards (fewer for a variable of fewer rows)."""
    return Partitioner(shards=_positive("shards", n))


def min_shard_bytes(n: int, max_shards: int | None = None) -> Partitioner:
    """As many shards as keep each at least ``n`` bytes, at most ``max_shards`` (default: one per ps)."""
    return Partitioner(min_bytes=_positive("min_shard_bytes", n),
                       max_shards=None if max_shards is None else _positive("max_shards", max_shards))


def max_shards(n: int) -> Partitioner:
    """One shard per ps task, at most ``n``."""
    return Partitioner(max_shards=_positive("max_shards", n))


def _positive(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{name}={n!r}: use an integer >= 1")
    return n


def partition_rows(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each shard: as even as possible, the first ``rows % num_shards`` one row
    longer (TF's fixed_size_partitioner)."""
    base, extra = divmod(rows, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        stop = start + base + (k < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def _partitioner_for(variable: Variable, partition: Mapping[str, int | Partitioner]) -> Partitioner | None:
    """The partitioner of the longest key that is the variable's name or a prefix of it
    (``embedding`` matches ``embedding.weight``)."""
    keys = [k for k in partition if variable.name == k or variable.name.startswith(k.rstrip(".") + ".")]
    if not keys:
        return None
    spec = partition[max(keys, key=len)]
    return spec if isinstance(spec, Partitioner) else fixed_shards(spec)


# --- the shard map ------------------------------------------------------------------------------
def shard_map(variables: Sequence[Variable], num_ps: int, placement: Strategy | str | Mapping = "round_robin",
              partition: Mapping[str, int | Partitioner] | None = None) -> list[Shard]:
    """Split the variables as ``partition`` says ({name or prefix: shard count or Partitioner}), then
    place every shard and whole variable by ``placement``. Shards in model order, rows in order."""
    _check_num_ps(num_ps)
    partition = dict(partition or {})
    names = {v.name for v in variables}
    unused = [k for k in partition if not any(n == k or n.startswith(k.rstrip(".") + ".") for n in names)]
    if unused:
        raise ConfigError(f"partition names {unused}, which match no variable: use a name or prefix from "
                          "model.named_parameters()")
    shards = []
    for v in variables:
        partitioner = _partitioner_for(v, partition)
        if partitioner is None:
            shards.append(Shard(v.name, tuple(v.shape), v.itemsize))
            continue
        if not v.shape:
            if v.name in partition:
                raise ConfigError(f"{v.name} is a scalar: only variables with rows can be partitioned")
            shards.append(Shard(v.name, (), v.itemsize))  # a scalar under a partitioned prefix (a step count)
            continue
        n = partitioner.num_shards(v, num_ps)
        for k, (start, stop) in enumerate(partition_rows(v.shape[0], n)):
            shards.append(Shard(v.name, (stop - start, *v.shape[1:]), v.itemsize, part=k, start=start))
    where = resolve_strategy(placement)(shards, num_ps)
    missing = [s.name for s in shards if not isinstance(where.get(s.name), int) or not 0 <= where[s.name] < num_ps]
    if missing:
        raise ConfigError(f"the placement gave no valid ps task for {missing[:3]}: a strategy must map every "
                          f"name to a ps in 0..{num_ps - 1}")
    return [Shard(s.variable, s.shape, s.itemsize, where[s.name], s.part, s.start) for s in shards]


def bytes_per_ps(shards: Sequence[Shard], num_ps: int, optimizer_slots: int = 0) -> list[int]:
    """Bytes each ps task holds: its shards times (1 + optimizer slots)."""
    loads = [0] * num_ps
    for s in shards:
        loads[s.ps] += s.nbytes * (1 + optimizer_slots)
    return loads
