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

import json
import secrets
import threading
from collections.abc import Sequence
from typing import Protocol

import zmq

from ..errors import ClusterStateError, PSClusterError
from ..runtime.waiting import wait_until
from ..spec import ClusterSpec, TaskSpec

POLL_MS = 200
MAX_REQUEST_BYTES = 64 * 1024  # a request is a small JSON object: ZeroMQ drops a peer that sends more
RESTART_S = 120.0  # how long a restart during a run waits for the run's recovery to replace the task
_replacing = threading.Lock()  # one restart at a time: a cluster adds one engine at a time


class ControlledRun(Protocol):
    """What a control request needs of a run: its id, whether and how it ended, and stopping it."""

    @property
    def id(self) -> int: ...

    @property
    def done(self) -> bool: ...

    @property
    def status(self) -> str: ...

    def stop(self): ...


class ControlledCluster(Protocol):
    """What control requests need of the cluster they act on (``Cluster`` is one): its name, state, tasks and
    runs, and stopping it, killing and replacing its tasks."""

    @property
    def name(self) -> str: ...

    @property
    def running(self) -> bool: ...

    @property
    def spec(self) -> ClusterSpec: ...

    @property
    def runs(self) -> Sequence[ControlledRun]: ...

    @property
    def active_run(self) -> ControlledRun | None: ...

    def stop(self) -> None: ...

    def roles(self) -> list[dict]: ...

    def lost(self, task: TaskSpec) -> bool: ...

    def kill_task(self, task: TaskSpec) -> None: ...

    def replace_task(self, role: str, index: int) -> ClusterSpec: ...


class ControlError(Exception):
    """A request that could not be carried out; ``kind`` is ``not_found``, ``conflict``,
    ``unavailable`` or ``invalid``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ControlServer:
    """Serves control requests for one cluster in a daemon thread, until ``close()``."""

    def __init__(self, cluster: ControlledCluster):
        self.token = secrets.token_hex(16)
        self._cluster = cluster
        self._sock = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
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
                try:  # a REP socket says a message is there, then drops it on receipt when it has no envelope
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self._sock.send(self._encoded_reply(frames))
        finally:
            self._sock.close(linger=0)

    def _encoded_reply(self, frames: list[bytes]) -> bytes:
        """The answer to one request as JSON bytes, whatever arrived: never raises, so that no request can stop
        the loop (nor leave the REP socket waiting for a reply it cannot send)."""
        try:
            return json.dumps(self._reply(frames)).encode()
        except Exception as e:  # a reply that does not encode: a bug, said to the caller
            return json.dumps({"ok": False, "kind": "invalid", "error": f"reply failed: {type(e).__name__}"}).encode()

    def _reply(self, frames: list[bytes]) -> dict:
        if len(frames) != 1:
            return {"ok": False, "kind": "invalid", "error": f"{len(frames)} frames: send one JSON object"}
        try:
            message = json.loads(frames[0])
        except (ValueError, RecursionError):  # not UTF-8, not JSON, nested deeper than the parser goes
            return {"ok": False, "kind": "invalid", "error": "not JSON, or nested too deeply: send one JSON object"}
        try:
            return self._answer(message)
        except Exception as e:  # a bug in an action: the caller hears of it, the server goes on
            return {"ok": False, "kind": "invalid", "error": f"{type(e).__name__}: {e}"}

    def _answer(self, message) -> dict:
        token = message.get("token") if isinstance(message, dict) else None
        if not isinstance(token, str) or not secrets.compare_digest(token.encode(), self.token.encode()):
            return {"ok": False, "kind": "forbidden", "error": "wrong control token"}
        action = ACTIONS.get(message.get("action"))
        if action is None:
            return {"ok": False, "kind": "invalid",
                    "error": f"unknown action {message.get('action')!r}: use one of {', '.join(ACTIONS)}"}
        args = message.get("args", {})
        if not isinstance(args, dict):
            return {"ok": False, "kind": "invalid", "error": f"args must be a JSON object, not {type(args).__name__}"}
        try:
            return {"ok": True, **action(self._cluster, **args)}
        except ControlError as e:
            return {"ok": False, "kind": e.kind, "error": str(e)}
        except (TypeError, ValueError) as e:
            return {"ok": False, "kind": "invalid", "error": f"bad arguments for {message['action']}: {e}"}


def _background(fn, name: str) -> None:
    threading.Thread(target=fn, name=name, daemon=True).start()


def _stop_cluster(cluster: ControlledCluster) -> dict:
    if not cluster.running:
        raise ControlError("conflict", f"cluster {cluster.name} is already stopped")
    _background(cluster.stop, f"pscluster-stop-{cluster.name}")
    return {"state": "stopping"}


def _stop_run(cluster: ControlledCluster, run_id: int) -> dict:
    run = next((r for r in cluster.runs if r.id == int(run_id)), None)
    if run is None:
        raise ControlError("not_found", f"run {run_id} is not a run of cluster {cluster.name}")
    if run.done:
        raise ControlError("conflict", f"run {run_id} already ended ({run.status})")
    _background(run.stop, f"pscluster-stop-run-{run_id}")
    return {"status": "stopping"}


def _task(cluster: ControlledCluster, role: str, index: int) -> dict:
    try:
        roles = cluster.roles()
    except ClusterStateError as e:
        raise ControlError("conflict", str(e)) from None
    task = next((t for t in roles if t["role"] == role and t["task"] == int(index)), None)
    if task is None:
        tasks = ", ".join(f"{t['role']} {t['task']}" for t in roles)
        raise ControlError("not_found", f"cluster {cluster.name} has no {role} task {index}: its tasks are {tasks}")
    return task


def _kill_task(cluster: ControlledCluster, role: str, index: int) -> dict:
    pid = _task(cluster, role, index)["pid"]
    task = cluster.spec.task("worker" if role == "chief" else role, int(index))
    try:
        if cluster.lost(task):
            raise ProcessLookupError
        cluster.kill_task(task)
    except ProcessLookupError:
        raise ControlError("conflict", f"{role} task {index} (pid {pid}) is already dead") from None
    return {"state": "killed", "pid": pid}


def _restart_task(cluster: ControlledCluster, role: str, index: int) -> dict:
    """Kill the task's engine (if it still runs) and give the task a new one, in the background."""
    pid = _task(cluster, role, index)["pid"]
    role = "worker" if role == "chief" else role
    _background(lambda: _restart(cluster, role, int(index), pid), f"pscluster-restart-{role}-{index}")
    return {"state": "restarting", "pid": pid}


def _restart(cluster: ControlledCluster, role: str, index: int, pid: int) -> None:
    """During a run, the run's recovery replaces the killed task as any lost one (a worker rejoins with
    the current parameters, a ps rolls every ps back to the latest checkpoint); without a run, or when
    the run ended before it did, the cluster replaces it here."""

    def replaced() -> bool:
        return not cluster.running or cluster.spec.task(role, index).pid != pid

    try:
        task = cluster.spec.task(role, index)
        if task.pid == pid and not cluster.lost(task):
            cluster.kill_task(task)
    except ProcessLookupError:  # it died meanwhile
        pass
    except PSClusterError:  # the cluster stopped meanwhile: nothing to restart
        return
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
