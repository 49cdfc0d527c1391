"""Communication hidden behind compute: 1 ps + 1 worker of the real runtime (ps and worker each its own
process) against a plain single-process loop, on the MLP of ``workload.py``; samples/s ratio."""

from __future__ import annotations

from pathlib import Path

from . import procs
from .common import Result, Target, alternate, compare, repetitions


def pscluster_speed(steps: int, split: list[dict]) -> float:
    """The worker's samples/s; its time split (compute, communication, waiting) is appended to ``split``."""
    with procs.PSProcesses(1, workers=1) as cluster:
        (out,) = procs.outputs([procs.spawn("workload", "pscluster", "sync", steps, **cluster.worker_env(0))])
    split.append({k: out[k] for k in ("compute_s", "comm_s", "wait_s")})
    return out["samples_per_s"]


def plain_speed(steps: int) -> float:
    return procs.outputs([procs.spawn("workload", "plain", steps)])[0]["samples_per_s"]


def run(tiny: bool, out_dir: Path) -> Result:
    steps = 40 if tiny else 300
    split: list[dict] = []
    speeds = alternate({"pscluster": lambda: pscluster_speed(steps, split), "plain": lambda: plain_speed(steps)},
                       repetitions(tiny))
    result = Result("hidden", "Communication hidden behind compute (1 ps + 1 worker vs a plain loop)", tiny)
    result.rows.append(compare("784-256-10 MLP, batch 128, SGD", "1 ps + 1 worker", speeds["pscluster"],
                               "plain loop", speeds["plain"], "samples/s", Target(0.85)))
    comm = [s["comm_s"] / (s["compute_s"] + s["comm_s"] + s["wait_s"]) for s in split]
    result.extra["worker_time_split"] = split
    result.notes.append(f"Where the worker's time goes (its own timers): communication (push-pull round trip, "
                        f"not overlapped) {sorted(comm)[len(comm) // 2]:.0%} of each step, the rest compute "
                        "(batch, forward, backward).")
    result.notes.append(f"{steps} steps per repetition; each process (ps, worker, plain loop) has 1 torch thread; "
                        "the ps and the worker are separate processes on the same host.")
    return result
