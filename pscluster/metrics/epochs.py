"""A run's epochs as every view says them: each worker's epoch, from the event its ``ctx.shard`` loader sends as an
epoch begins (``RunStore.epochs`` reads the latest of each worker).

pscluster knows the epoch a worker is in, not how many the loop will run (``range(epochs)`` is the loop's own), so
the words never say "of N". A loop that has no epochs (``ctx.endless_shard``, ``Cluster.train``'s) has no words.
"""

from __future__ import annotations

from collections.abc import Mapping
NAMED = 4  # workers in different epochs are named one by one up to this many; more read as a range


def words(epochs: Mapping[int, int]) -> str:
    """``{worker: epoch}`` in words: ``epoch 3`` where every worker is in epoch 3, ``worker 0 epoch 1, worker 1
    epoch 3`` where they differ, ``epochs 1 to 3 over 8 workers`` where more than ``NAMED`` do; '' for none."""
    found = sorted(set(epochs.values()))
    if len(found) == 1:
        return f"epoch {found[0]}"
    if len(epochs) > NAMED:
        return f"epochs {found[0]} to {found[-1]} over {len(epochs)} workers"
    return ", ".join(f"worker {w} epoch {e}" for w, e in sorted(epochs.items()))


def progress(global_step: int, steps: int | None, epochs: Mapping[int, int]) -> str:
    """A run's progress in words: ``epoch 3 · global step 1234``, ``/ 5000`` after it when the run has a step
    target (``steps``), without the epoch where the loop has none."""
    step = f"global step {global_step}" + ("" if steps is None else f" / {steps}")
    return " · ".join(part for part in (words(epochs), step) if part)
