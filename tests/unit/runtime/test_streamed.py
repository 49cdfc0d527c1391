"""A ps applying the gradient of a large variable as its parts arrive (``streamed``): chunk by chunk, against
plain torch; what it does not stream; a run stopped and a sender lost while a push is on its way."""

import pytest
import torch
import zmq

from pscluster.errors import TrainingError
from pscluster.runtime import checkpoint, parts
from pscluster.runtime.client import Pending
from pscluster.runtime.protocol import CHUNK_BYTES, Message, Op
from pscluster.runtime.waiting import wait_until

from ..conftest import RUN_ID, ps_config

MB = 2**20
SHAPE = (5 * MB // 4, 4)  # 20 MB of float32: payload frames of 8, 8 and 4 MB, one part each
FRAME = CHUNK_BYTES // 4  # elements of one frame


def start(local_ps, optimizer: str, kwargs: dict, *, mode: str = "async", **fields):
    """A ps holding a 20 MB variable ``w`` and a bias, a worker 0 to push in parts by hand, a worker 1, and the
    same variables in plain torch with the same optimizer."""
    torch.manual_seed(0)
    values = [torch.randn(SHAPE), torch.randn(7)]
    spec = local_ps.start(num_workers=2)
    config = ps_config(["w", "b"], mode=mode, steps=10, workers=2, optimizer=optimizer, **kwargs, **fields)
    local_ps.client(spec).init(RUN_ID, {0: ([0, 1], values)}, [config])
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    reference = getattr(torch.optim, optimizer)(plain, **kwargs)
    return spec, local_ps.servers[0], plain, reference


def send_in_parts(client, step: int, grads: list[torch.Tensor]) -> tuple[Message, list[list]]:
    """Worker ``client``'s PUSH_PULL of ``grads`` as the frame lists it travels in, none sent yet."""
    msg = Message(op=Op.PUSH_PULL, task=client.task, run_id=RUN_ID, request_id=next(client._ids),
                  nonce=client._nonces[0], step=step, ids=[0, 1], tensors=grads)
    return msg, list(parts.messages(msg, client.spec.key))


def send_head_and_first_part(server, client, sent: list[list]) -> None:
    """Send the head and the first part (w's first 8 MB) of ``sent``, and wait until the ps has taken them."""
    before = server.bytes_in
    for frames in sent[:2]:
        client._socks[0].send_multipart(frames)
    assert wait_until(lambda: server.bytes_in >= before + CHUNK_BYTES, 10)


def reply_to(client, msg: Message) -> Message:
    [reply] = client.collect(Pending(msg.op, {0: (msg.request_id, msg.nonce)}))
    return reply


@pytest.mark.parametrize("optimizer, kwargs", [("SGD", {"lr": 0.5}), ("Adam", {"lr": 0.01, "weight_decay": 0.1})])
def test_a_large_async_push_is_applied_chunk_by_chunk_as_its_parts_arrive_and_whole_it_is_torch_s_step(
        local_ps, optimizer, kwargs):
    spec, server, plain, reference = start(local_ps, optimizer, kwargs)
    worker, other = local_ps.client(spec, 0, run_id=RUN_ID), local_ps.client(spec, 1, run_id=RUN_ID)
    before = other.pull().messages[0].tensors[0].clone()
    grads = [torch.randn(SHAPE), torch.randn(7)]
    msg, sent = send_in_parts(worker, 0, grads)
    assert len(sent) == 1 + 3
    send_head_and_first_part(server, worker, sent)  # the head and the first 8 MB of w: the rest is on its way
    seen = other.pull()  # lock-free, as an async ps: the chunk that is in, applied; the others not yet
    assert seen.step == 0
    first, rest = seen.messages[0].tensors[0].reshape(-1)[:FRAME], seen.messages[0].tensors[0].reshape(-1)[FRAME:]
    assert not first.equal(before.reshape(-1)[:FRAME]) and rest.equal(before.reshape(-1)[FRAME:])
    [assembly] = server.assembling._open.values()
    assert assembly.message.tensors[0].is_meta  # w's gradient is never put together on the ps
    for frames in sent[2:]:
        worker._socks[0].send_multipart(frames)
    reply = reply_to(worker, msg)
    plain_step = [p for p in plain]
    for p, g in zip(plain_step, grads):
        p.grad = g
    reference.step()
    assert reply.step == 1
    for got, expected in zip(reply.tensors, plain):
        torch.testing.assert_close(got, expected.detach(), rtol=0, atol=1e-6)
    assert sum(server.rejected.values()) == 0 and not server.assembling


def test_a_sync_step_sums_the_chunks_as_they_arrive_and_changes_nothing_until_it_has_every_gradient(local_ps):
    spec, server, plain, reference = start(local_ps, "Adam", {"lr": 0.01}, mode="sync", replicas_to_aggregate=2)
    worker, other = local_ps.client(spec, 0, run_id=RUN_ID), local_ps.client(spec, 1, run_id=RUN_ID)
    controller = local_ps.client(spec, run_id=RUN_ID)
    before = controller.pull_all().messages[0].tensors[0].clone()
    grads = [[torch.randn(SHAPE), torch.randn(7)] for _ in range(2)]
    msg, sent = send_in_parts(worker, 0, grads[0])
    send_head_and_first_part(server, worker, sent)  # worker 0's first chunk: summed
    [assembly] = server.assembling._open.values()
    assert assembly.message.tensors[0].is_meta  # never put together
    received = server.bytes_in
    pending = other.send(Op.PUSH_PULL, {0: ([0, 1], grads[1])})  # worker 1's whole push, added to the same sums
    assert wait_until(lambda: server.bytes_in >= received + grads[1][0].numel() * 4, 10)
    seen = controller.pull_all()  # a step is one update of every variable: nothing yet
    assert seen.step == 0 and seen.messages[0].tensors[0].equal(before)
    for frames in sent[2:]:
        worker._socks[0].send_multipart(frames)
    replies = [reply_to(worker, msg), *other.collect(pending)]
    for p, g0, g1 in zip(plain, *grads):
        p.grad = (g0 + g1) / 2
    reference.step()
    for reply in replies:
        assert reply.step == 1
        for got, expected in zip(reply.tensors, plain):
            torch.testing.assert_close(got, expected.detach(), rtol=0, atol=1e-6)


def test_a_push_the_ps_refuses_changes_nothing_even_when_it_comes_in_parts(local_ps):
    spec, server, _, _ = start(local_ps, "SGD", {"lr": 0.5})
    worker, other = local_ps.client(spec, 0, run_id=RUN_ID), local_ps.client(spec, 1, run_id=RUN_ID)
    before = other.pull().messages[0].tensors[0].clone()
    with pytest.raises(TrainingError, match="wrong shape"):  # w's 20 MB in another shape: a different model
        worker.push_pull(0, {0: ([0, 1], [torch.ones(SHAPE[0] // 2, 8), torch.ones(7)])})
    after = other.pull()
    assert after.step == 0 and after.messages[0].tensors[0].equal(before)


def test_a_run_stopped_while_a_push_arrives_takes_no_more_of_it_and_its_last_checkpoint_holds_its_values(
        local_ps, tmp_path):
    spec, server, initial, _ = start(local_ps, "Adam", {"lr": 0.01}, checkpoint_dir=str(tmp_path))
    worker, controller = local_ps.client(spec, 0, run_id=RUN_ID), local_ps.client(spec, run_id=RUN_ID)
    msg, sent = send_in_parts(worker, 0, [torch.randn(SHAPE), torch.randn(7)])
    send_head_and_first_part(server, worker, sent)
    assert controller.stop() == 0  # stopped at step 0 with w's first chunk applied: its final shard is written
    final = server.run.params[0].detach().clone()
    for frames in sent[2:]:
        worker._socks[0].send_multipart(frames)
    reply = reply_to(worker, msg)
    assert reply.flags & reply.flags.DROPPED and reply.step == 0
    values, states = checkpoint.split_state(checkpoint.read_tensors(checkpoint.step_dir(tmp_path, 0) / "ps-0.tensors"))
    assert server.run.params[0].equal(final) and values["w"].equal(final)
    w, w0 = final.reshape(-1), initial[0].detach().reshape(-1)
    assert not w[:FRAME].equal(w0[:FRAME]) and w[FRAME:].equal(w0[FRAME:])
    assert "w" not in states and "b" not in states  # w: one chunk stepped, not the others; b: never stepped


def test_a_sender_lost_midway_leaves_its_push_applied_in_part_and_the_ps_serves_on(local_ps):
    spec, server, _, _ = start(local_ps, "SGD", {"lr": 0.5})
    other = local_ps.client(spec, 1, run_id=RUN_ID)
    before = other.pull().messages[0].tensors[0].clone()
    lost = local_ps.client(spec, 0, run_id=RUN_ID)
    msg, sent = send_in_parts(lost, 0, [torch.ones(SHAPE), torch.ones(7)])
    send_head_and_first_part(server, lost, sent)
    lost.close()  # its process died: its connection is gone
    reply = other.push_pull(0, {0: ([0, 1], [torch.zeros(SHAPE), torch.zeros(7)])})
    assert reply.step == 1  # the lost push never counts as a step
    w = reply.messages[0].tensors[0].reshape(-1)
    torch.testing.assert_close(w[:FRAME], before.reshape(-1)[:FRAME] - 0.5, rtol=0, atol=1e-6)
    assert w[FRAME:].equal(before.reshape(-1)[FRAME:])
    stray = zmq.Context.instance().socket(zmq.DEALER)
    try:  # what is left of it, from another connection: refused, counted
        stray.connect(spec.ps[0].address)
        stray.send_multipart(sent[2])
        assert wait_until(lambda: server.rejected["malformed"] == 1, 5)
    finally:
        stray.close(linger=0)


def test_a_sync_worker_lost_midway_leaves_its_chunks_so_far_in_the_step_s_mean_and_the_step_goes_on(local_ps):
    spec, server, plain, _ = start(local_ps, "SGD", {"lr": 1.0}, mode="sync", replicas_to_aggregate=2)
    lost, other = local_ps.client(spec, 0, run_id=RUN_ID), local_ps.client(spec, 1, run_id=RUN_ID)
    controller = local_ps.client(spec, run_id=RUN_ID)
    grads = [[torch.randn(SHAPE), torch.randn(7)] for _ in range(2)]
    msg, sent = send_in_parts(lost, 0, grads[0])
    send_head_and_first_part(server, lost, sent)
    controller.lost_workers([0])  # the step needs one gradient now
    reply = other.push_pull(0, {0: ([0, 1], grads[1])})
    assert reply.step == 1
    w0, w1, start_w = grads[0][0].reshape(-1), grads[1][0].reshape(-1), plain[0].detach().reshape(-1)
    w = reply.messages[0].tensors[0].reshape(-1)
    torch.testing.assert_close(w[:FRAME], start_w[:FRAME] - (w0[:FRAME] + w1[:FRAME]) / 2, rtol=0, atol=1e-6)
    torch.testing.assert_close(w[FRAME:], start_w[FRAME:] - w1[FRAME:], rtol=0, atol=1e-6)
    for frames in sent[2:]:  # the rest of the lost worker's push, late: its step is over, none of it is taken
        lost._socks[0].send_multipart(frames)
    assert wait_until(lambda: not server.assembling, 10)
    assert controller.pull_all().messages[0].tensors[0].reshape(-1).equal(w)


def test_a_checkpoint_in_the_middle_of_a_sync_step_holds_the_values_of_the_step_before(local_ps, tmp_path):
    spec, server, initial, _ = start(local_ps, "SGD", {"lr": 1.0}, mode="sync", replicas_to_aggregate=2,
                                     checkpoint_dir=str(tmp_path))
    first, last = local_ps.client(spec, 0, run_id=RUN_ID), local_ps.client(spec, 1, run_id=RUN_ID)
    pending = first.send(Op.PUSH_PULL, {0: ([0, 1], [torch.ones(SHAPE), torch.ones(7)])})  # whole, held
    msg, sent = send_in_parts(last, 0, [torch.ones(SHAPE), torch.ones(7)])
    send_head_and_first_part(server, last, sent)  # the step's last gradient, on its way
    local_ps.client(spec, run_id=RUN_ID).checkpoint()
    values, _ = checkpoint.split_state(checkpoint.read_tensors(checkpoint.step_dir(tmp_path, 0) / "ps-0.tensors"))
    assert values["w"].equal(initial[0].detach()) and values["b"].equal(initial[1].detach())
    for frames in sent[2:]:
        last._socks[0].send_multipart(frames)
    assert reply_to(last, msg).step == 1 and first.collect(pending)[0].step == 1
    torch.testing.assert_close(server.run.params[0].detach(), initial[0].detach() - 1, rtol=0, atol=1e-6)
