"""The zygote the tiny benchmark run forks its children from (``benchmarks/zygote.py``): a forked child runs its
module as ``python -m`` would, with its own arguments, folder, environment, torch threads and streams, and its
handle answers as ``subprocess.Popen``'s does."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from benchmarks.procs import ROOT, child_env
from benchmarks.zygote import Zygote

CHILD = [sys.executable, "-m", "tests.bench.forked_child"]


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(child_env(1), str(ROOT))
    yield z
    z.close()


def test_a_forked_child_runs_its_module_as_python_m_would(zygote, tmp_path):
    errors = (tmp_path / "stderr").open("w+")
    child = zygote.popen([*CHILD, "3"], cwd=str(tmp_path), env=child_env(2, MARK="x"), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=errors)
    started = json.loads(child.stdout.readline())
    assert started["name"] == "__main__" and started["argv"][1:] == ["3"]
    assert started["argv"][0].endswith("forked_child.py") and started["cwd"] == str(tmp_path)
    assert started["mark"] == "x" and started["threads"] == 2
    child.stdin.write("hello\n")
    child.stdin.flush()
    assert child.stdout.readline() == "HELLO\n"
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    child.stdin.close()
    assert child.wait(60) == 3 and child.returncode == 3
    errors.seek(0)
    assert errors.read() == "goodbye\n"


def test_communicate_and_an_exception_that_ends_a_child(zygote, tmp_path):
    errors = (tmp_path / "stderr").open("w+")
    child = zygote.popen([*CHILD, "raise"], cwd=str(ROOT), env=child_env(1), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=errors)
    out, _ = child.communicate(timeout=60)
    assert json.loads(out.splitlines()[0])["threads"] == 1
    assert child.returncode == 1
    errors.seek(0)
    assert "RuntimeError: the child broke" in errors.read()


def test_a_killed_child(zygote):
    child = zygote.popen([*CHILD, "0"], cwd=str(ROOT), env=child_env(1), stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL)
    child.kill()
    assert child.wait(60) == -signal.SIGKILL
    child.kill()  # ended already: nothing to do
