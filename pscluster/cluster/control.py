"""Control requests from other processes to the kernel that owns a cluster.

The owner serves a ZeroMQ REP socket on 127.0.0.1 (its address and a token are in the
cluster's registry entry, readable by the same user only). Another process, such as the
JupyterLab server extension, asks it to stop the cluster, stop a run, or kill or restart one
task with ``request(entry, action, **args)``. The owner carries the request out on its own Cluster
object, so the notebook, the Python API and the side panel all see the same state.

Every action is checked at once and answered; the slow part (stopping engines, waiting for the
workers to end) goes on in a background thread, and the reply says what was started.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from typing import TYPE_CHECKING

import zmq

from ..errors import ClusterStateError, PSClusterError
from ..runtime.ps import wait_until
from .reaper import alive

if TYPE_CHECKING:
    from .cluster import Cluster

POLL_MS = 200
RESTART_S = 120.0  # how long a restart during a run waits for the run's recovery to replace the task
_replacing = threading.Lock()  # one restart at a time: a cluster adds one engine at a time


class ControlError(Exception):
    """A request that could not be carried out; ``kind`` is ``not_found``, ``conflict``,
    ``unavailable`` or ``invalid``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ControlServer:
    """Serves control requests for one cluster in a daemon thread, until ``close()``."""

    def __init__(self, cluster: "Cluster"):
        self.token = secrets.token_hex(16)
        self._cluster = cluster
        self._sock = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"pscluster-control-{cluster.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving; the socket closes within ``POLL_MS``."""
        self._closed.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(5)

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                if not self._sock.poll(POLL_MS):
                    continue
                try:
                    message = self._sock.recv_json()
                except ValueError:
                    self._sock.send_json({"ok": False, "kind": "invalid", "error": "not JSON"})
                    continue
                self._sock.send_json(self._answer(message))
        finally:
            self._sock.close(linger=0)

    def _answer(self, message) -> dict:
        if not isinstance(message, dict) or not secrets.compare_digest(str(message.get("token", "")), self.token):
            return {"ok": False, "kind": "forbidden", "error": "wrong control token"}
        action = ACTIONS.get(message.get("action"))
        if action is None:
            return {"ok": False, "kind": "invalid",
                    "error": f"unknown action {message.get('action')!r}: use one of {', '.join(ACTIONS)}"}
        try:
            return {"ok": True, **action(self._cluster, **message.get("args", {}))}
        except ControlError as e:
            return {"ok": False, "kind": e.kind, "error": str(e)}
        except (TypeError, ValueError) as e:
            return {"ok": False, "kind": "invalid", "error": f"bad arguments for {message['action']}: {e}"}


def _background(fn, name: str) -> None:
    threading.Thread(target=fn, name=name, daemon=True).start()


def _stop_cluster(cluster: "Cluster") -> dict:
    if not cluster.running:
        raise ControlError("conflict", f"cluster {cluster.name} is already stopped")
    _background(cluster.stop, f"pscluster-stop-{cluster.name}")
    return {"state": "stopping"}


def _stop_run(cluster: "Cluster", run_id: int) -> dict:
    run = next((r for r in cluster.runs if r.id == int(run_id)), None)
    if run is None:
        raise ControlError("not_found", f"run {run_id} is not a run of cluster {cluster.name}")
    if run.done:
        raise ControlError("conflict", f"run {run_id} already ended ({run.status})")
    _background(run.stop, f"pscluster-stop-run-{run_id}")
    return {"status": "stopping"}


def _task(cluster: "Cluster", role: str, index: int) -> dict:
    try:
        roles = cluster.roles()
    except ClusterStateError as e:
        raise ControlError("conflict", str(e)) from None
    task = next((t for t in roles if t["role"] == role and t["task"] == int(index)), None)
    if task is None:
        tasks = ", ".join(f"{t['role']} {t['task']}" for t in roles)
        raise ControlError("not_found", f"cluster {cluster.name} has no {role} task {index}: its tasks are {tasks}")
    return task


def _kill_task(cluster: "Cluster", role: str, index: int) -> dict:
    task = _task(cluster, role, index)
    if not alive(task["pid"]):
        raise ControlError("conflict", f"{role} task {index} (pid {task['pid']}) is already dead")
    os.kill(task["pid"], signal.SIGKILL)
    return {"state": "killed", "pid": task["pid"]}


def _restart_task(cluster: "Cluster", role: str, index: int) -> dict:
    """Kill the task's engine (if it still runs) and give the task a new one, in the background."""
    pid = _task(cluster, role, index)["pid"]
    role = "worker" if role == "chief" else role
    _background(lambda: _restart(cluster, role, int(index), pid), f"pscluster-restart-{role}-{index}")
    return {"state": "restarting", "pid": pid}


def _restart(cluster: "Cluster", role: str, index: int, pid: int) -> None:
    """During a run, the run's recovery replaces the killed task as any lost one (a worker rejoins with
    the current parameters, a ps rolls every ps back to the latest checkpoint); without a run, or when
    the run ended before it did, the cluster replaces it here."""

    def replaced() -> bool:
        return not cluster.running or cluster.spec.task(role, index).pid != pid

    if alive(pid):
        os.kill(pid, signal.SIGKILL)
    run = cluster.active_run
    if run is not None:
        wait_until(lambda: run.done or replaced(), RESTART_S, interval=0.1)
    with _replacing:
        try:
            if not replaced():
                cluster.replace_task(role, index)
        except PSClusterError:  # the cluster stopped meanwhile: nothing to restart
            pass


ACTIONS = {"stop_cluster": _stop_cluster, "stop_run": _stop_run, "kill_task": _kill_task,
           "restart_task": _restart_task}


def request(entry: dict, action: str, *, timeout: float = 5.0, **args) -> dict:
    """Ask the owner of the cluster of registry ``entry`` to carry out ``action``; returns its reply
    (without ``ok``) or raises ControlError."""
    control = entry.get("control") or {}
    if "address" not in control:
        raise ControlError("unavailable", f"cluster {entry.get('name')} takes no control requests")
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control["address"])
        sock.send_json({"token": control.get("token"), "action": action, "args": args})
        if not sock.poll(int(timeout * 1000)):
            raise ControlError("unavailable", f"the kernel that owns cluster {entry.get('name')} did not answer "
                                              f"within {timeout:.0f}s: it may be busy or gone, try again")
        reply = sock.recv_json()
    finally:
        sock.close(linger=0)
    if not reply.pop("ok", False):
        raise ControlError(reply.get("kind", "invalid"), reply.get("error", "request refused"))
    return reply
