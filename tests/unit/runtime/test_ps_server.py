"""The ps server in this process, driven through PSClient over 127.0.0.1."""

import gc
import json
import re
import threading
import time
from dataclasses import replace

import pytest
import torch
import zmq

from pscluster.errors import ConfigError, PeerLost, RuntimeTimeout, StaleTask, TrainingError
from pscluster.metrics.collector import Collector
from pscluster.runtime import checkpoint, protocol
from pscluster.runtime.client import PSClient
from pscluster.runtime.network import free_port
from pscluster.runtime.protocol import Flag, Message, Op
from pscluster.runtime.ps import PASSED, ParameterServer
from pscluster.runtime.router import REJECTED
from pscluster.runtime.waiting import wait_until
from pscluster.spec import ClusterSpec, TaskSpec

from ..conftest import RUN_ID, make_spec, ps_config
from .rawpeer import RawPeer

LR = 0.1


@pytest.fixture
def values():
    """Initial values: a weight matrix and a bias."""
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


def grads(seed: int, like) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g) for t in like]


def assert_values(actual, expected, tol=1e-6):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.allclose(a, e, atol=tol), (a - e).abs().max()


# --- connection and initialization -----------------------------------------------------------


def test_a_ps_that_refuses_connections_is_lost_before_the_timeout():
    port = free_port()  # a port that nothing listens on: a ps that died before we connected
    spec = ClusterSpec(ps=(TaskSpec("ps", 0, port=port),), workers=(TaskSpec("worker", 0),))
    with pytest.raises(PeerLost, match=f"ps 0 at tcp://127.0.0.1:{port} refuses connections during HELLO"):
        PSClient(spec, timeout=60)  # RuntimeTimeout after 30 s if the refusals went unnoticed


def test_hello_and_pull_before_init(local_ps):
    spec = local_ps.start()
    client = local_ps.client(spec, run_id=1)  # the constructor's HELLO succeeded
    assert client.request(Op.HELLO)[0].value == protocol.PROTOCOL_VERSION
    assert client.pull() is None  # NOT_READY


def test_a_stop_before_init_ends_its_run_but_a_failed_attempts_stop_not_the_next_attempt(local_ps, values):
    """A replacement ps told to stop a failed attempt before the next one INITs it (a ps lost during a restore):
    the next attempt trains; a stop for an attempt to come ends it."""
    spec = local_ps.start()
    controller = local_ps.client(spec, run_id=RUN_ID)
    controller.stop(attempt=0)
    names, tensors = list(values), list(values.values())
    config = ps_config(names, steps=10)
    controller.init(RUN_ID, {0: (list(range(len(names))), tensors)}, [{**config, "attempt": 1}])
    assert not controller.pull().flags & Flag.STOPPED
    controller.stop(attempt=0)  # late, for the attempt that is over
    assert not controller.pull().flags & Flag.STOPPED
    controller.stop(attempt=2)  # for an attempt yet to come
    controller.init(RUN_ID, {0: (list(range(len(names))), tensors)}, [{**config, "attempt": 2}])
    assert controller.pull().flags & Flag.STOPPED


def test_stats_before_init_has_only_server_counters(local_ps):
    client = local_ps.client(local_ps.start())
    stats = client.stats()[0]
    assert set(stats) == {"ps", "rejected", "failed_requests", "bytes_in", "bytes_out", "bells", "bell_requests"}
    assert stats["bytes_in"] > 0 and stats["rejected"] == dict.fromkeys(REJECTED, 0)


def test_init_then_pull_returns_initial_values(start_run, values):
    run = start_run(values)
    reply = run.client(task=0).pull()
    assert reply.step == 0 and reply.flags == Flag.NONE
    assert reply.messages[0].ids == [0, 1]
    assert_values(run.values(run.client()), run.initial, tol=0)


def test_init_retry_of_the_same_run_keeps_the_trained_values(start_run, values):
    run = start_run(values, mode="async")
    chief = run.client(task=0)
    chief.push(0, run.split(grads(1, run.initial)))
    trained = run.values(chief)
    chief.init(7, run.split(run.initial), [ps_config(run.names, mode="async", workers=2)])  # a retry: nothing reset
    assert_values(run.values(chief), trained, tol=0)
    assert chief.pull().step == 1


@pytest.mark.parametrize("config, problem", [
    ({"mode": "sync"}, "bad INIT"),
    ({"options": {"mode": "sync", "steps": 1}, "num_workers": 1, "names": ["w", "b"],
      "optimizer": {"optimizer": "nosuch"}}, "unknown optimizer 'nosuch'"),
    ({"options": {"mode": "sync", "steps": 1}, "num_workers": 1, "names": ["w", "b"],
      "optimizer": {"optimizer": "sgd", "kwargs": {"lr": 0.1, "betas": [0.9, 0.9]}}}, "bad INIT"),
    ({"options": {"mode": "sync", "steps": 1}, "num_workers": 1, "names": ["w", "b"],
      "optimizer": {"optimizer": "sgd"}, "bogus": 1}, "bad INIT: INIT config: .*unexpected keyword argument 'bogus'"),
    ({"options": {"mode": "sync", "steps": 1, "bogus": 1}, "num_workers": 1, "names": ["w", "b"],
      "optimizer": {"optimizer": "sgd"}}, r"bad INIT: unknown run options \['bogus'\]"),
    ({"options": [1, 2], "num_workers": 1, "names": ["w", "b"], "optimizer": {"optimizer": "sgd"}}, "bad INIT"),
])
def test_bad_init_is_an_error_reply(local_ps, values, config, problem):
    client = local_ps.client(local_ps.start())
    with pytest.raises(TrainingError, match=f"ps 0: .*{problem}"):
        client.init(3, {0: ([0, 1], list(values.values()))}, [config])
    assert client.pull() is None  # still not initialized, still serving


def test_requests_of_a_replaced_run_are_refused(start_run, values):
    run = start_run(values)  # run 7
    old = run.local.client(run.spec, run_id=7)
    assert old.pull() is not None
    per_ps = run.split(run.initial)
    run.local.client(run.spec).init(3, per_ps, [ps_config(run.names)])  # a lower id is fine: ids need not grow
    with pytest.raises(TrainingError, match="run 7 is over: ps 0 serves run 3"):
        old.pull()
    unseen = run.local.client(run.spec, run_id=5)
    assert unseen.pull() is None  # a run that is not initialized yet


def test_a_reply_op_sent_as_a_request_is_an_error(local_ps):
    client = local_ps.client(local_ps.start())
    with pytest.raises(TrainingError, match="ps 0: op PARAMS is not a request"):
        client.request(Op.PARAMS)


def test_push_of_other_variables_is_an_error(start_run, values):
    client = start_run(values).client(task=0)
    with pytest.raises(TrainingError,
                       match=r"push holds variables \[1\]: ps 0 takes \[0, 1\] and its sparse ones, each once"):
        client.push(0, {0: ([1], [torch.zeros(4)])})


# --- sync mode -------------------------------------------------------------------------------


def test_sync_applies_one_averaged_update_per_step(start_run, values):
    run = start_run(values, mode="sync", replicas=2)
    w0, w1 = run.client(task=0), run.client(task=1)
    g0, g1 = grads(1, run.initial), grads(2, run.initial)

    assert not w0.push(0, run.split(g0)).flags
    stats = w0.stats()[0]
    assert stats["step"] == 0 and stats["applied"] == 0 and stats["waiting_on"] == [0]
    assert_values(run.values(w0), run.initial, tol=0)  # one gradient of two: nothing applied yet

    w1.push(0, run.split(g1))
    assert w0.pull().step == 1
    expected = [p - LR * (a + b) / 2 for p, a, b in zip(run.initial, g0, g1)]
    assert_values(run.values(w1), expected)

    stale = w1.push(0, run.split(grads(3, run.initial)))  # computed on step 0, now step 1: dropped
    assert stale.flags & Flag.DROPPED and stale.value == 1
    stats = w0.stats()[0]
    assert (stats["step"], stats["applied"], stats["dropped_stale"], stats["pushes"]) == (1, 1, 1, 3)
    assert_values(run.values(w0), expected)


def test_sync_push_pull_waits_for_the_other_replica(start_run, values):
    run = start_run(values, mode="sync", replicas=2)
    w0, w1 = run.client(task=0), run.client(task=1)
    g0, g1 = grads(1, run.initial), grads(2, run.initial)
    first = {}
    thread = threading.Thread(target=lambda: first.update(reply=w0.push_pull(0, run.split(g0))))
    thread.start()
    try:
        thread.join(0.3)
        assert thread.is_alive() and not first, "push_pull returned before the second replica pushed"
        assert wait_until(lambda: w1.stats()[0]["waiting_on"] == [0], 5)
        second = w1.push_pull(0, run.split(g1))
    finally:
        thread.join(10)
    assert not thread.is_alive()
    expected = [p - LR * (a + b) / 2 for p, a, b in zip(run.initial, g0, g1)]
    for reply in (first["reply"], second):
        assert reply.step == 1 and not reply.flags & Flag.DROPPED
        assert_values(reply.messages[0].tensors, expected)


def test_single_replica_sync_makes_progress_alone(start_run, values):
    run = start_run(values, mode="sync", replicas=1)
    chief = run.client(task=0)
    for step in range(3):
        assert chief.push_pull(step, run.split(grads(step, run.initial))).step == step + 1


def test_workers_added_count_from_their_first_request_and_removed_ones_are_stopped(start_run, values):
    run = start_run(values, mode="sync", replicas=2)
    w0, w1, w2, controller = run.client(task=0), run.client(task=1), run.client(task=2), run.client()
    controller.resize(workers=3, replicas=3)
    w0.push(0, run.split(grads(0, run.initial)))
    w1.push(0, run.split(grads(1, run.initial)))
    assert controller.stats()[0]["step"] == 1  # worker 2 has not joined: two gradients make the step
    assert w2.pull().step == 1  # a pull does not make it a member: the steps do not wait for it yet
    w2.push(1, run.split(grads(4, run.initial)))  # its first gradient of the current step does
    w0.push(1, run.split(grads(2, run.initial)))
    w1.push(1, run.split(grads(3, run.initial)))
    assert controller.stats()[0]["step"] == 2 and controller.stats()[0]["applied"] == 2
    w0.push(2, run.split(grads(5, run.initial)))
    w1.push(2, run.split(grads(6, run.initial)))
    assert controller.stats()[0]["step"] == 2 and controller.stats()[0]["waiting_on"] == [0, 1]  # and for 2
    w2.push(2, run.split(grads(7, run.initial)))
    assert controller.stats()[0]["step"] == 3

    controller.resize(workers=1, replicas=1)
    removed = w2.push_pull(3, run.split(grads(8, run.initial)))
    assert removed.flags & Flag.STOPPED and removed.flags & Flag.DROPPED and not removed.messages[0].tensors
    assert w1.pull().flags & Flag.STOPPED
    assert w0.push_pull(3, run.split(grads(9, run.initial))).step == 4  # the chief alone makes the steps
    assert controller.stats()[0]["applied"] == 4


def test_a_worker_declared_lost_while_it_hung_is_fenced_off_and_its_replacement_trains(start_run, values):
    """Sync, 2 workers: worker 1 hangs; the controller declares it lost; the chief goes on alone; then the hung
    process wakes and pushes: refused with an answer that ends it, its gradient never applied. Its replacement
    (a new session of worker 1) trains."""
    run = start_run(values, mode="sync", replicas=2)
    chief, hung, controller = run.client(task=0), run.client(task=1), run.client()
    hung.pull()
    controller.lost_workers([1])
    assert chief.push_pull(0, run.split(grads(0, run.initial))).step == 1
    with pytest.raises(StaleTask, match="worker 1 was declared lost and replaced .* fenced off"):
        hung.push_pull(1, run.split(grads(9, run.initial)))
    stats = controller.stats()[0]
    assert (stats["step"], stats["applied"], stats["rejected"]["fenced"]) == (1, 1, 1)
    replacement = run.client(task=1)
    assert replacement.pull().step == 1
    joined = {}  # its first gradient of the step makes it a member again: the step waits for the chief's too
    gradient = run.split(grads(2, run.initial))
    thread = threading.Thread(target=lambda: joined.update(r=replacement.push_pull(1, gradient)))
    thread.start()
    try:
        assert wait_until(lambda: controller.stats()[0]["waiting_on"] == [1], 5)
        assert controller.stats()[0]["step"] == 1
        assert chief.push_pull(1, run.split(grads(1, run.initial))).step == 2
    finally:
        thread.join(10)
    assert joined["r"].step == 2
    with pytest.raises(StaleTask):  # still fenced
        hung.pull()


def test_a_worker_that_joins_while_the_ps_are_a_step_apart_holds_no_step(start_run, values):
    """Sync on 2 ps: ps 0 has applied step 0, ps 1 still waits for one gradient of it, when a replacement of
    worker 2 pulls (its reply's step is ps 0's: 1). It pushes step 1; ps 1 must not wait for its gradient of
    step 0, which it never computes: that held every worker for good."""
    run = start_run(values, num_ps=2, num_workers=3, mode="sync", replicas=3)
    w0, w1, controller = run.client(task=0), run.client(task=1), run.client()
    controller.lost_workers([2])
    g = run.split(grads(0, run.initial))
    for worker, targets in ((w0, [0, 1]), (w1, [0])):
        worker.request(Op.PUSH, g, step=0, targets=targets)
    assert [s["step"] for s in controller.stats()] == [1, 0]
    joiner = run.client(task=2)
    assert joiner.pull().step == 1
    joiner.push(1, run.split(grads(1, run.initial)))  # ps 1 drops it: computed on a step it has not reached
    w1.request(Op.PUSH, g, step=0, targets=[1])
    assert [s["step"] for s in controller.stats()] == [1, 1]


# --- async mode ------------------------------------------------------------------------------


def test_async_applies_every_push_and_reports_staleness(start_run, values):
    run = start_run(values, mode="async")
    w0, w1 = run.client(task=0), run.client(task=1)
    expected = [t.clone() for t in run.initial]
    pushes = [(w0, 0, 0), (w1, 0, 1), (w0, 0, 2), (w1, 2, 1), (w0, 4, 0)]  # client, computed on, staleness
    for n, (client, computed_on, staleness) in enumerate(pushes):
        g = grads(n, run.initial)
        reply = client.push(computed_on, run.split(g))
        assert reply.value == staleness and not reply.flags
        expected = [p - LR * d for p, d in zip(expected, g)]
        assert_values(run.values(client), expected, tol=1e-5)
    stats = w0.stats()[0]
    assert stats["staleness"] == {"0": 2, "1": 2, "2": 1}
    assert (stats["step"], stats["applied"], stats["dropped_stale"]) == (5, 5, 0)


def test_adam_state_lives_on_the_ps(start_run, values):
    run = start_run(values, mode="async", optimizer="adam", lr=0.01)
    client = run.client(task=0)
    for step in range(2):
        client.push(step, run.split(grads(step, run.initial)))
    optimizer = run.servers[0].run.optimizer.optimizers[0]
    assert isinstance(optimizer, torch.optim.Adam)
    for p, initial in zip(run.servers[0].run.params, run.initial):
        state = optimizer.state[p]
        assert state["exp_avg"].shape == initial.shape and state["exp_avg_sq"].shape == initial.shape
        assert int(state["step"]) == 2


def test_a_ps_keeps_a_copy_of_its_values_and_optimizer_state_at_its_step(start_run, values, tmp_path):
    """The copy a lost ps's optimizer state comes back from (``rescue``): Adam's slots as the ps holds them at the
    step the receipt names, with the shapes of the ps's variables; written again once the last one is old enough (``keep_state_copy``)."""
    run = start_run(values, mode="async", optimizer="adam", lr=0.01, checkpoint_dir=str(tmp_path))
    server = run.servers[0].run
    client = run.client(task=0)
    client.push(0, run.split(grads(0, run.initial)))
    receipt = json.loads((tmp_path / "copies" / "ps-0.json").read_text())
    assert receipt["step"] == 1 and receipt["run_id"] == RUN_ID
    client.push(1, run.split(grads(1, run.initial)))
    time.sleep(max(0.0, server.state_copy_due - time.monotonic()))
    client.push(2, run.split(grads(2, run.initial)))
    receipt = json.loads((tmp_path / "copies" / "ps-0.json").read_text())
    assert receipt["step"] == 3
    held, slots = checkpoint.split_state(checkpoint.read_tensors(tmp_path / receipt["file"]))
    assert held == {}  # the values are the workers' to keep
    for name, param in zip(server.names, server.params):
        assert receipt["shapes"][name] == list(param.shape)
        state = server.optimizer.optimizers[0].state[param]
        assert torch.equal(slots[name]["exp_avg_sq"], state["exp_avg_sq"]) and int(slots[name]["step"]) == 3


def test_a_push_carries_the_learning_rate_of_its_update(start_run, values):
    """A user's loop sets its groups' options (a warmup's lr) and they go with the push: each update uses its own."""
    run = start_run(values, mode="async")
    client = run.client(task=0)
    expected = [t.clone() for t in run.initial]
    for n, lr in enumerate((0.5, 0.05, None)):  # None: no options sent, the last ones stay
        g = grads(n, run.initial)
        client.push_pull(n, run.split(g), meta=None if lr is None else {"groups": [{"lr": lr}]})
        expected = [p - (lr or 0.05) * d for p, d in zip(expected, g)]
        assert_values(run.values(client), expected, tol=1e-5)


def huge(like, scale: float) -> list[torch.Tensor]:
    return [torch.full_like(t, scale) for t in like]


@pytest.mark.parametrize("mode, optimizer, lr, scale", [("async", "sgd", 10.0, 1e38), ("sync", "adam", 0.01, 1e30)])
def test_an_update_that_would_leave_a_non_finite_value_is_refused_whole_and_ends_the_run(start_run, values, mode,
                                                                                        optimizer, lr, scale):
    """Finite gradients whose update overflows: SGD's value (1 - 10 * 1e38), Adam's squared gradient (1e60). The
    ps applies none of it; every worker request from then on gets the cause; the controller's still answered."""
    run = start_run(values, mode=mode, optimizer=optimizer, lr=lr, replicas=2)
    w0, w1 = run.client(task=0), run.client(task=1)
    for client in (w0, w1):
        client.push(0, run.split(grads(1, run.initial)))  # one good step
    ps = run.servers[0].run
    step = ps.step  # sync: 1, async: 2
    before = [p.clone() for p in ps.params]
    state_before = {k: v.clone() for k, v in ps.optimizer.state(ps.params[0]).items()}
    plain = [p.clone() for p in before]  # what torch's own step would make of it
    reference = getattr(torch.optim, {"sgd": "SGD", "adam": "Adam"}[optimizer])(
        [torch.nn.Parameter(p) for p in plain], lr=lr)
    assert not all(torch.isfinite(t).all() for t in _stepped(reference, huge(run.initial, scale)))

    held = {}
    waiting = threading.Thread(target=lambda: held.setdefault("error", _error(lambda: w0.push_pull(
        1, run.split(huge(run.initial, scale))))))
    waiting.start()
    if mode == "sync":
        assert wait_until(lambda: len(ps.waiting) == 1, 10)  # the first push held
        error = _error(lambda: w1.push_pull(1, run.split(huge(run.initial, scale))))
    waiting.join(10)
    errors = [held["error"]] + ([error] if mode == "sync" else [])
    for e in errors:
        assert isinstance(e, TrainingError) and f"ps 0 refused the update from global step {step}" in str(e), e
        assert "lower the learning rate" in str(e)
    for p, b in zip(ps.params, before):
        assert torch.equal(p, b)  # nothing of it applied
    for k, v in ps.optimizer.state(ps.params[0]).items():
        assert torch.equal(v, state_before[k]), k
    assert ps.step == step
    with pytest.raises(TrainingError, match="refused the update"):
        w1.pull()
    assert run.client().stats()[0]["step"] == step  # the controller is still answered


def _stepped(optimizer, gradients) -> list[torch.Tensor]:
    """The values and state after one step of ``optimizer`` with ``gradients``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p, g in zip(params, gradients):
        p.grad = g
    optimizer.step()
    return params + [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


def _error(call) -> Exception | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test looks at what it was
        return e
    return None


@pytest.mark.parametrize("groups", [[{"lr": "fast"}], [{"lr": float("nan")}], [{"params": 1.0}], [{"nope": 1.0}],
                                    [{"lr": 0.1}] * 5, "lr", [{"momentum": [0.9, 0.9]}], [[0.1]], 7])
def test_bad_group_options_in_a_push_are_refused_and_the_server_goes_on(start_run, values, groups):
    run = start_run(values, mode="async")
    client = run.client(task=0, timeout=0.5)
    with pytest.raises(TrainingError, match="group option|groups|options"):
        client.push_pull(0, run.split(grads(0, run.initial)), meta={"groups": groups})
    assert run.servers[0].running and run.servers[0].rejected["malformed"] == 1
    assert_values(run.values(client), run.initial, tol=0)  # nothing applied, nothing changed
    assert float(run.servers[0].run.optimizer.optimizers[0].param_groups[0]["lr"]) == LR


# --- stopping --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_step_target_stops_the_run_and_later_pushes_are_late(start_run, values, mode):
    run = start_run(values, mode=mode, steps=2, replicas=1)
    client = run.client(task=0)
    assert not client.push_pull(0, run.split(grads(0, run.initial))).flags & Flag.STOPPED
    reply = client.push_pull(1, run.split(grads(1, run.initial)))
    assert reply.step == 2 and reply.flags & Flag.STOPPED and not reply.flags & Flag.DROPPED
    final = run.values(client)

    late = client.push_pull(2, run.split(grads(2, run.initial)))
    assert late.flags & Flag.STOPPED and late.flags & Flag.DROPPED and late.step == 2
    assert_values(run.values(client), final, tol=0)
    stats = client.stats()[0]
    assert (stats["late"], stats["applied"], stats["stopped"]) == (1, 2, True)


def test_stop_op_stops_the_run_and_releases_waiting_workers(start_run, values):
    run = start_run(values, mode="sync", replicas=2)
    worker, controller = run.client(task=0), run.client()
    waiting = {}
    thread = threading.Thread(target=lambda: waiting.update(reply=worker.push_pull(0, run.split(run.initial))))
    thread.start()
    try:
        assert wait_until(lambda: controller.stats()[0]["waiting_on"] == [0], 5)
        controller.stop()
    finally:
        thread.join(10)
    assert waiting["reply"].flags & Flag.STOPPED
    assert controller.pull().flags & Flag.STOPPED
    assert controller.stats()[0]["applied"] == 0


def test_a_stop_in_two_phases_ends_every_ps_on_the_same_step(start_run, values):
    run = start_run(values, mode="async", num_ps=2)
    worker, controller = run.client(task=0), run.client()
    push = run.split(grads(0, run.initial))
    worker.request(Op.PUSH, push, step=0, targets=[0])  # it reached ps 0 and is still on its way to ps 1
    assert controller.park() == 1  # ps 0 parked at step 1, ps 1 at step 0
    arrived = {}
    thread = threading.Thread(target=lambda: arrived.update(
        reply=worker.request(Op.PUSH, push, step=0, targets=[1])[0]))
    thread.start()
    try:
        assert wait_until(lambda: len(run.servers[1].run.parked) == 1, 5)  # held while parked, not applied
        assert [s["step"] for s in controller.stats()] == [1, 0]
        assert controller.stop(at_step=1) == 1
    finally:
        thread.join(10)
    assert not arrived["reply"].flags & Flag.DROPPED  # applied: ps 1 needed it to reach step 1
    assert [(s["step"], s["stopped"]) for s in controller.stats()] == [(1, True), (1, True)]


def test_shutdown_op_stops_the_server(local_ps):
    spec = local_ps.start()
    local_ps.client(spec).shutdown()
    assert wait_until(lambda: not local_ps.servers[0].running, 5)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("frames, counter", [
    ([b"garbage"], "unsigned"), ([b""] * 3, "unsigned"), ([b"a", b"b", b"c", b"d", b"e"], "unsigned"),
    ([b"PSCL" + bytes(100), b"", b"", bytes(16)], "unsigned"),
    ([b"PSCL" + bytes(100), b"", b"", bytes(32)], "bad_signature"),
    ([b""] * (protocol.DEFAULT_LIMITS.max_frames + 1), "malformed"),
], ids=["one-frame", "empty-frames", "five-frames", "short-mac", "bad-mac", "too-many-frames"])
def test_garbage_is_counted_and_the_server_goes_on(local_ps, frames, counter):
    spec = local_ps.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(spec.ps[0].address)
        dealer.send_multipart(frames)
        server = local_ps.servers[0]
        # the ps reads every frame it is sent: 393,221 of them for too-many-frames, one recv each, which takes
        # it 2-3 s of CPU alone and more beside other work (a deadline of 5 s failed beside a CPU hog)
        assert wait_until(lambda: sum(server.rejected.values()) == 1, 60)
        assert dealer.poll(200) == 0  # no reply to garbage
    finally:
        dealer.close(linger=0)
    client = local_ps.client(spec)
    assert client.request(Op.HELLO)[0].op is Op.OK
    assert client.stats()[0]["rejected"] == {**dict.fromkeys(REJECTED, 0), counter: 1}


def test_message_signed_with_another_key_is_dropped(local_ps):
    spec = local_ps.start()
    other = type(spec)(ps=spec.ps, workers=spec.workers)  # same addresses, another secret
    with pytest.raises(RuntimeTimeout, match="no reply to HELLO from ps \\[0\\]"):
        PSClient(other, timeout=0.3)
    server = local_ps.servers[0]
    assert wait_until(lambda: server.rejected["bad_signature"] == 1, 5)
    assert server.running and sum(server.rejected.values()) == 1


def test_failed_handshake_leaves_no_socket_open(local_ps):
    spec = local_ps.start()
    other = type(spec)(ps=spec.ps, workers=spec.workers)
    ctx = zmq.Context()
    with pytest.raises(RuntimeTimeout) as failure:  # `failure` keeps the failed client reachable
        PSClient(other, timeout=0.3, context=ctx)
    terminated = threading.Thread(target=ctx.term, daemon=True)
    terminated.start()
    terminated.join(1)  # term() waits for every socket of the context to be closed
    leaked = terminated.is_alive()
    del failure  # let the garbage collector close what leaked, so term() can finish
    gc.collect()
    assert not leaked, "PSClient.__init__ left its sockets open after the handshake failed"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_signed_push_with_wrong_shapes_is_an_error_not_a_crash(start_run, values, mode):
    run = start_run(values, mode=mode, replicas=1)
    client = run.client(task=0, timeout=0.5)
    wrong = [torch.ones(4), torch.ones(3, 4)]  # the shapes of `b` and `w`, swapped
    with pytest.raises(TrainingError):
        client.push(0, run.split(wrong))
    assert run.servers[0].running
    assert_values(run.values(client), run.initial, tol=0)


# --- several ps tasks ------------------------------------------------------------------------


def test_two_ps_tasks_hold_their_round_robin_share(start_run):
    values = {name: torch.full((i + 1,), float(i)) for i, name in enumerate(["a", "b", "c", "d", "e"])}
    run = start_run(values, num_ps=2, mode="async")
    client = run.client(task=0)
    stats = client.stats()
    assert [s["ps"] for s in stats] == [0, 1]
    assert stats[0]["variables"] == ["a", "c", "e"] and stats[1]["variables"] == ["b", "d"]
    assert [len(s.run.params) for s in run.servers] == [3, 2]

    reply = client.push_pull(0, run.split([torch.ones(i + 1) for i in range(5)]))
    assert [m.ids for m in reply.messages] == [[0, 2, 4], [1, 3]]
    assert_values(run.values(client), [torch.full((i + 1,), i - LR) for i in range(5)])
    assert [s["applied"] for s in client.stats()] == [1, 1]


# --- sessions: replays -----------------------------------------------------------------------


@pytest.fixture
def peers():
    """Factory of RawPeers (``address``, ``key``), closed at teardown."""
    made = []

    def make(address: str, key: bytes) -> RawPeer:
        made.append(RawPeer(address, key))
        return made[-1]

    yield make
    for p in made:
        p.close()


def push_message(run, seed: int = 1, **fields) -> Message:
    """A worker's correct PUSH of variables 0 and 1 of ``run`` (one ps), computed on step 0."""
    return Message(**{"op": Op.PUSH, "task": 0, "run_id": RUN_ID, "step": 0, "ids": [0, 1],
                      "tensors": grads(seed, run.initial), **fields})


def test_replayed_frames_are_dropped_and_counted(start_run, values, peers):
    run = start_run(values, mode="async", optimizer="adam", lr=0.01)
    first = peers(run.spec.ps[0].address, run.spec.key)
    hello = first.hello()
    push = first.signed(push_message(run))
    first.send(push)
    assert first.reply(5000).op is Op.OK  # applied once
    applied = run.values(run.client())
    optimizer = run.servers[0].run.optimizer.optimizers[0]
    state = {k: v.clone() for k, v in optimizer.state[run.servers[0].run.params[0]].items()}

    first.send(push)  # the same frames again, on the same connection
    first.send(hello)  # a HELLO again
    second = peers(run.spec.ps[0].address, run.spec.key)
    second.send(push)  # on another connection, before any HELLO
    second.hello()
    second.send(push)  # on another connection, in a session of its own
    server = run.servers[0]
    assert wait_until(lambda: server.rejected["replayed"] == 4, 5)
    assert first.reply(300) is None and second.reply(300) is None  # replays are not answered
    assert_values(run.values(run.client()), applied, tol=0)
    now = optimizer.state[run.servers[0].run.params[0]]
    assert all(torch.equal(now[k], v) for k, v in state.items())  # the optimizer never saw them
    stats = run.client().stats()[0]
    assert (stats["applied"], stats["pushes"]) == (1, 1)
    assert stats["rejected"] == {**dict.fromkeys(REJECTED, 0), "replayed": 4}


def test_frames_captured_on_an_earlier_ps_are_replays_there(local_ps, start_run, values, peers):
    run = start_run(values, mode="async")
    earlier = peers(run.spec.ps[0].address, run.spec.key)
    earlier.hello()
    push = earlier.signed(push_message(run))
    earlier.send(push)
    assert earlier.reply(5000).op is Op.OK
    # a new ps process of the same cluster (a replacement: same secret), initialized again
    server = ParameterServer(run.spec.key).start()
    local_ps.servers.append(server)
    spec = run.spec.with_ps_ports([server.port])
    local_ps.client(spec).init(RUN_ID, run.split(run.initial), [ps_config(run.names, mode="async")])
    attacker = peers(spec.ps[0].address, spec.key)
    attacker.send(push)
    attacker.hello()
    attacker.send(push)
    assert wait_until(lambda: server.rejected["replayed"] == 2, 5)
    assert_values(run.values(local_ps.client(spec, run_id=RUN_ID)), run.initial, tol=0)


def test_a_reply_sent_back_to_the_ps_is_dropped(start_run, values, peers):
    run = start_run(values)
    peer = peers(run.spec.ps[0].address, run.spec.key)
    peer.hello()
    reply = peer.request(Message(op=Op.STATS))
    peer.send(protocol.encode(reply, run.spec.key))  # signed by the ps itself, in this session, already used
    assert wait_until(lambda: run.servers[0].rejected["replayed"] == 1, 5)


# --- hostile signed requests -------------------------------------------------------------------


def _hostile(run) -> dict:
    """Signed, fresh requests that do not fit the run: name -> (message, what the ERROR says)."""
    g = grads(1, run.initial)
    return {
        "unknown-variable": (push_message(run, ids=[0, 9]), r"push holds variables \[0, 9\]"),
        "variable-twice": (push_message(run, ids=[0, 0]), r"push holds variables \[0, 0\]"),
        "wrong-shapes": (push_message(run, tensors=g[::-1]), "wrong shape or dtype"),
        "wrong-dtype": (push_message(run, tensors=[t.double() for t in g]), "wrong shape or dtype"),
        "negative-step": (push_message(run, step=-1), "computed on step -1"),
        "future-step": (push_message(run, step=2**62), "computed on step 4611686018427387904"),
        "from-the-controller": (push_message(run, task=protocol.NO_TASK), "PUSH from the controller"),
        "rows-of-a-dense-variable": (Message(op=Op.PULL_ROWS, task=0, run_id=RUN_ID, ids=[0],
                                             tensors=[torch.zeros(1, dtype=torch.int64)]), "not a sparse variable"),
        "a-billion-workers": (Message(op=Op.MEMBERSHIP, run_id=RUN_ID, meta={"workers": 10**9}), "1 to 65535"),
        "lost-not-a-number": (Message(op=Op.MEMBERSHIP, run_id=RUN_ID, meta={"lost": [[1]]}), "MEMBERSHIP refused"),
        "checkpoint-past-the-end": (Message(op=Op.CHECKPOINT, run_id=RUN_ID, meta={"step": 10**6}), "no checkpoint"),
        "reply-op": (Message(op=Op.PARAMS, run_id=RUN_ID), "op PARAMS is not a request"),
        "init-negative-steps": (Message(op=Op.INIT, run_id=99, ids=[0], tensors=[torch.zeros(2)],
                                        meta=dict(ps_config(["w"]), options={"steps": -1})), "bad INIT: steps=-1: use"),
        "init-a-billion-workers": (Message(op=Op.INIT, run_id=99, ids=[0], tensors=[torch.zeros(2)],
                                           meta={**ps_config(["w"]), "num_workers": 10**9}),
                                           "bad INIT: 1000000000 workers"),
        "init-more-names-than-values": (Message(op=Op.INIT, run_id=99, ids=[0], tensors=[torch.zeros(2)],
                                                meta=ps_config(["w", "b"])), "bad INIT: 1 values"),
        "init-integer-parameters": (Message(op=Op.INIT, run_id=99, ids=[0], tensors=[torch.zeros(2, dtype=torch.int64)],
                                            meta=ps_config(["w"])), "bad INIT"),
    }


@pytest.mark.parametrize("name", list(_hostile(type("R", (), {"initial": [torch.zeros(3, 4), torch.zeros(4)]}))))
def test_a_signed_request_that_does_not_fit_is_refused_without_touching_the_optimizer(start_run, values, peers, name):
    run = start_run(values, mode="async", optimizer="adam", lr=0.01)
    msg, problem = _hostile(run)[name]
    peer = peers(run.spec.ps[0].address, run.spec.key)
    peer.hello()
    reply = peer.request(msg)
    assert reply.op is Op.ERROR and re.search(problem, reply.meta["error"]), reply.meta
    server = run.servers[0]
    assert server.rejected == {**dict.fromkeys(REJECTED, 0), "malformed": 1}
    assert server.run.run_id == RUN_ID and not server.run.optimizer.optimizers[0].state  # no Adam step was taken
    assert_values(run.values(run.client()), run.initial, tol=0)
    worker = run.client(task=0)  # and it goes on serving real workers
    assert worker.push_pull(0, run.split(grads(2, run.initial))).step == 1


def test_a_checkpoint_asked_of_a_step_passed_or_past_the_end_is_refused_and_not_counted_as_hostile(local_ps,
                                                                                                  tmp_path):
    # the controller's own requests, racing the run (it asks for the next step as the ps moves past it)
    spec = local_ps.start(num_workers=1)
    config = {**ps_config(["w"], mode="async", steps=10), "checkpoint_dir": str(tmp_path)}
    local_ps.client(spec).init(RUN_ID, {0: ([0], [torch.zeros(3)])}, [config])
    worker = local_ps.client(spec, 0, run_id=RUN_ID)
    for step in range(3):
        worker.push_pull(step, {0: ([0], [torch.ones(3)])})
    controller = local_ps.client(spec, run_id=RUN_ID)
    with pytest.raises(TrainingError, match=f"step 1 {PASSED}: ps 0 is at step 3"):
        controller.checkpoint(1)
    with pytest.raises(TrainingError, match="step 11 is beyond the run's 10 steps"):
        controller.checkpoint(11)
    controller.checkpoint(3)  # and the step it is at is written
    assert local_ps.servers[-1].rejected == dict.fromkeys(REJECTED, 0)


@pytest.fixture
def sparse_run(local_ps):
    """A run of one sparse 10 x 3 table (variable 0) and one dense bias (variable 1)."""
    spec = local_ps.start(num_workers=1)
    config = {**ps_config(["table", "bias"], mode="async"), "sparse": (True, False)}
    local_ps.client(spec).init(RUN_ID, {0: ([0, 1], [torch.zeros(10, 3), torch.zeros(3)])}, [config])
    return spec


@pytest.mark.parametrize("op, tensors, problem", [
    (Op.PULL_ROWS, [torch.tensor([0, 10])], r"out of range 0\.\.9"),
    (Op.PULL_ROWS, [torch.tensor([-1])], r"out of range 0\.\.9"),
    (Op.PULL_ROWS, [torch.zeros(11, dtype=torch.int64)], "at most 10 rows"),
    (Op.PULL_ROWS, [torch.zeros(2)], "1-D int64"),
    (Op.PUSH, [torch.tensor([1]), torch.ones(2, 3), torch.ones(3)], r"\(2, 3\) values for 1 rows"),
    (Op.PUSH, [torch.tensor([1]), torch.ones(1, 3, dtype=torch.float64), torch.ones(3)], "values for 1 rows"),
    (Op.PUSH, [torch.tensor([12]), torch.ones(1, 3), torch.ones(3)], "out of range"),
], ids=["row-past-the-end", "negative-row", "more-rows-than-the-table", "float-rows", "values-rows-mismatch",
        "values-dtype", "push-row-past-the-end"])
def test_sparse_requests_out_of_range_are_refused(local_ps, sparse_run, peers, op, tensors, problem):
    peer = peers(sparse_run.ps[0].address, sparse_run.key)
    peer.hello()
    ids = [0] if op is Op.PULL_ROWS else [0, 0, 1]
    reply = peer.request(Message(op=op, task=0, run_id=RUN_ID, ids=ids, tensors=tensors))
    assert reply.op is Op.ERROR and re.search(problem, reply.meta["error"]), reply.meta
    assert local_ps.servers[0].rejected["malformed"] == 1
    assert local_ps.servers[0].run.applied == 0


# --- limits ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda run: push_message(run, tensors=[torch.zeros(3, 4), torch.zeros(100_000)]),  # far past the model
    lambda run: push_message(run, ids=[0, 1, 0, 1, 0], tensors=[torch.zeros(1)] * 5),  # more tensors than a push has
    lambda run: Message(op=Op.STATS, meta={"pad": "x" * 70_000}),  # a JSON frame no request needs
], ids=["bytes", "tensors", "json"])
def test_a_run_holds_requests_to_the_sizes_of_its_variables(start_run, values, peers, make):
    run = start_run(values, mode="async")
    peer = peers(run.spec.ps[0].address, run.spec.key)
    peer.hello()
    assert peer.request(make(run), timeout_ms=300) is None  # dropped before it is read
    assert run.servers[0].rejected == {**dict.fromkeys(REJECTED, 0), "malformed": 1}
    assert peer.request(Message(op=Op.STATS)).op is Op.OK  # the session goes on


def test_init_of_the_next_run_is_not_held_to_the_running_ones_sizes(start_run, values):
    run = start_run(values, mode="async")
    bigger = {"w": torch.zeros(300, 400), "b": torch.zeros(400)}
    controller = run.local.client(run.spec)
    controller.init(RUN_ID + 1, {0: ([0, 1], list(bigger.values()))}, [ps_config(list(bigger))])
    assert run.servers[0].run.run_id == RUN_ID + 1


def test_zeromq_refuses_frames_past_the_frame_limit(local_ps, peers):
    spec = make_spec(1, 1)
    server = ParameterServer(spec.key, max_frame_bytes=1 << 20).start()
    local_ps.servers.append(server)
    spec = spec.with_ps_ports([server.port])
    peer = peers(spec.ps[0].address, spec.key)
    peer.send([bytes(2 << 20)] * 4)  # the transport drops the connection: the ps never sees it
    peer.send([b"small"])  # on the connection ZeroMQ makes again
    assert wait_until(lambda: server.rejected["unsigned"] == 1, 5)
    assert sum(server.rejected.values()) == 1 and server.bytes_in == len(b"small")


def test_rejected_counts_reach_the_collector_as_events(local_ps, values):
    spec = local_ps.start()
    events = []
    collector = Collector(events.extend, spec.key)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        config = {**ps_config(list(values)), "metrics_address": collector.address}
        local_ps.client(spec).init(RUN_ID, {0: ([0, 1], list(values.values()))}, [config])
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(spec.ps[0].address)
        for frames in ([b"x"], [b"y"], [b"z"] * 4 + [bytes(32)]):
            dealer.send_multipart(frames)

        def reported():
            return [e for e in events if e["kind"] == "rejected" and e["unsigned"] == 2]
        assert wait_until(reported, 5)
        assert reported()[-1]["task"] == "ps:0" and reported()[-1]["bad_signature"] == 1
    finally:
        dealer.close(linger=0)
        collector.close()


# --- CURVE encryption ----------------------------------------------------------------------------


def test_an_encrypted_ps_serves_curve_clients_only(local_ps, values):
    spec = replace(make_spec(1, 1), encrypt=True)
    server = ParameterServer(spec.key, encrypt=True).start()
    local_ps.servers.append(server)
    spec = spec.with_ps_ports([server.port])
    local_ps.client(spec).init(RUN_ID, {0: ([0, 1], list(values.values()))}, [ps_config(list(values), mode="async")])
    g = grads(1, list(values.values()))
    reply = local_ps.client(spec, 0, run_id=RUN_ID).push_pull(0, {0: ([0, 1], g)})
    assert reply.step == 1
    assert_values(reply.messages[0].tensors, [v - LR * d for v, d in zip(values.values(), g)])

    for _ in range(20):  # a plain client is refused at the handshake, and says so: never a send that hangs
        with pytest.raises(PeerLost, match="encrypt"):
            PSClient(replace(spec, encrypt=False), timeout=1.0)
    other = replace(spec, secret=make_spec(1, 1).secret)  # CURVE, but not this cluster's server key
    with pytest.raises((RuntimeTimeout, PeerLost)):
        PSClient(other, timeout=1.0)
    assert sum(server.rejected.values()) == 0  # neither reached the ps: refused by the transport
    assert server.run.applied == 1


def test_a_frame_past_a_ps_frame_limit_is_a_clear_error_before_it_is_sent(local_ps):
    spec = make_spec(1, 1)
    server = ParameterServer(spec.key, max_frame_bytes=1 << 16).start()
    local_ps.servers.append(server)
    client = local_ps.client(spec.with_ps_ports([server.port]))
    big = {"w": torch.zeros(4), "table": torch.zeros(100, 200)}  # 80,000 bytes
    with pytest.raises(ConfigError, match="a frame of 80000 bytes for ps 0, which receives at most 65536: start it "
                                          "with max_frame_bytes of at least"):
        client.init(RUN_ID, {0: ([0, 1], list(big.values()))}, [ps_config(list(big))])
    client.init(RUN_ID, {0: ([0], [big["w"]])}, [ps_config(["w"])])  # the connection is fine
    assert server.run.names == ["w"] and sum(server.rejected.values()) == 0


def test_a_ps_serving_one_run_is_done_once_the_supervisor_closes_it_and_tells_joining_workers_the_run(start_run,
                                                                                                      values):
    run = start_run(values, num_ps=2)
    controller = run.client()
    # a script's worker that starts after the chief learns the run from any ps: id, attempt, where metrics go
    for stats in controller.stats():
        assert (stats["run_id"], stats["attempt"], stats["stopped"]) == (RUN_ID, 0, False)
        assert "metrics_address" in stats and "checkpoint_dir" in stats
    assert not any(s.done_serving(quiet_s=3600) for s in run.servers)
    controller.stop()  # ended, not yet finalized: a ps waits for the supervisor (or an hour of quiet)
    assert not any(s.done_serving(quiet_s=3600) for s in run.servers)
    assert all(s.done_serving(quiet_s=0) for s in run.servers)  # ...which a supervisor that died never ends
    controller.close_run()
    assert all(s.done_serving(quiet_s=3600) for s in run.servers)
