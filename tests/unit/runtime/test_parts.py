"""Large messages in parts (``parts``): what a sender yields, what a receiver puts back together, what it
refuses; and a ps and its clients exchanging a model larger than one part over the socket, against plain torch."""

from dataclasses import replace

import pytest
import torch
import zmq

from pscluster.errors import BadSignature, MalformedMessage
from pscluster.runtime import parts, protocol
from pscluster.runtime.client import Pending
from pscluster.runtime.protocol import Flag, Limits, Message, Op
from pscluster.runtime.waiting import wait_until

from ..conftest import RUN_ID, ps_config

KEY = bytes(range(32))
MB = 2**20


def big_push(seed: int = 0) -> Message:
    """A push of a 20 MB embedding (payload frames of 8, 8 and 4 MB), a bias and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    return Message(op=Op.PUSH, task=1, run_id=RUN_ID, step=3, ids=[0, 1, 2],
                   tensors=[torch.randn(5 * MB // 4, 4, generator=g), torch.randn(10, generator=g),
                            torch.empty(0, 3)], meta={"note": "x"})


def reassembled(sent: list[list], key: bytes = KEY, limits: Limits = protocol.DEFAULT_LIMITS) -> Message:
    """The message a receiver puts back together from ``sent`` (a head, then its parts)."""
    head = protocol.decode(sent[0], key, limits)
    assert head.flags & Flag.PARTS and not any(parts.is_part(f) for f in sent[:1])
    assembly = parts.Assembly(head, sent[0][0], key)
    done = [assembly.feed(frames) for frames in sent[1:]]
    assert done == [False] * (len(sent) - 2) + [True]
    return assembly.message


def test_a_message_larger_than_a_part_travels_as_its_head_then_parts_and_comes_back_whole():
    msg = big_push()
    sent = list(parts.messages(msg, KEY))
    assert len(sent) == 1 + 3  # the head; two 8 MB chunks of the embedding; its last 4 MB and the pack (the bias,
    #                            the empty one)
    assert all(parts.is_part(frames) for frames in sent[1:])
    assert all(sum(memoryview(f).nbytes for f in frames[1:-1]) <= parts.PART_BYTES for frames in sent[1:])
    got = reassembled(sent)
    assert got.flags == Flag.NONE and (got.op, got.task, got.step, got.meta) == (Op.PUSH, 1, 3, {"note": "x"})
    assert got.ids == msg.ids and all(a.equal(b) for a, b in zip(got.tensors, msg.tensors))
    assert got.tensors[2].shape == (0, 3)


def test_a_head_sent_before_its_payloads_exist_takes_parts_of_any_grouping():
    """A worker pushing during backward: the head from shapes alone (meta tensors), then each payload frame as
    its own part as backward produces them, the small tensors last, in the pack."""
    msg = big_push()
    writer = parts.Writer(Message(op=msg.op, task=msg.task, run_id=msg.run_id, step=msg.step, ids=msg.ids,
                                  tensors=[t.to("meta") for t in msg.tensors], meta=msg.meta), KEY)
    frames = protocol.message_payloads(msg.tensors)
    sent = [writer.head] + [writer.part([f]) for f in frames]
    got = reassembled(sent)
    assert len(sent) == 1 + 3 + 1 and got.ids == msg.ids and all(a.equal(b) for a, b in zip(got.tensors, msg.tensors))


def test_a_large_message_carries_its_small_tensors_in_one_pack_in_its_last_part():
    """A model's shape: one large weight and a hundred small tensors (biases, norms), in parts."""
    g = torch.Generator().manual_seed(1)
    small = [torch.randn(64, generator=g) for _ in range(100)]
    msg = Message(op=Op.PUSH, task=1, run_id=RUN_ID, step=3, ids=list(range(101)),
                  tensors=[torch.randn(3 * MB, generator=g), *small])
    sent = list(parts.messages(msg, KEY))
    assert len(sent) == 1 + 2  # the head; 8 MB of the weight; its last 4 MB and the pack
    assert [memoryview(f).nbytes for f in sent[-1][1:-1]] == [4 * MB, 100 * 64 * 4]
    got = reassembled(sent)
    assert all(a.equal(b) for a, b in zip(got.tensors, msg.tensors))
    starts = [t.data_ptr() for t in got.tensors[1:]]
    assert starts == [starts[0] + 256 * k for k in range(100)]  # views of one pack, in table order

    head = parts.Writer(replace(msg, tensors=[t.to("meta") for t in msg.tensors]), KEY).head
    table = bytearray(head[1])
    table[protocol._TENSOR.size + 6] = 0  # a small tensor said to travel in frames of its own
    forged = [head[0], bytes(table), head[2]]
    with pytest.raises(MalformedMessage, match="packed otherwise"):
        protocol.decode([*forged, protocol.mac(KEY, forged)], KEY)


def test_a_message_of_one_part_or_less_is_one_plain_message():
    msg = Message(op=Op.PUSH, ids=[0], tensors=[torch.ones(parts.PART_BYTES // 4)])
    [frames] = list(parts.messages(msg, KEY))
    assert not parts.is_part(frames) and protocol.decode(frames, KEY).tensors[0].equal(msg.tensors[0])


def test_the_tags_kept_from_a_first_send_serve_the_next_send_of_the_same_payloads():
    msg = big_push()
    tags = protocol.PayloadTags()  # a ps tags its parameters once per step, as the first reply goes
    first = list(parts.messages(msg, KEY, tags))
    assert len(tags.tags) == 4 and bytes(first[0][0])[-protocol.SALT_SIZE:] == tags.salt  # 3 chunks and the pack
    again = list(parts.messages(msg, KEY, tags))  # the next reply of the step
    assert [bytes(f[-1]) for f in again[1:]] == [bytes(f[-1]) for f in first[1:]]
    assert all(a.equal(b) for a, b in zip(reassembled(again).tensors, msg.tensors))


def flipped(frames: list, index: int) -> list:
    frames = [bytearray(memoryview(f)) for f in frames]
    frames[index][len(frames[index]) // 2] ^= 1
    return frames


@pytest.mark.parametrize("what, change, error", [
    ("a payload byte", lambda sent: sent[:2] + [flipped(sent[2], 1)], BadSignature),
    ("a tag", lambda sent: sent[:2] + [flipped(sent[2], -1)], BadSignature),
    ("a part left out", lambda sent: sent[:2] + sent[3:], MalformedMessage),
    ("a part sent twice", lambda sent: sent[:3] + sent[2:3], MalformedMessage),
    ("a part of another message", lambda sent: sent[:2] + list(parts.messages(big_push(), KEY))[2:3], MalformedMessage),
    ("a tag of another part", lambda sent: sent[:2] + [[*sent[2][:-1], sent[1][-1]]], BadSignature),
    ("a part's header changed", lambda sent: sent[:2] + [flipped(sent[2], 0)], MalformedMessage),
])
def test_a_part_that_does_not_belong_where_it_arrives_is_refused(what, change, error):
    sent = change(list(parts.messages(big_push(), KEY)))
    assembly = parts.Assembly(protocol.decode(sent[0], KEY), sent[0][0], KEY)
    assert not assembly.feed(sent[1])
    with pytest.raises(error):
        for frames in sent[2:]:
            assembly.feed(frames)


def test_parts_tagged_with_another_key_are_refused():
    sent = list(parts.messages(big_push(), bytes(32)))
    head_frames = [*sent[0][:-1], protocol.mac(KEY, sent[0][:-1])]  # a head that verifies, parts that do not
    assembly = parts.Assembly(protocol.decode(head_frames, KEY), head_frames[0], KEY)
    with pytest.raises(BadSignature):
        assembly.feed(sent[1])


def test_a_head_is_held_to_the_limits_before_anything_is_allocated():
    sent = list(parts.messages(big_push(), KEY))
    with pytest.raises(MalformedMessage, match="at most"):
        protocol.decode(sent[0], KEY, Limits(max_message_bytes=8 * MB))
    head = protocol.decode(sent[0], KEY)
    with_payload = protocol.encode(Message(op=Op.PUSH, ids=[0], tensors=[torch.ones(2)]), KEY)
    forged = [*sent[0][:3], with_payload[3], sent[0][-1]]
    forged[-1] = protocol.mac(KEY, forged[:-1])
    with pytest.raises(MalformedMessage, match="payload frames"):
        protocol.decode(forged, KEY)
    assert head.tensors[0].shape == big_push().tensors[0].shape


# --- a ps and its clients, over the socket ------------------------------------------------------


def test_a_model_larger_than_a_part_trains_over_the_socket_as_plain_torch_does(local_ps):
    values = {"emb": torch.randn(3 * MB, 4), "b": torch.randn(7)}  # 48 MB: six parts each way
    spec = local_ps.start(num_workers=1)
    local_ps.client(spec).init(RUN_ID, {0: ([0, 1], list(values.values()))},
                               [ps_config(list(values), mode="async", steps=10)])
    worker = local_ps.client(spec, 0, run_id=RUN_ID)
    plain = [torch.nn.Parameter(v.clone()) for v in values.values()]
    sgd = torch.optim.SGD(plain, lr=0.1)
    for step in range(3):
        g = [torch.randn(v.shape) for v in values.values()]
        reply = worker.push_pull(step, {0: ([0, 1], g)})
        for p, d in zip(plain, g):
            p.grad = d
        sgd.step()
        assert reply.step == step + 1
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(reply.messages[0].tensors, plain))
    server = local_ps.servers[0]
    assert sum(server.rejected.values()) == 0 and not server.assembling


def test_a_ps_serves_others_while_a_message_in_parts_waits_and_drops_parts_without_a_head(local_ps):
    values = {"w": torch.randn(3 * MB, 4)}
    spec = local_ps.start(num_workers=2)
    local_ps.client(spec).init(RUN_ID, {0: ([0], list(values.values()))},
                               [ps_config(list(values), mode="async", steps=10, workers=2)])
    slow = local_ps.client(spec, 0, run_id=RUN_ID)
    other = local_ps.client(spec, 1, run_id=RUN_ID)
    server = local_ps.servers[0]
    msg = Message(op=Op.PUSH, task=0, run_id=RUN_ID, request_id=next(slow._ids), nonce=slow._nonces[0],
                  ids=[0], tensors=[torch.ones(3 * MB, 4)])
    sent = list(parts.messages(msg, spec.key))
    sock = slow._socks[0]
    for frames in sent[:2]:  # the head and one part: the rest is late (a slow link)
        sock.send_multipart(frames)
    assert other.push_pull(0, {0: ([0], [torch.zeros(3 * MB, 4)])}).step == 1  # served meanwhile
    assert len(server.assembling) == 1
    for frames in sent[2:]:
        sock.send_multipart(frames)
    [reply] = slow.collect(Pending(msg.op, {0: (msg.request_id, msg.nonce)}))
    assert reply.op is Op.OK and reply.step == 2
    assert not server.assembling

    stray = zmq.Context.instance().socket(zmq.DEALER)
    try:
        stray.connect(spec.ps[0].address)
        stray.send_multipart(sent[2])  # a part, without its head on this connection
        assert wait_until(lambda: server.rejected["malformed"] == 1, 5)
    finally:
        stray.close(linger=0)

