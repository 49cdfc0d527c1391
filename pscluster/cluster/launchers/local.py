"""Engines on this machine, forked by this process's forkserver (``forkserver``: torch imported once for every
cluster it starts) or, for a detached cluster, by one process launched for them (``engine_main``); watched and
killed by pid."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Sequence

from ...errors import ConfigError
from .. import engine_main, forkserver
from .base import LOOPBACK, Engines, Launcher

if TYPE_CHECKING:
    from ...spec import TaskSpec


@dataclass(frozen=True)
class LocalLauncher(Launcher):
    """Engines on this machine (the default). The controller, data plane and metrics collector listen on
    127.0.0.1 only."""

    kind: str = "local"

    local: ClassVar[bool] = True
    ipp_class: ClassVar[str] = "local"
    default_interface: ClassVar[str] = LOOPBACK
    hosts_fix: ClassVar[str] = "use launcher='ssh' to start engines on other hosts"
    default_spares: ClassVar[int] = 1

    def __post_init__(self):
        super().__post_init__()
        if self.interface is not None and self.interface != LOOPBACK:
            raise ConfigError(f"interface {self.interface}: a local cluster listens on {LOOPBACK} only; "
                              "pick another launcher for engines on other hosts")

    def cluster_options(self) -> dict:
        # the engines read the controller's connection file themselves (see engine_main)
        return {**super().cluster_options(), "send_engines_connection_env": False}

    def hint(self) -> str:
        return "check the machine's load and try again"

    def _fork(self, engines: Engines, n: int) -> None:
        path = engines.cluster.controller.connection_files["engine"]
        # a detached cluster outlives this process, and so would its owner's forkserver: its engines import
        # torch in a process of their own
        fork = engine_main.command if engines.detached else forkserver.command
        engines.launch(1, engine_cmd=fork(n, path, engines.since))

    def start(self, engines: Engines, n: int, num_ps: int, num_workers: int) -> None:
        self._fork(engines, n)

    def add(self, engines: Engines, task: "TaskSpec | None", live: Sequence["TaskSpec"]) -> None:
        self._fork(engines, 1)

    def launched_pids(self, engines: Engines) -> list[int]:
        """The processes the engines fork from, launched so far (the reaper kills them if this process dies
        while they register)."""
        return [e.pid for s in engines.cluster.engines.values() for e in getattr(s, "launchers", {}).values()]

    def kill(self, engines: Engines, engine_id: int) -> None:
        os.kill(engines.engines[engine_id], signal.SIGKILL)
