"""Shared-memory lanes between a worker and a ps on the same host (``pscluster.runtime.lanes``)."""

import os
import secrets
import threading

import pytest
import torch

from pscluster.errors import TrainingError
from pscluster.runtime import host_copies, lanes
from pscluster.runtime.lanes import Lane, LaneError
from pscluster.runtime.protocol import Flag, Message, Op

from ..conftest import RUN_ID, ps_config
from .rawpeer import RawPeer
from .test_ps_server import LR, assert_values


@pytest.fixture
def values():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(30, 40, generator=g), "b": torch.randn(40, generator=g),
            "h": torch.randn(7, dtype=torch.float64, generator=g)}


def grads(seed: int, like) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in like]


def shared_client(run, task: int):
    client = run.client(task=task)
    assert client.share(client.pull()) == list(range(len(run.spec.ps)))
    return client


@pytest.mark.parametrize("num_ps", [1, 2])
def test_async_pushes_through_a_lane_give_what_the_socket_gives(start_run, values, num_ps):
    through_lane = start_run(values, mode="async", num_ps=num_ps)
    over_socket = start_run(values, mode="async", num_ps=num_ps)
    lane_client, socket_client = shared_client(through_lane, 0), over_socket.client(task=0)
    # both sides mapped them: their names are gone (this client's own: other tests' lanes may come and go meanwhile)
    paths = [segment.path for lane in lane_client._lanes.values() for segment in lane.segments]
    assert len(paths) == 2 * num_ps and not any(map(os.path.exists, paths))
    expected = [t.clone() for t in values.values()]
    for step in range(4):
        g = grads(step, expected)
        shared = lane_client.push_pull(step, through_lane.split(g))
        plain = socket_client.push_pull(step, over_socket.split(g))
        assert shared.flags & Flag.SHARED and not plain.flags & Flag.SHARED
        expected = [p - LR * d for p, d in zip(expected, g)]
        for reply in (shared, plain):
            by_id = {i: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
            assert_values([by_id[i] for i in range(len(expected))], expected, tol=1e-6)
    assert_values(through_lane.values(lane_client), over_socket.values(socket_client), tol=0)
    payload = sum(t.numel() * t.element_size() for t in values.values())
    assert lane_client.bytes_received >= 4 * payload  # what went through the lane is counted too
    assert lane_client.pull().flags & Flag.SHARED


def test_the_ps_writes_the_set_of_values_the_model_does_not_hold(start_run, values):
    run = start_run(values, mode="async")
    client = shared_client(run, 0)
    (lane,) = client._lanes.values()
    expected = [t.clone() for t in values.values()]
    held = None
    for step in range(4):
        g = grads(step, expected)
        kept = [t.clone() for t in lane.values[held]] if held is not None else None
        reply = client.push_pull(step, run.split(g))
        expected = [p - LR * d for p, d in zip(expected, g)]
        written = 1 if held == 0 else 0
        assert bool(reply.flags & Flag.SECOND) == bool(written)
        assert all(t is slot for t, slot in zip(reply.messages[0].tensors, lane.values[written]))
        assert_values(reply.messages[0].tensors, expected, tol=1e-6)
        if kept is not None:  # what the model computes with stays as it was
            assert_values(lane.values[held], kept, tol=0)
        if step != 1:  # a model that copied this reply still holds the set it took before: the ps writes the other
            client.hold({0: written})
            held = written


def test_sync_averages_a_lane_worker_with_a_socket_worker(start_run, values):
    run = start_run(values, mode="sync", replicas=2)
    w0, w1 = shared_client(run, 0), run.client(task=1)
    g0, g1 = grads(1, run.initial), grads(2, run.initial)
    first = {}
    thread = threading.Thread(target=lambda: first.update(reply=w0.push_pull(0, run.split(g0))))
    thread.start()
    second = w1.push_pull(0, run.split(g1))
    thread.join(10)
    expected = [p - LR * (a + b) / 2 for p, a, b in zip(run.initial, g0, g1)]
    assert first["reply"].flags & Flag.SHARED and not second.flags & Flag.SHARED
    for reply in (first["reply"], second):
        assert reply.step == 1
        assert_values(reply.messages[0].tensors, expected)


def test_a_ps_that_cannot_map_the_segments_leaves_the_worker_on_the_socket(start_run, values):
    run = start_run(values, mode="async")
    client = run.client(task=0)
    missing = {"grads": "pscluster-" + "0" * 32, "values": "pscluster-" + "1" * 32, "token": "00" * 16}
    reply = client.request(Op.SHARE, meta=missing)[0]  # what a ps on another host sees
    assert reply.value == 0 and "No such file" in reply.meta["error"]

    lane = Lane.for_tensors([0, 1, 2], list(values.values()))
    try:
        forged = {**lane.request(), "token": "ff" * lanes.TOKEN_BYTES}
        reply = client.request(Op.SHARE, meta=forged)[0]
        assert reply.value == 0 and "another token" in reply.meta["error"]
    finally:
        lane.unlink()
    assert not client.push_pull(0, run.split(grads(0, run.initial))).flags & Flag.SHARED


def test_a_worker_that_can_make_no_lane_says_why_and_stays_on_the_socket(start_run, values, monkeypatch):
    run = start_run(values, mode="async")
    client = run.client(task=0)
    monkeypatch.setattr(lanes, "SHM_DIR", "/nonexistent-shm")  # a machine without shared memory
    notes = []
    assert client.share(client.pull(), note=notes.append) == []
    assert len(notes) == 1 and "over the socket" in notes[0] and "/nonexistent-shm" in notes[0]
    assert not client.push_pull(0, run.split(grads(0, run.initial))).flags & Flag.SHARED


def test_a_lane_laid_out_for_other_variables_is_refused(start_run, values):
    run = start_run(values, mode="async")
    client = run.client(task=0)
    lane = Lane.for_tensors([0], [torch.zeros(3)])
    try:
        reply = client.request(Op.SHARE, meta=lane.request())[0]
    finally:
        lane.unlink()
    assert reply.value == 0 and "expected" in reply.meta["error"]


def test_a_shared_push_without_a_lane_or_after_the_next_init_is_an_error(start_run, values):
    run = start_run(values, mode="async")
    peer = RawPeer(run.spec.ps[0].address, run.spec.key)
    try:
        peer.hello()
        reply = peer.request(Message(op=Op.PUSH_PULL, flags=Flag.SHARED, task=0, run_id=RUN_ID))
        assert reply.op is Op.ERROR and "SHARE first" in reply.meta["error"]
    finally:
        peer.close()

    client = shared_client(run, 0)
    controller = run.client()
    controller.init(RUN_ID + 1, run.split(run.initial), [ps_config(run.names, mode="async")])
    client.run_id = RUN_ID + 1
    with pytest.raises(TrainingError, match="SHARE first"):  # a new run drops the lanes of the last
        client.push_pull(0, run.split(grads(0, run.initial)))


def test_a_segment_without_room_in_shared_memory_is_refused_and_leaves_no_file():
    name = f"pscluster-{secrets.token_hex(16)}"
    with pytest.raises(LaneError, match="no room for"):
        lanes.Segment(name, 1 << 52, create=True)  # 4 PiB: more than any /dev/shm holds
    assert not os.path.exists(os.path.join(lanes.SHM_DIR, name))


def test_segments_are_private_and_named_by_the_lane_module_only():
    lane = Lane.for_tensors([0], [torch.zeros(5)])
    try:
        for segment in lane.segments:
            assert os.stat(segment.path).st_mode & 0o777 == 0o600
    finally:
        lane.unlink()
    with pytest.raises(LaneError, match="not a lane segment name"):
        Lane.attach([0], [torch.zeros(5)], {"grads": "../etc/passwd", "values": "x", "token": "00" * 16})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("num_ps", [1, 2])
def test_gradients_on_a_gpu_go_through_a_pinned_lane_and_pinned_frames(start_run, values, num_ps):
    through_lane = start_run(values, mode="async", num_ps=num_ps)
    over_socket = start_run(values, mode="async", num_ps=num_ps)
    lane_client, socket_client = shared_client(through_lane, 0), over_socket.client(task=0)
    expected = [t.clone() for t in values.values()]
    for step in range(4):
        on_gpu = [t.cuda() for t in grads(step, expected)]
        expected = [p - LR * d.cpu() for p, d in zip(expected, on_gpu)]
        for client, run in ((lane_client, through_lane), (socket_client, over_socket)):
            reply = client.push_pull(step, run.split(on_gpu))
            by_id = {i: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
            assert_values([by_id[i] for i in range(len(expected))], expected, tol=1e-6)
    pinned = list(lane_client._lanes.values())
    assert pinned and all(t.is_pinned() for lane in pinned for t in lane.grads + lane.values[0] + lane.values[1])
    lane_client.close()
    assert not any(t.is_pinned() for lane in pinned for t in lane.grads + lane.values[0] + lane.values[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_memory_cuda_refuses_to_page_lock_leaves_no_error_for_the_next_kernel():
    lane = Lane.for_tensors([0], [torch.zeros(1 << 20)])
    try:
        segment = lane.segments[0]
        assert host_copies.pin(segment.address, len(segment.map))
        assert not host_copies.pin(segment.address, len(segment.map))  # already page-locked: refused
        assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # torch's launch check finds no error
        host_copies.unpin(segment.address)
    finally:
        lane.unlink()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_a_large_reply_to_a_gpu_worker_arrives_in_pinned_memory_and_reaches_the_gpu_as_sent(start_run):
    weight = torch.randn(1536, 2048, generator=torch.Generator().manual_seed(0))  # 12 MB: answered in parts
    run = start_run({"w": weight}, mode="async")
    gpu_worker, other = run.client(task=0, pinned=True), run.client(task=1)
    (gradient,) = grads(0, [weight])
    reply = gpu_worker.push_pull(0, run.split([gradient.cuda()]))
    (value,) = reply.messages[0].tensors
    assert value.is_pinned()
    assert_values([value], [weight - LR * gradient], tol=1e-6)
    on_gpu = torch.empty(value.shape, device="cuda")
    on_gpu.copy_(value, non_blocking=True)  # a DMA copy, queued without waiting
    assert torch.equal(on_gpu.cpu(), value)
    (pulled,) = other.pull().messages[0].tensors
    assert not pulled.is_pinned() and torch.equal(pulled, value)
