"""``pscluster launch`` as a user runs it, for the launch tests and the fault matrix's script rows: the scripts
(a user's loop with ``pscluster.init()``, and ``train_from_environment``), and ``Launched``, a launch whose output
is read as it comes and whose processes are stopped by their pids (``Process``: one task started as a scheduler
would, with its own config)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil

# A user's loop on batches it makes itself. argv: how the loop ends, init()'s own arguments as JSON.
#   stop: at should_stop(); forever: never by itself; batches:N: after N batches, without should_stop();
#   fail:W:N: worker W raises at its step N; run_ended: raises RunEnded itself after a loop that stopped
LOOP = textwrap.dedent("""
    import json, sys, torch, pscluster
    import torch.nn.functional as F


    def main():
        how, options = sys.argv[1], json.loads(sys.argv[2])
        ctx = pscluster.init(**options)
        torch.manual_seed(0)
        model = ctx.model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
        optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
        batches = int(how.split(":")[1]) if how.startswith("batches:") else None
        fail = [int(n) for n in how.split(":")[1:]] if how.startswith("fail:") else None
        step = 0
        while batches is None or step < batches:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            ctx.log(loss=loss.item())
            step += 1
            if fail and fail == [ctx.worker_index, step]:
                raise ValueError(f"worker {ctx.worker_index}'s own error at its step {step}")
            if how in ("stop", "run_ended") and ctx.should_stop():
                break
        out = {"worker": ctx.worker_index, "global_step": ctx.global_step}
        if ctx.run is not None:
            out.update(status=ctx.run.status, mode=ctx.run.plan.mode, seed=ctx.run.plan.seed, steps=ctx.run.plan.steps)
        print("SUMMARY", json.dumps(out), flush=True)
        if how == "run_ended":
            raise pscluster.errors.RunEnded("raised by the script")


    if __name__ == "__main__":
        main()
""")

# The library's loop from a script. argv: mode, steps.
TRAIN = textwrap.dedent("""
    import json, sys, torch, pscluster

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    out = pscluster.train_from_environment(
        lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)), data,
        torch.nn.CrossEntropyLoss(), mode=sys.argv[1], steps=int(sys.argv[2]), batch_size=16, lr=0.1, log_every=10,
        checkpoint_every=50)
    if isinstance(out, pscluster.Run):
        print("SUMMARY", json.dumps({"worker": 0, "status": out.status, "global_step": out.global_step}), flush=True)
""")

# a worker's own progress line, printed as it trains (train_from_environment's chief prints every worker's again
# later, after its own task's name)
PROGRESS = r"^\[worker:{index}\] After \d+ training steps"


class Process:
    """``command`` with ``PSCLUSTER_HOME=home`` and ``env`` over this process's environment (less any cluster
    config): its lines as they come; ``stop()`` kills it, and whatever ``pids`` names, by pid."""

    def __init__(self, command: list[str], home, env: dict | None = None):
        base = {k: v for k, v in os.environ.items() if k not in ("PSCLUSTER_CONFIG", "TF_CONFIG")}
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**base, "PSCLUSTER_HOME": str(home), **(env or {})})
        self.home = Path(home)
        self.lines: list[str] = []
        self._new = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._new:
                self.lines.append(line)
                self._took(line)
                self._new.notify_all()
        with self._new:
            self._new.notify_all()

    def _took(self, line: str) -> None:
        """What a subclass learns from ``line``."""

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def pids(self) -> list[int]:
        return []

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        """The first line matching ``pattern``, once printed; AssertionError after ``timeout`` s or at the end."""
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                for line in self.lines:
                    if found := re.search(pattern, line):
                        return found
                assert self._reader.is_alive(), f"the process ended without {pattern!r}:\n{self.output[-3000:]}"
                assert time.monotonic() < deadline, f"no {pattern!r} within {timeout:.0f}s:\n{self.output[-3000:]}"
                self._new.wait(0.5)

    def wait(self, timeout: float = 180) -> int:
        code = self.process.wait(timeout)
        self._reader.join(10)
        return code

    def summaries(self) -> dict[int, dict]:
        found = [json.loads(line.split("SUMMARY ", 1)[1]) for line in self.lines if "SUMMARY " in line]
        return {s["worker"]: s for s in found}

    def stop(self) -> None:
        for pid in [self.process.pid, *self.pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(10)


class Launched(Process):
    """``pscluster launch [flags] script [args]`` with ``PSCLUSTER_HOME=home``, and the pids of its tasks (from its
    ``started, pid`` lines)."""

    def __init__(self, home, script, *flags: str, args=()):
        self.started: dict[str, list[int]] = {}  # a task's pids, the latest last
        super().__init__([sys.executable, "-m", "pscluster", "launch", *flags, str(script), *args], home)

    def _took(self, line: str) -> None:
        if started := re.match(r"\[launch\] (\S+) started, pid (\d+)", line):
            self.started.setdefault(started[1], []).append(int(started[2]))

    def pid(self, task: str) -> int:
        return self.started[task][-1]

    @property
    def pids(self) -> list[int]:
        return [pid for pids in self.started.values() for pid in pids]

    def kill(self, task: str, sig=signal.SIGKILL) -> None:
        os.kill(self.pid(task), sig)


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids of ``pids`` still running after ``seconds`` (zombies count as gone)."""
    deadline = time.monotonic() + seconds
    while True:
        left = [pid for pid in pids if running(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
