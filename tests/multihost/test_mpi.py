"""The MPI launcher on this machine (Open MPI's mpiexec starts the engines). (Slurm: test_slurm.)"""

import os
import shutil
import signal
import time

import pytest
import torch

import pscluster
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

