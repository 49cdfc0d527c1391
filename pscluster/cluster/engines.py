"""ipyparallel engines for one cluster: start, call, stop, leave nothing behind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import ipyparallel as ipp
import psutil

from ..errors import ClusterStateError
from . import reaper
from .roles import EngineInfo

os.environ.setdefault("IPP_NONINTERACTIVE", "1")  # no progress bars from ipyparallel itself


class EngineSet:
    """An ipyparallel controller with ``n`` local engines, and a reaper that kills them all if this process
    dies without stopping them (``detached``: if the controller dies; this process may end first)."""

    def __init__(self, n: int, cluster_id: str, *, timeout: float = 90.0, detached: bool = False):
        self.n = n
        self.cluster_id = cluster_id
        self.timeout = timeout
        self.detached = detached
        self._ipp: ipp.Cluster | None = None
        self.client: ipp.Client | None = None
        self.pids: list[int] = []
        self.engines: dict[int, int] = {}  # engine id -> pid, of the engines in use
        self._reaper: subprocess.Popen | None = None

    def start(self) -> list[EngineInfo]:
        self._ipp = ipp.Cluster(n=self.n, cluster_id=self.cluster_id, log_level=logging.ERROR,
                                shutdown_atexit=not self.detached)
        try:
            self.client = self._ipp.start_and_connect_sync(activate=False)
            self.client.wait_for_engines(self.n, timeout=self.timeout, interactive=False)
            infos = self.client[:].apply_sync(_describe)
            engines = [EngineInfo(engine_id=eid, host=i["host"], pid=i["pid"])
                       for eid, i in zip(self.client.ids, infos)]
        except (TimeoutError, ipp.error.TimeoutError) as e:
            self.stop()
            raise ClusterStateError(f"engines did not register within {self.timeout:.0f}s ({e}): "
                                    "check the machine's load and try again") from None
        except BaseException:
            self.stop()
            raise
        self.pids = _with_descendants([e.pid for e in engines] + [self._ipp.controller.pid])
        self.engines = {e.engine_id: e.pid for e in engines}
        self._watch()
        return engines

    @classmethod
    def attach(cls, cluster_file: str, engines: dict[int, int], pids: list[int]) -> "EngineSet":
        """The engines of a detached cluster that another process started: ``engines`` maps engine ids to
        pids, ``pids`` lists every process of the cluster."""
        self = cls(len(engines), os.path.basename(cluster_file), detached=True)
        try:
            self._ipp = ipp.Cluster.from_file(cluster_file, shutdown_atexit=False)
            self.client = self._ipp.connect_client_sync()
        except (OSError, ValueError) as e:
            raise ClusterStateError(f"cannot reach the cluster's controller ({e}): it is gone; start a new "
                                    "cluster") from None
        self.engines, self.pids = dict(engines), list(pids)
        self._watch()
        return self

    @property
    def controller_pid(self) -> int:
        return self._ipp.controller.pid

    @property
    def cluster_file(self) -> str:
        return self._ipp.cluster_file

    def _watch(self) -> None:
        """(Re)start the reaper on the current process list."""
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait(5)
        owner = self.controller_pid if self.detached else os.getpid()
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "pscluster.cluster.reaper", str(owner), *map(str, self.pids),
             "--remove", self._ipp.cluster_file],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)

    def add_engine(self) -> EngineInfo:
        """Start one more engine (to replace a lost one) and wait for it to register."""
        known = set(self.client.ids)
        self._ipp.start_engines_sync(n=1)
        deadline = time.monotonic() + self.timeout
        while not (new := set(self.client.ids) - known):
            if time.monotonic() > deadline:
                raise ClusterStateError(f"a new engine did not register within {self.timeout:.0f}s: "
                                        "check the machine's load")
            time.sleep(0.05)
        engine_id = min(new)
        info = self.client[engine_id].apply_sync(_describe)
        self.pids = list(dict.fromkeys(self.pids + _with_descendants([info["pid"]])))
        self.engines[engine_id] = info["pid"]
        self._watch()
        return EngineInfo(engine_id=engine_id, host=info["host"], pid=info["pid"])

    def remove_engines(self, engines: list[tuple[int, int]]) -> None:
        """Stop these (engine id, pid) engines for good: the cluster has fewer tasks now."""
        gone = _with_descendants([pid for _, pid in engines])
        self._shutdown([engine_id for engine_id, _ in engines])
        reaper.kill_all(gone, grace=5.0)
        self.pids = [p for p in self.pids if p not in gone]
        for engine_id, _ in engines:
            self.engines.pop(engine_id, None)
        self._watch()

    def _shutdown(self, engine_ids: list[int]) -> None:
        """Ask these engines to exit, without waiting for answers (an engine that died never answers)."""
        live = [e for e in engine_ids if e in self.engines and reaper.alive(self.engines[e])]
        try:
            if live:
                self.client.shutdown(targets=live, block=False)
        except Exception:  # an engine already gone: the kill that follows makes sure
            pass

    def view(self, engine_id: int):
        return self.client[engine_id]

    def alive_pids(self) -> list[int]:
        return [p for p in self.pids if reaper.alive(p)]

    def stop(self) -> None:
        """Shut engines down through the client (quietly), stop the cluster, kill survivors."""
        if self.client is not None:
            self._shutdown(list(self.engines))
            deadline = time.monotonic() + 5
            while any(reaper.alive(p) for p in self.engines.values()) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.client.close()
            self.client = None
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception:
                pass
            self._ipp = None
        reaper.kill_all(self.pids, grace=5.0)
        deadline = time.monotonic() + 5
        while self.alive_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait(5)
            self._reaper = None


def _with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (the controller's schedulers, the engines' nannies)."""
    found = list(pids)
    for pid in pids:
        try:
            found += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return list(dict.fromkeys(found))


def _describe():
    from pscluster.runtime.engine import describe

    return describe()
