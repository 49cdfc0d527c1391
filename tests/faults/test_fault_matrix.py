"""Faults at bad moments, every kind on every role: {SIGKILL, SIGSTOP} x {ps, chief, worker} x {mid training, mid
checkpoint write, mid restore, mid scale-up}, on 2 ps + 3 workers training the digits MLP in sync mode.

Every cell must reach its exact step target, end within ``ACCURACY_SLACK`` of the test accuracy of the same run
undisturbed, and leave no checkpoint whose shards disagree on their step (a rescue after a lost ps included, see
``runtime.rescue``). A stopped task gets SIGCONT once it is replaced (at the latest after
``HANG_S``): by then it must be dead, killed by the recovery, never back in the run. Each cell's timings (fault to
lost, to replaced, to training again) go to ``reports/faults.json``; the README's table comes from there.

A user's own loop (``Cluster.run``) on the same cluster and model survives a SIGKILLed ps and worker the same way
(``test_a_user_loop_survives_a_lost_task``).

Recovery without a pause: in every cell the victim's replacement trains within ``RECOVERY_S`` of the loss (the
kill, for a SIGKILL; for a SIGSTOP, the moment the stopped task is declared lost, when its heartbeats stop), beside
whatever else loads the machine (the load average goes to the report). The cluster keeps two spare engines: a
restore cell loses two tasks within a second (ps 0, then the victim), a scale cell takes an engine for the
added worker and one for the victim.

A script job under ``pscluster launch`` (``test_a_script_job_under_pscluster_launch``), sync and async: a SIGKILLed
ps (under the library's loop and a user's own) or worker is started again by launch and the run reaches its exact
target, and so is a SIGSTOPped ps (launch kills it once stopped for ``launch.STOPPED_S``); the chief SIGKILLed ends
every task within 10 s and launch exits non-zero; launch SIGKILLed leaves no task running. A ps of a job without
launch (as under another scheduler) whose chief is SIGKILLed ends itself once the run's lease lapses
(``test_a_ps_left_alone_ends_when_the_run_s_lease_lapses``).

Runs with ``make faults`` (about 15 minutes on 2 cores), not in ``make test``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import pscluster
from pscluster import environ
from pscluster.cluster.lease import PS_LEASE_S, RENEW_S
from pscluster.cluster.reaper import alive
from pscluster.errors import ConfigError
from pscluster.evaluate import evaluate
from pscluster.launch import STOPPED_S, local_spec
from pscluster.runtime import checkpoint
from tests.integration import launched

STEPS = 1200  # the digits MLP has converged by then (3 workers of 32 samples a step); the faults hit at 300
HANG_S = 30.0
ACCURACY_SLACK = 0.02
RECOVERY_S = 2.0
LOSS = torch.nn.CrossEntropyLoss()
REPORT = Path(os.environ.get("PSCLUSTER_REPORT_DIR", "reports")) / "faults.json"
VICTIMS = {"ps": "ps:1", "chief": "worker:0", "worker": "worker:2"}


class Net(torch.nn.Module):
    """The digits MLP, and a frozen table on each ps (never trained, never sent after the start) whose 16 MB make
    every checkpoint write take long enough to be caught in the middle of it."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        self.table_a = torch.nn.Parameter(torch.zeros(4_000_000), requires_grad=False)
        self.table_b = torch.nn.Parameter(torch.zeros(4_000_000), requires_grad=False)

    def forward(self, x):
        return self.body(x)


class SparseNet(torch.nn.Module):
    """The digits as bags of (pixel, intensity) rows of a sparse table, then a linear layer (0.91 accuracy by a
    plain loop at ``SPARSE_TRAIN``'s rate and steps): placed by
    ``SPARSE_TRAIN`` so that ps 1 holds the table and a dense bias, which a worker's copy cannot rebuild (a worker
    holds only the rows it touched)."""

    def __init__(self):
        super().__init__()
        self.pixels = torch.nn.EmbeddingBag(64 * 17, 64, mode="mean", sparse=True)
        self.head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.pixels((x * 16).round().long() + torch.arange(64) * 17))


TRAIN = dict(lr=0.1, mode="sync", steps=STEPS, batch_size=32, checkpoint_every=200)
SPARSE_TRAIN = dict(TRAIN, lr=2.0, placement={"pixels.weight": 1, "head.1.bias": 1, "head.1.weight": 0})


@pytest.fixture(scope="module")
def cluster():
    c = pscluster.Cluster(ps=2, workers=3, spares=2).start()
    yield c
    pids = c.pids
    c.stop()
    assert not [p for p in pids if alive(p)], "cluster processes left running after stop()"


@pytest.fixture(scope="module")
def data():
    return pscluster.datasets.digits("train"), pscluster.datasets.digits("test")


@pytest.fixture(scope="module")
def undisturbed(cluster, data):
    run = cluster.train(Net, data[0], LOSS, **TRAIN).wait(timeout=600, verbose=False)
    assert run.status == "finished" and run.global_step == STEPS
    return accuracy(run, data[1])


@pytest.fixture(scope="module")
def sparse_undisturbed(cluster, data):
    run = cluster.train(SparseNet, data[0], LOSS, **SPARSE_TRAIN).wait(timeout=600, verbose=False)
    assert run.status == "finished" and run.global_step == STEPS
    return accuracy(run, data[1], SparseNet)


def accuracy(run, test, model_class=Net) -> float:
    model = model_class()
    model.load_state_dict(run.state_dict())
    return evaluate(model, test, LOSS)["accuracy"]


def events(run, *kinds):
    e = run.store.events(run.id)
    return e[e["kind"].isin(kinds)]


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f}s"
        time.sleep(0.002)


def wait_for_step(run, step):
    wait_for(lambda: run.global_step >= step or run.done, 300, f"global step {step}")
    assert not run.done, f"the run ended at {run.global_step} before the fault: {run.error_line}"


def writing_shard(directory: Path, ps: int) -> bool:
    """Whether ps ``ps`` is writing a shard file now (its temporary file exists, beside the step folders: a step's
    folder is made once its shard is whole, see ``checkpoint._write_file``)."""
    try:
        return any((m := checkpoint.SHARD_BEING_WRITTEN.fullmatch(n)) and int(m.group(2)) == ps
                   for n in os.listdir(directory))
    except OSError:
        return False


def await_moment(phase: str, cluster, run, victim: str):
    """Block until the cell's bad moment; returns a cleanup to call after the run."""
    role, index = victim.split(":")
    if phase == "training":
        wait_for_step(run, STEPS // 4)
    elif phase == "checkpoint":  # a ps writing its shard (the victim, when it is a ps)
        wait_for_step(run, STEPS // 4)
        writer = int(index) if role == "ps" else 0
        wait_for(lambda: writing_shard(Path(run.plan.checkpoint_dir), writer) or run.done, 120, "shard write")
    elif phase == "restore":  # a new attempt starting after ps 0 was lost: the chief restores
        wait_for_step(run, STEPS // 4)
        os.kill(cluster.spec.task("ps", 0).pid, signal.SIGKILL)
        wait_for(lambda: len(events(run, "restarting")), 120, "restart after ps 0 was killed")
    elif phase == "scale":  # a worker being added: its engine starting
        wait_for_step(run, STEPS // 4)
        request = cluster.scale(workers=4)
        time.sleep(0.5)
        return lambda: (request.wait(timeout=120), cluster.scale(workers=3).wait(timeout=120))
    return lambda: None


def shards_of_one_step(directory) -> None:
    """Every committed checkpoint holds shards of its own step, a rescued one too (each ps's source, a shard or
    a worker's copy, of that step)."""
    for step in checkpoint.committed_steps(directory):
        manifest = json.loads(checkpoint.manifest_path(directory, step).read_text())
        rescued = {r["ps"]: r["step"] for r in manifest.get("rescued", [])}
        for shard in manifest["shards"]:
            receipt = json.loads((Path(directory) / shard["file"]).with_suffix(".json").read_text())
            assert receipt["step"] == step, (step, receipt)
            if shard["ps"] in rescued:
                assert rescued[shard["ps"]] == step, (step, manifest["rescued"])
        checkpoint.Checkpoint.load(checkpoint.manifest_path(directory, step))  # whole, checksums right


def record(cell: str, outcome: dict) -> None:
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    results[cell] = outcome
    REPORT.write_text(json.dumps(results, indent=1, sort_keys=True))


@pytest.mark.parametrize("phase", ["training", "checkpoint", "restore", "scale"])
@pytest.mark.parametrize("role", ["ps", "chief", "worker"])
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_fault_at_a_bad_moment(cluster, data, undisturbed, fault, role, phase):
    victim = VICTIMS[role]
    run = cluster.train(Net, data[0], LOSS, **TRAIN)
    cleanup = await_moment(phase, cluster, run, victim)
    victim_role, victim_index = victim.split(":")
    pid = cluster.spec.task(victim_role, int(victim_index)).pid
    hit_at, hit_step = time.time(), run.global_step
    os.kill(pid, getattr(signal, fault))
    if fault == "SIGSTOP":
        wait_for(lambda: not alive(pid) or run.done or
                 (events(run, "replaced")["task"] == victim).any(), HANG_S, "replacement")
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    run.wait(timeout=600, verbose=False)
    cleanup()
    assert run.status == "finished" and run.error is None, run.error_line
    assert run.global_step == STEPS  # exactly the target
    assert not alive(pid), f"the {fault} {victim} ({pid}) outlived its recovery"
    lost = events(run, "lost")
    assert victim in set(lost["task"]), f"{victim} was never declared lost: {list(lost['task'])}"
    assert set(lost["task"]) <= {victim, "ps:0" if phase == "restore" else victim}, list(lost["task"])
    restored = [d.get("from_step") for d in events(run, "restarting")["detail"]]
    assert None not in restored and all(step >= hit_step - 10 for step in restored), (hit_step, restored)
    shards_of_one_step(run.plan.checkpoint_dir)
    got = accuracy(run, data[1])
    assert got >= undisturbed - ACCURACY_SLACK, (got, undisturbed)
    after = lambda kind: events(run, kind)  # noqa: E731
    lost_at = lost[lost["task"] == victim]["time"].min()
    replaced = after("replaced")
    replaced_at = replaced[(replaced["task"] == victim) & (replaced["time"] >= lost_at)]["time"].min()
    metrics = run.metrics()
    training_again = metrics[metrics["time"] > replaced_at]["time"].min()
    # the replacement's own first step, from when its engine was ready (the 'replaced' event)
    own = metrics[(metrics["time"] > replaced_at) & (metrics["worker"] == int(victim_index))] \
        if victim_role == "worker" else metrics.iloc[:0]
    # from the loss to the replacement's first step: a worker's own, or the restarted run's after a ps
    recovery_s = (own["time"].min() if len(own) else training_again) - (hit_at if fault == "SIGKILL" else lost_at)
    record(f"{fault} {role} {phase}", {
        "fault_step": int(hit_step), "lost_s": round(lost_at - hit_at, 2), "replaced_s": round(replaced_at - hit_at, 2),
        "training_again_s": round(training_again - hit_at, 2), "accuracy": round(got, 4),
        "recovery_s": round(recovery_s, 2), "load": round(os.getloadavg()[0], 1),
        "replacement_first_step_s": round(own["time"].min() - replaced_at, 2) if len(own) else None,
        "undisturbed_accuracy": round(undisturbed, 4), "attempts": int(run.plan.attempt) + 1,
        "restored_from": [d.get("from_step") for d in events(run, "restarting")["detail"]]})
    assert recovery_s <= RECOVERY_S, f"training again {recovery_s:.2f}s after the loss (load {os.getloadavg()[0]:.1f})"


def net_loop(ctx):
    """TRAIN's run as a user's own loop."""
    torch.manual_seed(ctx.seed)
    model = ctx.model(Net())
    optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=TRAIN["lr"]))
    for x, y in ctx.endless_shard(pscluster.datasets.digits("train"), batch_size=TRAIN["batch_size"]):
        optimizer.zero_grad()
        loss = LOSS(model(x), y)
        loss.backward()
        optimizer.step()
        ctx.log(loss=loss.item())
        if ctx.should_stop():
            break


@pytest.mark.parametrize("role", ["ps", "worker"])
def test_a_user_loop_survives_a_lost_task(cluster, data, undisturbed, role):
    """A replaced worker calls the loop again and goes on from the run's step; a lost ps restarts every worker's
    loop from the newest state."""
    victim = VICTIMS[role]
    run = cluster.run(net_loop, mode="sync", steps=STEPS, checkpoint_every=TRAIN["checkpoint_every"])
    wait_for_step(run, STEPS // 4)
    victim_role, victim_index = victim.split(":")
    pid = cluster.spec.task(victim_role, int(victim_index)).pid
    hit_at, hit_step = time.time(), run.global_step
    os.kill(pid, signal.SIGKILL)
    run.wait(timeout=600, verbose=False)
    assert run.status == "finished" and run.error is None, run.error_line
    assert run.global_step == STEPS
    assert victim in set(events(run, "lost")["task"])
    shards_of_one_step(run.plan.checkpoint_dir)
    got = accuracy(run, data[1])
    assert got >= undisturbed - ACCURACY_SLACK, (got, undisturbed)
    replaced = events(run, "replaced")
    record(f"SIGKILL {role} training (user loop)", {
        "fault_step": int(hit_step), "replaced_s": round(replaced["time"].min() - hit_at, 2),
        "accuracy": round(got, 4), "undisturbed_accuracy": round(undisturbed, 4),
        "attempts": int(run.plan.attempt) + 1})


def finished_exactly(run, test, undisturbed: float, model_class=Net) -> float:
    """Assert the run reached its exact target with every checkpoint of one step and the accuracy of the same run
    undisturbed; returns its accuracy."""
    assert run.status == "finished" and run.error is None, run.error_line
    assert run.global_step == STEPS
    shards_of_one_step(run.plan.checkpoint_dir)
    got = accuracy(run, test, model_class)
    assert got >= undisturbed - ACCURACY_SLACK, (got, undisturbed)
    return got


def restarts(run) -> list[dict]:
    return list(events(run, "restarting")["detail"])


def test_a_lost_ps_holding_a_sparse_embedding_brings_every_ps_back_to_one_checkpointed_step(
        cluster, data, sparse_undisturbed):
    run = cluster.train(SparseNet, data[0], LOSS, **SPARSE_TRAIN)
    wait_for_step(run, STEPS // 4)
    hit_at, hit_step = time.time(), run.global_step
    os.kill(cluster.spec.task("ps", 1).pid, signal.SIGKILL)
    run.wait(timeout=600, verbose=False)
    got = finished_exactly(run, data[1], sparse_undisturbed, SparseNet)
    [restart] = restarts(run)
    # the table is only in ps 1's own shards: every ps comes back from the newest checkpoint, not the survivor
    # from its stop and ps 1 from an older shard
    assert restart["from_step"] % SPARSE_TRAIN["checkpoint_every"] == 0, restart
    assert hit_step - SPARSE_TRAIN["checkpoint_every"] <= restart["from_step"] <= hit_step + 10, (hit_step, restart)
    assert all(s["step"] == restart["from_step"] and s["optimizer_state"] for s in restart.get("sources") or []), \
        restart
    record("SIGKILL ps holding a sparse embedding", {
        "fault_step": int(hit_step), "accuracy": round(got, 4), "undisturbed_accuracy": round(sparse_undisturbed, 4),
        "restored_from": [restart["from_step"]], "training_again_s": training_again_s(run, hit_at)})


def training_again_s(run, hit_at: float) -> float:
    """Seconds from the fault to the run's first step after its last restart."""
    restarted_at = events(run, "restarting")["time"].max()
    metrics = run.metrics()
    return round(metrics[metrics["time"] > restarted_at]["time"].min() - hit_at, 2)


def test_every_ps_lost_at_once_comes_back_from_the_workers_copies(cluster, data, undisturbed):
    run = cluster.train(Net, data[0], LOSS, **TRAIN)
    wait_for_step(run, STEPS // 4)
    hit_at, hit_step = time.time(), run.global_step
    pids = [cluster.spec.task("ps", i).pid for i in (0, 1)]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    run.wait(timeout=600, verbose=False)
    got = finished_exactly(run, data[1], undisturbed)
    assert not [pid for pid in pids if alive(pid)]
    assert {"ps:0", "ps:1"} <= set(events(run, "lost")["task"])
    from_steps = [r["from_step"] for r in restarts(run)]
    assert from_steps and all(step >= hit_step - 10 for step in from_steps), (hit_step, from_steps)
    record("SIGKILL every ps at once", {
        "fault_step": int(hit_step), "accuracy": round(got, 4), "undisturbed_accuracy": round(undisturbed, 4),
        "restored_from": from_steps, "training_again_s": training_again_s(run, hit_at)})


def test_a_checkpoint_damaged_mid_run_is_refused_and_the_one_before_restored(cluster, data, sparse_undisturbed):
    every = STEPS // 4
    run = cluster.train(SparseNet, data[0], LOSS, **{**SPARSE_TRAIN, "checkpoint_every": every})
    directory = Path(run.plan.checkpoint_dir)
    wait_for(lambda: 2 * every in checkpoint.committed_steps(directory) or run.done, 300, f"checkpoint {2 * every}")
    shard = checkpoint.step_dir(directory, 2 * every) / "ps-1.tensors"
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[len(data_bytes) // 2] ^= 0xFF
    shard.write_bytes(bytes(data_bytes))  # the disk, not pscluster: the table's shard is damaged
    hit_at, hit_step = time.time(), run.global_step
    os.kill(cluster.spec.task("ps", 1).pid, signal.SIGKILL)  # its table must come back from a checkpoint
    run.wait(timeout=600, verbose=False)
    got = finished_exactly(run, data[1], sparse_undisturbed, SparseNet)
    refused = [d["error"] for d in events(run, "checkpoint_refused")["detail"]]
    assert any(f"{2 * every}" in error and "SHA-256" in error for error in refused), refused
    [restart] = restarts(run)
    assert restart["from_step"] == every, (restart, refused)
    record("checkpoint damaged mid-run, then its ps lost", {
        "fault_step": int(hit_step), "accuracy": round(got, 4), "undisturbed_accuracy": round(sparse_undisturbed, 4),
        "restored_from": [restart["from_step"]], "refused": refused, "training_again_s": training_again_s(run, hit_at)})


def test_a_nan_learning_rate_is_refused_before_anything_starts(cluster, data):
    with pytest.raises(ConfigError, match="lr=nan: give a finite number"):
        cluster.train(Net, data[0], LOSS, **{**TRAIN, "lr": float("nan")})
    run = cluster.train(Net, data[0], LOSS, **{**TRAIN, "steps": 20}).wait(timeout=120, verbose=False)
    assert run.status == "finished" and run.global_step == 20  # the cluster goes on training
    record("lr=nan", {"refused": True, "next_run_steps": int(run.global_step)})


SCRIPT_STEPS = 300  # a few seconds of the launched scripts' small model; the faults hit at their first progress line
SCRIPT_ROWS = [("SIGKILL", "ps:0", "library"), ("SIGKILL", "ps:0", "own"), ("SIGSTOP", "ps:0", "own"),
               ("SIGKILL", "worker:1", "own"), ("SIGKILL", "worker:0", "own"), ("SIGKILL", "launch", "own")]


@pytest.mark.parametrize("fault,victim,loop", SCRIPT_ROWS, ids=["-".join(row) for row in SCRIPT_ROWS])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_script_job_under_pscluster_launch(tmp_path, mode, fault, victim, loop):
    """``pscluster launch`` of a script (``loop``: the library's, ``train_from_environment``, or the user's own with
    ``pscluster.init()``), ``fault`` on one process: a lost ps or worker is started again (a stopped one killed
    first) and the run reaches its exact target; the chief lost ends every task within 10 s and launch fails;
    launch lost takes every task with it."""
    script = tmp_path / "job.py"
    script.write_text(launched.TRAIN if loop == "library" else launched.LOOP)
    steps = SCRIPT_STEPS * (3 if loop == "library" else 1)  # the library's loop steps faster: the kill lands mid-run
    args = (mode, str(steps)) if loop == "library" else ("forever" if victim == "launch" else "stop", "{}")
    job = launched.Launched(tmp_path / "home", script, "--mode", mode, "--steps", str(steps),
                            "--log-every", "20", args=args)
    try:
        job.wait_for(launched.PROGRESS.format(index=1))
        tasks, hit_at = job.pids, time.monotonic()
        if victim == "launch":
            job.process.kill()
        else:
            job.kill(victim, getattr(signal, fault))
        code = job.wait(timeout=180)
        ended_s = round(time.monotonic() - hit_at, 2)
        if victim in ("ps:0", "worker:1"):
            assert code == 0 and "Traceback" not in job.output, job.output[-3000:]  # the user's code saw nothing
            chief = job.summaries()[0]
            assert chief["status"] == "finished" and chief["global_step"] == steps, chief
            assert len(job.started[victim]) == 2, job.output[-3000:]
            if fault == "SIGSTOP":
                assert f"{victim} stopped for {STOPPED_S:g}s (SIGSTOP): killed" in job.output, job.output[-3000:]
        else:
            assert code == (-signal.SIGKILL if victim == "launch" else 128 + signal.SIGKILL), job.output[-3000:]
            assert ended_s <= 10.0, ended_s
        assert not launched.gone_within(tasks, 5.0), job.output[-3000:]
    finally:
        job.stop()
    record(f"{fault} {victim} of a script job ({mode}, {loop} loop, pscluster launch)", {
        "ended_s": ended_s, "exit_status": code, "starts": {task: len(p) for task, p in job.started.items()}})


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_ps_left_alone_ends_when_the_run_s_lease_lapses(tmp_path, mode):
    """A job without launch (each task started as another scheduler starts it, with its own config), its chief
    SIGKILLed mid-run: the ps ends once the run's lease lapses (``PS_LEASE_S`` after the chief's last renewal), in one
    line naming the run, with status 1, instead of listening with nobody left."""
    script = tmp_path / "job.py"
    script.write_text(launched.LOOP)
    spec = local_spec(1, 1, "left-alone")
    args = ["forever", json.dumps({"mode": mode, "steps": 100_000, "log_every": 1})]
    ps, chief = (launched.Process([sys.executable, str(script), *args], tmp_path / "home",
                                  {environ.CONFIG: spec.config_for(role, 0)}) for role in ("ps", "worker"))
    try:
        chief.wait_for(r"After \d+ training steps")
        chief.process.kill()
        hit_at = time.monotonic()
        ps.wait_for(r"^ps 0 ends: run \d+'s owner \(pid \d+ on .+\) has not renewed its lease for "
                    rf"{PS_LEASE_S:g}s", timeout=PS_LEASE_S + 30)
        ended_s = round(time.monotonic() - hit_at, 2)  # the chief renewed last at most RENEW_S before its kill
        code = ps.wait(timeout=30)
    finally:
        ps.stop()
        chief.stop()
    assert code == 1, ps.output[-3000:]
    assert PS_LEASE_S - RENEW_S - 1 <= ended_s <= PS_LEASE_S + RENEW_S, ended_s
    record(f"SIGKILL chief of a job without launch ({mode}): its ps alone", {"ps_ended_s": ended_s,
                                                                            "exit_status": code})
