"""Tensors travel in chunks, so a ps bounds every frame it receives to a few MB whatever the model: a variable
far larger than that trains exactly as a plain torch step does, and a frame declaring a gibibyte, from anyone,
is refused by the transport before the ps holds its bytes."""

import json
import subprocess
import sys
import time

import torch
import zmq

from pscluster.runtime import protocol
from pscluster.runtime.client import PSClient

from ..conftest import RUN_ID, make_spec, ps_config
from .rawpeer import RawPeer
from ..cluster.test_control import rss_mib, zmtp_frame_declaring

LR = 0.1


def test_a_variable_larger_than_any_frame_trains_as_plain_torch_does(start_run):
    # 25 MB: three chunks of 8 MiB and a shorter last one, past the largest frame a ps receives
    table = torch.randn(6_250_000, generator=torch.Generator().manual_seed(0))
    assert table.numel() * 4 > protocol.MAX_FRAME_BYTES
    run = start_run({"table": table, "b": torch.zeros(3)}, mode="async")
    worker = run.client(0)
    grad = torch.randn(6_250_000, generator=torch.Generator().manual_seed(1))
    reply = worker.push_pull(0, run.split([grad, torch.ones(3)]))
    reference = torch.nn.Parameter(table.clone())
    optimizer = torch.optim.SGD([reference], lr=LR)
    reference.grad = grad
    optimizer.step()
    got = {i: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
    assert torch.equal(got[0], reference.detach()) and torch.equal(got[1], -LR * torch.ones(3))


def test_a_reply_stuck_behind_a_stopped_reader_keeps_its_values_while_the_run_goes_on(start_run):
    """A ps sends large values without copying them and updates them in place: a reply that a hung worker never
    reads (here: a peer whose receive queue holds one message and whose kernel buffer is small) must still carry
    the values of its step, unchanged, when it is read at last, while the others train on."""
    table = torch.randn(6_250_000, generator=torch.Generator().manual_seed(0))  # 25 MB: sent zero-copy
    run = start_run({"table": table, "b": torch.zeros(3)}, mode="async")
    server = run.servers[0]
    stuck = zmq.Context()
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 64 << 10)
    reader = RawPeer(run.spec.ps[0].address, run.spec.key, context=stuck)
    try:
        reader.hello()
        for _ in range(3):
            reader.send(reader.signed(protocol.Message(op=protocol.Op.PULL, task=1, run_id=RUN_ID)))
        deadline = time.monotonic() + 30
        while server.run.pulls < 3:
            assert time.monotonic() < deadline, "the ps did not answer the pulls"
            time.sleep(0.01)
        assert any(not t.done for t in server.run.sending), "no reply stuck: the premise of this test"
        grad = torch.randn(6_250_000, generator=torch.Generator().manual_seed(1))
        reply = run.client(0).push_pull(0, run.split([grad, torch.ones(3)]))
        got = {i: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
        assert reply.step == 1 and torch.equal(got[0], table.clone().add_(grad, alpha=-LR))
        answers = [reader.reply(30_000) for _ in range(3)]  # signed over their bytes: torn values fail to decode
        assert [a.step for a in answers] == [0, 0, 0]
        assert all(torch.equal(dict(zip(a.ids, a.tensors))[0], table) for a in answers)
    finally:
        reader.close()
        stuck.term()


def test_frames_of_a_large_tensor_are_chunks_and_put_back_together():
    t = torch.arange(5 * protocol.CHUNK_BYTES // 8, dtype=torch.float64).reshape(5, -1)[:, :-3]  # not contiguous
    frames = protocol.encode(protocol.Message(op=protocol.Op.PUSH, ids=[4], tensors=[t]), b"k" * 32)
    sizes = [memoryview(f).nbytes for f in frames[3:-1]]
    assert max(sizes) == protocol.CHUNK_BYTES and sum(sizes) == t.numel() * 8 and len(sizes) == 5
    assert torch.equal(protocol.decode(frames, b"k" * 32).tensors[0], t)


SERVER = """
import json, sys
from pscluster.runtime.ps import ParameterServer
server = ParameterServer(bytes.fromhex(sys.argv[1])).start()
print(json.dumps({"port": server.port}), flush=True)
sys.stdin.read()
"""


def test_a_frame_declaring_a_gibibyte_leaves_a_live_ps_small_and_serving():
    spec = make_spec(1, 1)
    proc = subprocess.Popen([sys.executable, "-c", SERVER, spec.key.hex()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        spec = spec.with_ps_ports([port])
        with PSClient(spec, run_id=RUN_ID, timeout=30) as controller:
            controller.init(RUN_ID, {0: ([0], [torch.zeros(1000)])}, [ps_config(["w"], mode="async")])
        before = rss_mib(proc.pid)
        with zmtp_frame_declaring(port, 1 << 30, sent=256 << 20):
            assert rss_mib(proc.pid) - before < 64  # 256 MiB more with a frame limit of the model's size
        with PSClient(spec, task=0, run_id=RUN_ID, timeout=30) as worker:
            assert worker.push_pull(0, {0: ([0], [torch.ones(1000)])}).step == 1
    finally:
        proc.kill()
        proc.wait(10)
