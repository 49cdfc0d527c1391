"""Resource faults end a run truthfully (issue 54, item 1): ``PSCLUSTER_HOME`` (the run store, the registry, the
checkpoints, the TensorBoard files) on a small real tmpfs that fills up mid-run. The run ends ``failed`` with a
cause that names the path and the fault, ``run.wait()`` returns, ``cluster.stop()`` does not raise, no step folder
is left without its shards, and the checkpoint committed before the fault restores. Runs with ``make faults``."""

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

import pscluster
from pscluster.errors import TrainingError
from pscluster.runtime import checkpoint

LOSS = torch.nn.CrossEntropyLoss()


def mlp():  # 70 k parameters: its Adam checkpoint is under 1 MB
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


@pytest.fixture
def small_home(tmp_path, monkeypatch):
    """PSCLUSTER_HOME on a 24 MB tmpfs, unmounted at teardown."""
    disk = tmp_path / "home"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)], check=True)
    monkeypatch.setenv("PSCLUSTER_HOME", str(disk))
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk) -> None:
    with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * (1 << 20))
            f.flush()


def test_a_home_that_fills_up_ends_the_run_failed_naming_the_path(small_home):
    cluster = pscluster.Cluster(ps=1, workers=2).start()
    try:
        run = cluster.train(mlp, pscluster.datasets.digits("train"), LOSS, optimizer="adam", lr=0.01, mode="async",
                            steps=10**6, batch_size=32, checkpoint_every=20, checkpoint_secs=None,
                            keep_checkpoints=2)
        deadline = time.monotonic() + 120
        while run.latest_checkpoint_step() is None:
            assert time.monotonic() < deadline and not run.done, run.error
            time.sleep(0.1)
        fill(small_home)
        with pytest.raises(TrainingError) as failed:
            run.wait(timeout=60, verbose=False)
        cause = str(failed.value).splitlines()[0]
        assert run.status == "failed"
        assert str(small_home) in cause and ("ENOSPC" in cause or "SQLITE_FULL" in cause), cause
    finally:
        cluster.stop()  # never raises for a full disk
    directory = Path(run.plan.checkpoint_dir)
    empty = [d.name for d in directory.iterdir() if d.is_dir() and not any(d.iterdir())]
    assert not empty, f"step folders left without their shards: {empty}"
    os.unlink(small_home / "filler")
    restored = checkpoint.latest(directory)
    assert restored is not None and set(restored.state_dict()) == set(mlp().state_dict())
