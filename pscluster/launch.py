"""``pscluster launch [--ps N] [--workers N] [run options] train.py [args...]``: a local cluster of processes, each
running the same script with its own ``PSCLUSTER_CONFIG`` (as ``torchrun`` starts a script's ranks): the script calls
``pscluster.init()`` (its own loop) or ``pscluster.train_from_environment()``.

- Every task listens on 127.0.0.1 only; the data plane is signed with a secret drawn for this launch. Each line a
  task prints is shown with its task's name, launch's own with ``[launch]``.
- The run options typed as flags (``--mode async --steps 500``...) go to every task: a flag overrides the option's
  default, an argument the script gives ``init()`` overrides the flag. A bad value stops launch before any task.
- A ps, or a worker other than the chief, that dies (a non-zero status, a signal) is started again with the same
  config, at most ``--max-restarts`` times each: the chief's supervisor recovers the run of a lost ps, a worker
  rejoins the run. A task hung is lost too: one whose process is stopped (SIGSTOP) for ``STOPPED_S`` is killed,
  then started again as a dead one (the chief's end ends the job). That is the hang the data plane sees: ZeroMQ
  answers the workers' heartbeats from threads of its own, so a ps busy (or stuck) in Python still answers them,
  and only a process that does not run at all misses them.
- The chief (worker 0) ends the job: the other tasks get ``TASKS_END_S`` to end after it ended well, and are ended
  at once after it failed. launch ended by SIGTERM or SIGINT sends the signal on to every task (SIGTERM to the
  chief first, whose clean stop releases the other workers); killed by any signal (SIGKILL too), its tasks die
  with it.
- The exit status: the chief's when it failed (non-zero when its run failed, 128 + N for a signal N), else that of
  a worker that failed with no restart left, else 0; 128 + N when launch itself was sent signal N.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil

from . import environ
from .cluster.launchers.base import HEARTBEAT_DEADLINE_S
from .errors import ConfigError
from .runtime import options
from .runtime.network import free_port
from .spec import ClusterSpec, TaskSpec, threads_per_task

TASKS_END_S = 30.0  # how long the other tasks may take to end once the chief ended well (it finalized the run),
# and the chief once launch passed it a SIGTERM (its clean stop writes a final checkpoint), or the workers a SIGINT
KILL_AFTER_S = 5.0  # how long a task may take to end on SIGTERM before it gets SIGKILL
POLL_S = 0.1
STOPPED_S = HEARTBEAT_DEADLINE_S  # a task stopped this long is lost, as a notebook's engine missing its heartbeats
MAX_RESTARTS = 3
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message}: see pscluster launch --help")


def local_spec(num_ps: int, num_workers: int, name: str) -> ClusterSpec:
    """A cluster on this machine: each ps on a port free now (the workers must know it before it serves). The
    chief's metrics go to a port its collector picks itself when it binds (port 0): the tasks learn it from the
    run's plan, and a port picked here could be taken by another process before the chief's first step."""
    return ClusterSpec(ps=tuple(TaskSpec("ps", i, port=free_port()) for i in range(num_ps)),
                       workers=tuple(TaskSpec("worker", i, port=0) for i in range(num_workers)), name=name)


def parser(*, typed_only: bool = False) -> Parser:
    """launch's flags, a run option's made from the options table; ``typed_only``: an option not typed stays
    out of the parsed namespace (no default), so that only what the user typed goes to the tasks."""
    p = Parser(prog="pscluster launch", description="a local cluster of processes, each running "
               "the same script with its own PSCLUSTER_CONFIG (as torchrun starts a script's ranks)")
    p.add_argument("--ps", type=int, default=1, help="ps tasks (default 1)")
    p.add_argument("--workers", type=int, default=2, help="worker tasks (default 2); worker 0 is the chief")
    p.add_argument("--max-restarts", type=int, default=MAX_RESTARTS,
                   help=f"how many times a lost ps or worker (not the chief) is started again (default {MAX_RESTARTS})")
    options.add_flags(p.add_argument_group("run options (an argument the script gives pscluster.init() wins)"),
                      options.SCRIPT)
    if typed_only:  # a flag whose default is SUPPRESS stays out of the namespace unless typed
        for action in p._actions:
            if action.dest in options.OPTIONS:
                action.default = argparse.SUPPRESS
    p.add_argument("script", help="the Python script every task runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def typed_options(argv: list[str]) -> dict:
    """The run options typed in ``argv``, checked, by name."""
    values = options.from_flags(parser().parse_args(argv), options.SCRIPT)
    return {name: values[name] for name in vars(parser(typed_only=True).parse_args(argv)) if name in values}


@dataclass
class Task:
    """One task's process, started again (``restarts``) with the same ``env`` when it dies."""

    role: str
    index: int
    env: dict
    process: subprocess.Popen | None = None
    restarts: int = 0
    relay: threading.Thread | None = None
    done: bool = False  # ended, and not to be started again
    killed: bool = False  # by launch, for not ending in time
    stopped_since: float | None = None  # when launch first saw its process stopped (SIGSTOP)

    @property
    def label(self) -> str:
        return f"{self.role}:{self.index}"

    @property
    def chief(self) -> bool:
        return (self.role, self.index) == ("worker", 0)

    def start(self, command: list[str]) -> None:
        self.process = subprocess.Popen(command, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        env=self.env, preexec_fn=_dies_with(os.getpid()), process_group=0)
        self.relay = _relay(self.process, self.label)
        say(f"{self.label} started, pid {self.process.pid}")

    def stopped(self) -> bool:
        """Whether the task's process is stopped (SIGSTOP, SIGTSTP: not running at all)."""
        try:
            return psutil.Process(self.process.pid).status() == psutil.STATUS_STOPPED
        except psutil.Error:  # ended, and reaped
            return False

    def send(self, sig: int) -> None:
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, sig)
            except ProcessLookupError:
                pass


def _dies_with(parent: int):
    """The task's ``preexec_fn``: the kernel kills it when launch dies, by any signal. launch's own cleanup
    (``Launch._end``) cannot run on SIGKILL, and a task of a loop without ``should_stop()`` would train on for ever,
    orphaned. Linux sends PDEATHSIG when the *thread* that started the child ends: tasks start in the main
    thread only. Elsewhere (no prctl) only launch's cleanup ends them."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it

    def preexec():
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # launch died before the prctl took effect
            os._exit(1)

    return preexec


def say(line: str) -> None:
    print(f"[launch] {line}", flush=True)


def _relay(process: subprocess.Popen, label: str) -> threading.Thread:
    def relay():
        for line in process.stdout:
            print(f"[{label}] {line}", end="", flush=True)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return thread


def exit_status(code: int) -> int:
    """A process's status as a shell shows it: 128 + N for a process ended by signal N."""
    return 128 - code if code < 0 else code


def describe(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    given = typed_options(argv)
    if args.ps < 1 or args.workers < 1:
        raise ConfigError("give --ps and --workers of 1 or more")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: use 0 or more")
    if not os.path.isfile(args.script):
        raise ConfigError(f"no script {args.script!r}: give the path of the script every task runs")
    spec = local_spec(args.ps, args.workers, "pscluster-launch")
    tasks = [Task(role, i, {**task_env(args.ps + args.workers, given), environ.CONFIG: spec.config_for(role, i)})
             for role, count in (("ps", args.ps), ("worker", args.workers)) for i in range(count)]
    return Launch(tasks, [sys.executable, args.script, *args.args], args.max_restarts).run()


def task_env(tasks: int, given: dict) -> dict:
    """The environment every one of ``tasks`` tasks starts in: this one's, with the typed run options ``given``,
    and as many torch threads (``OMP_NUM_THREADS``, unless set) as a notebook's cluster gives an engine: the
    cores divided among the tasks (torchrun sets it to 1 for several processes on a machine)."""
    env = {k: v for k, v in os.environ.items() if k not in (environ.TF_CONFIG, environ.LAUNCH_OPTIONS)}
    env.setdefault("OMP_NUM_THREADS", str(threads_per_task(tasks)))
    if given:
        env[environ.LAUNCH_OPTIONS] = json.dumps(given)
    return env


class Launch:
    """The tasks' processes, followed from the main thread until the chief ends (see the module)."""

    def __init__(self, tasks: list[Task], command: list[str], max_restarts: int):
        self.tasks, self.command, self.max_restarts = tasks, command, max_restarts
        self.chief = next(t for t in tasks if t.chief)
        self.signalled: int | None = None

    def run(self) -> int:
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for task in self.tasks:
                task.start(self.command)
            while self.signalled is None and self.chief.process.poll() is None:
                self._kill_stopped()
                self._restart_lost()
                time.sleep(POLL_S)
            return self._end()
        finally:
            for task in self.tasks:  # whatever happened above (an error of launch's own): no task outlives it
                if task.process is not None and task.process.poll() is None:
                    task.process.kill()
                    task.process.wait()
            for task in self.tasks:
                if task.relay is not None:
                    task.relay.join(5)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig, _frame) -> None:
        self.signalled = sig

    def _kill_stopped(self) -> None:
        """SIGKILL each task whose process has been stopped for ``STOPPED_S``: it is lost (see the module)."""
        now = time.monotonic()
        for task in self.tasks:
            if task.done or not task.stopped():
                task.stopped_since = None
            elif task.stopped_since is None:
                task.stopped_since = now
            elif now - task.stopped_since >= STOPPED_S:
                say(f"{task.label} stopped for {STOPPED_S:g}s (SIGSTOP): killed, as a lost task")
                task.stopped_since = None
                task.send(signal.SIGKILL)

    def _restart_lost(self) -> None:
        """Start again each task other than the chief that died, while it has restarts left."""
        for task in self.tasks:
            code = task.process.poll()
            if task.chief or task.done or code is None:
                continue
            if code == 0:
                task.done = True  # its part is over (a ps whose run the chief closed, a worker whose loop ended)
            elif task.restarts < self.max_restarts:
                task.restarts += 1
                say(f"{task.label} {describe(code)}: starting it again ({task.restarts} of {self.max_restarts})")
                task.relay.join(1)
                task.start(self.command)
            else:
                task.done = True
                say(f"{task.label} {describe(code)}, started again {self.max_restarts} times already: left down")

    def _end(self) -> int:
        """End every task: the exit status (see the module)."""
        others = [t for t in self.tasks if not t.chief]
        if self.signalled is not None:
            # SIGTERM to the chief first: its clean stop writes its final checkpoint through the ps tasks and
            # releases the other workers, whose loops end; SIGINT to every worker (each loop interrupted)
            say(f"{signal.Signals(self.signalled).name}: passing it on to every task")
            first = [self.chief] if self.signalled == signal.SIGTERM else [t for t in self.tasks if t.role == "worker"]
            for task in first:
                task.send(self.signalled)
            self._ended_within(first, TASKS_END_S)
            for task in self.tasks:
                task.send(self.signalled)
            self._ended_within(self.tasks, KILL_AFTER_S)
            return 128 + self.signalled
        code = self.chief.process.returncode
        if code:
            say(f"the chief {describe(code)}: ending every other task")
            for task in others:
                task.send(signal.SIGTERM)
            self._ended_within(others, KILL_AFTER_S)
            return exit_status(code)
        self._ended_within(others, TASKS_END_S)
        failed = [t.process.returncode for t in others
                  if t.role == "worker" and t.process.returncode and not t.killed]
        return exit_status(failed[0]) if failed else 0

    def _ended_within(self, tasks: list[Task], seconds: float) -> None:
        """Wait up to ``seconds`` for ``tasks`` to end; SIGKILL the ones still running then."""
        deadline = time.monotonic() + seconds
        for task in tasks:
            try:
                task.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{task.label} still running after {seconds:.0f}s: killed")
                task.killed = True
                task.process.kill()
                task.process.wait()


if __name__ == "__main__":
    sys.exit(main())
