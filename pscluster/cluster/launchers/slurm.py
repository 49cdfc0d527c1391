"""Engines as Slurm jobs, one job (of one task) per engine, submitted with ipyparallel's Slurm launcher
(``sbatch``; ``srun`` starts the engine inside). A lost engine is its job: ``kill`` cancels it (``scancel``),
a replacement is a new job; ``stop`` cancels every job and waits until ``squeue`` lists none of them.

``sbatch_args`` that size a job (``--nodes=2``, ``--ntasks-per-node=4``...) make the first engines one job of
as many tasks instead, over those nodes (as ipyparallel submits them); a replacement is still a job of one task,
without those lines."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from typing import ClassVar, Sequence

from .base import option
from .ipp import BatchLauncher

DRAIN_S = 15.0  # how long stop() waits for the cancelled jobs to leave the queue
# sbatch options that size a job (its tasks, nodes): with one, the first engines are one job of that size
_TASK_COUNT = ("--nodes", "--ntasks", "--ntasks-per-node", "-N", "-n")


def _counts_tasks(arg: str) -> bool:
    word = (arg.strip().split("=")[0].split() or [""])[0]
    return word in _TASK_COUNT or (not word.startswith("--") and word[:2] in _TASK_COUNT)


def _template() -> str:
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    return SlurmEngineSetLauncher.class_traits()["default_template"].default_value


@dataclass(frozen=True)
class SlurmLauncher(BatchLauncher):
    """``slurm_partition``, ``account``, ``time_limit``, ``qos``: those of each engine's job; ``sbatch_args``: more
    ``#SBATCH`` lines of each, e.g. ``--gres=gpu:1``, ``--mem=8G``, ``--constraint=FEATURE`` (or ``--nodes=2``:
    the first engines one job over two nodes). Other traits of ipyparallel's ``SlurmEngineSetLauncher`` are
    taken too (``options=``, ``namespace=``...)."""

    kind: str = "slurm"
    slurm_partition: str | None = option(None, help="the Slurm partition of the engines' jobs")
    account: str | None = option(None, help="the account")
    time_limit: str | None = option(None, help="the job's time limit, e.g. 01:00:00")
    qos: str | None = option(None, help="the QoS")
    sbatch_args: tuple[str, ...] = option((), metavar="ARG", repeat=True, help="an extra #SBATCH argument of each "
                                          "engine's job (repeatable), e.g. --sbatch-arg=--gres=gpu:1")

    ipp_class: ClassVar[str] = "slurm"
    hosts_fix: ClassVar[str] = ("Slurm places the engines' jobs on the partition's nodes: ask for nodes with "
                                "sbatch_args, e.g. --nodes=2 (one job for all engines) or --constraint=FEATURE")

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "sbatch_args", tuple(self.sbatch_args))

    def together(self) -> bool:
        return any(_counts_tasks(a) for a in self.sbatch_args)

    def _options(self, sbatch_args: Sequence[str]) -> dict:
        options = dict(self.traits)  # more of ipyparallel's SlurmEngineSetLauncher, e.g. options=, namespace=
        options.update({k: v for k, v in (("queue", self.slurm_partition), ("account", self.account),
                                          ("timelimit", self.time_limit), ("qos", self.qos)) if v})
        if sbatch_args:  # ipyparallel's own engine job script, with these lines after its first; the task count
            # stated too (ipyparallel would take a line that starts with --n for one and leave it out)
            shebang, rest = _template().split("\n", 1)
            lines = ["#SBATCH --ntasks={n}", *(f"#SBATCH {a}" for a in sbatch_args)]
            options["default_template"] = "\n".join([shebang, *lines, rest])
        return options

    def engine_options(self, counts: dict[str, int] | None = None) -> dict:
        return self._options(self.sbatch_args)

    def replacement_options(self) -> dict:
        return self._options([a for a in self.sbatch_args if not _counts_tasks(a)])

    def hint(self) -> str:
        return "check the jobs with squeue: they may wait in the queue (partition, account, time limit)"

    def drain(self, jobs: list[str]) -> None:
        deadline = time.monotonic() + DRAIN_S
        while jobs and time.monotonic() < deadline:
            try:
                listed = subprocess.run(["squeue", "--noheader", "--format=%i", f"--jobs={','.join(jobs)}"],
                                        capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                return
            if listed.returncode != 0 or not listed.stdout.split():  # "Invalid job id": none of them is left
                return
            time.sleep(0.2)

