"""Processes of the benchmarks: ps tasks served by ``python -m pscluster.runtime`` (the product's own
standalone ps), and benchmark roles run as ``python -m benchmarks.<module> ...`` children, started once per
contender and told to run one round at a time (so that rounds of several contenders alternate without
paying for process starts). Within ``tiny_run`` (the tiny size) every child is forked from a zygote that has
imported torch once, instead of started fresh, and the benchmarks share one started cluster."""

from __future__ import annotations

import contextlib
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pscluster.errors import PeerLost
from pscluster.runtime.client import PSClient
from pscluster.runtime.network import free_port
from pscluster.runtime.optim import OptimizerSpec
from pscluster.runtime.plan import PsConfig
from pscluster.spec import ClusterSpec, TaskSpec

from .zygote import Zygote

if TYPE_CHECKING:
    import pscluster

ROOT = Path(__file__).absolute().parent.parent


def child_env(threads: int = 1, **extra: str) -> dict:
    """The environment of a child: this repository importable (before what PYTHONPATH held), ``threads``
    intra-op threads for torch."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra)
    return env


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports free right now, none handed out before by this process (``network.free_port``)."""
    return [free_port() for _ in range(n)]


@dataclass
class StartedCluster:
    """A started ``pscluster.Cluster(ps=1, workers=2)`` and the seconds its ``start()`` took."""

    cluster: pscluster.Cluster
    start_s: float

    @classmethod
    def start(cls, store: str) -> StartedCluster:
        import pscluster  # ipyparallel's client with it: imported where a cluster is started

        cluster = pscluster.Cluster(ps=1, workers=2, store=store)
        began = time.perf_counter()
        cluster.start()
        return cls(cluster, time.perf_counter() - began)


class TinyRun:
    """What the benchmarks of one tiny run share (``tiny_run``): the zygote their children are forked from, and a
    temporary folder for the cluster they share, started on first use."""

    def __init__(self):
        self.zygote = Zygote(child_env(1), str(ROOT))
        self.folder = tempfile.TemporaryDirectory(prefix="pscluster-bench-")
        self.started: StartedCluster | None = None

    def cluster(self) -> StartedCluster:
        if self.started is None:
            self.started = StartedCluster.start(os.path.join(self.folder.name, "runs.sqlite"))
        return self.started

    def close(self) -> None:
        try:
            if self.started is not None:
                self.started.cluster.stop()
        finally:
            self.zygote.close()
            self.folder.cleanup()


_tiny: TinyRun | None = None  # within tiny_run


@contextlib.contextmanager
def tiny_run(tiny: bool = True):
    """Within it, with ``tiny``, the benchmarks share processes, as the tiny size (which checks that they run,
    its numbers meaning nothing) can: every child of ``spawn`` and ``PSProcesses`` is forked from one zygote
    process (``zygote.Zygote``) that has imported torch and pscluster's runtime once, rather than started as a
    fresh interpreter (4-6 s of CPU less per child), and ``started_cluster`` gives the benchmarks that train on a
    ``Cluster(ps=1, workers=2)`` the same one. Measurements at full size start every child and cluster fresh, as
    the product starts its processes."""
    global _tiny
    if not tiny or _tiny is not None:
        yield
        return
    _tiny = TinyRun()
    try:
        yield
    finally:
        shared, _tiny = _tiny, None
        shared.close()


@contextlib.contextmanager
def started_cluster(store: str):
    """A ``StartedCluster`` just started, recording its runs in ``store``, stopped on leaving; within ``tiny_run``,
    the one the run shares (started on its first use, its store in a folder of its own; left running)."""
    if _tiny is not None:
        yield _tiny.cluster()
        return
    started = StartedCluster.start(store)
    try:
        yield started
    finally:
        started.cluster.stop()


def _start(module: str, args, *, threads: int, env: dict, **streams):
    """``python -m module args...`` in this repository with ``child_env(threads, **env)``: a ``subprocess.Popen``
    (text streams), or its like forked from the zygote within ``tiny_run``."""
    command = [sys.executable, "-m", module, *map(str, args)]
    if _tiny is not None:
        return _tiny.zygote.popen(command, cwd=str(ROOT), env=child_env(threads, **env), **streams)
    return subprocess.Popen(command, cwd=ROOT, env=child_env(threads, **env), text=True, **streams)


def spawn(module: str, *args, threads: int = 1, **env: str) -> subprocess.Popen:
    """``python -m benchmarks.<module> args...``: commands on its stdin, JSON lines on its stdout, its error
    output in a temporary file (read back when it fails). Within ``tiny_run``, a ``zygote.Forked``."""
    errors = tempfile.TemporaryFile()
    child = _start(f"benchmarks.{module}", args, threads=threads, env=env, stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, stderr=errors)
    child.errors = errors
    return child


def _failure(child: subprocess.Popen, what: str) -> RuntimeError:
    child.kill()
    child.wait()
    child.errors.seek(0)
    return RuntimeError(f"{child.args[2:]} {what}: {child.errors.read()[-2000:].decode(errors='replace')}")


def read_json(child: subprocess.Popen, timeout: float = 300) -> dict:
    """The next JSON line ``child`` prints (other lines skipped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not select.select([child.stdout], [], [], deadline - time.monotonic())[0]:
            break
        line = child.stdout.readline()
        if not line:
            raise _failure(child, f"ended (exit {child.wait()})")
        if line.startswith("{"):
            return json.loads(line)
    raise _failure(child, f"printed no result within {timeout:.0f}s")


class Rounds:
    """The processes of one contender, started once, that run one round per command: each of ``commanded``
    is sent a line with the round's steps and answers one JSON line; ``after`` runs once they have ended."""

    def __init__(self, commanded: list[subprocess.Popen], others: list[subprocess.Popen] = (), after=None):
        self.commanded, self.others, self.after = commanded, list(others), after

    def round(self, *command) -> list[dict]:
        """Send ``command`` (numbers: a round's size) to every commanded process; their answers."""
        for child in self.commanded:
            child.stdin.write(" ".join(map(str, command)) + "\n")
            child.stdin.flush()
        return [read_json(child) for child in self.commanded]

    def end_input(self) -> None:
        """End of input for the commanded processes, which then end (``close`` waits for them)."""
        for child in self.commanded:
            child.stdin.close()

    def close(self) -> None:
        """End of input for the commanded processes: every process ends (killed after 30 s)."""
        self.end_input()
        for child in self.commanded + self.others:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if self.after is not None:
            self.after()


def close_all(contenders) -> None:
    """``close`` each of ``contenders`` (``Rounds``), every one told to end before any is waited for, so that
    their processes end together rather than one contender after another."""
    contenders = list(contenders)
    for rounds in contenders:
        rounds.end_input()
    for rounds in contenders:
        rounds.close()


WORKER_TIMES = ("compute_s", "comm_s", "wait_s")  # a runtime worker's seconds computing, exchanging, waiting


def worker_times(summary: dict) -> dict:
    """Where a runtime worker's round went: ``WORKER_TIMES`` of its summary (or of ``workload.py``'s answer)."""
    return {k: summary[k] for k in WORKER_TIMES}


def step_split(rounds: list[dict], steps: int) -> dict[str, float]:
    """Milliseconds a step of each of ``WORKER_TIMES``: the medians of ``rounds`` (``worker_times`` of rounds of
    ``steps`` steps each)."""
    return {k: 1e3 * statistics.median(r[k] for r in rounds) / steps for k in WORKER_TIMES}


def workload_workers(mode: str, workers: int, pipeline: bool = False, device: str = "cpu", *, socket: bool = False,
                     overlap: bool = True, threads: int = 1, loop: bool = False, **env: str) -> Rounds:
    """1 ps and ``workers`` workers of the real runtime training ``workload.py``'s model in ``mode``, one round
    per command; ``pipeline``: async workers compute their next gradients while the push-pull is in flight;
    ``socket``: no shared-memory lane; ``overlap``: sync pushes leave during backward; ``device``: the workers'
    (``cuda:0``); ``threads``: torch threads of each process; ``loop``: the workload as a user's own loop
    (``workload.train_fn``) instead of the library's; ``env``: more of the workers' environment
    (``WORKLOAD_MODEL``...)."""
    cluster = PSProcesses(1, workers=workers, threads=threads, device=device)
    how = [name for name, on in (("pipeline", pipeline), ("socket", socket), ("no-overlap", not overlap)) if on]
    command = ("loop", mode) if loop else ("pscluster", mode, *how)
    return Rounds([spawn("workload", *command, threads=threads, **cluster.worker_env(i), **env)
                   for i in range(workers)], after=cluster.close)


def runtime_worker(model_fn, dataset, loss_fn, *, run_id: int, log, **options) -> dict:
    """Train as the worker PSCLUSTER_CONFIG names on the runtime alone (no run store, no supervisor): one run,
    ``run_id``, whose chief (worker 0) initializes the ps tasks; ``options`` as ``Cluster.train``'s. Its
    summary."""
    from dataclasses import replace

    from pscluster.runtime.options import TRAIN_SCRIPT
    from pscluster.runtime.plan import training_plan
    from pscluster.runtime.worker import run_worker
    from pscluster.task_config import from_environment

    spec, task = from_environment()
    plan, _, dataset, collate_fn, _ = training_plan(model_fn, dataset, options, entry=TRAIN_SCRIPT,
                                                    of=runtime_worker, num_ps=len(spec.ps),
                                                    num_workers=len(spec.workers))
    return run_worker(spec, task.index, replace(plan, run_id=run_id), model_fn, dataset, loss_fn,
                      collate_fn=collate_fn, log=log)


def runtime_loop(train_fn, *, run_id: int, log, mode: str, steps: int, **options) -> dict:
    """Run ``train_fn(ctx)`` as the worker PSCLUSTER_CONFIG names, on the runtime alone, as ``runtime_worker`` runs
    the library's loop: the plan made at its loop's first training call (as ``Cluster.run``'s chief makes it); its
    summary."""
    from dataclasses import replace

    from pscluster.runtime.context import loop_plan, run_loop, settings_plan
    from pscluster.task_config import from_environment

    spec, task = from_environment()
    given = dict(options, mode=mode, steps=steps)
    return run_loop(spec, task.index, replace(settings_plan(given, num_workers=len(spec.workers)), run_id=run_id),
                    train_fn, log=log,
                    planned=lambda *registered: replace(loop_plan(*registered, given, num_ps=len(spec.ps),
                                                                  num_workers=len(spec.workers)), run_id=run_id))


def serve_rounds(run_round) -> None:
    """A child's side of ``Rounds``: for each line of stdin (numbers), print ``run_round(*numbers)`` as JSON."""
    for line in sys.stdin:
        print(json.dumps(run_round(*(float(x) if "." in x else int(x) for x in line.split()))), flush=True)


class PSProcesses:
    """``num_ps`` ps tasks (and ``workers`` worker slots on ``device``) of a fresh cluster, each its own
    process."""

    def __init__(self, num_ps: int, workers: int = 1, threads: int = 1, device: str = "cpu"):
        self.spec = ClusterSpec(ps=tuple(TaskSpec("ps", i, port=p) for i, p in enumerate(free_ports(num_ps))),
                                workers=tuple(TaskSpec("worker", i, device=device) for i in range(workers)))
        self.procs = [_start("pscluster.runtime", (), threads=threads,
                             env={"PSCLUSTER_CONFIG": self.spec.config_for("ps", i)}, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL)
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


def ps_config(*names: str, optimizer: str = "SGD", lr: float = 0.0, workers: int = 1, **fields) -> dict:
    """The INIT config of a ps holding variables ``names`` in an endless async run (what a chief would send)."""
    return PsConfig.of(mode="async", steps=10**9, replicas_to_aggregate=1, num_workers=workers, names=names,
                       optimizer=OptimizerSpec(optimizer, {"lr": lr}).to_dict(), **fields).to_dict()
