"""Fault tolerance on real engines: SIGKILL a worker or a ps mid-run; the run recovers by itself and ends
exactly on its step target, and no process of the cluster outlives it."""

import os
import time

import pytest
import torch

from pscluster.errors import ConfigError, RuntimeTimeout
from pscluster.evaluate import evaluate
from pscluster.cluster.reaper import alive
from pscluster.runtime import checkpoint
from pscluster.runtime.waiting import wait_until

from .conftest import events, mlp, wait_for_step

LOSS = torch.nn.CrossEntropyLoss()
STEPS = 1_000


class SlowWhile(torch.utils.data.Dataset):
    """``data``, each batch ``delay_s`` late while the file ``flag`` exists: the workers train on, slowly, for as
    long as the test holds the run back."""

    supports_batch_index = True  # as the digits: a batch at once

    def __init__(self, data, flag: str, delay_s: float = 0.1):
        self.data, self.flag, self.delay_s = data, flag, delay_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        if not isinstance(index, int) and os.path.exists(self.flag):
            time.sleep(self.delay_s)
        return self.data[index]


def wait_until_trained_by(run, worker: int, since: float, timeout: float = 180) -> None:
    """Wait until worker ``worker`` has reported a step made after ``since`` (unix seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = run.metrics()
        if ((metrics["worker"] == worker) & (metrics["time"] > since)).any():
            return
        assert not run.done, f"the run ended at {run.global_step} before worker {worker} trained again: {run.error}"
        assert time.monotonic() < deadline, f"worker {worker} did not train again within {timeout}s"
        time.sleep(0.2)


@pytest.mark.parametrize("mode, victim", [("sync", "worker:1"), ("async", "worker:0")])
def test_a_lost_worker_is_replaced_and_the_run_reaches_its_target(own_cluster, digits_train, tmp_path, mode, victim):
    c = own_cluster(ps=1, workers=2)
    with pytest.raises(ConfigError, match="task 'worker': name it role:index, e.g. worker:1 or ps:0"):
        c.kill("worker")
    with pytest.raises(ConfigError, match="no worker task 9: this cluster has 2"):
        c.kill("worker:9")
    # the run must still train when the replacement's new engine is ready (5 s here, more under load: thousands
    # of steps of this model at full speed): from the loss until the replacement has trained, batches come slowly
    slow = tmp_path / "slow"
    run = c.train(mlp, SlowWhile(digits_train, str(slow)), LOSS, lr=0.1, mode=mode, steps=STEPS, batch_size=32,
                  checkpoint_secs=None)
    wait_for_step(run, 100)
    slow.touch()
    old_pid = c.kill(victim)
    role, index = victim.split(":")
    wait_until_trained_by(run, int(index), since=time.time())
    slow.unlink()
    run.wait(timeout=180, verbose=False)
    assert run.status == "finished" and run.error is None
    assert run.global_step == STEPS  # exactly the target
    lost, replaced = events(run, "lost"), events(run, "replaced")
    assert list(lost["task"]) == [victim] and list(replaced["task"]) == [victim]
    assert c.spec.task(role, int(index)).pid != old_pid
    assert not alive(old_pid)
    assert run.local_steps[int(index)] > 0, run.local_steps  # the replacement trained


def test_a_lost_task_takes_the_spare_engine_and_a_new_spare_starts(own_cluster, digits_train):
    c = own_cluster(ps=1, workers=2)  # one spare, the default on this machine, started with the tasks'
    engines = c._engines
    [spare] = engines.spares
    assert spare.engine_id not in {t.engine_id for t in (*c.spec.ps, *c.spec.workers)}
    assert spare.pid in c.pids  # stopped with the cluster, killed by the reaper with this process
    run = c.train(mlp, digits_train, LOSS, lr=0.1, mode="async", steps=3 * STEPS, batch_size=32, checkpoint_secs=None)
    wait_for_step(run, 100)
    c.kill("worker:1")
    run.wait(timeout=180, verbose=False)
    assert run.status == "finished" and run.global_step == 3 * STEPS
    replacement = c.spec.task("worker", 1)
    assert (replacement.engine_id, replacement.pid) == (spare.engine_id, spare.pid)  # taken, not started
    assert list(events(run, "replaced")["task"]) == ["worker:1"]
    assert wait_until(lambda: len(engines.spares) == 1, 60), "the spare taken was not started again"
    assert engines.spares[0].engine_id != spare.engine_id


def test_a_cluster_asked_for_no_spare_keeps_none(own_cluster):
    c = own_cluster(ps=1, workers=1, spares=0)
    assert c._engines.spares == [] and len(c._engines.registered()) == 2


def test_a_worker_lost_between_two_runs_is_replaced_when_the_next_run_starts(own_cluster, digits_train):
    # its engine is gone (ipyparallel no longer lists it) when the next run starts a worker on it
    c = own_cluster(ps=1, workers=2)
    first = c.train(mlp, digits_train, LOSS, lr=0.1, mode="sync", steps=50, batch_size=32, checkpoint_secs=None)
    first.wait(timeout=120, verbose=False)
    lost = c.spec.task("worker", 1)
    c.kill("worker:1")
    deadline = time.monotonic() + 60
    while lost.engine_id in c._engines.registered():
        assert time.monotonic() < deadline, "the killed engine is still registered"
        time.sleep(0.1)
    # sync, 2 replicas: no global step without the replacement's gradients
    run = c.train(mlp, digits_train, LOSS, lr=0.1, mode="sync", steps=300, batch_size=32, checkpoint_secs=None)
    run.wait(timeout=180, verbose=False)
    assert run.status == "finished" and run.global_step == 300
    assert list(events(run, "replaced")["task"]) == ["worker:1"]
    assert c.spec.task("worker", 1).engine_id != lost.engine_id and run.local_steps[1] > 0


def test_a_lost_ps_goes_on_from_a_state_newer_than_its_last_checkpoint(own_cluster, digits_train):
    c = own_cluster(ps=2, workers=2)
    run = c.train(mlp, digits_train, LOSS, lr=0.1, mode="sync", steps=500, batch_size=32, checkpoint_every=50,
                  checkpoint_secs=None)
    wait_for_step(run, 160)
    c.kill("ps:1")
    run.wait(timeout=240, verbose=False)
    assert run.status == "finished" and run.error is None
    assert run.global_step == 500
    restart = events(run, "restarting")
    assert len(restart) == 1
    from_step = restart["detail"].iloc[0]["from_step"]
    assert from_step >= 160  # not from the checkpoint of step 150, nor from 0
    # sync with every worker's gradients: each took a step of every global step, in both attempts (but for the one
    # in flight at the loss, which the surviving ps may have applied: a worker counts a step once it is answered)
    assert all(steps >= 500 - 1 for steps in run.local_steps), run.local_steps
    # from the store: after the restart, the global step went on from there
    metrics = run.metrics()
    after = metrics[metrics["time"] > restart["time"].iloc[0]]
    assert after["global_step"].min() == from_step + 1
    # the final checkpoint holds every ps's shard of the last step, and loads
    final = checkpoint.latest(run.plan.checkpoint_dir)
    assert final.step == 500 and len(final.shards) == 2
    for name, value in final.state_dict().items():
        assert torch.equal(value, run.state_dict()[name]), name


@pytest.mark.parametrize("mode, optimizer", [("sync", {"optimizer": "adam", "lr": 0.01}),
                                             ("async", {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9})])
def test_a_lost_ps_with_no_checkpoint_yet_costs_a_few_steps_not_the_run(own_cluster, digits_train, digits_test,
                                                                       mode, optimizer):
    """Default settings (a checkpoint every 10 minutes): the ps is lost long before the first one. Its
    variables come back from the workers' copies, the other ps's from a source of that same step; both with
    their optimizer state (Adam's moments and step counts, SGD's momentum), of a few steps before."""
    c = own_cluster(ps=2, workers=2)
    # the step seen here lags the ps's (metrics arrive in batches): the kill must land well before the end
    run = c.train(mlp, digits_train, LOSS, mode=mode, steps=3000, batch_size=32, **optimizer)
    wait_for_step(run, 700)
    c.kill("ps:1")
    run.wait(timeout=240, verbose=False)
    assert run.status == "finished" and run.error is None
    assert run.global_step == 3000
    restart = events(run, "restarting")
    assert len(restart) == 1
    detail = restart["detail"].iloc[0]
    assert detail["from_step"] >= 690, detail
    sources = {s["ps"]: s for s in detail["sources"]}
    assert sources[1]["from"].startswith("worker ")
    assert {s["step"] for s in sources.values()} == {detail["from_step"]}  # every ps of one step, never a mix
    for s in sources.values():  # its own state: the lost ps's copy, the survivor's shard (a push per worker ahead)
        assert s["optimizer_state"] and 0 < s["optimizer_state_step"] <= detail["from_step"] + 2, s
    metrics = run.metrics()
    after = metrics[metrics["time"] > restart["time"].iloc[0]]
    assert after["global_step"].min() == detail["from_step"] + 1
    slots = checkpoint.latest(run.plan.checkpoint_dir).tensors()[1]
    assert set(slots) == {name for name, _ in mlp().named_parameters()}
    for name, state in slots.items():
        if "momentum_buffer" in state:
            assert state["momentum_buffer"].abs().sum() > 0, name
        else:  # Adam counted every step of the run, not only those after the restart
            oldest = min(s["optimizer_state_step"] for s in sources.values())
            assert float(state["step"]) >= 3000 - (detail["from_step"] - oldest), (name, float(state["step"]))
    model = mlp()
    model.load_state_dict(run.state_dict())
    assert evaluate(model, digits_test, LOSS)["accuracy"] > 0.9


def test_stop_ends_on_one_step_with_a_final_checkpoint_and_export(own_cluster, digits_train, tmp_path):
    c = own_cluster(ps=2, workers=1)
    run = c.train(mlp, digits_train, LOSS, lr=0.1, mode="async", steps=10**6, batch_size=32, checkpoint_secs=None)
    wait_for_step(run, 30)
    with pytest.raises(RuntimeTimeout, match="still training after 0s"):
        run.evaluate(digits_train, timeout=0.2)  # the trained model is for after the run: its wait is bounded
    mid = run.checkpoint()
    assert mid.exists() and checkpoint.Checkpoint.load(mid).step >= 30
    run.stop()
    assert run.status == "stopped"
    final = checkpoint.latest(run.plan.checkpoint_dir)
    assert final.step == run.global_step  # both ps ended on the same step, and it was saved
    exported = run.export(tmp_path / "model.pt")
    model = mlp()
    model.load_state_dict(torch.load(exported, weights_only=True))
    for name, value in model.state_dict().items():
        assert torch.equal(value, run.state_dict()[name]), name


def test_fifty_checkpoints_on_demand_during_a_fast_async_run_all_commit(own_cluster, digits_train):
    c = own_cluster(ps=2, workers=2)
    run = c.train(mlp, digits_train, LOSS, lr=0.1, mode="async", steps=10**6, batch_size=8, checkpoint_secs=None,
                  keep_checkpoints=100)
    steps = []
    for _ in range(50):  # the first right after train() returns, while the run is starting on the ps tasks
        path = run.checkpoint()
        saved = checkpoint.Checkpoint.load(path)
        assert len(saved.shards) == 2 and (not steps or saved.step > steps[-1])
        steps.append(saved.step)
    run.stop()
    assert run.status == "stopped" and run.error is None
    assert set(steps) <= set(checkpoint.committed_steps(run.plan.checkpoint_dir))
    assert len(events(run, "checkpoint")) >= 51  # the 50 and the final one
