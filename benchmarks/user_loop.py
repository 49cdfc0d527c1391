"""The user's own loop as fast as the library's: the workload of ``workload.py`` (MLP, batch 128 per worker, SGD) as
a ``train_fn`` (``Cluster.run``) against ``Cluster.train``'s loop, on 1 ps + 2 workers and on 1 ps + 1 worker (where
the loop's own costs are the largest share) in sync mode; the 1-worker loop beside a plain single-process loop too,
without a target (the library's own loop is measured against it in ``hidden``); samples/s ratios, side by side."""

from __future__ import annotations

from pathlib import Path

from . import procs
from .common import Result, Target, alternate, compare, repetitions
from .peers import aggregate
from .workload import TINY_STEPS

# A round's steps: a round of a few hundred steps lasts under a second on a fast machine, and one garbage
# collection or scheduling hiccup in it moved its ratio by 20 % and more
ROUND_STEPS = 1000


def run(tiny: bool, out_dir: Path) -> Result:
    steps = TINY_STEPS if tiny else ROUND_STEPS
    systems = {"run": lambda: procs.workload_workers("sync", 2, loop=True),
               "train": lambda: procs.workload_workers("sync", 2),
               "run, 1 worker": lambda: procs.workload_workers("sync", 1, loop=True),
               "train, 1 worker": lambda: procs.workload_workers("sync", 1),
               "plain": lambda: procs.Rounds([procs.spawn("workload", "plain")])}
    started: dict[str, procs.Rounds] = {}
    try:
        for name, start in systems.items():
            started[name] = start()
        speeds = alternate({name: (lambda name=name: aggregate(started[name].round(steps))) for name in started},
                           repetitions(tiny, times=2))
    finally:
        procs.close_all(started.values())
    result = Result("user_loop", "Your own loop (Cluster.run) against the library's (Cluster.train)", tiny)
    unit = "samples/s"
    result.rows += [
        compare("sync, 1 ps + 2 workers: run vs train", "Cluster.run (train_fn)", speeds["run"],
                "Cluster.train", speeds["train"], unit, Target(0.97)),
        compare("sync, 1 ps + 1 worker: run vs train", "Cluster.run, 1 worker", speeds["run, 1 worker"],
                "Cluster.train, 1 worker", speeds["train, 1 worker"], unit, Target(0.97)),
        compare("sync, 1 ps + 1 worker: run vs a plain loop", "Cluster.run, 1 worker", speeds["run, 1 worker"],
                "plain loop", speeds["plain"], unit, Target(0.85)),
    ]
    result.notes.append(f"{steps} steps per worker per repetition (the first 20 left out), twice the usual "
                        "repetitions; each process has one torch thread; every pscluster repetition is a new run. "
                        "Both loops run on the same worker context and exchange (train's is a train_fn of its own), "
                        "each with its defaults; the workload's 0.8 MB push is under overlap's 4 MB, so neither "
                        "pushes during backward: the ratio is what the user's loop, its ctx calls and its optimizer "
                        "object, costs over the library's.")
    return result
