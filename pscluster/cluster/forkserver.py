"""The engine forkserver: one process per owner (a kernel, a script) that has imported what engines run, once
(``engine_main.preload``: torch, the ps server, ipyparallel's engine; about 3 s of CPU), and forks the engines
of every local cluster its owner starts, and each engine that replaces a lost one. Only the first cluster of a
process pays for the import; a later one starts, and a lost engine is replaced, without it.

    python -m pscluster.cluster.forkserver SOCKET OWNER_PID

It listens on a Unix socket in a directory only its user can enter, and takes requests (JSON, never pickles)
from ``fork_request``, the command ipyparallel's launcher runs for each engine set: the engines' count, the
controller's connection file, the ipengine arguments, the environment and directory to run in, and (passed as
file descriptors) where their output goes. It forks a child that becomes the engines (``engine_main``) and
answers its pid. A request it cannot read is answered with an error and the loop goes on.

It ends with its owner, killing the engines forked since (a detached cluster's engines do not come from it), or
when its owner stops it after ``IDLE_S`` in which no cluster asked for engines, leaving its engines running. The
owner decides that, under the lock it hands out the forkserver's socket with: a forkserver that timed itself out
could end between the owner's check that it runs and the request of the engine set the owner started (that set's
engines never came, and the cluster's start waited 90 s for them). It is their subreaper: an engine whose parent
(the first engine of its set) ended first is still its descendant then, not init's.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import engine_main

IDLE_S = 600.0  # a forkserver no cluster asked for this long is stopped (its torch stays in memory until then)
POLL_S = 0.2  # how often it looks at its owner and its ended children
REQUEST_BYTES = 1 << 20  # the largest request: an environment and arguments
REQUEST_S = 5.0  # for a connected asker to send its request (fork_request sends it at once)
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def serve(path: str, owner: int) -> None:
    """The forkserver's loop (see the module's docstring)."""
    # the reaper's SIGTERM to a set's first engine (through fork_request) can end it before this loop sees its
    # owner gone: the engines it forked come to this process then, to be killed with the rest
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    engine_main.preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    while os.getppid() == owner:
        _reap()
        if select.select([listener], [], [], POLL_S)[0]:
            connection, _ = listener.accept()
            connection.settimeout(REQUEST_S)
            with connection:
                _answer(connection, listener)
    listener.close()
    _kill_descendants()  # the owner is gone: so are the clusters it started


def _answer(connection: socket.socket, listener: socket.socket) -> None:
    """Fork the engines of one request; answer ``{"pid": ...}`` or ``{"error": ...}``."""
    fds: list[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(connection, REQUEST_BYTES, 2)
        request = json.loads(message)
        copies, path, since = int(request["copies"]), str(request["connection_file"]), float(request["since"])
        engine_args, env, cwd = [str(a) for a in request["engine_args"]], dict(request["env"]), str(request["cwd"])
        if len(fds) != 2 or copies < 1:
            raise ValueError("a request names one or more copies and passes two file descriptors")
    except Exception as e:  # a request that is not one: answered, and the loop goes on
        _reply(connection, {"error": f"{type(e).__name__}: {e}"})
        for fd in fds:
            os.close(fd)
        return
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            listener.close()
            connection.close()
            os.setpgid(0, 0)  # as every engine: its own process group
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in env.items()})
            engine_main.become_engines(copies, path, since, engine_args)
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    for fd in fds:
        os.close(fd)
    _reply(connection, {"pid": pid})


def _reply(connection: socket.socket, answer: dict) -> None:
    try:
        connection.send(json.dumps(answer).encode())
    except OSError:  # the asker is gone
        pass


def _reap() -> None:
    """Collect the exit status of every child that ended (no zombie engines)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_descendants() -> None:
    import psutil

    for process in psutil.Process().children(recursive=True):
        try:
            process.kill()
        except psutil.Error:
            pass


# --- the owner's side ----------------------------------------------------------------------------------
@dataclass
class _Server:
    owner: int
    process: subprocess.Popen
    folder: str
    used: float = field(default_factory=time.monotonic)  # when a cluster last asked it for engines

    @property
    def path(self) -> str:
        return os.path.join(self.folder, "socket")

    def running(self) -> bool:
        return self.owner == os.getpid() and self.process.poll() is None

    def stop(self) -> None:
        if self.owner == os.getpid():
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


_server: _Server | None = None
_starting = threading.Lock()


def socket_path() -> str:
    """The socket of this process's forkserver, started now when none runs (it is listening once its imports are
    done: ``fork_request`` waits for it)."""
    return _running().path


def _running() -> _Server:
    """This process's forkserver, started now when none runs."""
    global _server
    with _starting:
        if _server is None or not _server.running():
            if _server is not None:
                _server.stop()
            folder = tempfile.mkdtemp(prefix="pscluster-forkserver-")  # mode 0700: its user's alone
            path = os.path.join(folder, "socket")
            process = subprocess.Popen([sys.executable, "-m", __name__, path, str(os.getpid())],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
            _server = _Server(os.getpid(), process, folder)
            atexit.register(_server.stop)
            threading.Thread(target=_stop_when_idle, args=(_server,), name="pscluster-forkserver-idle",
                             daemon=True).start()
        _server.used = time.monotonic()  # under the lock the idle stop takes: it cannot stop a server handed out now
        return _server


def _stop_when_idle(server: _Server) -> None:
    """Stop ``server`` once no cluster has asked it for engines for ``IDLE_S`` (its engines run on)."""
    global _server
    while server.running():
        time.sleep(min(POLL_S * 10, IDLE_S))
        with _starting:
            if _server is server and time.monotonic() - server.used > IDLE_S:
                server.stop()
                _server = None


def stop() -> None:
    """Stop this process's forkserver, if one runs (it stops at this process's exit otherwise)."""
    global _server
    with _starting:
        if _server is not None:
            _server.stop()
            _server = None


def command(copies: int, connection_file: str, since: float) -> list[str]:
    """The ``engine_cmd`` of ipyparallel's local engine launcher for ``copies`` engines forked by this process's
    forkserver (``fork_request``, run by its path: it imports nothing of pscluster, or of torch)."""
    server = _running()
    request = Path(__file__).with_name("fork_request.py")
    return [sys.executable, str(request), server.path, str(server.process.pid), str(copies), connection_file,
            repr(since)]


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
