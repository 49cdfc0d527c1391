"""Overheads: starting a cluster (1 ps + 2 workers) against a bare ipyparallel.Cluster of 3 engines; the time
from ``train()`` to every worker's first step, on a cluster just started and on the run after; training
with the live dashboard against without (a short ``dashboard_overhead`` run); a sharded checkpoint of a
100 MB model written by 2 ps processes against one ``torch.save`` of the same tensors."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import ipyparallel as ipp
import numpy as np
import torch

import pscluster
from pscluster.runtime.client import PSClient

from . import dashboard_overhead, procs
from .common import Result, Target, alternate, compare, repetitions, timed

MB = 2**20


def pscluster_start(store: str) -> float:
    """Seconds from ``Cluster(ps=1, workers=2).start()`` to ready (ps serving, roles assigned); then stopped (in a
    tiny run: the start of the cluster the run shares, left running; see ``procs.started_cluster``)."""
    with procs.started_cluster(store) as started:
        return started.start_s


def start_model() -> torch.nn.Module:
    """An MLP of 4.3 MB of parameters on the digits (64 features, 10 classes)."""
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def to_first_steps(cluster: pscluster.Cluster, dataset) -> float:
    """Seconds from ``cluster.train()`` to the first step of its last worker (each worker's first metric row,
    written when its first push-pull is answered); the run is a short sync one, waited for."""
    began = time.time()
    run = cluster.train(start_model, dataset, torch.nn.CrossEntropyLoss(), lr=0.05, mode="sync", steps=20,
                        batch_size=32, checkpoint_secs=None)
    run.wait(timeout=300, verbose=False)
    return float(run.metrics().groupby("worker")["time"].min().max() - began)


def run_starts(store: str) -> tuple[float, float]:
    """``to_first_steps`` of the first run on a cluster just started (1 ps + 2 workers), and of the run after it (in
    a tiny run: on the cluster the run shares, whose first runs they are when no benchmark used it before)."""
    with procs.started_cluster(store) as started:
        dataset = pscluster.datasets.digits("train")
        return to_first_steps(started.cluster, dataset), to_first_steps(started.cluster, dataset)


def ipyparallel_start() -> float:
    """Seconds from a bare ``ipyparallel.Cluster(n=3)`` start to 3 engines registered; then stopped."""
    cluster = ipp.Cluster(n=3, log_level=logging.ERROR)

    def start():
        client = cluster.start_and_connect_sync(activate=False)
        client.wait_for_engines(3, timeout=120, interactive=False)
        return client
    began = time.perf_counter()
    client = start()
    seconds = time.perf_counter() - began
    client.close()
    cluster.stop_cluster_sync()
    return seconds


class Checkpointing:
    """A 2-ps run of ``nbytes`` of parameters (half on each ps) that writes shards to a temporary folder."""

    def __init__(self, cluster: procs.PSProcesses, nbytes: int, folder: str):
        self.folder = folder
        self.client = PSClient(cluster.spec, task=0, timeout=300)
        half = nbytes // 8
        self.values = {i: ([i], [torch.randn(half)]) for i in range(2)}
        self.client.init(1, self.values, [procs.ps_config(f"p{i}", checkpoint_dir=folder) for i in range(2)])
        self.step = self.client.pull().step
        self.saves = 0

    def sharded(self) -> float:
        """Seconds for both ps to write their shard of a new step (each shard and receipt fsynced)."""
        self.step = self.client.push_pull(self.step, self.values).step  # a step not written yet
        return timed(self.client.checkpoint)

    def torch_save(self) -> float:
        """Seconds for one ``torch.save`` of the same tensors to a new file (as each shard is), flushed and
        fsynced as the shards are."""
        state = {f"p{i}": t for i, (_, (t,)) in self.values.items()}
        self.saves += 1

        def save():
            with open(Path(self.folder) / f"model-{self.saves}.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        return timed(save)

    def close(self) -> None:
        self.client.close()


def run(tiny: bool, out_dir: Path) -> Result:
    result = Result("overheads", "Overheads: cluster start, first steps, live dashboard, checkpoint writing", tiny)
    rounds = repetitions(tiny)
    with tempfile.TemporaryDirectory(prefix="pscluster-bench-") as folder:
        starts = alternate({"pscluster": lambda: pscluster_start(f"{folder}/runs.sqlite"),
                            "ipyparallel": ipyparallel_start}, rounds)
        result.rows.append(compare("start to ready", "Cluster(ps=1, workers=2).start()", starts["pscluster"],
                                   "ipyparallel.Cluster(n=3), 3 engines", starts["ipyparallel"], "s",
                                   Target(1.2, higher=False)))

        starts = [run_starts(f"{folder}/runs.sqlite") for _ in range(rounds)]
        for i, which in enumerate(("first run on a cluster just started", "the run after it")):
            result.rows.append(compare(f"train() to every worker's first step: {which}", "train() to first steps",
                                       [s[i] for s in starts], "one second", [1.0] * rounds, "s",
                                       Target(0.5, higher=False)))

        nbytes = 4 * MB if tiny else 100 * MB
        with procs.PSProcesses(2) as cluster:
            ckpt = Checkpointing(cluster, nbytes, folder)
            try:
                times = alternate({"sharded": ckpt.sharded, "torch.save": ckpt.torch_save}, rounds)
            finally:
                ckpt.close()
        result.rows.append(compare(f"checkpoint of {nbytes // MB} MB", "sharded, 2 ps", times["sharded"],
                                   "one torch.save", times["torch.save"], "s", Target(1.0, higher=False)))

    pairs, window = (1, 0.8) if tiny else (rounds + 1, 2.0)
    speeds = dashboard_overhead.measure(pairs, window, warmup_steps=0 if tiny else 600)
    with_, without = speeds["with"], speeds["without"]
    keep = np.isfinite(with_) & np.isfinite(without)
    result.rows.append(compare("training with the live dashboard", "with", list(with_[keep]), "without",
                               list(without[keep]), "samples/s", Target(0.97),
                               note=f"{speeds['refreshes']} refreshes, "
                                    f"{1000 * speeds['cpu_s'] / max(speeds['refreshes'], 1):.0f} ms CPU each"))
    result.notes += [
        "Cluster start is Cluster.start(), which `%pscluster start` calls: engines, roles, torch threads, ps "
        "servers; both kinds of start are stopped after each measurement.",
        "train() to first steps: a sync run of an MLP of 4.3 MB (1 ps + 2 workers, digits, batch 32) on a cluster "
        "whose start() has returned, from the call to the time of the last worker's first step (its first metric "
        "row, written when its first push-pull is answered): the optimizer check, shipping the model and data "
        "description, INIT, every worker's first batch, forward, backward and push-pull. Against one second: "
        "the ratio is the seconds.",
        "Checkpoint: shards and their receipts, written by the two ps processes at once (the manifest that "
        "commits them, one small JSON file written by the controller, is left out); torch.save is flushed and "
        "fsynced too.",
        f"Dashboard: {pairs} pairs of {window:g} s windows of one sync run (1 ps + 2 workers, digits MLP), "
        "the dashboard switched on and off (dashboard_overhead.py, shortened).",
    ]
    return result
