"""TensorBoard on the event files the runs of a run store write (``metrics.tensorboard``), for
``%pscluster tensorboard``: one process on 127.0.0.1, started with the kernel as its owner (a reaper ends it
when the kernel dies), shown inline as a frame and by its URL.

    board = TensorBoard(logdir).start()
    board.url            # http://127.0.0.1:PORT/
    board.stop()
"""

from __future__ import annotations

import html
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .errors import ClusterStateError
from .runtime.network import free_port

START_S = 60.0


class TensorBoard:
    """TensorBoard reading ``logdir`` on 127.0.0.1:``port`` (0: a free one)."""

    def __init__(self, logdir: str | os.PathLike, port: int = 0):
        self.logdir = Path(logdir)
        self.port = port or free_port()
        self._process: subprocess.Popen | None = None
        self._reaper: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = START_S) -> "TensorBoard":
        """Start it and wait until it answers; ClusterStateError with its last output when it does not."""
        self.logdir.mkdir(parents=True, exist_ok=True)
        log = self.logdir / f".tensorboard-{self.port}.log"
        with open(log, "wb") as out:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tensorboard.main", "--logdir", str(self.logdir), "--host", "127.0.0.1",
                 "--port", str(self.port), "--reload_interval", "2"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._reaper = subprocess.Popen([sys.executable, "-m", "pscluster.cluster.reaper", str(os.getpid()),
                                         str(self._process.pid)], start_new_session=True,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self._answers():
            if not self.running or time.monotonic() > deadline:
                ended = not self.running
                self.stop()
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
                what = "ended as it started" if ended else f"did not answer within {timeout:.0f}s"
                raise ClusterStateError(f"TensorBoard on port {self.port} {what}"
                                        f"{' (' + tail[0] + ')' if tail else ''}: pick another port with --port")
            time.sleep(0.2)
        return self

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        for process in (self._process, self._reaper):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)

    def __repr__(self) -> str:
        return f"<TensorBoard {self.url} on {self.logdir}{'' if self.running else ' (stopped)'}>"

    def _repr_html_(self) -> str:
        return (f'<p>TensorBoard: <a href="{self.url}" target="_blank">{self.url}</a> '
                f"({html.escape(str(self.logdir))})</p>"
                f'<iframe src="{self.url}" width="100%" height="800" frameborder="0"></iframe>')
