"""Waiting for a condition by polling it (the control plane and the tests wait on the ps and on runs this way)."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
