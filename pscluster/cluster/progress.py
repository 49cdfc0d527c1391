"""Progress that also shows in reports executed headless: a bar of a run's global step (``StepProgress``) and
the line of a cluster's start (``StartProgress``).

In a kernel the bar is one display output updated in place through its display
id, so JupyterLab shows it moving and nbconvert keeps its final state; on a
terminal it is a plain tqdm bar. Both use tqdm's own formatting, with the rate
the caller gives (the run's steps/s by ``metrics.speed``) rather than tqdm's
steps over the time since the bar was made, which is wrong for a bar made after
the run started, or a run that starts at a step above 0.
"""

from __future__ import annotations

import math
import sys
import time

from tqdm.std import tqdm

UPDATE_S = 0.5


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (where a display updates in place)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


class _Bar(tqdm):
    """A terminal tqdm bar that shows the rate it is given (``rate``; 0: unknown, shown as ``?``)."""

    rate = 0.0

    @property
    def format_dict(self):
        return {**super().format_dict, "rate": self.rate}


class StepProgress:
    """Progress of a run towards its global step target."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.rate = total, desc, 0, 0.0
        self._started = self._shown = time.monotonic()
        self._bar = None
        self._handle = None
        if in_kernel():
            from IPython.display import display

            self._handle = display({"text/plain": self._line()}, raw=True, display_id=True)
        else:
            self._bar = _Bar(total=total, desc=desc, unit="step", file=sys.stdout)

    def _line(self) -> str:
        return tqdm.format_meter(self.n, self.total, time.monotonic() - self._started, prefix=self.desc,
                                 unit="step", ncols=80, rate=self.rate)

    def update(self, n: int, steps_per_s: float, *, force: bool = False) -> None:
        """Move to global step ``n`` at ``steps_per_s`` (the run's; NaN: not known yet), redrawn at most
        every UPDATE_S seconds unless ``force``."""
        self.rate = steps_per_s if math.isfinite(steps_per_s) else 0.0
        if self._bar is not None:
            self._bar.rate = self.rate
            self._bar.update(n - self._bar.n)
            return
        self.n = n
        if force or time.monotonic() - self._shown >= UPDATE_S:
            self._shown = time.monotonic()
            self._handle.update({"text/plain": self._line()}, raw=True)

    def write(self, line: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self.update(self.n, self.rate, force=True)


class StartProgress:
    """What the start of a cluster (``what``: its name and size) has done so far, one stage at a time (call it with
    the stage: "engines up 2 of 4"), with the seconds since it began: in a kernel one output updated in place, on a
    terminal one line per new stage."""

    def __init__(self, what: str):
        self.what, self._stage = what, None
        self._started = time.monotonic()
        self._handle = None
        if in_kernel():
            from IPython.display import display

            self._handle = display({"text/plain": f"{what}: starting"}, raw=True, display_id=True)

    def __call__(self, stage: str) -> None:
        if stage == self._stage:
            return
        self._stage = stage
        line = f"{self.what}: {stage} ({time.monotonic() - self._started:.1f} s)"
        if self._handle is not None:
            self._handle.update({"text/plain": line}, raw=True)
        else:
            print(line, flush=True)
