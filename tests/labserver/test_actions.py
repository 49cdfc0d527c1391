"""Actions on a real cluster of ipyparallel engines, started in this process before the server:
the server finds it in the registry and asks its owner (this process) through the control socket."""

import asyncio
import inspect
import time

import pytest
import torch

import pscluster
from pscluster.cluster.reaper import alive
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


def digits_run(cluster, steps: int):
    return cluster.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), steps=steps,
                         lr=0.1, log_every=100_000)


async def eventually(check, timeout: float = 30.0):
    """Call ``check`` (a function or a coroutine function) until it returns something true; returns that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        await asyncio.sleep(0.2)
    raise AssertionError(f"still false after {timeout:.0f}s")


async def listed_task(api, role: str, index: int) -> dict:
    """Task ``role`` ``index`` of the only cluster, as GET clusters lists it."""
    status, body = await api("GET", "clusters")
    return next(t for t in body["clusters"][0]["tasks"] if (t["role"], t["task"]) == (role, index))


async def restart(api, cluster, role: str, index: int) -> dict:
    """Restart a task through the API; returns it as listed once it runs on a new engine."""
    old = (await listed_task(api, role, index))["pid"]
    assert await api("POST", "clusters", cluster.name, "tasks", role, str(index), "restart") == (
        200, {"action": "restart_task", "target": f"{cluster.name}/{role}/{index}", "state": "restarting"})

    async def on_a_new_engine():
        task = await listed_task(api, role, index)
        return task["pid"] != old and task["state"] == "running" and task

    return await eventually(on_a_new_engine, 90)


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
    run = digits_run(cluster, 10**6)

    async def training():
        status, body = await api("GET", "runs", str(run.id), "series")
        return body["run"]["global_step"] > 5 and body

    body = await eventually(training)
    assert body["run"]["status"] == "training" and body["run"]["steps"] == 10**6
    assert await api("POST", "runs", str(run.id), "stop") == (
        200, {"action": "stop_run", "target": str(run.id), "state": "stopping"})

    async def stopped():
        status, body = await api("GET", "runs")
        return body["runs"][0]["status"] == "stopped"

    await eventually(stopped)
    assert run.status == "stopped"  # the notebook's own Run object saw it
    status, body = await api("POST", "runs", str(run.id), "stop")
    assert status == 409 and "already ended (stopped)" in body["error"]


async def test_restart_a_worker_during_a_run_replaces_it_through_the_runs_recovery(api, cluster):
    run = digits_run(cluster, 10**6)
    try:
        await eventually(lambda: run.global_step > 5)
        new = await restart(api, cluster, "worker", 1)
        assert cluster.roles()[2]["pid"] == new["pid"]

        def replaced_event():  # the listing may show the new engine a moment before the run notes it
            return set(run.events().query("task == 'worker:1'")["kind"]) >= {"lost", "replaced"}

        await eventually(replaced_event, 30)
        events = run.events()
        replaced = events[(events["kind"] == "replaced") & (events["task"] == "worker:1")]
        assert list(replaced["detail"].map(lambda d: d["pid"]))[-1] == new["pid"]
        replaced_at = replaced["time"].max()

        def rejoined():  # the new engine trains: worker 1 reports steps again
            m = run.metrics()
            return ((m["worker"] == 1) & (m["time"] > replaced_at)).sum() >= 3

        await eventually(rejoined, 60)
    finally:  # the module's later tests need the cluster without a run
        run.stop()
    assert run.status == "stopped"


async def test_task_actions_and_their_errors(api, cluster):
    status, body = await api("POST", "clusters", cluster.name, "tasks", "worker", "7", "kill")
    assert status == 404 and "worker 1" in body["error"]
    status, body = await api("POST", "clusters", cluster.name, "tasks", "worker", "7", "restart")
    assert status == 404 and "worker 1" in body["error"]
    status, body = await api("POST", "clusters", cluster.name, "tasks", "worker", "1", "kill")
    assert status == 200 and body["state"] == "killed"

    async def dead():
        status, body = await api("GET", "clusters")
        return [t["state"] for t in body["clusters"][0]["tasks"]] == ["running", "running", "dead"]

    await eventually(dead)
    status, body = await api("POST", "clusters", cluster.name, "tasks", "worker", "1", "kill")
    assert status == 409 and "already dead" in body["error"]


async def test_restart_without_a_run_gives_new_engines_that_train(api, cluster):
    assert cluster.active_run is None
    dead_worker, live_ps = cluster.spec.task("worker", 1).pid, cluster.spec.task("ps", 0).pid
    worker, ps = await restart(api, cluster, "worker", 1), await restart(api, cluster, "ps", 0)
    assert [r["pid"] for r in cluster.roles()] == [ps["pid"], cluster.spec.task("worker", 0).pid, worker["pid"]]
    await eventually(lambda: not alive(live_ps))  # the old ps engine was killed
    assert dead_worker not in (ps["pid"], worker["pid"])
    run = digits_run(cluster, 30).wait(120, verbose=False)
    assert run.status == "finished" and run.global_step == 30 and min(run.local_steps) > 0


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
