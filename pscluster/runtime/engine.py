"""Entry points the control plane calls on an engine (through ipyparallel ``apply``).

Plain functions over plain data (JSON strings, bytes), so they also serve a
process started from ``PSCLUSTER_CONFIG``. The ps of an engine runs in a
background thread, which leaves the engine free to answer the control plane.
"""

from __future__ import annotations

import os
import socket

import cloudpickle
import torch

from ..spec import ClusterSpec
from .plan import TrainPlan
from .ps import ParameterServer

_servers: dict[int, ParameterServer] = {}


def describe() -> dict:
    """Host and pid of this engine process."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def configure_task(device: str, threads: int) -> None:
    """Give this process one GPU (``cuda:i`` -> CUDA_VISIBLE_DEVICES=i) or none (``cpu``), and
    ``threads`` torch intra-op threads."""
    os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":")[1] if device.startswith("cuda:") else ""
    torch.set_num_threads(threads)


def start_ps(secret: str, index: int, host: str = "127.0.0.1", port: int = 0) -> int:
    """Start ps task ``index`` in a background thread; returns its data-plane port."""
    stop_ps(index)
    server = ParameterServer(bytes.fromhex(secret), index=index, host=host, port=port).start()
    _servers[index] = server
    return server.port


def stop_ps(index: int) -> None:
    server = _servers.pop(index, None)
    if server is not None:
        server.shutdown()


def train_worker(spec_json: str, index: int, plan_json: str, code: bytes, join: bool = False) -> dict:
    """Run worker ``index`` of a plan; ``code`` is cloudpickle of (model_fn, dataset, loss_fn); ``join``:
    replace a lost worker of a running run."""
    from .worker import run_worker

    model_fn, dataset, loss_fn = cloudpickle.loads(code)
    return run_worker(ClusterSpec.from_json(spec_json), index, TrainPlan.from_json(plan_json),
                      model_fn, dataset, loss_fn, join=join)
