"""The cluster registry: one JSON file per running cluster under ``$PSCLUSTER_HOME/clusters``.

A running cluster writes ``<name>.json`` when it starts, rewrites it when its state changes
and removes it when it stops. Another process (the JupyterLab server extension, another
notebook) lists the clusters with ``read_all()``. Every write goes to a temporary file first
and is committed by a rename, so a reader never sees half a file.

An entry names its owner process (the kernel that started the cluster): an entry whose owner
is dead (the kernel died, and its reaper stopped the engines) is reported apart, never listed
as running. A detached cluster outlives its owner: its entry stays listed (state ``detached``)
while its controller lives, and holds what a later process needs to attach to it (see
``Cluster.attach``). Entries are readable by the owner's user only: they carry the control token
and, for detached clusters, the data-plane secret.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from typing import TYPE_CHECKING, Protocol

from .. import environ
from .control import ControlledCluster, ControlServer
from .reaper import alive

if TYPE_CHECKING:  # annotations only: reading the registry (pscluster.clusters()) loads no pandas
    from ..metrics.store import RunStore

DIRECTORY = "clusters"
log = logging.getLogger("pscluster.registry")


def directory(home: str | None = None) -> str:
    """``$PSCLUSTER_HOME/clusters`` (or ``<home>/clusters``)."""
    return os.path.join(home or environ.home(), DIRECTORY)


def entry_path(name: str, home: str | None = None) -> str:
    """The registry file of cluster ``name``."""
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"cluster name {name!r} cannot name a registry file: use letters, digits, - and _")
    return os.path.join(directory(home), f"{name}.json")


def write(entry: dict, home: str | None = None) -> str:
    """Write (or replace) the entry of cluster ``entry["name"]`` atomically; returns its path."""
    path = entry_path(entry["name"], home)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:  # mkstemp: mode 0600
            json.dump(entry, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def read(name: str, home: str | None = None) -> dict | None:
    """The entry of cluster ``name`` as written, whether its owner lives or not; None if there is none."""
    try:
        with open(entry_path(name, home)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _payload_path(name: str, run_id: int, home: str | None) -> str:
    return entry_path(name, home)[:-len(".json")] + f".run-{int(run_id)}.payload"


def write_payload(name: str, run_id: int, payload: bytes, home: str | None = None) -> None:
    """Keep a detached cluster's shipped run code (model, dataset, loss), for workers started after an
    attach. Readable by the owner's user only; the attaching process passes it on without loading it."""
    path = _payload_path(name, run_id, home)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(payload)


def read_payload(name: str, run_id: int, home: str | None = None) -> bytes:
    with open(_payload_path(name, run_id, home), "rb") as f:
        return f.read()


def remove_payload(name: str, run_id: int, home: str | None = None) -> None:
    try:
        os.unlink(_payload_path(name, run_id, home))
    except FileNotFoundError:
        pass


def remove(name: str, home: str | None = None) -> None:
    """Remove the entry of cluster ``name`` (nothing happens when there is none)."""
    try:
        os.unlink(entry_path(name, home))
    except FileNotFoundError:
        pass


def read_all(home: str | None = None) -> tuple[list[dict], list[dict]]:
    """``(live, skipped)``: the entries whose owner process is alive, by start time, each task with a
    ``state`` of ``running`` or ``dead`` (its process, now); and ``{"name", "reason"}`` for every file
    skipped: an owner that died, or a file that does not parse."""
    live, skipped = [], []
    try:
        names = sorted(n for n in os.listdir(directory(home)) if n.endswith(".json") and not n.startswith("."))
    except FileNotFoundError:
        return [], []
    for filename in names:
        name = filename[:-len(".json")]
        try:
            with open(os.path.join(directory(home), filename)) as f:
                entry = json.load(f)
            owner = int(entry["owner_pid"])
        except FileNotFoundError:  # removed since the listing: the cluster stopped
            continue
        except (OSError, ValueError, KeyError, TypeError) as e:
            skipped.append({"name": name, "reason": f"unreadable registry file ({type(e).__name__}): "
                                                     f"delete {filename} from {directory(home)}"})
            continue
        if not alive(owner):
            if not _detached_alive(entry):
                skipped.append({"name": name, "reason": f"its kernel (pid {owner}) is gone; the cluster was "
                                                        "stopped with it"})
                continue
            entry["state"] = "detached"
        for task in entry.get("tasks", []):
            task["state"] = "running" if task.get("pid") and alive(task["pid"]) else "dead"
        live.append(entry)
    live.sort(key=lambda e: e.get("started", 0))
    return live, skipped


def _detached_alive(entry: dict) -> bool:
    detached = entry.get("detached")
    pid = int(detached.get("controller_pid") or 0) if isinstance(detached, dict) else 0
    return pid > 0 and alive(pid)


def find(name: str, home: str | None = None) -> dict | None:
    """The live entry of cluster ``name``, or None."""
    return next((e for e in read_all(home)[0] if e["name"] == name), None)


def _kernel_id() -> str | None:
    """The id of the Jupyter kernel this process is (from its connection file), or None outside a kernel."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    name = os.path.basename(shell.config.get("IPKernelApp", {}).get("connection_file", ""))
    return name[len("kernel-"):-len(".json")] if name.startswith("kernel-") and name.endswith(".json") else None


class RegisteredCluster(ControlledCluster, Protocol):
    """What a registry entry says of a cluster (``Cluster`` is one), besides what its control socket needs."""

    @property
    def num_ps(self) -> int: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def detached(self) -> bool: ...

    @property
    def store(self) -> RunStore: ...

    def detached_state(self) -> dict:
        """What a later process needs to attach to the detached cluster."""


class Registration:
    """A running cluster's registry entry and control socket, from its start to its stop.

    ``update(state)`` rewrites the entry from the cluster's current roles: call it whenever the
    cluster's state or its tasks change. ``close()`` removes the entry and stops serving requests.
    """

    def __init__(self, cluster: RegisteredCluster):
        self.cluster = cluster
        self.started = time.time()
        self.kernel = _kernel_id()
        self.control = ControlServer(cluster)
        self.failed_writes = 0  # entries that could not be written since the first (a full disk...), warned once
        try:
            self._write("running")
        except OSError as e:
            self.control.close()
            raise OSError(e.errno, f"cluster {cluster.name} cannot be registered: {e.strerror}: free space there, "
                                   "or set PSCLUSTER_HOME to a writable directory", e.filename) from None

    def update(self, state: str) -> None:
        """Rewrite the entry. One that cannot be written (the disk filled up since the start) leaves the last one
        listed: a warning the first time, a count after, never an exception (a cluster must stop all the same)."""
        try:
            self._write(state)
        except OSError as e:
            self.failed_writes += 1
            if self.failed_writes == 1:
                log.warning("cluster %s: its registry entry cannot be rewritten (%s); the side panel may list it "
                            "as it was", self.cluster.name, e)

    def _write(self, state: str) -> None:
        c = self.cluster
        tasks = c.roles() if c.running else []
        write({"detached": c.detached_state() if c.detached and c.running else None,
               "name": c.name, "owner_pid": os.getpid(), "owner_kernel": self.kernel, "started": self.started,
               "state": state, "ps": c.num_ps, "workers": c.num_workers, "store": os.path.abspath(c.store.path),
               "hosts": sorted({t["host"] for t in tasks}), "devices": sorted({t["device"] for t in tasks}),
               "tasks": tasks, "control": {"address": self.control.address, "token": self.control.token}})

    def close(self) -> None:
        self.control.close()
        try:
            remove(self.cluster.name)
        except OSError as e:
            log.warning("cluster %s: its registry entry cannot be removed (%s): the side panel lists it until this "
                        "process ends", self.cluster.name, e)
