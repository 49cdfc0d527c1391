"""``pscluster launch --ps 1 --workers 2 train.py [args...]``: a local cluster of processes, each running the same
script with its own ``PSCLUSTER_CONFIG`` (as ``torchrun`` starts a script's ranks): the script calls
``pscluster.init()`` (its own loop) or ``pscluster.train_from_environment()``. Every task listens on 127.0.0.1 only;
the data plane is signed with a secret drawn for this launch. Each line a task prints is shown with its task's name;
the exit status is the first failed worker's, else 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading

from .spec import ClusterSpec, TaskSpec

PS_END_S = 30.0  # how long the ps tasks may take to end once every worker has (the chief closed the run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_spec(num_ps: int, num_workers: int, name: str) -> ClusterSpec:
    """A cluster on this machine: each ps on a free port, the chief's metrics on another."""
    return ClusterSpec(ps=tuple(TaskSpec("ps", i, port=free_port()) for i in range(num_ps)),
                       workers=tuple(TaskSpec("worker", i, port=free_port() if i == 0 else 0)
                                     for i in range(num_workers)), name=name)


def _relay(process: subprocess.Popen, label: str) -> threading.Thread:
    def relay():
        for line in process.stdout:
            print(f"[{label}] {line}", end="", flush=True)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pscluster launch", description=__doc__.splitlines()[0])
    parser.add_argument("--ps", type=int, default=1, help="ps tasks (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="worker tasks (default 2); worker 0 is the chief")
    parser.add_argument("--name", default="pscluster-launch", help="the cluster's name")
    parser.add_argument("script", help="the Python script every task runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    if args.ps < 1 or args.workers < 1:
        parser.error("give --ps and --workers of 1 or more")
    if not os.path.isfile(args.script):
        parser.error(f"no script {args.script!r}")
    spec = local_spec(args.ps, args.workers, args.name)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    tasks = [("ps", i) for i in range(args.ps)] + [("worker", i) for i in range(args.workers)]
    processes = {task: subprocess.Popen([sys.executable, args.script, *args.args], text=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT,
                                        env={**env, "PSCLUSTER_CONFIG": spec.config_for(*task)})
                 for task in tasks}
    relays = [_relay(p, f"{role}:{i}") for (role, i), p in processes.items()]
    status = 0
    try:
        for (role, i), p in processes.items():
            if role == "worker" and p.wait() and not status:
                status = p.returncode
        for (role, i), p in processes.items():
            if role == "ps":
                try:
                    p.wait(PS_END_S)
                except subprocess.TimeoutExpired:  # a run that never started, or a chief that died first
                    p.terminate()
                    p.wait(10)
    except KeyboardInterrupt:
        status = 130
    finally:
        for p in processes.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for relay in relays:
            relay.join(5)
    return status


if __name__ == "__main__":
    sys.exit(main())
