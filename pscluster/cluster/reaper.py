"""A watchdog process: when the owner (the kernel) dies, kill the cluster's processes.

Started in its own session so it outlives the owner; exits when the owner is
gone and the processes are dead, or when every process it watches is already
gone (the cluster was stopped normally).

    python -m pscluster.cluster.reaper OWNER_PID PID [PID ...] [--remove FILE ...]

``--remove``: files to delete after killing (the ipyparallel cluster file, so
that no stale cluster is listed afterwards).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import psutil

POLL_S = 0.5
GRACE_S = 3.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # reaped since the signal above reached it
        return False
    except OSError:
        return True


def with_descendants(pids: list[int], spared: list[int] = ()) -> list[int]:
    """``pids`` and every process below them (the controller's schedulers, the engines' nannies), except
    ``spared`` processes and those below them: local engines are forked from one of them (``engine_main``),
    so the others are its children."""
    found = list(dict.fromkeys(p for p in pids if p not in spared))
    for pid in found:  # grows as it goes: children, then theirs
        try:
            found += [c.pid for c in psutil.Process(pid).children() if c.pid not in spared and c.pid not in found]
        except psutil.NoSuchProcess:
            pass
    return found


def kill_all(pids: list[int], grace: float = GRACE_S) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            if alive(pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def watch(owner: int, pids: list[int], remove: list[str] = ()) -> None:
    while True:
        if not any(alive(p) for p in pids):
            return
        if not alive(owner):
            kill_all(with_descendants(pids))  # engines forked since the list was made too
            for path in remove:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pscluster.cluster.reaper")
    parser.add_argument("owner", type=int)
    parser.add_argument("pids", type=int, nargs="+")
    parser.add_argument("--remove", nargs="*", default=[])
    args = parser.parse_args()
    watch(args.owner, args.pids, args.remove)
