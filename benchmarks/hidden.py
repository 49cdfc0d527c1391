"""Communication hidden behind compute: 1 ps + 1 worker of the real runtime (ps and worker each its own
process) against a plain single-process loop, on the MLP of ``workload.py``; samples/s ratio."""

from __future__ import annotations

from pathlib import Path

from . import procs
from .common import Result, Target, alternate, compare, repetitions


def pscluster_worker() -> procs.Rounds:
    cluster = procs.PSProcesses(1, workers=1)
    return procs.Rounds([procs.spawn("workload", "pscluster", "sync", **cluster.worker_env(0))], after=cluster.close)


def run(tiny: bool, out_dir: Path) -> Result:
    steps = 40 if tiny else 300
    pscluster, plain = pscluster_worker(), procs.Rounds([procs.spawn("workload", "plain")])
    split: list[dict] = []

    def pscluster_speed() -> float:
        (out,) = pscluster.round(steps)
        split.append({k: out[k] for k in ("compute_s", "comm_s", "wait_s")})
        return out["samples_per_s"]
    try:
        # twice the usual repetitions: this VM's speed moves between runs seconds apart, and one pair of
        # 300-step runs takes only a couple of seconds
        speeds = alternate({"pscluster": pscluster_speed, "plain": lambda: plain.round(steps)[0]["samples_per_s"]},
                           2 * repetitions(tiny))
    finally:
        pscluster.close()
        plain.close()
    result = Result("hidden", "Communication hidden behind compute (1 ps + 1 worker vs a plain loop)", tiny)
    result.rows.append(compare("784-256-10 MLP, batch 128, SGD", "1 ps + 1 worker", speeds["pscluster"],
                               "plain loop", speeds["plain"], "samples/s", Target(0.85)))
    comm = [s["comm_s"] / (s["compute_s"] + s["comm_s"] + s["wait_s"]) for s in split]
    result.extra["worker_time_split"] = split
    result.notes.append(f"Where the worker's time goes (its own timers): communication (the push-pull round trip "
                        f"beyond what overlaps it) {sorted(comm)[len(comm) // 2]:.0%} of each step, the rest compute "
                        "(forward, backward, and during the round trip: the loss, the accuracy and the next batch).")
    result.notes.append(f"{steps} steps per repetition (the first 20 left out); each process (ps, worker, plain "
                        "loop) has 1 torch thread; the ps and the worker are separate processes on the same host, "
                        "started once; each pscluster repetition is a new run.")
    return result
