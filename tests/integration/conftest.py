"""Integration tests run real ipyparallel engines; every cluster started here is stopped here."""

import time

import pytest
import torch

import pscluster
from pscluster.cluster.reaper import alive


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


@pytest.fixture(scope="module")
def start_cluster():
    """Factory: start a Cluster; all of them are stopped, and their processes checked dead, at the end of the
    module: no idle cluster of an earlier module runs beside the later ones."""
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


@pytest.fixture(scope="session")
def digits_test():
    return pscluster.datasets.digits("test")


@pytest.fixture
def own_cluster():
    """A cluster of its own for each test (it loses engines); stopped and checked dead afterwards."""
    made = []

    def start(**kwargs):
        made.append(pscluster.Cluster(**kwargs).start())
        return made[-1]

    yield start
    for c in made:
        pids = c.pids  # the replacement engines too
        c.stop()
        assert pids and not [p for p in pids if alive(p)], "cluster processes left running after stop()"


def wait_for_step(run, step, timeout=120):
    deadline = time.monotonic() + timeout
    while run.global_step < step:
        assert not run.done, f"the run ended at {run.global_step} before step {step}: {run.error}"
        assert time.monotonic() < deadline, f"global step {run.global_step} after {timeout}s"
        time.sleep(0.05)


def events(run, kind):
    e = run.store.events(run.id)
    return e[e["kind"] == kind]
