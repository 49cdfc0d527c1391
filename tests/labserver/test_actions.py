"""Actions on a real cluster of ipyparallel engines, started in this process before the server:
the server finds it in the registry and asks its owner (this process) through the control socket."""

import time

import pytest
import torch

import pscluster
from pscluster.metrics.store import RunStore

pytestmark = pytest.mark.integration


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PSCLUSTER_HOME", str(tmp_path_factory.mktemp("home")))
        cluster = pscluster.Cluster(ps=1, workers=2).start()
        try:
            yield cluster
        finally:
            cluster.stop()


async def eventually(check, timeout: float = 30.0):
    """Call the coroutine ``check`` until it returns something true; returns that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        await pytest.importorskip("asyncio").sleep(0.2)
    raise AssertionError(f"still false after {timeout:.0f}s")


async def test_a_server_started_after_the_cluster_lists_it_with_its_roles(api, cluster):
    status, body = await api("GET", "clusters")
    assert status == 200
    (listed,) = body["clusters"]
    assert listed["name"] == cluster.name and listed["state"] == "running"
    assert [(t["role"], t["task"], t["state"]) for t in listed["tasks"]] == [
        ("ps", 0, "running"), ("chief", 0, "running"), ("worker", 1, "running")]
    assert listed["hosts"] == ["127.0.0.1"] and listed["devices"] == ["cpu"]
    assert {t["pid"] for t in listed["tasks"]} == {r["pid"] for r in cluster.roles()}


async def test_stop_a_run_from_the_server(api, cluster):
    run = cluster.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), steps=100_000,
                        lr=0.1, log_every=10_000)

    async def training():
        status, body = await api("GET", "runs", str(run.id), "metrics")
        return body["run"]["global_step"] > 5 and body

    body = await eventually(training)
    assert body["run"]["status"] == "training" and body["run"]["steps"] == 100_000
    assert await api("POST", "runs", str(run.id), "stop") == (
        200, {"action": "stop_run", "target": str(run.id), "state": "stopping"})

    async def stopped():
        status, body = await api("GET", "runs")
        return body["runs"][0]["status"] == "stopped"

    await eventually(stopped)
    assert run.status == "stopped"  # the notebook's own Run object saw it
    status, body = await api("POST", "runs", str(run.id), "stop")
    assert status == 409 and "already ended (stopped)" in body["error"]


async def test_task_actions_and_their_errors(api, cluster):
    status, body = await api("POST", "clusters", cluster.name, "tasks", "worker", "7", "kill")
    assert status == 404 and "worker 1" in body["error"]
    status, body = await api("POST", "clusters", cluster.name, "tasks", "worker", "1", "restart")
    assert status == 501 and "stop the cluster" in body["error"]
    status, body = await api("POST", "clusters", cluster.name, "tasks", "worker", "1", "kill")
    assert status == 200 and body["state"] == "killed"

    async def dead():
        status, body = await api("GET", "clusters")
        return [t["state"] for t in body["clusters"][0]["tasks"]] == ["running", "running", "dead"]

    await eventually(dead)
    status, body = await api("POST", "clusters", cluster.name, "tasks", "worker", "1", "kill")
    assert status == 409 and "already dead" in body["error"]


async def test_stop_the_cluster_from_the_server(api, cluster):
    assert await api("POST", "clusters", cluster.name, "stop") == (
        200, {"action": "stop_cluster", "target": cluster.name, "state": "stopping"})

    async def gone():
        status, body = await api("GET", "clusters")
        return body["clusters"] == []

    await eventually(gone)
    assert not cluster.running and not cluster.pids
    status, body = await api("POST", "clusters", cluster.name, "stop")
    assert status == 409 and f"cluster {cluster.name} is stopped" in body["error"]
    with RunStore() as store:
        assert set(store.runs()["cluster"]) == {cluster.name}
