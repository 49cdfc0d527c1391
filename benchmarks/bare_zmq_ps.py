"""The baseline of the peer benchmark: a bare ZeroMQ parameter server. One ps holds the model as one flat
float32 buffer; each step a worker pushes its flat gradient and gets the parameters back in the reply
(sync: once every worker's gradient of the step is in and their mean applied; async: at once, applied
on arrival). SGD, no signing, no checks.

    python -m benchmarks.bare_zmq_ps ps PORT WORKERS sync|async
    python -m benchmarks.bare_zmq_ps worker PORT RANK WORKERS     (one round per step count read from stdin)
"""

from __future__ import annotations

import sys

import torch
import zmq
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .procs import serve_rounds
from .workload import LR, Clock, batches, model_fn


def serve(port: int, workers: int, mode: str) -> None:
    torch.manual_seed(0)
    params = parameters_to_vector(model_fn().parameters()).detach()
    grad_sum, waiting, done = torch.zeros_like(params), [], 0
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while done < workers:
        identity, op, *payload = sock.recv_multipart(copy=False)
        if op.bytes == b"x":
            done += 1
            continue
        if op.bytes == b"p":  # the first pull
            sock.send_multipart([identity, params.numpy().copy()], copy=False)
            continue
        grad = torch.frombuffer(payload[0].buffer, dtype=torch.float32)
        if mode == "async":
            params.sub_(grad, alpha=LR)
            sock.send_multipart([identity, params.numpy().copy()], copy=False)
            continue
        grad_sum.add_(grad)
        waiting.append(identity)
        if len(waiting) == workers:
            params.sub_(grad_sum, alpha=LR / workers)
            grad_sum.zero_()
            reply = params.numpy().copy()
            for who in waiting:
                sock.send_multipart([who, reply], copy=False)
            waiting = []
    sock.close(linger=0)


def train(port: int, rank: int, workers: int) -> None:
    model = model_fn()
    loss_fn = torch.nn.CrossEntropyLoss()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(b"p")
    reply = sock.recv(copy=False)

    def steps(n: int) -> dict:
        nonlocal reply
        clock, data = Clock(), batches(rank, workers)
        for _ in range(n):
            with torch.no_grad():
                vector_to_parameters(torch.frombuffer(reply.buffer, dtype=torch.float32), model.parameters())
            x, y = next(data)
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            sock.send_multipart([b"g", grad.numpy()], copy=False)
            reply = sock.recv(copy=False)
            clock.tick()
        return clock.result()
    serve_rounds(steps)
    sock.send(b"x")
    sock.close(linger=1000)


if __name__ == "__main__":
    role, port, *rest = sys.argv[1:]
    if role == "ps":
        serve(int(port), int(rest[0]), rest[1])
    else:
        train(int(port), *map(int, rest))
