"""Recovery of a lost worker: worker 1 of an async digits run (1 ps + 2 workers) SIGKILLed, again and again,
each time once its replacement steps. Per loss, from the run's events and metrics: the kill to the loss
recorded (detection), the loss to the replacement's engine ready (a new engine started and configured: the
``replaced`` event), and the engine ready to the replacement's first step, whose goal is 1 s."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import pscluster
from pscluster.datasets import digits

from . import procs
from .common import Result, Target, compare, repetitions

STEPS = 10**7  # the run outlasts the kills; it is stopped after them
WAIT_S = 120.0


def model_fn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _until(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {WAIT_S:.0f} s")
        time.sleep(0.05)
    return found


def one_loss(cluster: pscluster.Cluster, run) -> dict:
    """Kill worker 1 and time its recovery (seconds: ``detection``, ``engine``, ``first_step``)."""
    killed = time.time()
    cluster.kill("worker:1")

    def after(kind: str):
        events = run.events()
        events = events[(events["kind"] == kind) & (events["task"] == "worker:1") & (events["time"] >= killed)]
        return float(events["time"].iloc[0]) if len(events) else None

    lost = _until(lambda: after("lost"), "lost event")
    replaced = _until(lambda: after("replaced"), "replaced event")

    def first_step():
        m = run.metrics()
        m = m[(m["worker"] == 1) & (m["time"] > replaced)]
        return float(m["time"].min()) if len(m) else None

    stepped = _until(first_step, "step of the replacement")
    return {"detection": lost - killed, "engine": replaced - lost, "first_step": stepped - replaced}


def run(tiny: bool, out_dir: Path) -> Result:
    result = Result("recovery", "Recovery of a lost worker: engine ready to the replacement's first step", tiny)
    losses = []
    with tempfile.TemporaryDirectory() as folder:  # the run store, and the checkpoint that stop() writes
        with procs.started_cluster(os.path.join(folder, "runs.sqlite")) as started:  # in a tiny run, the shared one
            cluster = started.cluster
            training = cluster.train(model_fn, digits("train"), torch.nn.CrossEntropyLoss(), mode="async",
                                     steps=STEPS, batch_size=32, lr=0.05, log_every=STEPS, checkpoint_secs=None)
            _until(lambda: training.global_step > 200, "training")
            for _ in range(repetitions(tiny)):
                losses.append(one_loss(cluster, training))
            training.stop()
    first = [loss["first_step"] for loss in losses]
    result.rows.append(compare("replacement worker: engine ready to first step", "replacement", first,
                               "the goal", [1.0] * len(first), "s", Target(1.0, higher=False),
                               note="a lost worker's replacement, on the new engine"))
    medians = {k: statistics.median(loss[k] for loss in losses) for k in ("detection", "engine", "first_step")}
    result.extra.update(losses=losses, medians=medians)
    result.notes.append(f"Median of {len(losses)} losses: killed to lost {medians['detection']:.2f} s (detection), "
                        f"lost to engine ready {medians['engine']:.2f} s (a new engine: a process importing torch), "
                        f"engine ready to first step {medians['first_step']:.2f} s.")
    return result
