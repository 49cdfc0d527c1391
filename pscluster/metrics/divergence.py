"""Divergence: a run whose loss rises far above its level at the start and stays there.

The rule, applied to the losses the workers report, in the order they arrive (every worker's together):

- the **reference** is the smallest of the first ``REFERENCE_REPORTS`` finite losses: the untrained model's (a
  learning rate far too large has taken the loss up by the second step);
- the **smoothed loss** is their exponential moving average with ``SMOOTHING`` (about the last 20 reports);
- the run is **diverging** once the smoothed loss has stayed above ``reference + FACTOR * max(|reference|,
  FLOOR)`` (5 times the reference, for a positive one) for ``PATIENCE`` reports in a row, "since" the first of
  them. The margin follows the loss's own size, so the rule holds for a loss of any scale or sign; ``FLOOR`` keeps
  a loss that starts near 0 from being flagged for a rise that is still small.

A loss that comes down again under the threshold resets the count; a run is flagged once. A non-finite loss is
not this rule's: it fails the run at once (``on_nonfinite``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

REFERENCE_REPORTS = 3
SMOOTHING = 0.05
FACTOR = 4.0
FLOOR = 1e-3
PATIENCE = 100


@dataclass(frozen=True)
class Diverging:
    """What the rule found: the report it began at and the numbers it compared."""

    since_step: int
    loss: float  # the smoothed loss when the rule held
    reference: float
    threshold: float

    def words(self) -> str:
        """What every view says of the run: ``diverging since step N``."""
        return f"diverging since step {self.since_step}"

    def line(self) -> str:
        """The finding with its numbers, in one line (the run's logs, a view's details)."""
        return (f"{self.words()}: the loss (smoothed) is {self.loss:.4g}, over {self.threshold:.4g}, far above its "
                f"level at the start, {self.reference:.4g}")


class DivergenceWatch:
    """Feed it each reported loss (``add``); ``found`` is set, once, when the rule above holds."""

    def __init__(self):
        self._early: list[float] = []
        self._threshold: float | None = None
        self._reference = 0.0
        self._smoothed: float | None = None
        self._above_since: int | None = None
        self._above = 0
        self.found: Diverging | None = None

    def add(self, step: int, loss: float) -> Diverging | None:
        """Take the loss reported at global step ``step``; the finding when this report completes it."""
        if self.found is not None or not math.isfinite(loss):
            return None
        self._smoothed = loss if self._smoothed is None else self._smoothed + SMOOTHING * (loss - self._smoothed)
        if self._threshold is None:
            self._early.append(loss)
            if len(self._early) == REFERENCE_REPORTS:
                self._reference = min(self._early)
                self._threshold = self._reference + FACTOR * max(abs(self._reference), FLOOR)
            return None
        if self._smoothed <= self._threshold:
            self._above, self._above_since = 0, None
            return None
        self._above += 1
        if self._above_since is None:
            self._above_since = step
        if self._above >= PATIENCE:
            self.found = Diverging(self._above_since, self._smoothed, self._reference, self._threshold)
        return self.found
