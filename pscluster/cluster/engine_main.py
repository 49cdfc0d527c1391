"""The processes of a local cluster's engines: one process imports what every task runs (torch, the ps server,
ipyparallel's engine) once, while the controller starts, then forks into the engines, which register with
torch loaded. N engines cost one import of torch instead of N (about 2 s of CPU each), and none of it
waits for the controller.

    python -m pscluster.cluster.engine_main COPIES CONNECTION_FILE SINCE [ipengine arguments]

``CONNECTION_FILE``: the controller's engine connection file, read once it is complete and written at or
after ``SINCE`` (a ``time.time()``; an older file is a stale one of an earlier controller of the same name).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

WAIT_S = 120.0  # for the controller's connection file, on a loaded machine


def command(copies: int, connection_file: str, since: float) -> list[str]:
    """The ``engine_cmd`` of an ipyparallel engine launcher that starts ``copies`` engines in one launch."""
    return [sys.executable, "-m", __name__, str(copies), connection_file, repr(since)]


def connection_info(path: str, since: float, timeout: float = WAIT_S) -> dict:
    """The controller's engine connection info, once ``path`` holds a complete one written since ``since``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.stat(path).st_mtime >= since:
                with open(path) as f:
                    return json.load(f)
        except (FileNotFoundError, ValueError):  # not written yet, or being written
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"pscluster engine: no connection file {path} from the controller within "
                             f"{timeout:.0f}s")
        time.sleep(0.05)


def preload() -> None:
    """Import what every task runs: torch, the ps server, the first optimizer's imports, ipyparallel's engine."""
    import pscluster.runtime.remote  # noqa: F401  (loaded once, shared by the forks)
    from pscluster.runtime import optim

    optim.preload()
    import ipyparallel.engine.app  # noqa: F401


def become_engines(copies: int, path: str, since: float, engine_args: list[str]) -> None:
    """Turn this process (``preload``-ed) into ``copies`` engines of the controller whose connection file is
    ``path``: it forks the others, then each runs ipyparallel's engine with ``engine_args``. Returns when the
    engine this process became ends."""
    from ipyparallel.engine.app import main as engine

    from .ipp_bounds import bound_sockets

    bound_sockets()  # before ipyparallel's engine makes a socket
    os.environ["IPP_CONNECTION_INFO"] = json.dumps(connection_info(path, since))
    # what is loaded so far lives as long as the engines: out of the garbage collector's sight, so that no
    # collection in a fork walks (and copies) the shared pages of torch's objects
    gc.freeze()
    for _ in range(copies - 1):
        if os.fork() == 0:  # a child is one more engine; the parent forks the rest
            # its own process group: an engine that shuts down or is interrupted signals every process of
            # its group (ipykernel does), and the parent's group would hold the other engines
            os.setpgid(0, 0)
            break
    # no nanny process beside each engine: a local engine is watched and killed by its pid
    sys.argv = [sys.argv[0], *engine_args, "--IPEngine.enable_nanny=False"]
    engine()


def main(argv: list[str]) -> None:
    copies, path, since = int(argv[1]), argv[2], float(argv[3])
    preload()
    become_engines(copies, path, since, argv[4:])  # the rest is ipengine's


if __name__ == "__main__":
    main(sys.argv)
