"""Integration tests run real ipyparallel engines; every cluster started here is stopped here."""

import pytest
import torch

import pscluster
from pscluster.cluster.reaper import alive


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


@pytest.fixture(scope="session")
def start_cluster():
    """Factory: start a Cluster; all of them are stopped, and their processes checked dead, at the end."""
    started = []

    def start(**kwargs) -> pscluster.Cluster:
        cluster = pscluster.Cluster(**kwargs)
        started.append(cluster)
        return cluster.start()

    yield start
    pids = [p for c in started for p in c.pids]
    for c in started:
        c.stop()
    assert not [p for p in pids if alive(p)], "cluster processes left running after stop()"


@pytest.fixture(scope="module")
def cluster_1ps_2w(start_cluster):
    return start_cluster(ps=1, workers=2)


@pytest.fixture(scope="session")
def digits_train():
    return pscluster.datasets.digits("train")
