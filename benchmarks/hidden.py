"""Communication hidden behind compute: 1 ps + 1 worker of the real runtime (ps and worker each its own
process) against a plain single-process loop, on the MLP of ``workload.py``; samples/s ratio. The bare ZeroMQ ps
of ``peers`` with one worker runs beside them: what a sync round trip costs on this machine with nothing but
the transfer and the update."""

from __future__ import annotations

from pathlib import Path

from . import procs
from .common import Result, Target, alternate, compare, repetitions
from .peers import bare
from .workload import TINY_STEPS


def run(tiny: bool, out_dir: Path) -> Result:
    steps = TINY_STEPS if tiny else 300
    workers = {"sync": procs.workload_workers("sync", 1),
               "async, pipelined": procs.workload_workers("async", 1, pipeline=True)}
    plain = procs.Rounds([procs.spawn("workload", "plain")])
    bare_sync = bare("sync", workers=1)
    split: dict[str, list[dict]] = {name: [] for name in workers}

    def speed(name: str) -> float:
        (out,) = workers[name].round(steps)
        split[name].append(procs.worker_times(out))
        return out["samples_per_s"]
    try:
        # twice the usual repetitions: this VM's speed moves between runs seconds apart, and one pair of
        # 300-step runs takes only a couple of seconds
        speeds = alternate({**{name: (lambda name=name: speed(name)) for name in workers},
                            "plain": lambda: plain.round(steps)[0]["samples_per_s"],
                            "bare": lambda: bare_sync.round(steps)[0]["samples_per_s"]}, repetitions(tiny, times=2))
    finally:
        procs.close_all((*workers.values(), plain, bare_sync))
    result = Result("hidden", "Communication hidden behind compute (1 ps + 1 worker vs a plain loop)", tiny)
    for name in workers:
        result.rows.append(compare(f"784-256-10 MLP, batch 128, SGD, {name}", f"1 ps + 1 worker, {name}",
                                   speeds[name], "plain loop", speeds["plain"], "samples/s", Target(0.85)))
    result.rows += [
        compare("784-256-10 MLP, batch 128, SGD, sync, bare ZeroMQ ps", "bare ZeroMQ ps + 1 worker, sync",
                speeds["bare"], "plain loop", speeds["plain"], "samples/s"),
        compare("784-256-10 MLP, batch 128, SGD, sync: pscluster against the bare ZeroMQ ps", "1 ps + 1 worker, sync",
                speeds["sync"], "bare ZeroMQ ps + 1 worker, sync", speeds["bare"], "samples/s", Target(1.0)),
    ]
    result.extra["worker_time_split"] = split
    shares = {name: sorted(s["comm_s"] / (s["compute_s"] + s["comm_s"] + s["wait_s"]) for s in splits)
              for name, splits in split.items()}
    result.notes.append("Where the worker's time goes (its own timers): communication (the push-pull round trip "
                        "beyond what overlaps it) " + ", ".join(f"{c[len(c) // 2]:.0%} of each step {name}"
                                                               for name, c in shares.items()) +
                        "; the rest compute (forward, backward, and during the round trip: the loss, the accuracy "
                        "and the next batch, and pipelined the next forward and backward too).")
    result.notes.append(f"{steps} steps per repetition (the first 20 left out); each process (ps, worker, plain "
                        "loop) has 1 torch thread; the ps and the worker are separate processes on the same host, "
                        "started once; each pscluster repetition is a new run. Pipelined: async, each gradient "
                        "computed while the last push-pull is in flight, on parameters one step older. The bare "
                        "ZeroMQ ps (bare_zmq_ps.py: no signing, no checks) answers with the whole flat parameter "
                        "vector over TCP, where pscluster's shared-memory lane carries the values.")
    return result
