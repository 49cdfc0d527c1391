"""Placement: which ps task holds which variable. Pure functions over plain data."""

from __future__ import annotations

from collections.abc import Sequence


def round_robin(names: Sequence[str], num_ps: int) -> dict[str, int]:
    """Variable ``i`` (in model order) goes to ps task ``i % num_ps``, like replica_device_setter."""
    if num_ps < 1:
        raise ValueError("num_ps must be >= 1")
    return {name: i % num_ps for i, name in enumerate(names)}
