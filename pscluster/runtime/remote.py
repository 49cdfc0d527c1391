"""The functions the control plane calls on an engine (through ipyparallel ``apply``): describe the engine,
watch the controller, configure the task, start and stop its ps, register a run's objects, learn a user's loop's
plan (``probe_loop``), train a worker.

Plain functions over plain data (JSON strings, bytes). The ps of an engine runs in a background thread,
which leaves the engine free to answer the control plane.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import socket
import threading
import time
import types

import cloudpickle
import torch

from ..spec import ClusterSpec
from .network import bind_in_range, route_address
from .plan import TrainPlan
from .ps import ParameterServer

_servers: dict[int, ParameterServer] = {}


def describe(controller_ip: str | None = None) -> dict:
    """This engine process: its host name, pid, the GPUs it sees, and (given the controller's address) its own
    address on the route to the controller, where its ps listens on a multi-host cluster."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "address": route_address(controller_ip) if controller_ip else None}


def watch_controller(host: str, port: int, deadline_s: float, period_s: float = 1.0) -> None:
    """End this engine process once the controller at ``host:port`` has accepted no connection for ``deadline_s``
    (an attempt every ``period_s``): a remote engine ends with its cluster (a controller stopped or killed with
    its kernel, a link cut) instead of serving forever."""
    def watch():
        reached = time.monotonic()
        while time.monotonic() - reached < deadline_s:
            time.sleep(period_s)
            try:
                socket.create_connection((host, port), timeout=period_s).close()
                reached = time.monotonic()
            except OSError:
                pass
        os._exit(3)

    threading.Thread(target=watch, name="pscluster-controller-watch", daemon=True).start()


def configure_task(device: str, threads: int) -> None:
    """Give this process one GPU (``cuda:i`` -> CUDA_VISIBLE_DEVICES=i) or none (``cpu``), and
    ``threads`` torch intra-op threads."""
    os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":")[1] if device.startswith("cuda:") else ""
    torch.set_num_threads(threads)


def start_ps(secret: str, index: int, host: str = "127.0.0.1", port: int = 0,
             ports: tuple[int, int] | None = None, encrypt: bool = False) -> int:
    """Start ps task ``index`` in a background thread, listening on ``host`` only (``encrypt``: over ZeroMQ
    CURVE); returns its data-plane port: ``port``, or a free one (from the range ``ports`` when given)."""
    stop_ps(index)
    key = bytes.fromhex(secret)

    def serve(p: int) -> ParameterServer:
        return ParameterServer(key, index=index, host=host, port=p, encrypt=encrypt)

    server = serve(port) if port or not ports else bind_in_range(serve, ports)
    _servers[index] = server.start()
    return server.port


def stop_ps(index: int) -> None:
    server = _servers.pop(index, None)
    if server is not None:
        server.shutdown()


def shipped_code(args: tuple, filename: str, lines: list[str] | None) -> types.CodeType:
    """A code object the controller shipped (``cluster.shipping``): cloudpickle's constructor ``args``, under its
    ``filename`` there; the file's ``lines``, when given, are registered in ``linecache`` (kept however the file
    reads here, if at all: they are the code's own), so that a traceback through it shows them."""
    if lines:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return types.CodeType(*args).replace(co_filename=filename)


def register_objects(names: list[str], code: bytes) -> None:
    """Make the optimizer classes and schedule functions of a run (cloudpickle of them, in the order of ``names``,
    sent over the authenticated control plane) known by name to this process's ps (see ``optim.register``)."""
    from . import optim

    optim.register(dict(zip(names, cloudpickle.loads(code))))


def probe_loop(code: bytes, num_workers: int, seed: int) -> bytes:
    """``context.probe`` of the shipped ``train_fn`` (``code``: cloudpickle of ``(train_fn,)``) in this process, as
    the chief calls it, up to its loop's first step. What it prints is dropped: the worker's own call prints it.
    Returns cloudpickle of (its model, module names, optimizer specs), or of the ConfigError that says what is
    wrong with it."""
    from ..errors import ConfigError
    from .context import probe

    (train_fn,) = cloudpickle.loads(code)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            found = probe(train_fn, num_workers, seed)
        except ConfigError as e:
            found = e
    return cloudpickle.dumps(found)


def train_worker(spec_json: str, index: int, plan_json: str, code: bytes, join: bool = False) -> dict:
    """Run worker ``index`` of a plan; ``code`` is cloudpickle (sent over the authenticated control plane) of
    (model_fn, dataset, loss_fn, step_fn, collate_fn) for the library's loop, or of (train_fn,) for a user's loop
    (a plan that names the loop's modules); ``join``: replace a lost worker of a running run."""
    spec, plan = ClusterSpec.from_json(spec_json), TrainPlan.from_json(plan_json)
    if plan.modules:
        from .context import run_loop

        (train_fn,) = cloudpickle.loads(code)
        return run_loop(spec, index, plan, train_fn, join=join)
    from .worker import run_worker

    model_fn, dataset, loss_fn, step_fn, collate_fn = cloudpickle.loads(code)
    return run_worker(spec, index, plan, model_fn, dataset, loss_fn, step_fn=step_fn, collate_fn=collate_fn,
                      join=join)


def start_session_worker(spec_json: str, index: int, plan_json: str, code: bytes, join: bool = False) -> None:
    """Start worker ``index`` of a notebook's session in a thread of this engine (``session_worker``); ``code`` is
    cloudpickle of (model_fn, optimizer, optimizer options, loss_fn, step_fn)."""
    from . import session_worker

    session_worker.start(ClusterSpec.from_json(spec_json), index, TrainPlan.from_json(plan_json),
                         *cloudpickle.loads(code), join=join)


def session_step(run_id: int, index: int, batch, groups: list[dict], timeout: float) -> dict:
    """Worker ``index``'s slice of a session's step (``session_worker.step``)."""
    from . import session_worker

    return session_worker.step(run_id, index, batch, groups, timeout)


def end_session_worker(run_id: int, index: int) -> None:
    from . import session_worker

    session_worker.end(run_id, index)
