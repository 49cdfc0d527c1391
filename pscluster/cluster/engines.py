"""ipyparallel engines for one cluster: start (by one of ipyparallel's launchers), call, stop, leave nothing
behind.

Local engines are watched by pid, and a reaper process kills them if this process dies. Engines on other
hosts (ssh, mpi, slurm) are watched through the controller's heartbeats: one that misses them is
unregistered, and counts as lost; they end themselves once the controller is unreachable for a while
(stopped, killed by the reaper with its kernel, or cut off: ``runtime.remote.watch_controller``), and are
stopped through ipyparallel (client shutdown, then the launcher's stop).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import ipyparallel as ipp
import ipyparallel.client.client as ipp_client

from ..errors import ClusterStateError
from . import engine_main, reaper
from .launchers import Launcher, host_name
from .roles import EngineInfo

RECOUNT_S = 2.0  # how often a start that waits for engines compares the client's count with the hub's
os.environ.setdefault("IPP_NONINTERACTIVE", "1")  # no progress bars from ipyparallel itself

log = logging.getLogger("pscluster.engines")


def _client_note(*args, **_) -> None:
    log.info(" ".join(map(str, args)))


# ipyparallel's client prints what it does not expect ("got stale result: ..." and the whole message, for the
# replies of an engine declared lost, after a recovery) from its own thread, into whatever notebook cell runs:
# they are log lines. Its module's globals come before the builtins, so this print is the one it calls.
ipp_client.print = _client_note


class _ClientGarbage(logging.Filter):
    """Garbage that reaches the client's sockets (hostile local traffic, forwarded by the controller) makes
    ipyparallel's message handler raise "DELIM not in msg_list", which the event loop logs as an uncaught error
    with its traceback: onto the notebook's stderr when nothing else handles the log. It goes to this module's
    log instead; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ValueError) and "DELIM not in msg_list" in str(error):
            log.info("dropped a malformed message to the ipyparallel client: %s", error)
            return False
        return True


for _logger in ("tornado.general", "asyncio"):  # pyzmq's ZMQStream logs the first, the event loop the second
    logging.getLogger(_logger).addFilter(_ClientGarbage())

SHUTDOWN_S = 2.0  # how long stop() waits for engines to end when asked (a client broken by hostile traffic asks in
# vain), then after SIGTERM, before SIGKILL: stop() ends within a few times this


class EngineSet:
    """An ipyparallel controller with ``n`` engines started by ``launcher``, and a reaper that kills the local
    processes if this process dies without stopping them (``detached``: if the controller dies; this process
    may end first). ``counts``: engines per ssh host."""

    def __init__(self, n: int, cluster_id: str, *, timeout: float = 90.0, detached: bool = False,
                 launcher: Launcher | None = None, counts: dict[str, int] | None = None):
        self.n = n
        self.cluster_id = cluster_id
        self.timeout = timeout
        self.detached = detached
        self.launcher = launcher or Launcher()
        self.counts = counts
        self._ipp: ipp.Cluster | None = None
        self.client: ipp.Client | None = None
        self.pids: list[int] = []
        self.engines: dict[int, int] = {}  # engine id -> pid, of the engines in use
        self._reaper: subprocess.Popen | None = None
        self._adding = threading.Lock()  # held while one engine is added (see add_engine)

    def start(self) -> list[EngineInfo]:
        self._ipp = ipp.Cluster(n=self.n, cluster_id=self.cluster_id, log_level=logging.ERROR,
                                shutdown_atexit=not self.detached, **self.launcher.cluster_options())
        try:
            since = time.time()
            self._ipp.start_controller_sync()
            self._start_engines(self.n, self.counts, since)
            self._watch_launched()
            self.client = self._ipp.connect_client_sync()
            self._wait_for_engines()
            engines = self._describe(self.client.ids)
        except (TimeoutError, ipp.error.TimeoutError):
            registered = len(self.client.ids) if self.client is not None else 0
            self.stop()
            raise ClusterStateError(f"{self.n} engines did not register within {self.timeout:.0f}s (only "
                                    f"{registered} did): {self._hint()}") from None
        except BaseException:
            self.stop()
            raise
        if not self.launcher.local:
            self.client[[e.engine_id for e in engines]].apply_sync(_watch_controller, *self._controller_endpoint())
        local = [e.pid for e in engines] if self.launcher.local else []
        self.pids = reaper.with_descendants(local + [self._ipp.controller.pid])
        self.engines = {e.engine_id: e.pid for e in engines}
        self._watch()
        return engines

    def _watch_launched(self) -> None:
        """Watch what is started so far (the controller, the process local engines fork from) while the
        engines register: if this process dies before the start ends, the reaper kills them and every
        process below them."""
        self.pids = [self._ipp.controller.pid]
        if self.launcher.local:
            self.pids += [e.pid for s in self._ipp.engines.values() for e in s.launchers.values()]
        self._watch()

    def _wait_for_engines(self) -> None:
        """Until the client counts ``n`` engines. It learns of engines from the hub's list when it connects,
        then from the hub's notifications, so it misses one that registers between the two (local engines
        start while it connects): a client that counts fewer engines than the hub connects again."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.client.wait_for_engines(self.n, timeout=min(RECOUNT_S, max(0.0, deadline - time.monotonic())),
                                             interactive=False)
                return
            except (TimeoutError, ipp.error.TimeoutError):
                if time.monotonic() >= deadline:
                    raise
            if sum(isinstance(k, int) for k in self.client.queue_status()) > len(self.client.ids):
                self.client.close()
                self.client = self._ipp.connect_client_sync()

    def _start_engines(self, n: int, counts: dict[str, int] | None, since: float = 0.0) -> None:
        """Launch ``n`` engines: local ones as one process that forks into them (``engine_main``: torch imported
        once, while the controller starts, from its connection file written since ``since``), others by the
        launcher, ``counts`` of them on each ssh host."""
        if self.launcher.local:
            path = self._ipp.controller.connection_files["engine"]
            self._ipp.start_engines_sync(1, engine_cmd=engine_main.command(n, path, since))
        else:
            self._ipp.start_engines_sync(n, **self.launcher.engine_options(counts))

    def _describe(self, engine_ids: list[int]) -> list[EngineInfo]:
        """Ask the engines (all at once: each imports torch first, unless engine_main did) who and where they
        are."""
        asked = [self.client[e].apply_async(_describe, self.launcher.controller_ip()) for e in engine_ids]
        return [EngineInfo(engine_id=e, host=i["host"], pid=i["pid"], address=i["address"], gpus=i["gpus"])
                for e, i in zip(engine_ids, (a.get(self.timeout) for a in asked))]

    def _controller_endpoint(self) -> tuple[str, int]:
        """The controller's registration address, as its engines reach it."""
        with open(self._ipp.controller.connection_files["engine"]) as f:
            info = json.load(f)
        return info["interface"].rpartition("/")[2], info["registration"]

    def _hint(self) -> str:
        return {"local": "check the machine's load and try again",
                "ssh": "check that `ssh HOST python3 -c 1` works without a password on every host and that the "
                       f"hosts reach {self.launcher.controller_ip()} (pass interface= otherwise)",
                "mpi": "check that mpiexec runs (as root it needs --allow-run-as-root in mpi_args)",
                "slurm": "check the job with squeue: it may wait in the queue (partition, account, time limit)",
                }[self.launcher.kind]

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

    def add_engine(self, host: str | None = None) -> EngineInfo:
        """Start one more engine (to replace a lost one; ssh: on ``host``) and wait for it to register. One at a
        time: a scale and a recovery that start engines together would otherwise both take the first to come."""
        with self._adding:
            known = set(self.client.ids)
            self._start_engines(1, {host: 1} if host else None)
            deadline = time.monotonic() + self.timeout
            while not (new := {e for e in set(self.client.ids) - known if self._addressable(e)}):
                if time.monotonic() > deadline:
                    raise ClusterStateError(f"a new engine did not register within {self.timeout:.0f}s: "
                                            "check the machine's load")
                time.sleep(0.05)
        info = self._describe([min(new)])[0]
        if not self.launcher.local:
            self.client[info.engine_id].apply_sync(_watch_controller, *self._controller_endpoint())
        if self.launcher.local:
            self.pids = list(dict.fromkeys(self.pids + reaper.with_descendants([info.pid])))
        self.engines[info.engine_id] = info.pid
        self._watch()
        return info

    def _addressable(self, engine_id: int) -> bool:
        """Whether the client can address the engine: ipyparallel lists a registering engine's id a moment before
        it records the engine's identity (``client[id]`` raises KeyError in between)."""
        try:
            self.client[engine_id]
        except KeyError:
            return False
        return True

    def registered(self) -> set[int]:
        """The engines the controller still counts as alive (remote ones vanish when they miss heartbeats)."""
        return set(self.client.ids) if self.client is not None else set()

    def lost(self, engine_id: int) -> bool:
        """Whether the engine is gone: its process is dead (local engines, seen at once), or it missed the
        controller's heartbeats for ``launchers.HEARTBEAT_DEADLINE_S`` (hung, or its host unreachable)."""
        pid = self.engines.get(engine_id)
        if self.launcher.local and pid is not None and not reaper.alive(pid):
            return True
        return engine_id not in self.registered()

    def kill(self, engine_id: int) -> None:
        """SIGKILL the engine's process: directly (local), or through its nanny on its host (remote)."""
        if self.launcher.local:
            os.kill(self.engines[engine_id], signal.SIGKILL)
        else:
            self.client.send_signal(signal.SIGKILL, targets=[engine_id], block=True)

    def ssh_host(self, address: str | None) -> str | None:
        """The ssh host (as listed in the launcher's hosts) of an engine that reported ``address``."""
        for host in self.launcher.hosts:
            if address in _addresses(host_name(host)):
                return host
        return None

    def remove_engines(self, engine_ids: list[int]) -> None:
        """Stop these engines for good: the cluster has fewer tasks now."""
        removed = [self.engines[e] for e in engine_ids if e in self.engines]
        staying = [pid for engine_id, pid in self.engines.items() if engine_id not in engine_ids]
        gone = reaper.with_descendants(removed, staying) if self.launcher.local else []
        self._shutdown(engine_ids)
        reaper.kill_all(gone, grace=5.0)
        self.pids = [p for p in self.pids if p not in gone]
        for engine_id in engine_ids:
            self.engines.pop(engine_id, None)
        self._watch()

    def _shutdown(self, engine_ids: list[int]) -> None:
        """Ask these engines to exit, without waiting for answers (an engine that died never answers)."""
        live = [e for e in engine_ids if e in self.engines and not self.lost(e)]
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
        # listed before ipyparallel stops the process local engines fork from: they are its children until then
        self.pids = reaper.with_descendants(self.pids)
        if self.client is not None:
            self._shutdown(list(self.engines))
            deadline = time.monotonic() + SHUTDOWN_S
            while time.monotonic() < deadline and any(not self.lost(e) for e in self.engines):
                time.sleep(0.05)
            self.client.close()
            self.client = None
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception:
                pass
            self._ipp = None
        reaper.kill_all(self.pids, grace=SHUTDOWN_S)
        deadline = time.monotonic() + 5
        while self.alive_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait(5)
            self._reaper = None


def _addresses(host: str) -> set[str]:
    try:
        return {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def _watch_controller(host, port):
    from pscluster.runtime.remote import watch_controller

    watch_controller(host, port)


def _describe(controller_ip):
    from pscluster.runtime.remote import describe

    return describe(controller_ip)
