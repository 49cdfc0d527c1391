"""Sync and async semantics on real engines (1 ps + 2 workers, and 2 ps tasks)."""

import os
import time

import pytest
import torch

import pscluster
from pscluster.errors import CheckpointError, ClusterStateError, ConfigError, TrainingError
from pscluster.runtime import checkpoint
from pscluster.runtime.options import DEFAULTS
from pscluster.runtime.policies import LEAD_SLACK

from .conftest import mlp

pytestmark = pytest.mark.integration
LOSS = torch.nn.CrossEntropyLoss()


def test_roles_table(cluster_1ps_2w):
    roles = cluster_1ps_2w.roles()
    assert [(r["role"], r["task"]) for r in roles] == [("ps", 0), ("chief", 0), ("worker", 1)]
    assert len({r["pid"] for r in roles}) == 3 and len({r["engine"] for r in roles}) == 3
    assert all(r["device"] == "cpu" for r in roles)  # no CUDA on this machine
    assert roles[0]["address"].startswith("tcp://127.0.0.1:")


def test_sync_global_step_is_local_steps_over_replicas(cluster_1ps_2w, digits_train):
    run = cluster_1ps_2w.train(mlp, digits_train, LOSS, optimizer="sgd", lr=0.1, mode="sync",
                               steps=120, batch_size=32, log_every=40).wait(verbose=False)
    s = run.summary()
    assert s["global_step"] == 120
    assert run.local_steps == [120, 120]  # each worker contributes once per global step
    assert s["dropped_stale"] == 0
    # steps/s over the whole run once it ended; each worker steps once per global step
    assert s["steps_per_s"] > 0 and s["steps_per_s"] == pytest.approx(s["worker_steps_per_s"][0], rel=0.1)
    assert set(s["worker_steps_per_s"]) == {0, 1}
    assert s["startup_s"] > 0 and 0 < s["training_s"] < s["wall_s"] - s["startup_s"]
    # one wall time: the summary's, the run store's (the dashboard's and the panel's), the one samples/s divides by
    record, listed = run.store.run(run.id), run.store.runs().set_index("id").loc[run.id]
    assert s["wall_s"] == pytest.approx(record["ended"] - record["started"], rel=1e-9)
    assert s["wall_s"] == pytest.approx(listed["wall_s"], rel=1e-9) == pytest.approx(run.wall_s, rel=1e-9)
    assert s["samples_per_sec"] == pytest.approx(sum(r["samples"] for r in run.results) / s["wall_s"])
    assert record["config"]["optimizer"] == "SGD"  # as torch spells it, whatever case it was given in
    assert len(run.logs) == 6 and run.logs[0].startswith("[worker:")
    assert "After 40 training steps (40 global steps), loss" in " ".join(run.logs)
    last = run.metrics().groupby("worker")["local_step"].max()
    assert list(last) == [120, 120]  # every worker's last metrics reached the store before the run ended


def test_sync_with_fewer_replicas_drops_and_counts_stale_gradients(cluster_1ps_2w, digits_train):
    run = cluster_1ps_2w.train(mlp, digits_train, LOSS, lr=0.1, mode="sync", steps=150, batch_size=32,
                               replicas_to_aggregate=1, shared_memory=False).wait(verbose=False)
    stats = run.ps_stats[0]
    assert stats["lanes"] == 0  # both workers over the socket, as asked
    # Every push was applied (one per global step), dropped as stale, or arrived after the target.
    assert sum(run.local_steps) == stats["pushes"]
    assert stats["applied"] == run.global_step == 150
    assert stats["pushes"] == stats["applied"] + stats["dropped_stale"] + stats["late"]
    assert stats["dropped_stale"] > 0  # two workers racing for the same step


def test_async_records_staleness_per_push(cluster_1ps_2w, digits_train):
    run = cluster_1ps_2w.train(mlp, digits_train, LOSS, optimizer=torch.optim.SGD, lr=0.05, mode="async",
                               steps=200, batch_size=32).wait(verbose=False)
    stats = run.ps_stats[0]
    hist = run.staleness()
    assert stats["lanes"] == 2  # both workers share the ps's host: each exchanged through shared memory
    assert run.global_step == 200
    assert sum(hist.values()) == stats["applied"] == 200
    assert stats["pushes"] == stats["applied"] + stats["late"]
    assert max(hist) >= 1  # the two workers interleave
    per_worker = sum(sum(r["staleness"].values()) for r in run.results)
    assert per_worker == stats["applied"]


def test_trained_model_evaluates_and_survives_cluster_state(cluster_1ps_2w, digits_train):
    run = cluster_1ps_2w.train(mlp, digits_train, LOSS, lr=0.1, mode="sync", steps=300,
                               batch_size=64).wait(verbose=False)
    result = run.evaluate(pscluster.datasets.digits("test"))
    assert result["accuracy"] > 0.85 and result["loss"] < 1.0
    assert set(run.state_dict()) == {n for n, _ in mlp().named_parameters()}


class FailsLater(torch.nn.Module):
    """A model whose fifth forward pass fails (on whichever process runs it)."""

    def __init__(self):
        super().__init__()
        self.fc, self.calls = torch.nn.Linear(64, 10), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 5:
            raise RuntimeError("CUDA out of memory (simulated)")
        return self.fc(x)


def test_a_worker_s_error_says_its_cause_first_and_the_cluster_stays_usable(cluster_1ps_2w, digits_train):
    def broken():
        return torch.nn.Sequential(torch.nn.Linear(63, 10))  # digits have 64 features

    with pytest.raises(ConfigError, match=r"the training step fails on a batch of the dataset \(tuple of 2\): "
                                          r"RuntimeError: mat1 and mat2 shapes cannot be multiplied"):
        cluster_1ps_2w.train(broken, digits_train, LOSS, steps=10)  # known at train(): refused there
    run = cluster_1ps_2w.train(FailsLater, digits_train, LOSS, steps=10)
    with pytest.raises(TrainingError) as err:
        run.wait(timeout=120, verbose=False)
    first, *frames = str(err.value).splitlines()  # the cause in one line, where it was, then the user's frames
    assert first.startswith("RuntimeError: CUDA out of memory (simulated) (at ") and "in FailsLater.forward)" in first
    assert any(line.endswith("in FailsLater.forward(self, x)") for line in frames)
    assert "Traceback" in run.error and "CUDA out of memory (simulated)" in run.error
    again = cluster_1ps_2w.train(mlp, digits_train, LOSS, lr=0.1, steps=20).wait(verbose=False)
    assert again.global_step == 20


def test_a_diverging_run_with_on_divergence_fail_wakes_its_waiter_with_the_cause(cluster_1ps_2w, digits_train):
    """lr=1e6 with a cross-entropy loss: the loss rises to ~1e5 and stays there, never NaN (before divergence was
    watched, such a run finished, nothing flagged)."""
    run = cluster_1ps_2w.train(mlp, digits_train, LOSS, lr=1e6, steps=20_000, on_divergence="fail")
    with pytest.raises(TrainingError, match=r"diverging since step \d+: the loss \(smoothed\)"):
        run.wait(timeout=120, verbose=False)
    woke = time.time()
    assert run.status == "failed" and run.global_step < 20_000
    failed = run.events()
    assert woke - failed[failed["kind"] == "diverging"]["time"].iloc[0] < 10
    assert run.failure["task"] == "controller" and "lower the learning rate" in run.failure["cause"]


def pretrained_head():
    """A model whose first layer starts from weights in a file, read where the model is built: the path is
    ``PRETRAINED`` in that process's environment (a shared folder that one host may lack)."""
    model = mlp()
    model[0].weight.data.copy_(torch.load(os.environ["PRETRAINED"]))
    return model


def test_a_chief_that_fails_before_it_initializes_the_run_ends_it_at_once(cluster_1ps_2w, digits_train, tmp_path,
                                                                          monkeypatch):
    weights = tmp_path / "pretrained.pt"
    torch.save(torch.zeros(32, 64), weights)
    monkeypatch.setenv("PRETRAINED", str(weights))  # the controller's, for train()'s checks
    chief = cluster_1ps_2w._engines.view(cluster_1ps_2w.spec.workers[0].engine_id)
    other = cluster_1ps_2w._engines.view(cluster_1ps_2w.spec.workers[1].engine_id)
    chief.execute(f"import os; os.environ['PRETRAINED'] = {str(tmp_path / 'missing.pt')!r}", block=True)
    other.execute(f"import os; os.environ['PRETRAINED'] = {str(weights)!r}", block=True)
    try:
        began = time.monotonic()
        run = cluster_1ps_2w.train(pretrained_head, digits_train, LOSS, lr=0.1, steps=50, request_timeout=60)
        with pytest.raises(TrainingError, match=r"^FileNotFoundError: .*missing\.pt.* on worker 0\n"):
            run.wait(timeout=120, verbose=False)
        # the other worker stopped waiting for the chief as soon as the run was stopped: it ends with no step,
        # where before it waited request_timeout (60 s here, 120 by default) and failed on RuntimeTimeout
        assert time.monotonic() - began < 30 and "RuntimeTimeout" not in run.error
    finally:
        chief.execute(f"import os; os.environ['PRETRAINED'] = {str(weights)!r}", block=True)
    again = cluster_1ps_2w.train(pretrained_head, digits_train, LOSS, lr=0.1, steps=20).wait(verbose=False)
    assert again.global_step == 20 and again.local_steps == [20, 20]


def wider_mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 10))


def test_a_checkpoint_dir_of_another_model_is_refused_at_train_and_loses_nothing(cluster_1ps_2w, digits_train,
                                                                                tmp_path):
    folder = tmp_path / "mnist-checkpoints"
    first = cluster_1ps_2w.train(mlp, digits_train, LOSS, lr=0.1, steps=60, checkpoint_dir=folder).wait(verbose=False)
    runs = len(first.store.runs())
    # the notebook's model cell changed (a wider hidden layer), the checkpoint_dir did not: refused at train(),
    # where before the chief failed on its restore and the other worker waited 120 s for it
    with pytest.raises(CheckpointError) as refused:
        cluster_1ps_2w.train(wider_mlp, digits_train, LOSS, lr=0.1, steps=120, checkpoint_dir=folder)
    assert "\n" not in str(refused.value) and "holds 0.weight as (32, 64) float32, the model as (48, 64)" in \
        str(refused.value) and "train with another checkpoint_dir or restore=False" in str(refused.value)
    assert len(first.store.runs()) == runs and cluster_1ps_2w.active_run is None
    assert checkpoint.committed_steps(folder)[-1] == 60  # what was trained is still there
    # the same model goes on from it; the wider one trains from scratch where told to
    again = cluster_1ps_2w.train(mlp, digits_train, LOSS, lr=0.1, steps=120, checkpoint_dir=folder).wait(verbose=False)
    assert again.global_step == 120 and sum(r["local_steps"] for r in again.results) == 60 * 2
    fresh = cluster_1ps_2w.train(wider_mlp, digits_train, LOSS, lr=0.1, steps=30, checkpoint_dir=folder,
                                 restore=False).wait(verbose=False)
    assert fresh.global_step == 30
    # ...having set the earlier checkpoints aside, whole, where they still restore: before, it wrote its steps
    # beside them, its commits pruned them by step number, and its own in-flight step 30 folder (< 120) with them
    aside = folder / f"before-run-{fresh.id}"
    assert checkpoint.committed_steps(aside)[-1] == 120 and checkpoint.latest(aside).step == 120
    assert checkpoint.committed_steps(folder)[-1] == 30
    [said] = fresh.events().query("kind == 'set_aside'")["detail"]
    assert said == {"checkpoint_dir": str(folder), "into": str(aside), "run": again.id, "step": 120}
    # the folder is the new run's: restoring from it continues the wider model from its step 30
    later = cluster_1ps_2w.train(wider_mlp, digits_train, LOSS, lr=0.1, steps=40, checkpoint_dir=folder)
    assert later.wait(verbose=False).global_step == 40 and sum(r["local_steps"] for r in later.results) == 10 * 2


def test_second_train_while_one_runs_is_refused(cluster_1ps_2w, digits_train):
    run = cluster_1ps_2w.train(mlp, digits_train, LOSS, lr=0.1, steps=2000, batch_size=8)
    try:
        with pytest.raises(ClusterStateError, match="still training"):
            cluster_1ps_2w.train(mlp, digits_train, LOSS, steps=10)
    finally:
        run.stop()
    assert run.done and run.global_step < 2000


def test_two_ps_tasks_hold_disjoint_variables(start_cluster, digits_train):
    cluster = start_cluster(ps=2, workers=2)
    run = cluster.train(mlp, digits_train, LOSS, optimizer="adam", lr=0.01, mode="async", steps=100,
                        batch_size=32).wait(verbose=False)
    held = [set(s["variables"]) for s in run.ps_stats]
    assert held[0] and held[1] and not held[0] & held[1]
    assert held[0] | held[1] == {n for n, _ in mlp().named_parameters()}
    assert cluster.placement() == ["0.weight: /job:ps/task:0", "0.bias: /job:ps/task:1",
                                   "2.weight: /job:ps/task:0", "2.bias: /job:ps/task:1"]
    pids = cluster.pids
    cluster.stop()
    from pscluster.cluster.reaper import alive
    assert pids and not [p for p in pids if alive(p)]
    with pytest.raises(ClusterStateError, match="not running"):
        cluster.train(mlp, digits_train, LOSS, steps=10)


def test_a_short_async_run_on_fresh_engines_is_shared_by_every_worker(start_cluster, digits_train):
    # The quickstart's async run, first on new engines: each worker imports and builds at its own pace, and
    # 600 steps take well under a second; the chief waits for every worker's first pull before it steps.
    c = start_cluster(ps=1, workers=3)
    run = c.train(mlp, digits_train, LOSS, optimizer="sgd", lr=0.1, mode="async", steps=600, batch_size=64)
    run.wait(timeout=120, verbose=False)
    assert run.status == "finished" and run.global_step == 600 and min(run.local_steps) > 0
    # max_lead, as the ps counts: a worker's pushes from its first, which starts level with the slowest of those
    # pushing already (on a loaded machine a worker's first step may come a few hundred steps into the run, and
    # its local steps are then fewer by as many: by design, one slow to start holds no one)
    clocks: dict[int, int] = {}
    for worker in run.metrics().sort_values("time")["worker"]:
        if worker not in clocks:
            clocks[worker] = min(clocks.values(), default=0)
        clocks[worker] += 1
    slowest = min(clocks.values())
    # one push past the bound is held, and records may arrive a push or two apart from the pushes' order
    assert max(clocks.values()) - slowest <= max(LEAD_SLACK, DEFAULTS.max_lead * slowest) + 3, (clocks,
                                                                                                 run.local_steps)
    states = run.events().query("kind == 'state' and task == 'worker:0'")["detail"].map(lambda d: d["state"])
    assert "waiting for workers" in list(states)
