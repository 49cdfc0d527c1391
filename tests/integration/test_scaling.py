"""Workers added and removed during a run (cluster.scale), and backup workers in sync mode, on real engines."""

import os
import time

import torch

from pscluster.cluster.reaper import alive

from .conftest import events, mlp, wait_for_step

SLOW_ENV = "PSCLUSTER_TEST_SLOW_S"


def slow_loss(output, target):
    """Cross-entropy; sleeps on an engine where SLOW_ENV is set (a straggler made on purpose)."""
    delay = float(os.environ.get(SLOW_ENV, 0))
    if delay:
        time.sleep(delay)
    return torch.nn.functional.cross_entropy(output, target)


def wait_for(predicate, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.1)


def accepted(metrics, worker: int) -> int:
    """How many of ``worker``'s gradients the ps applied (not dropped as stale)."""
    return int(((metrics["worker"] == worker) & ~metrics["dropped"].astype(bool)).sum())


def test_workers_added_during_a_sync_run_join_it_and_removed_ones_end(own_cluster, digits_train):
    c = own_cluster(ps=1, workers=2)
    run = c.train(mlp, digits_train, slow_loss, lr=0.1, mode="sync", steps=10**6, batch_size=32,
                  checkpoint_secs=None)
    wait_for_step(run, 50)
    request = c.scale(3)
    assert not request.done()  # returned at once: its engine starts in the background while the run trains
    assert request.wait(timeout=120) is c.spec
    assert len(c.spec.workers) == 3 and run.plan.num_workers == 3 and run.plan.replicas_to_aggregate == 3
    wait_for(lambda: accepted(run.metrics(), 2) >= 50, "the added worker trains")
    removed = [t.pid for t in c.spec.workers[1:]]
    c.scale(1).wait(timeout=120)
    assert [t.index for t in c.spec.workers] == [0] and run.plan.replicas_to_aggregate == 1
    assert not [p for p in removed if alive(p)] and not set(removed) & set(c.pids)
    shrunk_at = time.time()
    wait_for(lambda: run.metrics()["time"].max() > shrunk_at + 2, "the chief trains on alone")
    run.stop()
    assert run.status == "stopped" and run.error is None
    metrics = run.metrics()
    assert set(metrics[metrics["time"] > shrunk_at + 1]["worker"]) == {0}
    # while three trained, each sync step aggregated three gradients: one global step per local step of each.
    # Joining, the added worker's gradients may be of a step the other two already completed (dropped), until one
    # arrives in time; its last step ends at the shrink, after the chief's steps alone.
    added = metrics[metrics["worker"] == 2].reset_index(drop=True)
    joined = added.index[~added["dropped"].astype(bool)][0]
    member = added.iloc[joined:-1]
    assert not member["dropped"].astype(bool).any()
    assert (member["global_step"].diff().dropna() == 1).all() and len(member) >= 49
    assert [d["workers"] for d in events(run, "scaled")["detail"]] == [3, 1]
    assert len(run.results) == 3  # the removed workers' summaries are kept
    assert c.num_workers == 1 and len(run.store.run(run.id)["spec"]["worker"]) == 1


def test_a_scale_that_outlasts_its_run_changes_the_cluster_and_records_nothing_for_the_run(own_cluster,
                                                                                          digits_train):
    c = own_cluster(ps=1, workers=2, spares=0)  # no engine ready for the new worker
    run = c.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), lr=0.1, mode="async", steps=10**6, batch_size=32,
                  checkpoint_secs=None)
    wait_for_step(run, 50)
    request = c.scale(3)
    run.stop()  # a moment, where the new engine takes a second or more to start
    assert request.wait(timeout=120) is c.spec and len(c.spec.workers) == 3 and c.num_workers == 3
    assert run.status == "stopped"
    assert events(run, "scaled").empty and events(run, "end")["time"].max() == run.store.events(run.id)["time"].max()
    assert run.summary()["workers"] == len(run.local_steps) == 2
    after = c.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), lr=0.1, mode="async", steps=300, batch_size=32,
                    checkpoint_secs=None).wait(timeout=120, verbose=False)
    assert len(after.local_steps) == 3  # the next run has the new worker


def test_backup_workers_let_sync_steps_go_on_without_the_straggler(own_cluster, digits_train):
    c = own_cluster(ps=1, workers=2)
    c.scale(3).wait(timeout=120)  # between runs: one more engine
    assert [t.index for t in c.spec.workers] == [0, 1, 2] and len(set(t.pid for t in c.spec.workers)) == 3
    straggler = c._engines.view(c.spec.workers[2].engine_id)
    straggler.execute(f"import os; os.environ[{SLOW_ENV!r}] = '0.3'", block=True)
    run = c.train(mlp, digits_train, slow_loss, lr=0.1, mode="sync", steps=150, batch_size=32,
                  replicas_to_aggregate=2, checkpoint_secs=None).wait(timeout=180, verbose=False)
    assert run.global_step == 150
    local = dict(zip(range(3), run.local_steps))
    # every step took the first two gradients: the straggler's came late, were dropped, and held nobody up
    assert local[2] < 150 / 3 and min(local[0], local[1]) > 150 / 2
    # each gradient beyond the first two of a step was dropped as stale, or came after the end (the straggler
    # may start so late under load that the others finish first)
    summary = run.summary()
    assert summary["dropped_stale"] + summary["late"] >= min(local[2], 1)
