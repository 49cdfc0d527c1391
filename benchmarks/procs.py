"""Processes of the benchmarks: ps tasks served by ``python -m pscluster.runtime`` (the product's own
standalone ps), and benchmark roles run as ``python -m benchmarks.<module> ...`` children that print
one JSON line as their last line of output."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pscluster.errors import PeerLost
from pscluster.runtime.client import PSClient
from pscluster.spec import ClusterSpec, TaskSpec

ROOT = Path(__file__).absolute().parent.parent


def child_env(threads: int = 1, **extra: str) -> dict:
    """The environment of a child: this repository importable, ``threads`` intra-op threads for torch."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra)
    return env


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free right now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawn(module: str, *args, threads: int = 1, **env: str) -> subprocess.Popen:
    """``python -m benchmarks.<module> args...`` with its output captured."""
    return subprocess.Popen([sys.executable, "-m", f"benchmarks.{module}", *map(str, args)], cwd=ROOT,
                            env=child_env(threads, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def outputs(children: list[subprocess.Popen], timeout: float = 300) -> list[dict]:
    """The JSON line each child printed last; RuntimeError with its error output if one failed."""
    out = []
    for child in children:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for c in children:
                c.kill()
            raise RuntimeError(f"{child.args[2:]} ran past {timeout:.0f}s") from None
        if child.returncode != 0:
            raise RuntimeError(f"{child.args[2:]} failed (exit {child.returncode}): {stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


class PSProcesses:
    """``num_ps`` ps tasks (and ``workers`` worker slots) of a fresh cluster, each its own process."""

    def __init__(self, num_ps: int, workers: int = 1, threads: int = 1):
        self.spec = ClusterSpec(ps=tuple(TaskSpec("ps", i, port=p) for i, p in enumerate(free_ports(num_ps))),
                                workers=tuple(TaskSpec("worker", i) for i in range(workers)))
        self.procs = [subprocess.Popen([sys.executable, "-m", "pscluster.runtime"], cwd=ROOT,
                                       env=child_env(threads, PSCLUSTER_CONFIG=self.spec.config_for("ps", i)),
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                      for i in range(num_ps)]
        try:
            self._wait_ready(60.0)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Until every ps answers HELLO (a ps still importing torch refuses connections for a while)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                PSClient(self.spec, timeout=timeout).close()
                return
            except PeerLost:
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def worker_env(self, index: int) -> dict:
        """What a worker child needs to join this cluster as worker ``index``."""
        return {"PSCLUSTER_CONFIG": self.spec.config_for("worker", index)}

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
