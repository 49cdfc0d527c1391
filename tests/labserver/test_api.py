"""The read endpoints over a real SQLite run store, and what they answer when it is missing,
locked or broken; authentication of every route."""

import os
import sqlite3

import pytest

from pscluster.cluster import registry
from pscluster.labserver.service import SPARK_POINTS
from pscluster.metrics.store import RunStore

ROUTES = [("GET", ("clusters",)), ("POST", ("clusters", "c", "stop")),
          ("POST", ("clusters", "c", "tasks", "worker", "1", "kill")),
          ("POST", ("clusters", "c", "tasks", "worker", "1", "restart")),
          ("GET", ("runs",)), ("GET", ("runs", "1", "metrics")), ("POST", ("runs", "1", "stop"))]


def steps(worker: int, first: int, last: int, t0: float = 1000.0) -> list[dict]:
    """Step events of one worker: global step == local step, one step per 0.1 s, falling loss."""
    return [{"kind": "step", "task": f"worker:{worker}", "time": t0 + 0.1 * s, "local_step": s,
             "global_step": s, "loss": 2.0 / (1 + s)} for s in range(first, last + 1)]


def new_run(store: RunStore, cluster: str = "gone-cluster", steps_target: int = 500) -> int:
    return store.create_run(name=None, cluster=cluster, mode="sync", config={"steps": steps_target}, spec={})


@pytest.mark.parametrize("method,path", ROUTES)
@pytest.mark.parametrize("token", ["", "token wrong"])
async def test_every_route_refuses_a_request_without_the_token(api, home, method, path, token):
    status, _ = await api(method, *path, headers={"Authorization": token})
    assert status == 403
    status, body = await api(method, *path)  # the route exists: with the token, our JSON answers
    assert isinstance(body, dict) and status != 403, (status, body)


async def test_nothing_yet_is_an_empty_list_with_a_message(api, home):
    assert await api("GET", "clusters") == (200, {"clusters": [], "skipped": []})
    status, body = await api("GET", "runs")
    assert status == 200 and body["runs"] == []
    assert "No run store yet" in body["message"] and str(home) in body["message"]
    status, body = await api("GET", "runs", "1", "metrics")
    assert status == 404 and "no run store yet" in body["error"]


async def test_runs_newest_first_with_step_speed_loss_and_sparkline(api, home):
    with RunStore() as store:
        done = new_run(store)
        store.add_batch(done, steps(0, 1, 200) + steps(1, 1, 200))
        store.set_status(done, "finished")
        lost = new_run(store)
        store.add_batch(lost, steps(0, 1, 10))
        store.set_status(lost, "training")
    status, body = await api("GET", "runs")
    assert status == 200 and body["message"] is None
    assert [r["id"] for r in body["runs"]] == [lost, done]
    second, first = body["runs"]
    assert first["status"] == "finished" and first["global_step"] == 200 and first["steps"] == 500
    assert first["steps_per_s"] == pytest.approx(10.0)
    assert first["loss"] == pytest.approx(2.0 / 201)
    assert len(first["sparkline"]) == SPARK_POINTS and first["sparkline"][0] > first["sparkline"][-1]
    # training, but its cluster is in no registry: nobody will finish it
    assert second["status"] == "lost" and second["global_step"] == 10


async def test_hundreds_of_runs(api, home):
    with RunStore() as store:
        for i in range(300):
            run = new_run(store)
            store.add_batch(run, steps(0, 1, 5 + i % 7))
            store.set_status(run, "finished")
    status, body = await api("GET", "runs")
    assert status == 200 and len(body["runs"]) == 300
    assert {r["global_step"] for r in body["runs"]} == set(range(5, 12))


async def test_metrics_from_a_cursor(api, home):
    with RunStore() as store:
        run = new_run(store)
        store.add_batch(run, steps(0, 1, 5) + steps(1, 1, 3))
        status, body = await api("GET", "runs", str(run), "metrics", after="0")
        assert status == 200 and not body["more"]
        assert sorted(zip(body["worker"], body["local_step"])) == [(0, s) for s in range(1, 6)] + [
            (1, s) for s in range(1, 4)]
        cursor = body["cursor"]
        store.add_batch(run, steps(1, 4, 6))
    status, body = await api("GET", "runs", str(run), "metrics", after=str(cursor))
    assert (body["worker"], body["local_step"]) == ([1, 1, 1], [4, 5, 6])
    assert body["run"]["id"] == run and body["cursor"] > cursor
    status, same = await api("GET", "runs", str(run), "metrics", after=str(body["cursor"]))
    assert same["worker"] == [] and same["cursor"] == body["cursor"]


async def test_runs_of_the_stores_of_running_clusters_too_each_store_once(api, home):
    default, own = home / "runs.sqlite", home / "elsewhere" / "own.sqlite"
    with RunStore() as store:
        new_run(store, cluster="a")
    with RunStore(own) as store:
        store.add_batch(new_run(store, cluster="b"), steps(0, 1, 3))
    (home / "link").symlink_to(home / "elsewhere")
    for name, path in (("a", default), ("b", own), ("b2", home / "link" / "own.sqlite")):
        registry.write({"name": name, "owner_pid": os.getpid(), "store": str(path), "tasks": []})
    status, body = await api("GET", "runs")
    assert status == 200
    assert [(r["id"], r["store"], r["cluster"]) for r in body["runs"]] == [(1, str(own), "b"), (1, str(default), "a")]
    status, body = await api("GET", "runs", "1", "metrics", store=str(own))
    assert status == 200 and body["run"]["cluster"] == "b" and body["local_step"] == [1, 2, 3]
    status, body = await api("GET", "runs", "1", "metrics")  # no store: the default one
    assert status == 200 and body["run"]["cluster"] == "a" and body["local_step"] == []
    status, body = await api("GET", "runs", "1", "metrics", store=str(home / "other.sqlite"))
    assert status == 404 and "neither the default run store nor the store of a running cluster" in body["error"]
    status, body = await api("POST", "runs", "1", "stop", store=str(home / "other.sqlite"))
    assert status == 404


async def test_unknown_run_and_bad_cursor(api, home):
    with RunStore() as store:
        run = new_run(store)
    status, body = await api("GET", "runs", str(run + 1), "metrics")
    assert status == 404 and f"no run {run + 1}" in body["error"]
    status, body = await api("GET", "runs", str(run), "metrics", after="-3")
    assert status == 400 and "cursor" in body["error"]
    status, body = await api("POST", "runs", str(run + 1), "stop")
    assert status == 404


async def test_a_locked_store_answers_503_then_recovers(api, home):
    with RunStore() as store:
        new_run(store)
    locker = sqlite3.connect(home / "runs.sqlite")
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")
    status, body = await api("GET", "runs")
    assert status == 503 and "locked by another process" in body["error"]
    locker.rollback()
    locker.close()
    status, body = await api("GET", "runs")
    assert status == 200 and len(body["runs"]) == 1


async def test_a_file_that_is_no_store_answers_503(api, home):
    (home / "runs.sqlite").write_bytes(b"not a database, " * 100)
    status, body = await api("GET", "runs")
    assert status == 503 and "cannot be read" in body["error"] and "move it away" in body["error"]


async def test_entries_of_dead_kernels_and_broken_files_are_skipped(api, home, dead_pid):
    registry.write({"name": "orphan", "owner_pid": dead_pid, "tasks": []})
    (home / "clusters" / "broken.json").write_text("{")
    status, body = await api("GET", "clusters")
    assert status == 200 and body["clusters"] == []
    reasons = {s["name"]: s["reason"] for s in body["skipped"]}
    assert f"pid {dead_pid}" in reasons["orphan"] and "delete broken.json" in reasons["broken"]
    status, body = await api("POST", "clusters", "orphan", "stop")
    assert status == 409 and "stopped" in body["error"]
    status, body = await api("POST", "clusters", "never-was", "stop")
    assert status == 404 and "no running cluster never-was" in body["error"]
