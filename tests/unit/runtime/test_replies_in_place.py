"""Replies that arrive where they belong (``PSClient.receive_into``, ``member.Shards.spare``): a CPU worker's
reply in parts is written into a spare of each large variable as its parts arrive and swapped in whole, never
copied (through a shared-memory lane, the lane's values are swapped in, ``PSClient.hold``); a reply spoiled midway
on the wire leaves the model as the last whole reply left it (what a worker's rescue copy holds). Against an
in-process ps over loopback TCP, compared with plain torch."""

import threading

import pytest
import torch
import zmq

from pscluster.errors import BadSignature
from pscluster.runtime import parts
from pscluster.runtime.member import Shards, initialize
from pscluster.runtime.seeding import build_model

from .test_overlap import Wide, plan_for
from .test_worker_inprocess import RUN_ID, SEED, dataset, plain_batches  # noqa: F401 - a fixture


class Tamper:
    """A hop between one client and a ps over loopback TCP that passes every message on, and flips a bit in the
    first payload of the ``n``-th part the ps sends after ``arm(n)`` (damage on the wire)."""

    def __init__(self, ps_address: str):
        ctx = zmq.Context.instance()
        self._front, self._back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        for s in (self._front, self._back):
            s.setsockopt(zmq.LINGER, 0)
        self.port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self._back.connect(ps_address)
        self._parts_left = 0  # armed: parts of the ps to pass before the one to spoil, plus one
        self.spoiled = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def arm(self, n: int) -> None:
        self._parts_left = n

    def _relay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._back, zmq.POLLIN)
        client = None
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                if sock is self._front:
                    client, *frames = self._front.recv_multipart()
                    self._back.send_multipart(frames)
                    continue
                frames = self._back.recv_multipart()
                if self._parts_left and parts.is_part(frames):
                    self._parts_left -= 1
                    if not self._parts_left:
                        payload = bytearray(frames[1])
                        payload[len(payload) // 2] ^= 1
                        frames[1] = bytes(payload)
                        self.spoiled.set()
                self._front.send_multipart([client, *frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._front.close()
        self._back.close()


@pytest.fixture
def tamper(local_ps):
    spec = local_ps.start(num_ps=1, num_workers=1)
    hop = Tamper(spec.ps[0].address)
    yield spec.with_ps_ports([hop.port]), hop
    hop.close()


def worker_half(local_ps, spec, steps):
    """A chief worker's model, its ``Shards`` and a client that receives into their spares, the run
    initialized (Wide with Adam over the socket: its 8.8 MB replies come in parts), and the first pull loaded."""
    plan = plan_for(spec, steps=steps, overlap=False)
    model = build_model(Wide, SEED)
    shards = Shards(model, plan, 1)
    client = local_ps.client(spec, 0, run_id=RUN_ID)
    client.receive_into(shards.spare)
    initialize(client, plan, shards, lambda *args, **kwargs: None)
    shards.load(client.pull())
    return model, shards, client


def step(model, shards, client, x, y, global_step):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    reply = client.push_pull(global_step, shards.grads())
    client.hold(shards.load(reply))
    return reply.step


@pytest.mark.parametrize("through", ["socket", "lane"])
def test_each_large_reply_is_swapped_into_the_model_not_copied_and_training_matches_plain_torch(local_ps, dataset,
                                                                                              through):
    """Over the socket, the replies in parts arrive in the spares; through a shared-memory lane, the ps writes
    the set of values the model does not hold (``lanes``)."""
    steps = 12
    spec = local_ps.start(num_ps=1, num_workers=1)
    model, shards, client = worker_half(local_ps, spec, steps)
    if through == "lane":
        assert client.share(client.pull()) == [0]
    torch.manual_seed(SEED)
    plain = Wide()
    adam = torch.optim.Adam(plain.parameters(), lr=0.001)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    addresses = []
    global_step = 0
    for x, y in plain_batches(dataset, steps):
        global_step = step(model, shards, client, x, y, global_step)
        adam.zero_grad()
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        adam.step()
        addresses.append(model.hidden.weight.data_ptr())
    assert global_step == steps
    # the 8 MB weight lives in two buffers in turn: each reply's values arrived in the one not in use
    assert len(set(addresses)) == 2 and all(a != b for a, b in zip(addresses, addresses[1:]))
    if through == "lane":
        (lane,) = client._lanes.values()
        assert set(addresses) == {t.data_ptr() for values in lane.values for vid, t in zip(lane.ids, values)
                                  if shards.by_id[vid].parameter == "hidden.weight"}
    for (name, got), expected in zip(model.state_dict().items(), plain.state_dict().values()):
        assert (got.to(expected.dtype) - expected).abs().max() <= 1e-6, name


def test_a_reply_spoiled_midway_leaves_the_model_as_the_last_whole_reply_left_it(local_ps, dataset, tamper):
    spec, hop = tamper
    model, shards, client = worker_half(local_ps, spec, steps=10)
    batches = plain_batches(dataset, 10)
    x, y = next(batches)
    assert step(model, shards, client, x, y, 0) == 1
    before = {name: t.detach().clone() for name, t in model.named_parameters()}  # (forward moves the buffers)

    hop.arm(3)  # the output layer's and the 8 MB weight's parts arrive whole, in their spares; the third is spoiled
    x, y = next(batches)
    with pytest.raises(BadSignature):
        step(model, shards, client, x, y, 1)
    assert hop.spoiled.is_set()
    assert all(torch.equal(t, before[name]) for name, t in model.named_parameters())
    values = shards.dense_values()  # what the worker's rescue copy would hold
    assert all(torch.equal(values[v.name], before[v.parameter]) for v in shards.by_id.values() if v.kind == "param")
