"""Memory of a ps process: the peak RSS that holding N bytes of parameters with Adam state adds, against N
(the peak of a fresh ps holding N against one holding N / 64, so that what any run costs, torch's own first
optimizer step included, cancels out); and its RSS over consecutive segments of many push-pull steps (no
growth)."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import psutil
import torch

from pscluster.runtime.client import PSClient

from . import procs
from .common import Result, Target, alternate, compare, repetitions

MB = 2**20


def _peak_rss(pid: int) -> int:
    """The process's high-water mark of resident memory (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


class AdamRun:
    """A run of ``nbytes`` of float32 parameters with Adam on one ps of ``cluster``, stepped by push-pulls; with
    a checkpoint directory, as a run has by default (the ps keeps copies of its state there: ``rescue``)."""

    def __init__(self, cluster: procs.PSProcesses, nbytes: int, variables: int = 1):
        self.folder = tempfile.TemporaryDirectory(prefix="pscluster-memory-")
        self.client = PSClient(cluster.spec, task=0, timeout=300)
        self.grads = {0: (list(range(variables)), [torch.full((nbytes // 4 // variables,), 1e-3)] * variables)}
        names = [f"p{i}" for i in range(variables)]
        self.client.init(1, self.grads, [procs.ps_config(*names, optimizer="Adam", lr=1e-3,
                                                          checkpoint_dir=self.folder.name)])
        self.step = self.client.pull().step

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step = self.client.push_pull(self.step, self.grads).step

    def close(self) -> None:
        self.client.close()
        self.folder.cleanup()


def peak_gain(nbytes: int, variables: int = 1) -> float:
    """The peak RSS (MB) a fresh ps process gains over INIT and 3 steps holding ``nbytes`` with Adam (in
    ``variables`` equal variables)."""
    with procs.PSProcesses(1) as cluster:
        pid = cluster.pids[0]
        before = psutil.Process(pid).memory_info().rss
        run = AdamRun(cluster, nbytes, variables)
        run.steps(3)
        peak = _peak_rss(pid)
        run.close()
    return (peak - before) / MB


def growth(nbytes: int, warmup: int, segment: int, segments: int) -> tuple[list[float], list[float]]:
    """RSS (MB) of one ps at the start and at the end of ``segments`` consecutive segments of ``segment``
    push-pull steps each, after ``warmup`` steps."""
    with procs.PSProcesses(1) as cluster:
        proc = psutil.Process(cluster.pids[0])
        run = AdamRun(cluster, nbytes)
        run.steps(warmup)
        starts, ends = [], []
        for _ in range(segments):
            starts.append(proc.memory_info().rss / MB)
            run.steps(segment)
            ends.append(proc.memory_info().rss / MB)
        run.close()
    return ends, starts


def run(tiny: bool, out_dir: Path) -> Result:
    nbytes = 4 * MB if tiny else 64 * MB
    result = Result("memory", "Memory of a ps process", tiny)
    small = nbytes // 64
    peaks = alternate({"N": lambda: peak_gain(nbytes), "small": lambda: peak_gain(small)}, repetitions(tiny))
    added = [big - little for big, little in zip(peaks["N"], peaks["small"])]
    result.rows.append(compare(f"peak RSS holding N = {nbytes // MB} MB with Adam", "peak RSS added", added,
                               "N", [(nbytes - small) / MB] * len(added), "MB", Target(3.3, higher=False),
                               note=f"peak gained holding N / 64: median {statistics.median(peaks['small']):.0f} MB"))
    # a model of many variables each smaller than a frame is stepped whole, not chunk by chunk as it arrives
    variables = 16
    peaks = alternate({"N": lambda: peak_gain(nbytes, variables), "small": lambda: peak_gain(small, variables)},
                      repetitions(tiny))
    added = [big - little for big, little in zip(peaks["N"], peaks["small"])]
    result.rows.append(compare(f"peak RSS holding N = {nbytes // MB} MB with Adam in {variables} variables",
                               "peak RSS added", added, "N", [(nbytes - small) / MB] * len(added), "MB",
                               note="each variable stepped whole, its gradient held whole, beside Adam's temporaries; "
                               f"peak gained holding N / 64: median {statistics.median(peaks['small']):.0f} MB"))
    segment, segments = (50, 2) if tiny else (2000, 5)
    ends, starts = growth(MB // 4, warmup=segment // 4, segment=segment, segments=segments)
    result.rows.append(compare(f"RSS over {segments} x {segment} push-pull steps, 256 KB with Adam",
                               "RSS after a segment", ends, "RSS before it", starts, "MB", Target(1.01, higher=False),
                               note=f"{segments * segment + segment // 4} steps in all"))
    result.notes.append("Each ps is a fresh `python -m pscluster.runtime` process; its RSS before INIT (torch "
                        "imported, serving) is subtracted from the peak (VmHWM) it reaches over INIT and 3 steps.")
    return result
