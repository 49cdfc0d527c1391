"""The command ipyparallel's local engine launcher runs for an engine set of a local cluster, by its path:

    python .../fork_request.py SOCKET SERVER_PID COPIES CONNECTION_FILE SINCE [ipengine arguments]

It asks the owner's forkserver (process ``SERVER_PID``, listening at ``SOCKET``: ``forkserver``) for ``COPIES``
engines, with this process's environment, directory and output, then stands for them as the process the launcher
watches: it lives as long as the first engine (the one the others were forked from) and passes it SIGTERM and
SIGINT. It imports nothing but the standard library: it starts in milliseconds, with no torch to import.
"""

import json
import os
import select
import signal
import socket
import sys
import time

WAIT_S = 120.0  # for the forkserver to listen (its imports, on a loaded machine)


def connect(path: str, pid: int) -> socket.socket:
    """A connection to the forkserver, once it listens (its imports done)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            server.connect(path)
            return server
        except (FileNotFoundError, ConnectionRefusedError):  # not listening yet
            server.close()
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise SystemExit(f"pscluster engine: the forkserver (pid {pid}) ended before it listened: its error is "
                             "in the output of the process that started the cluster") from None
        if time.monotonic() > deadline:
            raise SystemExit(f"pscluster engine: the forkserver at {path} did not listen within {WAIT_S:.0f}s")
        time.sleep(0.05)


def main(argv: list[str]) -> None:
    path, pid, copies, connection_file, since = argv[1], int(argv[2]), int(argv[3]), argv[4], float(argv[5])
    request = {"copies": copies, "connection_file": connection_file, "since": since, "engine_args": argv[6:],
               "env": dict(os.environ), "cwd": os.getcwd()}
    with connect(path, pid) as server:
        socket.send_fds(server, [json.dumps(request).encode()], [sys.stdout.fileno(), sys.stderr.fileno()])
        answer = json.loads(server.recv(65536) or b"{}")
    if "pid" not in answer:
        raise SystemExit(f"pscluster engine: the forkserver refused the request: {answer.get('error')}")
    engine = answer["pid"]

    def pass_on(number, _frame) -> None:
        try:
            os.kill(engine, number)
        except ProcessLookupError:  # it ended: the wait below returns
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, pass_on)
    try:
        ended = os.pidfd_open(engine)
    except ProcessLookupError:  # it ended already
        return
    select.select([ended], [], [])


if __name__ == "__main__":
    main(sys.argv)
