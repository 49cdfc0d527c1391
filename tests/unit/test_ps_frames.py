"""Tensors travel in chunks, so a ps bounds every frame it receives to a few MB whatever the model: a variable
far larger than that trains exactly as a plain torch step does, and a frame declaring a gibibyte, from anyone,
is refused by the transport before the ps holds its bytes."""

import json
import subprocess
import sys

import torch

from pscluster.runtime import protocol
from pscluster.runtime.client import PSClient

from .conftest import RUN_ID, make_spec, ps_config
from .test_control import rss_mib, zmtp_frame_declaring

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
