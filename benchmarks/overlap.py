"""Sync overlap: a worker whose pushes leave during backward against the same worker pushing after it, 1 ps + 1
worker over the socket (no shared-memory lane: as between hosts), each its own process, on the wide MLP of
``workload.py`` (backward and exchange both take tens of milliseconds); samples/s ratio, and each against the
plain loop."""

from __future__ import annotations

from pathlib import Path

from . import procs
from .common import Result, Target, alternate, compare, repetitions
from .workload import TINY_STEPS

MODEL = {"WORKLOAD_MODEL": "wide_mlp"}


def run(tiny: bool, out_dir: Path) -> Result:
    steps = TINY_STEPS if tiny else 80  # the clock ticks every 10 steps and leaves out the first 20
    workers = {on: procs.workload_workers("sync", 1, socket=True, overlap=on, **MODEL) for on in (True, False)}
    plain = procs.Rounds([procs.spawn("workload", "plain", **MODEL)])
    overlapped: list[int] = []

    def speed(on: bool) -> float:
        (out,) = workers[on].round(steps)
        if on:
            overlapped.append(out["overlapped_pushes"])
        return out["samples_per_s"]
    try:
        speeds = alternate({"on": lambda: speed(True), "off": lambda: speed(False),
                            "plain": lambda: plain.round(steps)[0]["samples_per_s"]}, repetitions(tiny))
    finally:
        procs.close_all((*workers.values(), plain))
    result = Result("overlap", "Sync overlap: pushes during backward (1 ps + 1 worker over the socket)", tiny)
    case = "784-2048-2048-10 MLP, batch 128, SGD, sync, socket"
    result.rows.append(compare(case, "overlap on", speeds["on"], "overlap off", speeds["off"], "samples/s",
                               Target(1.0)))
    result.rows.append(compare(case, "overlap on", speeds["on"], "plain loop", speeds["plain"], "samples/s"))
    result.rows.append(compare(case, "overlap off", speeds["off"], "plain loop", speeds["plain"], "samples/s"))
    result.extra["overlapped_pushes"] = overlapped
    result.notes.append(f"{steps} steps per repetition (the first 20 left out), each a new run; each process (ps, "
                        "worker, plain loop) has 1 torch thread; 'on' pushed during backward in every step "
                        f"(overlapped pushes per round: {overlapped}).")
    return result
