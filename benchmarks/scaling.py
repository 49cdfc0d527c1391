"""Scaling by simulation: workers whose compute is a fixed sleep (no CPU), so that up to 64 fit on this
machine, each a thread of this process with its own PSClient (its own sockets to every ps), pushing and
pulling a small model (async: every push is a global step) to 1, 2 and 4 ps processes. Aggregate global
steps/s against ideal linear scaling: n times the speed of one worker, measured alongside."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import torch

from pscluster.runtime.client import PSClient

from . import procs
from .common import Result, Target, alternate, compare, repetitions

COMPUTE_S = 0.05


class SleepingWorkers:
    """Up to ``most`` clients of one async run of ``numel`` parameters split over the ps of ``cluster``."""

    def __init__(self, cluster: procs.PSProcesses, most: int, numel: int):
        n = len(cluster.spec.ps)
        self.grads = {i: ([0], [torch.zeros(numel // n)]) for i in range(n)}
        self.clients = [PSClient(cluster.spec, task=i, run_id=1, timeout=120) for i in range(most)]
        self.clients[0].init(1, self.grads, [{"mode": "async", "steps": 10**9, "replicas_to_aggregate": 1,
                                              "num_workers": most, "optimizer": "SGD",
                                              "optimizer_kwargs": {"lr": 0.0}, "names": ["p"]}] * n)

    def steps_per_s(self, workers: int, window: float) -> float:
        """Global steps/s of ``workers`` sleeping workers over ``window`` seconds (a third more before it left
        out: threads starting): the sum of each worker's steps per second from the window's start to its last
        step in the window."""
        stop, begin = threading.Event(), time.monotonic() + window / 3
        counts, last = [0] * workers, [begin] * workers

        def work(k: int) -> None:
            client, step = self.clients[k], 0
            while not stop.is_set():
                time.sleep(COMPUTE_S)
                step = client.push_pull(step, self.grads).step
                if (now := time.monotonic()) >= begin and not stop.is_set():
                    counts[k] += 1
                    last[k] = now
        threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
        for t in threads:
            t.start()
        time.sleep(window * 4 / 3)
        stop.set()
        for t in threads:
            t.join()
        return sum(c / (t - begin) for c, t in zip(counts, last) if c)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def cpu_seconds(pids: list[int]) -> float:
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
    window = 0.3 if tiny else 0.6
    numel = 64 * 1024  # 256 KB: far from loopback bandwidth even at 64 workers
    result = Result("scaling", "Scaling by simulation: workers that sleep 50 ms per step, async", tiny)
    curves, single = {}, {}
    for num_ps in ps_counts:
        with procs.PSProcesses(num_ps, workers=max(counts)) as cluster:
            sim = SleepingWorkers(cluster, max(counts), numel)
            cpu_before, wall = cpu_seconds(cluster.pids), time.monotonic()
            try:
                speeds = alternate({n: (lambda n=n, sim=sim: sim.steps_per_s(n, window)) for n in (1, *counts)},
                                   repetitions(tiny))
            finally:
                sim.close()
            busy = (cpu_seconds(cluster.pids) - cpu_before) / (time.monotonic() - wall) / num_ps
        single[num_ps] = sorted(speeds[1])[len(speeds[1]) // 2]
        curves[num_ps] = {}
        for n in counts:
            linear = [n * s for s in speeds[1]]
            row = compare(f"{n} workers, {num_ps} ps", "global steps/s", speeds[n], "linear (n x 1 worker)", linear,
                          "steps/s", Target(0.85) if n == 32 else None)
            result.rows.append(row)
            curves[num_ps][n] = row.a["median"]
        result.extra[f"ps_cpu_busy_{num_ps}ps"] = busy
        result.notes.append(f"{num_ps} ps: each ps process used {busy:.0%} of a core on average over the runs")
    result.extra["curves"] = {str(k): v for k, v in curves.items()}
    image = plot(curves, single, out_dir / "scaling.png")
    result.extra["plot"] = image
    result.notes.append(f"Model {numel * 4 // 1024} KB (split over the ps), SGD lr 0; the workers are threads of the "
                        f"benchmark process (sleeping: no CPU) with a socket per ps each; {window:g} s windows.")
    return result
