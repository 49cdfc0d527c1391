"""The ports in docs/examples: each plain script is run as it is written, then its port under ``pscluster launch``.
A port changes a handful of lines; on one sync worker it is the plain script to the bit; on two workers, sync and
async, it trains its epochs to the end."""

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
RUN_S = 300


def changed_lines(example: str) -> int:
    """Lines of the port written anew or rewritten against the plain script."""
    plain, port = ((EXAMPLES / example / f"{name}.py").read_text().splitlines() for name in ("plain", "port"))
    return sum(line.startswith("+") and not line.startswith("+++")
               for line in difflib.unified_diff(plain, port, n=0, lineterm=""))


def run(args: list[str], cwd: Path) -> str:
    """Run a command in ``cwd`` with its own pscluster home; its output (stdout and stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PSCLUSTER_CONFIG", "TF_CONFIG")}
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(args, cwd=cwd, env={**env, "PSCLUSTER_HOME": str(cwd / "home")}, capture_output=True,
                          text=True, timeout=RUN_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def plain(example: str, cwd: Path, *args: str) -> str:
    return run([sys.executable, str(EXAMPLES / example / "plain.py"), *args], cwd)


def port(example: str, cwd: Path, *args: str, workers: int = 1, launch: tuple[str, ...] = ()) -> str:
    return run([sys.executable, "-m", "pscluster", "launch", "--ps", "1", "--workers", str(workers), *launch,
                str(EXAMPLES / example / "port.py"), *args], cwd)


def evaluations(output: str, task: str = "") -> list[str]:
    return re.findall(rf"{re.escape(task)}Test set: (.*)", output)


def same_state(a: Path, b: Path) -> bool:
    got, expected = torch.load(a), torch.load(b)
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_the_mnist_port_changes_six_lines_and_one_sync_worker_is_the_plain_script(tmp_path):
    assert changed_lines("mnist") <= 6
    expected = plain("mnist", tmp_path / "plain", "--epochs", "2", "--save-model")
    got = port("mnist", tmp_path / "port", "--epochs", "2", "--save-model")
    assert same_state(tmp_path / "port" / "mnist_cnn.pt", tmp_path / "plain" / "mnist_cnn.pt")
    assert evaluations(got, "[worker:0] ") == evaluations(expected) and len(evaluations(expected)) == 2
    # its epochs, len(train_loader) and len(train_loader.dataset) as the plain script has them
    assert "[worker:0] Train Epoch: 2 [1280/1437 (87%)]" in got


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_mnist_port_trains_its_epochs_on_two_workers(tmp_path, mode):
    got = port("mnist", tmp_path, "--epochs", "1", "--save-model", workers=2, launch=("--mode", mode))
    for task in ("[worker:0] ", "[worker:1] "):  # each worker its half of the epoch, and the test set after it
        assert len(evaluations(got, task)) == 1
        assert f"{task}Train Epoch: 1 [640/1437 (83%)]" in got
    assert (tmp_path / "mnist_cnn.pt").exists()
