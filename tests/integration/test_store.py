"""The run store behind a real run: metrics, placement, events; readers never disturb the writer."""

import json
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone

import pytest
import torch

import pscluster
from pscluster.metrics.store import RunStore

from .conftest import mlp

pytestmark = pytest.mark.integration

READER = textwrap.dedent("""
    import os, sqlite3, sys, time
    path, stop = sys.argv[1], sys.argv[2]
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    queries = rows = 0
    while not os.path.exists(stop):
        rows = db.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
        db.execute("SELECT worker, MAX(global_step), AVG(loss) FROM metrics GROUP BY worker").fetchall()
        db.execute("SELECT * FROM runs ORDER BY id DESC").fetchall()
        queries += 3
    print(queries, rows)
""")


@pytest.fixture(scope="module")
def stored_cluster(start_cluster, tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "runs.sqlite"
    return start_cluster(ps=2, workers=2, store=path), path


def test_store_holds_metrics_placement_and_events_of_a_run(stored_cluster, digits_train, tmp_path):
    cluster, path = stored_cluster
    RunStore(path).close()  # the file exists before the reader starts
    stop = tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        run = cluster.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), lr=0.1, mode="sync", steps=600,
                            batch_size=32, name="stored-sync", test_dataset=pscluster.datasets.digits("test"),
                            eval_every=100).wait(verbose=False)  # long enough to evaluate on the way, under load too
    finally:
        stop.touch()
        queries, rows_seen = map(int, reader.communicate(timeout=30)[0].split())
    assert reader.returncode == 0 and queries > 30  # the reader ran all along, unblocked

    metrics = run.metrics()
    assert len(metrics) == sum(run.local_steps) == 1200  # no row lost to the concurrent reader
    for _, rows in metrics.groupby("worker"):
        assert list(rows["local_step"]) == list(range(1, 601))
        assert list(rows["global_step"]) == list(range(1, 601))  # sync, 2 replicas: one global step per step
        assert rows["loss"].notna().all() and (rows["compute_s"] > 0).all() and (rows["wait_s"] >= 0).all()
        assert (rows["bytes_sent"] > 0).all() and (rows["bytes_received"] > 0).all()
    assert sorted(metrics["worker"].unique()) == [0, 1]
    assert metrics["global_step"].max() == run.global_step

    store = RunStore(path, readonly=True)
    placement = store.placement(run.id)
    actual = {(name, s["ps"]) for s in run.ps_stats for name in s["variables"]}
    assert set(zip(placement["variable"], placement["ps"])) == actual
    assert set(placement["ps"]) == {0, 1}
    assert placement["bytes"].sum() == sum(p.numel() * 4 for p in mlp().parameters())

    events = store.events(run.id)
    kinds = list(events["kind"])
    assert kinds.count("start") == 1 and kinds[-1] == "end" and events["detail"].iloc[-1]["status"] == "finished"
    assert {"state", "done"} <= set(kinds)

    ps_rows = store.ps_metrics(run.id)
    assert set(ps_rows["ps"]) == {0, 1}
    assert ps_rows.groupby("ps")["applied"].max().tolist() == [600, 600]

    evaluations = run.evaluations()
    # exactly every 100 global steps (from the shards the ps tasks write there), the last one once
    assert evaluations["global_step"].tolist() == [100, 200, 300, 400, 500, 600]
    assert evaluations.equals(store.evaluations(run.id))
    final = run.evaluate(pscluster.datasets.digits("test"))
    assert evaluations["accuracy"].iloc[-1] == pytest.approx(final["accuracy"])

    record = store.run(run.id)
    assert record["name"] == "stored-sync" and record["status"] == "finished" and record["ended"] > record["started"]
    assert record["config"]["mode"] == "sync" and "secret" not in record["spec"]
    assert "def mlp" in record["code"]
    assert record["summary"]["global_step"] == 600


def test_runs_survive_the_process_that_trained_them(stored_cluster):
    _, path = stored_cluster
    code = f"import pscluster; print(pscluster.runs({str(path)!r}).to_json(orient='records', date_format='iso'))"
    listing = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    runs = json.loads(listing.stdout)
    assert [r["name"] for r in runs] == ["stored-sync"] and runs[0]["status"] == "finished"
    # its times as dates, not seconds since 1970
    started, ended = (datetime.fromisoformat(runs[0][k]) for k in ("started", "ended"))
    assert timedelta(0) < ended - started < timedelta(minutes=10) and datetime.now(timezone.utc) - ended < \
        timedelta(hours=1)
