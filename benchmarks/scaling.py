"""Scaling by simulation: workers whose compute is a fixed sleep (no CPU), so that up to 64 fit on this
machine, each a thread with its own PSClient (its own sockets and shared-memory lanes to every ps), spread
over ``HOSTS`` worker-host processes, pushing and pulling a small model (async: every push is a global step)
to 1, 2 and 4 ps processes. Aggregate global steps/s against ideal linear scaling: n times the speed of one
worker, measured alongside.

    python -m benchmarks.scaling host H HOSTS MOST NUMEL    a worker host (PSCLUSTER_CONFIG names the cluster):
        clients H, H + HOSTS, ... < MOST; each round "N WINDOW" runs those below N for WINDOW seconds
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from pscluster.runtime.client import PSClient
from pscluster.task_config import from_environment

from . import procs
from .common import Result, Target, alternate, compare, repetitions

COMPUTE_S = 0.05
HOSTS = 2
RUN_ID = 1


def _grads(num_ps: int, numel: int) -> dict:
    return {i: ([0], [torch.zeros(numel // num_ps)]) for i in range(num_ps)}


def host(index: int, hosts: int, most: int, numel: int) -> None:
    """Serve rounds of this host's sleeping workers (see the module's docstring)."""
    spec, _ = from_environment()
    grads = _grads(len(spec.ps), numel)
    clients = {k: PSClient(spec, task=k, run_id=RUN_ID, timeout=120) for k in range(index, most, hosts)}
    for client in clients.values():  # as a worker of the runtime does: shared memory with the ps on its host
        client.share(client.pull())

    def run(workers: int, window: float) -> dict:
        """Steps/s of each of this host's workers below ``workers`` over ``window`` seconds (a third more
        before it left out: threads starting), from the window's start to its last step in the window."""
        mine = [k for k in clients if k < workers]
        stop, begin = threading.Event(), time.monotonic() + window / 3
        counts, last = dict.fromkeys(mine, 0), dict.fromkeys(mine, begin)

        def work(k: int) -> None:
            step = 0
            while not stop.is_set():
                time.sleep(COMPUTE_S)
                step = clients[k].push_pull(step, grads).step
                if (now := time.monotonic()) >= begin and not stop.is_set():
                    counts[k] += 1
                    last[k] = now
        threads = [threading.Thread(target=work, args=(k,)) for k in mine]
        for t in threads:
            t.start()
        time.sleep(window * 4 / 3)
        stop.set()
        for t in threads:
            t.join()
        return {"steps_per_s": sum(counts[k] / (last[k] - begin) for k in mine if counts[k])}
    procs.serve_rounds(run)
    for c in clients.values():
        c.close()


class SleepingWorkers:
    """Up to ``most`` sleeping workers of one async run of ``numel`` parameters split over the ps of
    ``cluster``, on ``HOSTS`` worker-host processes."""

    def __init__(self, cluster: procs.PSProcesses, most: int, numel: int):
        n = len(cluster.spec.ps)
        with PSClient(cluster.spec, run_id=RUN_ID, timeout=120) as controller:
            controller.init(RUN_ID, _grads(n, numel), [procs.ps_config("p", workers=most)] * n)
        self.hosts = procs.Rounds([procs.spawn("scaling", "host", h, HOSTS, most, numel, **cluster.worker_env(0))
                                   for h in range(HOSTS)])

    @property
    def pids(self) -> list[int]:
        return [h.pid for h in self.hosts.commanded]

    def steps_per_s(self, workers: int, window: float) -> float:
        return sum(out["steps_per_s"] for out in self.hosts.round(workers, float(window)))

    def close(self) -> None:
        self.hosts.close()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far."""
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def plot(curves: dict[int, dict[int, float]], single: dict[int, float], path: Path) -> str | None:
    """A PNG of steps/s against workers, per ps count, with linear scaling; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for num_ps, curve in curves.items():
        line, = ax.plot(list(curve), list(curve.values()), marker="o", label=f"{num_ps} ps")
        ax.plot(list(curve), [n * single[num_ps] for n in curve], ls=":", color=line.get_color())
    ax.set_xlabel("workers (compute: a sleep of 50 ms)")
    ax.set_ylabel("global steps/s (median)")
    ax.set_title("Scaling by simulation (dotted: linear)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def run(tiny: bool, out_dir: Path) -> Result:
    counts = (2, 4) if tiny else (8, 16, 32, 64)
    ps_counts = (1,) if tiny else (1, 2, 4)
    window = 0.3 if tiny else 0.5
    numel = 64 * 1024  # 256 KB: far from loopback bandwidth even at 64 workers
    result = Result("scaling", "Scaling by simulation: workers that sleep 50 ms per step, async", tiny)
    curves, single = {}, {}
    for num_ps in ps_counts:
        busy: dict[int, list[tuple[float, float]]] = {}  # workers -> (ps, host) share of a core, per round

        def measured(n: int, sim: SleepingWorkers, pids: list[int], num_ps=num_ps, busy=busy) -> float:
            before, began = (cpu_seconds(pids), cpu_seconds(sim.pids)), time.monotonic()
            speed = sim.steps_per_s(n, window)
            elapsed = time.monotonic() - began
            busy.setdefault(n, []).append(((cpu_seconds(pids) - before[0]) / elapsed / num_ps,
                                           (cpu_seconds(sim.pids) - before[1]) / elapsed / HOSTS))
            return speed
        with procs.PSProcesses(num_ps, workers=max(counts)) as cluster:
            sim = SleepingWorkers(cluster, max(counts), numel)
            try:
                speeds = alternate({n: (lambda n=n, sim=sim, pids=cluster.pids: measured(n, sim, pids))
                                    for n in (1, *counts)}, repetitions(tiny))
            finally:
                sim.close()
        single[num_ps] = sorted(speeds[1])[len(speeds[1]) // 2]
        curves[num_ps] = {}
        for n in counts:
            linear = [n * s for s in speeds[1]]
            ps_busy = sorted(b[0] for b in busy[n])[len(busy[n]) // 2]
            host_busy = sorted(b[1] for b in busy[n])[len(busy[n]) // 2]
            row = compare(f"{n} workers, {num_ps} ps", "global steps/s", speeds[n], "linear (n x 1 worker)", linear,
                          "steps/s", Target(0.85) if n == 32 else None,
                          note=f"CPU: each ps {ps_busy:.0%}, each worker host {host_busy:.0%} of a core")
            result.rows.append(row)
            curves[num_ps][n] = row.a["median"]
    result.extra["curves"] = {str(k): v for k, v in curves.items()}
    image = plot(curves, single, out_dir / "scaling.png")
    result.extra["plot"] = image
    result.notes.append(f"Model {numel * 4 // 1024} KB (split over the ps), SGD lr 0; the workers are threads of "
                        f"{HOSTS} worker-host processes (sleeping: no CPU but their own push-pulls), each with a "
                        f"socket and a shared-memory lane per ps; {window:g} s windows. CPU: median share of a core "
                        "over the rounds.")
    return result


if __name__ == "__main__":
    host(*map(int, sys.argv[2:]))
