"""The run store on a real SQLite file: schema, writes, reads, concurrent readers."""

import sqlite3
import threading
import time

import pytest

from pscluster.errors import ConfigError, RuntimeTimeout
from pscluster.metrics.divergence import Diverging
from pscluster.metrics.store import LEASE_S, MIGRATIONS, RunStore, default_path, placement_frame
from pscluster.runtime.plan import VariableSpec
from pscluster.stored_run import open_run
from pscluster.widgets.figures import placement_lines


@pytest.fixture
def store(tmp_path):
    with RunStore(tmp_path / "runs.sqlite") as s:
        yield s


def new_run(store, **kw) -> int:
    return store.create_run(name=kw.get("name"), cluster="c1", mode="sync", config={"steps": 10},
                            spec={"ps": [], "worker": []}, code="model = 1")


def step(worker, local, global_, t=1.0, **extra):
    return {"kind": "step", "task": f"worker:{worker}", "time": t, "local_step": local, "global_step": global_,
            "loss": 1.0 / local, **extra}


def open_at_once(path, n: int) -> tuple[list[int], list[Exception]]:
    """``n`` threads open the store at ``path`` at the same moment: the schema version each saw, the errors."""
    opened, errors, start = [], [], threading.Barrier(n)

    def open_store():
        start.wait()
        try:
            with RunStore(path) as store:
                opened.append(store.schema_version)
        except sqlite3.Error as e:
            errors.append(e)

    threads = [threading.Thread(target=open_store) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return opened, errors


def test_a_new_store_opened_by_several_at_once_is_created_once(tmp_path):
    # a script's chief creates the store while a notebook (or another task) opens it to read
    for trial in range(20):
        opened, errors = open_at_once(tmp_path / f"{trial}.sqlite", 6)
        assert not errors and opened == [len(MIGRATIONS)] * 6, errors


def test_schema_is_versioned_and_in_wal_mode(store):
    assert store.schema_version == len(MIGRATIONS)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    RunStore(store.path).close()  # opening again applies nothing twice
    assert store.schema_version == len(MIGRATIONS)


def test_default_path_follows_pscluster_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PSCLUSTER_HOME", str(tmp_path / "home"))
    assert default_path() == str(tmp_path / "home" / "runs.sqlite")
    with RunStore() as s:
        assert s.path == default_path()


def test_run_lifecycle_and_listing(store):
    first, second = new_run(store), new_run(store, name="named")
    assert second > first
    runs = store.runs()
    assert list(runs["id"]) == [second, first] and list(runs["name"]) == ["named", f"run-{first}"]
    assert set(runs["status"]) == {"starting"}
    store.set_status(first, "finished", {"global_step": 10})
    record = store.run(first)
    assert record["status"] == "finished" and record["ended"] >= record["started"]
    assert record["summary"] == {"global_step": 10} and record["config"] == {"steps": 10}
    assert store.run(12345) is None


def test_a_run_whose_owner_stops_renewing_its_lease_reads_failed_with_who_and_when(store, monkeypatch):
    held, ended, unleased = new_run(store), new_run(store), new_run(store)
    for run_id in (held, ended):
        store.renew_lease(run_id, "pid 1 on host-a")
    store.set_status(held, "training")
    store.set_status(ended, "finished")
    renewed = time.time()
    assert dict(zip(store.runs()["id"], store.runs()["status"])) == {
        held: "training", ended: "finished", unleased: "starting"}
    later = renewed + LEASE_S + 1  # no renewal since
    monkeypatch.setattr("pscluster.metrics.store.time.time", lambda: later)
    runs = store.runs().set_index("id")
    assert runs.loc[held, "status"] == "failed" and runs.loc[held, "ended"] <= renewed + LEASE_S + 0.5
    assert runs.loc[held, "owner"] == "pid 1 on host-a" and runs.loc[held, "wall_s"] < LEASE_S + 1
    assert runs.loc[ended, "status"] == "finished" and runs.loc[unleased, "status"] == "starting"
    record = store.run(held)
    assert record["status"] == "failed" and record["owner_lost"].startswith(
        "owner lost: pid 1 on host-a renewed its lease last at ")
    assert store.run(ended)["owner_lost"] is None and runs["owner_lost"].drop(held).isna().all()
    assert runs.loc[held, "owner_lost"] == record["owner_lost"] == runs.loc[held, "cause"]
    assert record["failure"] == {"cause": record["owner_lost"], "task": "controller", "step": None, "traceback": None}
    store.renew_lease(held, "pid 2 on host-b")  # a process that adopts the run holds it again
    assert store.run(held)["status"] == "training" and store.run(held)["owner"] == "pid 2 on host-b"


def test_a_failed_run_keeps_its_cause_task_step_and_traceback(store):
    failed, finished = new_run(store), new_run(store)
    failure = {"cause": "worker 0 failed: ValueError: bad: fix the cause and train again", "task": "worker:0",
               "step": 12, "traceback": "Traceback...\nValueError: bad"}
    store.set_status(failed, "training")
    store.set_status(failed, "failed", {"global_step": 12}, failure=failure)
    store.set_status(finished, "finished", {"global_step": 10})
    assert store.run(failed)["failure"] == failure and store.run(failed)["summary"] == {"global_step": 12}
    assert store.run(finished)["failure"] is None
    runs = store.runs().set_index("id")
    assert runs.loc[failed, "cause"] == failure["cause"] and runs.loc[finished, "cause"] is None
    assert "failure" not in runs.columns  # the whole of it (the traceback) is the run's record's


def test_a_store_older_than_failures_reads_none(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    for migration in MIGRATIONS[:6]:  # a store written before schema 7
        db.executescript(migration)
    db.execute("PRAGMA user_version = 6")
    db.execute("INSERT INTO runs (name, cluster, mode, status, started, ended, config, spec) "
               "VALUES ('old', 'c', 'sync', 'failed', 1.0, 2.0, '{}', '{}')")
    db.commit()
    db.close()
    with RunStore(path, readonly=True) as old:
        assert old.run(1)["failure"] is None and old.runs()["cause"].tolist() == [None]


def test_batches_are_routed_to_their_tables(store):
    run = new_run(store)
    store.add_batch(run, [
        step(0, 1, 1, staleness=0), step(1, 1, 2, t=1.1, staleness=1),
        {"kind": "ps", "task": "ps:1", "time": 1.2, "step": 2, "pushes": 2, "pulls": 2, "applied": 2,
         "dropped_stale": 0, "late": 0, "bytes_in": 100, "bytes_out": 200, "waiting_for": [0]},
        {"kind": "state", "task": "worker:1", "time": 1.3, "state": "training"},
        {"kind": "step", "task": "worker:x"},  # malformed: skipped
        {"kind": "step"},                      # malformed: skipped
    ])
    metrics = store.metrics(run)
    assert list(metrics["worker"]) == [0, 1] and list(metrics["global_step"]) == [1, 2]
    assert list(metrics["staleness"]) == [0, 1]
    first = store.metrics(run, after_row=0)
    assert first["worker"].tolist() == [0, 1] and "row" in first and "row" not in metrics
    store.add_batch(run, [step(0, 2, 3, t=1.0)])  # stored later, though reported earlier than worker 1's
    assert store.metrics(run, after_row=first["row"].max())["global_step"].tolist() == [3]
    assert store.metrics(run, after_row=store.metrics(run, after_row=0)["row"].max()).empty
    ps = store.ps_metrics(run)
    assert ps.iloc[0]["ps"] == 1 and ps.iloc[0]["waiting_for"] == [0] and ps.iloc[0]["bytes_out"] == 200
    events = store.events(run)
    assert events.iloc[0]["kind"] == "state" and events.iloc[0]["detail"] == {"state": "training"}
    assert store.epochs(run) == {}  # a loop without epochs
    store.add_batch(run, [{"kind": "epoch", "task": f"worker:{w}", "time": 2.0 + e, "epoch": e, "batches": 5,
                           "global_step": 5 * e} for e, w in ((1, 1), (1, 0), (2, 1), (3, 1))])
    assert store.epochs(run) == {0: 1, 1: 3}  # each worker's latest
    assert store.epochs(new_run(store)) == {}  # of its own run only
    assert store.divergence(run) is None and store.runs().set_index("id").loc[run, "diverging_since"] is None
    finding = {"since_step": 8, "loss": 950.0, "reference": 2.3, "threshold": 11.5}
    store.add_batch(run, [{"kind": "diverging", "task": "worker:0", "time": 3.0, **finding}])  # not the rule's
    assert store.divergence(run) is None
    store.add_event(run, "controller", "diverging", finding)  # the supervisor's
    assert store.divergence(run) == Diverging(**finding)
    assert store.runs().set_index("id")["diverging_since"].to_dict() == {run: 8, run + 1: None}


def test_placement_and_evaluations(store):
    run = new_run(store)
    store.record_placement(run, [VariableSpec(0, "fc.weight", (10, 4), "float32", 0),
                                 VariableSpec(1, "fc.bias", (10,), "float32", 1)])
    placement = store.placement(run)
    assert list(placement["variable"]) == ["fc.weight", "fc.bias"]
    assert list(placement["bytes"]) == [160, 40] and placement.iloc[0]["shape"] == (10, 4)
    store.add_evaluation(run, 20, 0.5, 0.9)
    store.add_evaluation(run, 10, 0.7, None)
    evals = store.evaluations(run)
    assert list(evals["global_step"]) == [10, 20] and evals.iloc[1]["accuracy"] == 0.9


def test_placement_of_shards_keeps_rows_part_sparse_and_kind(store):
    run = new_run(store)
    store.record_placement(run, [
        VariableSpec(0, "emb.weight/part_0", (3, 4), "float32", 0, variable="emb.weight", start=0, sparse=True),
        VariableSpec(1, "emb.weight/part_1", (2, 4), "float32", 1, variable="emb.weight", start=3, sparse=True),
        VariableSpec(2, "fc.bias", (10,), "float32", 1),
        VariableSpec(3, "bn.running_mean", (10,), "float32", 0, kind="buffer"),
        VariableSpec(4, "stem.weight", (10,), "float32", 1, kind="frozen")])
    placement = store.placement(run)
    assert list(placement.columns) == ["variable", "ps", "shape", "dtype", "bytes", "start", "stop", "part",
                                       "sparse", "kind"]
    assert list(placement["kind"]) == ["param", "param", "param", "buffer", "frozen"]
    assert placement_lines(placement)[3:] == ["bn.running_mean: /job:ps/task:0 (buffer)",
                                              "stem.weight: /job:ps/task:1 (frozen)"]
    placement = placement.iloc[:3]
    assert list(placement["start"]) == [0, 3, 0] and list(placement["stop"]) == [3, 5, 10]
    assert list(placement["part"].iloc[:2]) == [0, 1] and placement["part"].isna().tolist() == [False, False, True]
    assert list(placement["sparse"]) == [1, 1, 0] and list(placement["bytes"]) == [48, 32, 40]
    assert placement_frame([VariableSpec(2, "fc.bias", (10,), "float32", 1)]).iloc[0].tolist() \
        == placement.iloc[2].tolist()


def make_v1_store(path) -> None:
    """A run store as schema 1 wrote it: one run, two placement rows."""
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO runs (name, cluster, mode, status, started, config, spec) "
               "VALUES ('old', 'c', 'sync', 'finished', 1.0, '{}', '{}')")
    db.executemany("INSERT INTO placement VALUES (1, ?, ?, ?, 'float32', ?)",
                   [("fc.weight", 0, "[10, 4]", 160), ("fc.bias", 1, "[10]", 40)])
    db.commit()
    db.close()


def check_v1_rows(placement) -> None:
    assert list(placement["variable"]) == ["fc.weight", "fc.bias"] and list(placement["bytes"]) == [160, 40]
    assert list(placement["start"]) == [0, 0] and list(placement["stop"]) == [10, 10]
    assert placement["part"].isna().all() and list(placement["sparse"]) == [0, 0]


def test_a_schema_1_store_is_read_as_is_and_upgraded_keeping_its_rows(tmp_path):
    path = tmp_path / "old.sqlite"
    make_v1_store(path)
    with RunStore(path, readonly=True) as reader:  # a reader does not migrate, and still reads
        assert reader.schema_version == 1
        check_v1_rows(reader.placement(1))
        assert reader.epochs(1) == {} and reader.divergence(1) is None
        assert reader.runs()["diverging_since"].tolist() == [None]
    with RunStore(path) as upgraded:
        assert upgraded.schema_version == len(MIGRATIONS) >= 2
        assert upgraded.run(1)["name"] == "old"
        check_v1_rows(upgraded.placement(1))
        run = new_run(upgraded)
        upgraded.record_placement(run, [VariableSpec(0, "w/part_1", (2, 3), "float32", 1, variable="w", start=2)])
        row = upgraded.placement(run).iloc[0]
        assert (row["start"], row["stop"], row["part"], row["sparse"]) == (2, 4, 1, 0)


def test_readonly_reader_cannot_write_and_needs_the_file(store, tmp_path):
    new_run(store)
    with RunStore(store.path, readonly=True) as reader:
        assert len(reader.runs()) == 1
        with pytest.raises(sqlite3.OperationalError):
            reader._db.execute("DELETE FROM runs")
    with pytest.raises(FileNotFoundError, match="set PSCLUSTER_HOME"):
        RunStore(tmp_path / "missing.sqlite", readonly=True)


def test_a_reader_in_a_loop_never_makes_the_writer_fail(store):
    run = new_run(store)
    stop, reads, errors = threading.Event(), [0], []

    def read():
        with RunStore(store.path, readonly=True) as reader:
            while not stop.is_set():
                try:
                    reader.metrics(run)
                    reads[0] += 1
                except Exception as e:  # noqa: BLE001 - any reader failure is reported
                    errors.append(e)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for i in range(1, 301):
            store.add_batch(run, [step(0, i, i, t=float(i))])
    finally:
        stop.set()
        thread.join(10)
    assert not errors and reads[0] > 0
    assert len(store.metrics(run)) == 300


def test_open_run_finds_a_run_by_id_by_name_or_the_newest_and_names_the_fix_otherwise(store):
    first, second, third = new_run(store, name="estimator"), new_run(store, name="estimator"), new_run(store)
    store.add_batch(second, [step(0, 1, 1), step(1, 1, 1)])
    store.add_evaluation(second, 1, 0.5, 0.9)
    assert open_run(first, store=store).name == "estimator"
    by_name = open_run("estimator", store=store.path)  # its newest run of that name
    assert by_name.id == second and by_name.status == "starting" and by_name.summary() is None
    assert sorted(by_name.metrics()["worker"]) == [0, 1] and list(by_name.evaluations()["accuracy"]) == [0.9]
    assert open_run(store=store).id == third
    with pytest.raises(RuntimeTimeout, match="still starting"):
        by_name.wait(timeout=0.1)
    store.set_status(second, "finished", {"global_step": 1})
    assert by_name.wait(timeout=5).summary() == {"global_step": 1}
    with pytest.raises(ConfigError, match=r"^no run 'estimatr' in the run store .*\(its newest: run-3, estimator\): "
                                          r"see pscluster.runs\(\)$"):
        open_run("estimatr", store=store)
    with pytest.raises(ConfigError, match="give a run id, a run name or nothing"):
        open_run(2.5, store=store)
