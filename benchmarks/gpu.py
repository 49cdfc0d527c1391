"""GPU workers: 1 ps (CPU) + 1 worker of the real runtime on ``cuda:0`` against a plain torch loop on the same
GPU: sync through the shared-memory lane (ps and worker on one host), sync over the socket (as between hosts)
and async pipelined, for the conv net of ``workload.py`` (1.2 MB) and its wider one (14.6 MB); samples/s ratio,
and where the worker's time goes (compute, exchange, waiting). Sync through the lane runs a second time in the
same rounds with the gradients copied to the host after backward (``overlap=False``): the ratio of the two is
what copying them during backward (``staging``) gains. Each process gets the torch threads that
``Cluster(ps=1, workers=1, gpus=1)`` gives each task on this machine (half its cores), the plain loop as many.
Not run without a CUDA GPU."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from . import procs
from .common import Result, Target, alternate, compare, repetitions
from .workload import TINY_STEPS

DEVICE = "cuda:0"
BATCH = 256
MODELS = {"conv": "conv net (2 conv + 2 dense, 1.2 MB)",
          "wide_conv": "wide conv net (3 conv + 2 dense, 14.6 MB)"}
MODES = {"sync": "sync, lane", "socket": "sync, socket", "pipelined": "async, pipelined",
         "after": "sync, lane, gradients copied after backward"}
THREADS = max(1, (os.cpu_count() or 2) // 2)  # each task's share in a Cluster of 1 ps + 1 worker


def _model_rows(model: str, label: str, steps: int, rounds: int) -> tuple[list, dict]:
    """The rows of one model, and the worker's median seconds of a round by mode and part."""
    env = {"WORKLOAD_MODEL": model, "WORKLOAD_BATCH": str(BATCH)}
    contenders = {"sync": procs.workload_workers("sync", 1, device=DEVICE, threads=THREADS, **env),
                  "socket": procs.workload_workers("sync", 1, device=DEVICE, socket=True, threads=THREADS, **env),
                  "pipelined": procs.workload_workers("async", 1, pipeline=True, device=DEVICE, threads=THREADS,
                                                      **env),
                  "after": procs.workload_workers("sync", 1, device=DEVICE, overlap=False, threads=THREADS, **env),
                  "plain": procs.Rounds([procs.spawn("workload", "plain", threads=THREADS, WORKLOAD_DEVICE=DEVICE,
                                                     **env)])}
    times: dict[str, list[dict]] = {mode: [] for mode in MODES}
    staged: dict[str, int] = {}  # by mode: the worker's steps whose gradients were copied during backward

    def measure(name: str) -> float:
        (out,) = contenders[name].round(steps)
        if name in times:
            times[name].append(procs.worker_times(out))
            staged[name] = out["staged_steps"]
        return out["samples_per_s"]
    try:
        speeds = alternate({name: (lambda name=name: measure(name)) for name in contenders}, rounds)
    finally:
        procs.close_all(contenders.values())
    rows = [compare(f"{label}, {how}, batch {BATCH}", "1 ps + 1 GPU worker", speeds[mode], "plain loop on the GPU",
                    speeds["plain"], "samples/s", Target(0.85) if mode != "after" else None)
            for mode, how in MODES.items()]
    rows.append(compare(f"{label}, sync, lane: gradients copied during backward against after it, batch {BATCH}",
                        "copied during backward", speeds["sync"], "copied after backward", speeds["after"],
                        "samples/s"))
    medians = {mode: {**{k: statistics.median(t[k] for t in ts) for k in procs.WORKER_TIMES},
                      "staged_steps": staged[mode]} for mode, ts in times.items()}
    return rows, medians


def run(tiny: bool, out_dir: Path) -> Result:
    result = Result("gpu", "GPU workers: 1 ps + 1 worker on the GPU against a plain loop on the same GPU", tiny)
    if not torch.cuda.is_available():
        result.skipped = "no CUDA GPU on this machine"
        return result
    steps = TINY_STEPS if tiny else 300
    for model, label in MODELS.items():
        rows, result.extra[model] = _model_rows(model, label, steps, repetitions(tiny))
        result.rows += rows
    result.notes.append(f"{steps} steps per repetition and process (the first 20 left out); the ps runs on the CPU, "
                        f"each process with {THREADS} torch threads (half the cores, as a "
                        "Cluster of 1 ps + 1 worker gives each task). extra: the worker's median seconds of a round "
                        "in compute (batch to the GPU, forward, backward, the gradient checks, the next batch), "
                        "exchange (the gradients to the host, the round trip, the parameters to the GPU) and "
                        "waiting for the ps; and its steps of the last round whose gradients were copied to the host "
                        "during backward (staged_steps).")
    return result
