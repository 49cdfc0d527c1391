"""The MPI launcher on this machine (Open MPI's mpiexec starts the engines), and the Slurm launcher as far as
the batch script it submits (no slurmctld here)."""

import os
import shutil
import signal
import time

import pytest
import torch
from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

import pscluster
from pscluster.cluster.launchers import Launcher
from pscluster.cluster.reaper import alive

MPI_ARGS = ["--allow-run-as-root", "--oversubscribe"]  # root in CI; 3 engines on 2 cores


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec is missing: make multihost-deps installs "
                                                           "openmpi-bin")
def test_mpi_engines_train_and_end_themselves_when_the_controller_dies():
    cluster = pscluster.Cluster(ps=1, workers=2, launcher="mpi", mpi_args=MPI_ARGS).start()
    engine_pids = [t.pid for t in (*cluster.spec.ps, *cluster.spec.workers)]
    try:
        assert {t.host for t in (*cluster.spec.ps, *cluster.spec.workers)} == {"127.0.0.1"}  # no interface given
        run = cluster.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), lr=0.1,
                            steps=30, batch_size=32, checkpoint_secs=None).wait(verbose=False)
        assert run.global_step == 30 and run.local_steps is not None and sum(run.local_steps) == 60
        # the controller goes away without stopping anything (as when the reaper kills it and its schedulers after
        # its kernel died): the engines notice they cannot reach it any more and end
        for pid in cluster.pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while [p for p in engine_pids if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [p for p in engine_pids if alive(p)] == []
    finally:
        pids = cluster.pids
        cluster.stop()
        assert [p for p in pids + engine_pids if alive(p)] == []


def test_slurm_batch_script_carries_partition_account_time_and_extra_options(tmp_path):
    launcher = Launcher("slurm", partition="gpu", account="proj42", time_limit="01:30:00", qos="normal",
                        sbatch_args=("--nodes=2", "--gres=gpu:4"))
    engines = SlurmEngineSetLauncher(work_dir=str(tmp_path), profile_dir=str(tmp_path), cluster_id="c1",
                                     **launcher.engine_options())
    engines.write_batch_script(5)
    script = (tmp_path / engines.batch_file_name).read_text()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj42", "#SBATCH --time=01:30:00",
                 "#SBATCH --qos=normal", "#SBATCH --nodes=2", "#SBATCH --gres=gpu:4", "#SBATCH --ntasks=5"):
        assert line in script.splitlines(), f"{line!r} missing from\n{script}"
    assert "srun" in script and "ipyparallel.engine" in script
