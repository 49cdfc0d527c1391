"""Resource faults end a run truthfully (issue 54, item 1): ``PSCLUSTER_HOME`` (the run store, the registry, the
checkpoints, the TensorBoard files) on a small real tmpfs that fills up, turns read-only or is emptied mid-run. The
run ends ``failed`` with a cause that names the path and the fault, ``run.wait()`` returns, ``cluster.stop()`` does
not raise, no step folder is left without its shards, and the checkpoint committed before the fault restores
where it is still there. Runs with ``make faults``."""

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import pscluster
from pscluster.errors import TrainingError
from pscluster.runtime import checkpoint

from ..disks import fill, mounted

LOSS = torch.nn.CrossEntropyLoss()


def mlp():  # 70 k parameters: its Adam checkpoint is under 1 MB
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


@pytest.fixture
def small_home(tmp_path, monkeypatch):
    """PSCLUSTER_HOME on a 24 MB tmpfs, and its folder ``checkpoints`` bind-mounted on ``tmp_path/checkpoints``
    (a file system cannot turn read-only while a file is open on it for writing, as the run store is: its
    checkpoints' can, between two writes); unmounted at teardown."""
    with mounted(tmp_path / "home", size="24m") as home:
        (home / "checkpoints").mkdir()
        with mounted(tmp_path / "checkpoints", bind=home / "checkpoints"):
            monkeypatch.setenv("PSCLUSTER_HOME", str(home))
            yield home


def read_only(home) -> None:
    """The checkpoints' file system turned read-only (tried again while a shard's write holds it busy)."""
    deadline = time.monotonic() + 30
    while subprocess.run(["mount", "-o", "remount,bind,ro", str(home.parent / "checkpoints")]).returncode != 0:
        assert time.monotonic() < deadline, "the checkpoints' bind mount stayed busy"
        time.sleep(0.01)


def removed(disk) -> None:
    for entry in disk.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


# the fault, and the words one of which the run's cause must hold; the checkpoints committed before it restore
# where they are still there
FAULTS = {"full": (fill, ("No space left on device", "SQLITE_FULL")),
          "read-only": (read_only, ("Read-only file system", "SQLITE_READONLY")),
          "removed": (removed, ("was removed while it trained", "it was removed while the run trained"))}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_home_that_fails_mid_run_ends_the_run_failed_naming_the_path(small_home, fault):
    make_fault, words = FAULTS[fault]
    cluster = pscluster.Cluster(ps=1, workers=2).start()
    try:
        run = cluster.train(mlp, pscluster.datasets.digits("train"), LOSS, optimizer="adam", lr=0.01, mode="async",
                            steps=10**6, batch_size=32, checkpoint_every=20, checkpoint_secs=None,
                            keep_checkpoints=2, checkpoint_dir=small_home.parent / "checkpoints" / "run")
        deadline = time.monotonic() + 120
        while run.latest_checkpoint_step() is None:
            assert time.monotonic() < deadline and not run.done, run.error
            time.sleep(0.1)
        make_fault(small_home)
        with pytest.raises(TrainingError) as failed:
            run.wait(timeout=60, verbose=False)
        cause = str(failed.value).splitlines()[0]
        assert run.status == "failed"
        assert str(small_home.parent) in cause and any(word in cause for word in words), cause
    finally:
        cluster.stop()  # never raises for the fault
    directory = Path(run.plan.checkpoint_dir)
    if fault == "removed":
        return
    empty = [d.name for d in directory.iterdir() if d.is_dir() and not any(d.iterdir())]
    assert not empty, f"step folders left without their shards: {empty}"
    restored = checkpoint.latest(directory)
    assert restored is not None and set(restored.state_dict()) == set(mlp().state_dict())
