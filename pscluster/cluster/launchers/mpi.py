"""Engines started by ``mpiexec`` (ipyparallel's MPI launcher): ``mpi_args`` name the hosts (``--hostfile``,
``--host``); without ``interface`` the controller listens on 127.0.0.1 (all engines on this machine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Sequence

from .base import LOOPBACK, Engines, Launcher, option

if TYPE_CHECKING:
    from ...spec import TaskSpec


@dataclass(frozen=True)
class MPILauncher(Launcher):
    """``mpi_args``: arguments of mpiexec, e.g. ``("--hostfile", "hosts.txt")`` (as root, Open MPI needs
    ``--allow-run-as-root``). A replacement engine is one more mpiexec of one process."""

    kind: str = "mpi"
    mpi_args: tuple[str, ...] = option((), metavar="ARG", repeat=True, help="an mpiexec argument (repeatable), e.g. "
                                       "--mpi-arg=--hostfile --mpi-arg=hosts.txt")

    ipp_class: ClassVar[str] = "mpi"
    default_interface: ClassVar[str] = LOOPBACK
    hosts_fix: ClassVar[str] = "name them in mpi_args, e.g. --host a,b or --hostfile FILE"

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "mpi_args", tuple(self.mpi_args))

    def engine_options(self, counts: dict[str, int] | None = None) -> dict:
        return {"mpi_args": list(self.mpi_args)}

    def hint(self) -> str:
        return "check that mpiexec runs (as root it needs --allow-run-as-root in mpi_args)"

    def start(self, engines: Engines, n: int, num_ps: int, num_workers: int) -> None:
        engines.launch(n, **self.engine_options())

    def add(self, engines: Engines, task: "TaskSpec | None", live: Sequence["TaskSpec"]) -> None:
        engines.launch(1, **self.engine_options())
