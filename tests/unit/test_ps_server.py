"""The ps server in this process, driven through PSClient over 127.0.0.1."""

import gc
import socket
import threading

import pytest
import torch
import zmq

from pscluster.errors import PeerLost, RuntimeTimeout, TrainingError
from pscluster.runtime import protocol
from pscluster.runtime.client import PSClient
from pscluster.runtime.protocol import Flag, Op
from pscluster.runtime.ps import wait_until
from pscluster.spec import ClusterSpec, TaskSpec

from .conftest import ps_config

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
    with socket.socket() as s:  # a port that nothing listens on: a ps that died before we connected
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = ClusterSpec(ps=(TaskSpec("ps", 0, port=port),), workers=(TaskSpec("worker", 0),))
    with pytest.raises(PeerLost, match=f"ps 0 at tcp://127.0.0.1:{port} refuses connections during HELLO"):
        PSClient(spec, timeout=60)  # RuntimeTimeout after 30 s if the refusals went unnoticed


def test_hello_and_pull_before_init(local_ps):
    spec = local_ps.start()
    client = local_ps.client(spec, run_id=1)  # the constructor's HELLO succeeded
    assert client.request(Op.HELLO)[0].value == protocol.PROTOCOL_VERSION
    assert client.pull() is None  # NOT_READY


def test_stats_before_init_has_only_server_counters(local_ps):
    client = local_ps.client(local_ps.start())
    stats = client.stats()[0]
    assert set(stats) == {"ps", "bad_messages", "failed_requests", "bytes_in", "bytes_out"}
    assert stats["bytes_in"] > 0 and stats["bad_messages"] == 0


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
    chief.init(7, run.split(run.initial), [{}])  # same run id: acknowledged, nothing reset
    assert_values(run.values(chief), trained, tol=0)
    assert chief.pull().step == 1


@pytest.mark.parametrize("config, problem", [
    ({"mode": "sync"}, "bad INIT"),
    ({"mode": "sync", "steps": 1, "replicas_to_aggregate": 1, "optimizer": "nosuch", "names": ["w", "b"]},
     "unknown optimizer 'nosuch'"),
    ({"mode": "sync", "steps": 1, "replicas_to_aggregate": 1, "optimizer": "sgd",
      "optimizer_kwargs": {"lr": 0.1, "betas": [0.9, 0.9]}, "names": ["w", "b"]}, "bad INIT"),
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
    with pytest.raises(TrainingError, match=r"push holds variables \[1\]: ps 0 has \[0, 1\], each once"):
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
    assert w2.pull().step == 1  # joined
    w0.push(1, run.split(grads(2, run.initial)))
    w1.push(1, run.split(grads(3, run.initial)))
    assert controller.stats()[0]["step"] == 1 and controller.stats()[0]["waiting_on"] == [0, 1]
    w2.push(1, run.split(grads(4, run.initial)))
    assert controller.stats()[0]["step"] == 2

    controller.resize(workers=1, replicas=1)
    removed = w2.push_pull(2, run.split(grads(5, run.initial)))
    assert removed.flags & Flag.STOPPED and removed.flags & Flag.DROPPED and not removed.messages[0].tensors
    assert w1.pull().flags & Flag.STOPPED
    assert w0.push_pull(2, run.split(grads(6, run.initial))).step == 3  # the chief alone makes the steps
    assert controller.stats()[0]["applied"] == 3


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
    optimizer = run.servers[0].run.optimizer
    assert isinstance(optimizer, torch.optim.Adam)
    for p, initial in zip(run.servers[0].run.params, run.initial):
        state = optimizer.state[p]
        assert state["exp_avg"].shape == initial.shape and state["exp_avg_sq"].shape == initial.shape
        assert int(state["step"]) == 2


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


@pytest.mark.parametrize("frames", [[b"garbage"], [b""] * 3, [b"a", b"b", b"c", b"d", b"e"],
                                    [b"PSCL" + bytes(100), b"", b"", bytes(16)]],
                         ids=["one-frame", "empty-frames", "five-frames", "bad-mac"])
def test_garbage_is_counted_and_the_server_goes_on(local_ps, frames):
    spec = local_ps.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(spec.ps[0].address)
        dealer.send_multipart(frames)
        server = local_ps.servers[0]
        assert wait_until(lambda: server.bad_messages == 1, 5)
        assert dealer.poll(200) == 0  # no reply to garbage
    finally:
        dealer.close(linger=0)
    client = local_ps.client(spec)
    assert client.request(Op.HELLO)[0].op is Op.OK
    assert client.stats()[0]["bad_messages"] == 1


def test_message_signed_with_another_key_is_dropped(local_ps):
    spec = local_ps.start()
    other = type(spec)(ps=spec.ps, workers=spec.workers)  # same addresses, another secret
    with pytest.raises(RuntimeTimeout, match="no reply to HELLO from ps \\[0\\]"):
        PSClient(other, timeout=0.3)
    server = local_ps.servers[0]
    assert wait_until(lambda: server.bad_messages == 1, 5)
    assert server.running


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
