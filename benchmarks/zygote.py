"""A zygote: one process that imports what the benchmarks' children run (torch, torch._dynamo, pscluster's runtime)
once, then forks into those children on request, each then running ``python -m MODULE ARGS`` as a fresh
interpreter would: its own arguments, environment, torch threads, stdin, stdout and stderr, the module run as
``__main__``, the interpreter's normal exit. N children cost one import of torch instead of N (4-6 s of CPU each,
up to a minute of wall time on a loaded 2-core machine): the tiny size starts its children this way
(``procs.tiny_run``), full size starts each one fresh. pscluster's local engines are started the same way
(``pscluster.cluster.engine_main``).

    python -m benchmarks.zygote FD      serve fork requests on the inherited Unix socket FD (``Zygote`` starts it)
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

# imported once, before any fork: no module of benchmarks/, whose modules read their environment when imported
PRELOAD = ("numpy", "zmq", "psutil", "torch", "torch.distributed.rpc", "pscluster.runtime.standalone",
           "pscluster.runtime.context", "pscluster.runtime.emitter", "pscluster.metrics.collector",
           "pscluster.metrics.store")
CHILD_FDS = 4  # sent with each request: the child's stdin, stdout and stderr, and where its exit code goes
START_S = 300.0  # for the zygote's imports, on a loaded machine


class Forked:
    """A child forked by the zygote, with what the benchmarks use of ``subprocess.Popen``'s interface: ``args``,
    ``pid``, ``stdin`` and ``stdout`` (text, when piped), ``returncode``, ``poll``, ``wait``, ``communicate``,
    ``terminate``, ``kill``. Its exit code comes from the zygote (its parent) through a pipe."""

    def __init__(self, args: list[str], pid: int, stdin, stdout, exit_fd: int):
        self.args, self.pid, self.stdin, self.stdout = args, pid, stdin, stdout
        self.returncode: int | None = None
        self._exit_fd = exit_fd

    def poll(self) -> int | None:
        return self._collect(0.0)

    def wait(self, timeout: float | None = None) -> int:
        if self._collect(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, None]:
        """Close its stdin, read its stdout to the end (when piped), wait for it: ``(stdout, None)``."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())
        if self.stdin is not None:
            self.stdin.close()
        out = None
        if self.stdout is not None:
            chunks = []  # read below the text wrapper, which has read nothing yet
            while select.select([self.stdout], [], [], left())[0]:
                if not (chunk := os.read(self.stdout.fileno(), 1 << 16)):
                    break
                chunks.append(chunk)
            else:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.stdout.close()
            out = b"".join(chunks).decode()
        self.wait(left())
        return out, None

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is None and select.select([self._exit_fd], [], [], timeout)[0]:
            code = os.read(self._exit_fd, 32)
            os.close(self._exit_fd)
            self.returncode = int(code) if code else -signal.SIGKILL  # no code: the zygote itself was killed
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended meanwhile: its exit code is on its way
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The client of a zygote process, started with ``env`` (which sets the libraries' defaults: give it one
    torch thread); ``popen`` forks a child from it. The zygote imports while this process goes on: the first
    ``popen`` waits for it."""

    def __init__(self, env: dict, cwd: str):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen([sys.executable, "-m", __spec__.name, str(theirs.fileno())], cwd=cwd, env=env,
                                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()  # one request and its answer at a time

    def popen(self, args: list[str], *, cwd: str, env: dict, stdin=None, stdout=None, stderr=None) -> Forked:
        """A child running ``args`` (``[python, "-m", MODULE, *ARGS]``) as ``subprocess.Popen(args, cwd=cwd, env=env,
        stdin=..., stdout=..., stderr=..., text=True)`` would, with ``subprocess.PIPE``, ``subprocess.DEVNULL``,
        a file or None (this process's) for each stream."""
        if args[1] != "-m":
            raise ValueError(f"the zygote runs modules (python -m MODULE ...), not {args}")
        ends: list[int] = []  # ours, of the pipes
        theirs: list[int] = []  # to send, and close here once sent

        def stream(how, fd: int, reading: bool) -> int:
            if how == subprocess.PIPE:
                r, w = os.pipe()
                ends.append(w if reading else r)
                theirs.append(r if reading else w)
                return theirs[-1]
            if how == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_RDWR))
                return theirs[-1]
            return fd if how is None else how.fileno()
        fds = [stream(stdin, 0, True), stream(stdout, 1, False), stream(stderr, 2, False)]
        exit_r, exit_w = os.pipe()
        theirs.append(exit_w)
        request = json.dumps({"module": args[2], "args": args[3:], "cwd": str(cwd), "env": dict(env)}).encode()
        try:
            with self.lock:
                socket.send_fds(self.sock, [request], [*fds, exit_w])
                pid = self._pid()
        except BaseException:
            for fd in (*ends, exit_r):
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        pipes = iter(ends)
        child_in = open(next(pipes), "w", encoding="utf-8") if stdin == subprocess.PIPE else None
        child_out = open(next(pipes), encoding="utf-8") if stdout == subprocess.PIPE else None
        return Forked(list(args), pid, child_in, child_out, exit_r)

    def _pid(self) -> int:
        """The answer to a request: the pid of the child forked (the first answer waits for the zygote's imports)."""
        deadline = time.monotonic() + START_S
        while not select.select([self.sock], [], [], 1.0)[0] and self.process.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the benchmarks' zygote forked nothing within {START_S:.0f} s")
        answer = self.sock.recv(64)
        if not answer:
            raise RuntimeError(f"the benchmarks' zygote ended (exit {self.process.wait()}): see its error output")
        return int(answer)

    def close(self) -> None:
        """End the zygote (any child of it still running is terminated)."""
        self.sock.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serve(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """Fork a child for each request, and write each child's exit code to the pipe it came with once it ends;
    until the client closes its end (then the children still running are terminated; returns None). Returns in
    a forked child only: its request and its descriptors."""
    exits: dict[int, int] = {}  # child pid -> where its exit code goes
    while True:
        if select.select([sock], [], [], 0.1)[0]:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, CHILD_FDS)
            if not message:
                break
            pid = os.fork()
            if pid == 0:
                sock.close()
                for fd in exits.values():
                    os.close(fd)
                return json.loads(message), fds
            for fd in fds[:-1]:
                os.close(fd)
            exits[pid] = fds[-1]
            sock.send(str(pid).encode())
        _reap(exits)
    for pid in exits:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while exits and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap(exits)
    for pid in exits:
        os.kill(pid, signal.SIGKILL)
    return None


def _reap(exits: dict[int, int]) -> None:
    """Every child that has ended: its exit code (as ``Popen.returncode`` gives it) written, its pipe closed."""
    while exits:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        fd = exits.pop(pid, None)
        if fd is not None:
            os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
            os.close(fd)


def become(request: dict, fds: list[int]) -> None:
    """In a forked child: take the request's streams, folder, environment and arguments, and run its module as
    ``python -m`` would (an exception or ``sys.exit`` ends the process as it would end that interpreter)."""
    import runpy

    import torch

    for fd, target in zip(fds, (0, 1, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.close(fds[-1])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # read by the libraries when the zygote imported them: set anew, as a fresh interpreter would from them
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def main(fd: int) -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    from pscluster.runtime import optim

    optim.preload()
    # what is imported now is never garbage: out of the collector's sight, which would otherwise go through it (and
    # write to every page of it, copying each page into the child) in each child's first collections and its exit
    gc.collect()
    gc.freeze()
    forked = serve(socket.socket(fileno=fd))
    if forked is not None:
        become(*forked)


if __name__ == "__main__":
    main(int(sys.argv[1]))
