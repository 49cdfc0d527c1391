"""The reaper: kills the cluster's processes when the owner (the kernel) dies, and only then."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from pscluster.cluster.reaper import alive, kill_all

STARTUP_S = 30  # a reaper is a fresh interpreter: allow for a slow start on a loaded machine
KILL_S = 5  # from the owner's death to its processes' death, once the reaper watches


class Spawner:
    """Starts subprocesses; ``close`` kills and reaps whatever still runs."""

    def __init__(self):
        self.started = []

    def __call__(self, *argv, **kw) -> subprocess.Popen:
        self.started.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, **kw))
        return self.started[-1]

    def close(self):
        for p in self.started:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.fixture
def spawn():
    spawner = Spawner()
    yield spawner
    spawner.close()


def wchan(pid: int) -> str:
    """Where the kernel says ``pid`` waits ("0" while it runs, or where the kernel does not say)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return "0"


@dataclass
class Watch:
    """A reaper started by ``python -m pscluster.cluster.reaper OWNER PID...``."""

    reaper: subprocess.Popen
    owner: subprocess.Popen | None  # None: the owner is this test process
    victims: list[subprocess.Popen]
    since: float = 0.0  # time.monotonic() when the reaper was seen watching


@pytest.fixture(scope="module")
def watches():
    """Two reapers, started together (their start-up is the slow part) and already watching:
    ``"child"`` watches two processes for an owner the test can kill, ``"self"`` one process
    for this test process."""
    spawn = Spawner()
    try:
        child_owner = spawn("sleep", "60")
        started = {"child": ([spawn("sleep", "60") for _ in range(2)], child_owner),
                   "self": ([spawn("sleep", "60")], None)}
        watches = {}
        for name, (victims, owner) in started.items():
            reaper = spawn(sys.executable, "-m", "pscluster.cluster.reaper",
                           str(owner.pid if owner else os.getpid()), *(str(v.pid) for v in victims),
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            watches[name] = Watch(reaper, owner, victims)
        wait_until_watching([w.reaper for w in watches.values()], sleeping_pid=child_owner.pid)
        for w in watches.values():
            w.since = time.monotonic()
        yield watches
    finally:
        spawn.close()


def wait_until_watching(reapers, sleeping_pid: int):
    """Wait until every reaper sleeps between two polls of its watch loop (start-up is over)."""
    if "sleep" not in wchan(sleeping_pid):  # this kernel does not tell: give the reapers time
        time.sleep(5)
        return
    deadline = time.monotonic() + STARTUP_S
    for reaper in reapers:
        while "sleep" not in wchan(reaper.pid):
            assert reaper.poll() is None, reaper.stderr.read()
            assert time.monotonic() < deadline, "the reaper did not start watching"
            time.sleep(0.02)


def test_processes_are_killed_when_the_owner_dies(watches):
    watch = watches["child"]
    assert all(v.poll() is None for v in watch.victims)
    watch.owner.kill()
    watch.owner.wait(5)
    died = time.monotonic()
    for v in watch.victims:
        assert v.wait(KILL_S) == -signal.SIGTERM  # killed, not finished
    assert time.monotonic() - died < KILL_S
    assert watch.reaper.wait(KILL_S) == 0, watch.reaper.stderr.read()


def test_reaper_leaves_processes_alone_while_the_owner_lives_and_exits_when_they_are_gone(watches):
    watch = watches["self"]
    time.sleep(max(0.0, watch.since + 1.1 - time.monotonic()))  # two polls and more
    (victim,) = watch.victims
    assert victim.poll() is None and watch.reaper.poll() is None
    victim.terminate()
    victim.wait(5)
    assert watch.reaper.wait(KILL_S) == 0, watch.reaper.stderr.read()


def test_alive_and_kill_all(spawn):
    assert alive(os.getpid())
    child = spawn("sleep", "60")
    assert alive(child.pid)
    started = time.monotonic()
    kill_all([child.pid], grace=5)
    assert time.monotonic() - started < 5  # SIGTERM was enough: no wait for the grace period
    assert not alive(child.pid)  # a zombie (not yet reaped by us) counts as dead
    assert child.wait(5) == -signal.SIGTERM


def test_a_zombie_reaped_while_it_is_looked_at_is_dead(spawn, monkeypatch):
    # its parent (a forkserver) reaps it between the probe signal and the read of its /proc entry
    child = spawn("true")
    while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    probe = os.kill

    def probe_then_reap(pid, sig):
        probe(pid, sig)
        child.wait(5)

    monkeypatch.setattr(os, "kill", probe_then_reap)
    assert not alive(child.pid)


def test_kill_all_escalates_to_sigkill(spawn):
    stubborn = spawn(sys.executable, "-c",
                     "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                     "print('ready', flush=True)\ntime.sleep(60)", stdout=subprocess.PIPE)
    assert stubborn.stdout.readline() == b"ready\n"
    kill_all([stubborn.pid], grace=0.3)
    assert stubborn.wait(5) == -signal.SIGKILL
