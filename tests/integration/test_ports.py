"""The ports in docs/examples: each plain script is run as it is written, then its port under ``pscluster launch``.
A port changes a handful of lines; on one sync worker it is the plain script to the bit; on two workers, sync and
async, it trains its epochs to the end."""

import difflib
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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
    # one torch thread a process, as torchrun sets it: three processes of a launch with two threads each on two
    # cores spin in each other's way (a language model's epoch of 0.1 s took 8 s)
    env.update(PSCLUSTER_HOME=str(cwd / "home"), OMP_NUM_THREADS="1")
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def plain_and_port(example: str, tmp_path: Path, *args: str) -> tuple[str, str]:
    """The outputs of the plain script and of its port on one sync worker, run at the same time, each in a folder
    of its own (``plain``, ``port``)."""
    with ThreadPoolExecutor(1) as pool:
        expected = pool.submit(run, [sys.executable, str(EXAMPLES / example / "plain.py"), *args], tmp_path / "plain")
        got = port(example, tmp_path / "port", *args)
        return expected.result(), got


def port(example: str, cwd: Path, *args: str, workers: int = 1, launch: tuple[str, ...] = ()) -> str:
    return run([sys.executable, "-m", "pscluster", "launch", "--ps", "1", "--workers", str(workers), *launch,
                str(EXAMPLES / example / "port.py"), *args], cwd)


def evaluations(output: str, task: str = "") -> list[str]:
    return re.findall(rf"{re.escape(task)}Test set: (.*)", output)


def same_state(a: Path, b: Path) -> bool:
    got, expected = torch.load(a), torch.load(b)
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def saved_whole(*paths: Path) -> bool:
    """Whether each file is a whole state_dict: two workers writing one file at once leave it torn."""
    return all(isinstance(torch.load(path), dict) for path in paths)


def test_the_mnist_port_changes_six_lines_and_one_sync_worker_is_the_plain_script(tmp_path):
    assert changed_lines("mnist") <= 6
    expected, got = plain_and_port("mnist", tmp_path, "--epochs", "2", "--save-model")
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
    assert saved_whole(tmp_path / "mnist_cnn.pt")


def dcgan_lines(output: str, task: str = "") -> list[str]:
    return re.findall(rf"^{re.escape(task)}(\[\d+/\d+\]\[\d+/\d+\] Loss_D: .*)$", output, re.M)


def test_the_dcgan_port_changes_six_lines_and_one_sync_worker_is_the_plain_script(tmp_path):
    assert changed_lines("dcgan") <= 6
    args = ("--niter", "2", "--batchSize", "128", "--manualSeed", "3")
    expected, got = plain_and_port("dcgan", tmp_path, *args)
    for saved in ("netG_epoch_0", "netD_epoch_0", "netG_epoch_1", "netD_epoch_1"):
        assert same_state(tmp_path / "port" / f"{saved}.pth", tmp_path / "plain" / f"{saved}.pth"), saved
    # both optimizers' steps, the shuffled order, the noise and BatchNorm's statistics as the plain script has them
    assert dcgan_lines(got, "[worker:0] ") == dcgan_lines(expected) and len(dcgan_lines(expected)) == 2 * 15
    assert "[worker:0] [1/2][14/15] Loss_D" in got


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_dcgan_port_trains_its_epochs_on_two_workers(tmp_path, mode):
    got = port("dcgan", tmp_path, "--niter", "1", "--batchSize", "256", "--manualSeed", "3", workers=2,
               launch=("--mode", mode))
    for task in ("[worker:0] ", "[worker:1] "):  # each worker its half of the epoch: 899 images, 4 batches
        assert [line[:10] for line in dcgan_lines(got, task)] == [f"[0/1][{i}/4]" for i in range(4)]
    assert saved_whole(tmp_path / "netG_epoch_0.pth", tmp_path / "netD_epoch_0.pth")


def lm_lines(output: str, task: str = "") -> list[str]:
    """The language model's printed lines, without their timings."""
    lines = re.findall(rf"^{re.escape(task)}(\| (?:epoch|end of epoch|End of training) .*)$", output, re.M)
    return [re.sub(r"(ms/batch|time:) *[\d.]+s?", r"\1", line) for line in lines]


def test_the_language_model_port_changes_eight_lines_and_one_sync_worker_is_the_plain_script(tmp_path):
    assert changed_lines("word_language_model") <= 8
    args = ("--epochs", "3", "--log-interval", "2")
    expected, got = plain_and_port("word_language_model", tmp_path, *args)
    assert same_state(tmp_path / "port" / "model.pt", tmp_path / "plain" / "model.pt")
    # the hidden state carried, clipping, dropout's draws and torch's SGD on the ps as the update written by hand
    assert lm_lines(got, "[worker:0] ") == lm_lines(expected) and len(lm_lines(expected)) == 3 * 5 + 1
    assert "| epoch   3 |     2/    8 batches | lr 5.00 |" in got  # annealed by hand after epoch 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_language_model_port_trains_its_epochs_on_two_workers(tmp_path, mode):
    got = port("word_language_model", tmp_path, "--epochs", "2", "--log-interval", "2", workers=2,
               launch=("--mode", mode))
    for task in ("[worker:0] ", "[worker:1] "):  # each worker its part of the 9 batches of an epoch: 5 of them
        lines = lm_lines(got, task)
        assert [re.match(r"\| epoch +(\d+) \| +(\d+)/", line).groups() for line in lines if "batches" in line] == \
            [("1", "2"), ("1", "4"), ("2", "2"), ("2", "4")]
        assert lines[-1].startswith("| End of training")
    assert saved_whole(tmp_path / "model.pt")
