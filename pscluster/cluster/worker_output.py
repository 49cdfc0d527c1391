"""What the workers print, relayed to the run's log lines, as ipyparallel's ``%px`` shows it in the notebook.

A worker on an engine runs under an ipyparallel ``apply``, whose result (``AsyncResult``) collects the engine's
stdout and stderr as they arrive. ``WorkerOutput`` follows each worker's result, a replacement's too, and gives
every new complete line once, prefixed by its task (``[worker:1] hello``); a result that ended gives its last
line, complete or not, once its output is all in. Workers of another kind (a script's processes, whose output is
their own) have no such result and are left alone.
"""

from __future__ import annotations

import time
from typing import Callable

OUTPUT_GRACE_S = 1.0  # how long the run's end waits for the output its ended workers printed last


class WorkerOutput:
    """Relays the output of the workers' results to ``log`` (a function of one line), each line once, in order."""

    def __init__(self, log: Callable[[str], None]):
        self._log = log
        self._followed: dict[int, _Followed] = {}  # by id() of the result, which its entry holds (over ones too)

    def relay(self, results: list, *, final: bool = False) -> None:
        """Log the lines the results printed since the last call; ``results``: the run's workers now, by index
        (each new one is followed from here on, as are those followed before). ``final``: the run ended, the last
        lines of every result are logged (its output awaited ``OUTPUT_GRACE_S`` at most)."""
        for i, result in enumerate(results):
            if id(result) not in self._followed and isinstance(getattr(result, "stdout", None), str):
                self._followed[id(result)] = _Followed(result, f"worker:{i}")
        deadline = time.monotonic() + OUTPUT_GRACE_S
        for followed in self._followed.values():
            if not followed.over:
                followed.relay(self._log, deadline if final else None)


class _Followed:
    """One worker's result, with what of its stdout and stderr was logged."""

    def __init__(self, result, task: str):
        self.result, self.prefix = result, f"[{task}] "
        self.logged = {"stdout": 0, "stderr": 0}  # characters of each stream logged
        self.over = False  # its output is all in, and logged

    def relay(self, log: Callable[[str], None], deadline: float | None) -> None:
        """Log its new complete lines; once its output is all in (awaited until ``deadline``, if given), the rest
        too, and it is over."""
        self.over = self.result.ready() and self.result.wait_for_output(
            0 if deadline is None else max(0.0, deadline - time.monotonic()))
        for stream in self.logged:
            text = getattr(self.result, stream) or ""
            end = len(text) if self.over or deadline is not None else text.rfind("\n", self.logged[stream]) + 1
            for line in text[self.logged[stream]:end].splitlines():
                log(self.prefix + line)
            self.logged[stream] = max(self.logged[stream], end)
