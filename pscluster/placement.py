"""Placement: which ps task holds which variable, or which rows of it.

Strategies place variables (and shards of partitioned ones) on ps tasks; partitioners split a
variable along dim 0. Give either to ``Cluster.train`` or ``Cluster.plan``::

    import pscluster
    from pscluster.placement import greedy, explicit, fixed_shards, min_shard_bytes

    cluster = pscluster.Cluster(ps=2, workers=2)
    plan = cluster.plan(model_fn, placement="greedy", partition={"embedding": 2}, optimizer="adam")
    plan                    # bytes per ps (optimizer state included), the placement lines, a figure
    pscluster.placement.compare_placements({"round-robin": cluster.plan(model_fn),
                                            "greedy": plan})
    cluster.start().train(model_fn, dataset, loss_fn, placement=explicit({"fc.weight": 1}, rest=greedy),
                          partition={"embedding": min_shard_bytes(1 << 20)})

The functions are pure and need no model: ``shard_map`` takes ``Variable`` descriptions::

    shards = shard_map([Variable("embedding.weight", (1000, 64)), Variable("fc.weight", (10, 64))],
                       num_ps=2, placement=greedy, partition={"embedding": fixed_shards(2)})
    [s.placement for s in shards]    # ['embedding.weight/part_0: /job:ps/task:0 (rows 0-499, 125.0 KB)', ...]
    bytes_per_ps(shards, 2, optimizer_slots("adam", {}))

This module imports no torch, plotly or IPython; ``PlacementPlan`` and ``compare_placements`` load on
first use.
"""

from typing import TYPE_CHECKING

from .footprint import format_bytes, optimizer_slot_names, optimizer_slots, placement_line
from .runtime.sharding import (
    STRATEGIES,
    Partitioner,
    Shard,
    Strategy,
    Variable,
    bytes_per_ps,
    explicit,
    fixed_shards,
    greedy,
    largest_first,
    max_shards,
    min_shard_bytes,
    partition_rows,
    resolve_strategy,
    round_robin,
    shard_map,
)

if TYPE_CHECKING:  # loaded on first use (pandas, plotly): see __getattr__
    from .widgets.placement_plan import PlacementPlan, compare_placements

__all__ = ["STRATEGIES", "Partitioner", "PlacementPlan", "Shard", "Strategy", "Variable", "bytes_per_ps",
           "compare_placements", "explicit", "fixed_shards", "format_bytes", "greedy", "largest_first", "max_shards",
           "min_shard_bytes", "optimizer_slot_names", "optimizer_slots", "partition_rows", "placement_line",
           "resolve_strategy", "round_robin", "shard_map"]


def __getattr__(name):
    if name in ("PlacementPlan", "compare_placements"):
        from .widgets import placement_plan

        return getattr(placement_plan, name)
    raise AttributeError(f"module 'pscluster.placement' has no attribute {name!r}")
