"""Bells: a worker with a lane rings its ps through a pipe instead of the socket (``pscluster.runtime.bells``)."""

import os
import stat

import pytest
import torch

from pscluster.errors import StaleTask
from pscluster.runtime import bells
from pscluster.runtime.bells import Bell
from pscluster.runtime.lanes import LaneError
from pscluster.runtime.protocol import Flag
from pscluster.runtime.waiting import wait_until

from .test_lanes import grads, shared_client, values  # noqa: F401 - the fixture
from .test_ps_server import LR, assert_values


def test_lane_requests_ring_the_bell_and_give_what_the_socket_gives(start_run, values):
    rung, plain = start_run(values, mode="async"), start_run(values, mode="async")
    client, socket_client = shared_client(rung, 0), plain.client(task=0)
    bell = client._bells[0]
    assert not any(os.path.exists(os.path.join(bells.SHM_DIR, n)) for n in bell.names)  # both sides opened them
    before = rung.client().stats()[0]
    expected = [t.clone() for t in values.values()]
    for step in range(5):
        g = grads(step, expected)
        a, b = client.push_pull(step, rung.split(g)), socket_client.push_pull(step, plain.split(g))
        assert a.flags & Flag.SHARED and (a.step, a.value) == (b.step, b.value)
        expected = [p - LR * d for p, d in zip(expected, g)]
    after = rung.client().stats()[0]
    assert (before["bells"], after["bells"]) == (1, 1)
    assert after["bell_requests"] - before["bell_requests"] == 5  # every push-pull came by the bell
    assert_values(rung.values(client), expected, tol=1e-6)


def test_pipes_are_private_and_a_bell_is_refused_where_the_pipes_are_not(start_run, values):
    bell = Bell.make()
    try:
        for name in bell.names:
            mode = os.stat(os.path.join(bells.SHM_DIR, name)).st_mode
            assert stat.S_ISFIFO(mode) and mode & 0o777 == 0o600
    finally:
        bell.unlink()
        bell.close()
    with pytest.raises(LaneError, match="not a bell's pipe name"):
        Bell.attach({"requests": "../etc/passwd", "replies": "x"})
    with pytest.raises(LaneError, match="No such file"):  # what a ps on another host finds
        Bell.attach({"requests": f"pscluster-{'0' * 32}-bell", "replies": f"pscluster-{'1' * 32}-bell"})


def test_bytes_that_are_not_frames_close_the_bell_and_the_worker_goes_on_over_the_socket(start_run, values):
    run = start_run(values, mode="async")
    client, controller = shared_client(run, 0), run.client()
    bell = client._bells[0]
    assert bell.send(b"\xff" * 64)  # a length past PIPE_BUF: not a bell's message
    assert wait_until(lambda: controller.stats()[0]["bells"] == 0, 5)
    assert controller.stats()[0]["rejected"]["malformed"] == 1
    reply = client.push_pull(0, run.split(grads(0, run.initial)))  # the bell is gone: over the socket
    assert reply.flags & Flag.SHARED and reply.step == 1 and not client._bells
    assert_values(run.values(client), [p - LR * d for p, d in zip(run.initial, grads(0, run.initial))], tol=1e-6)


def test_a_worker_that_ends_closes_its_bell_on_the_ps(start_run, values):
    run = start_run(values, mode="async")
    client, controller = shared_client(run, 0), run.client()
    assert controller.stats()[0]["bells"] == 1
    client.close()
    assert wait_until(lambda: controller.stats()[0]["bells"] == 0, 5)


def test_a_fenced_worker_is_told_through_its_bell(start_run, values):
    run = start_run(values, mode="sync", replicas=2)
    chief, hung, controller = run.client(task=0), shared_client(run, 1), run.client()
    controller.lost_workers([1])
    assert chief.push_pull(0, run.split(grads(0, run.initial))).step == 1
    rung = controller.stats()[0]["bell_requests"]
    with pytest.raises(StaleTask, match="fenced off"):
        hung.push_pull(1, run.split(grads(9, run.initial)))
    stats = controller.stats()[0]
    assert stats["bell_requests"] == rung + 1 and stats["rejected"]["fenced"] == 1 and stats["applied"] == 1


def test_a_message_too_large_for_a_pipe_is_not_framed():
    assert bells.frame([b"x" * (bells.PIPE_BUF - 8)]) is not None
    assert bells.frame([b"x" * bells.PIPE_BUF]) is None
    assert bells.frame([torch.zeros(2).numpy().tobytes()] * 9) is None  # more frames than a bell carries
