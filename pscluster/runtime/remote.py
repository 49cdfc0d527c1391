"""The functions the control plane calls on an engine (through ipyparallel ``apply``): describe the engine,
watch the controller, configure the task, start and stop its ps, register a run's objects, begin a user's loop as
its run's chief (``begin_chief``, ``go_on_chief``), train a worker.

Plain functions over plain data (JSON strings, bytes). The ps of an engine runs in a background thread,
which leaves the engine free to answer the control plane.
"""

from __future__ import annotations

import contextvars
import io
import linecache
import os
import socket
import threading
import time
import types
from concurrent.futures import Future

import cloudpickle
import torch

from ..errors import ConfigError, RuntimeTimeout
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


class _Refused(BaseException):
    """Raised into the loop of a chief waiting for its plan when its run is refused (``cancel_chief``): a
    BaseException, so that ``except Exception`` in the user's code does not stop it."""


class _Chief:
    """Worker 0 of a ``Cluster.run`` in the run's first attempt: its loop, in a thread of this engine, hands what it
    registered to ``begin_chief`` at its first training call and waits there, at most the plan's
    ``request_timeout``, for the run's plan (``go_on_chief``) or its refusal (``cancel_chief``)."""

    def __init__(self, spec: ClusterSpec, settings: TrainPlan, train_fn):
        self.registered: Future = Future()  # (model, module names, optimizer specs), or the error before them
        self.plan: Future = Future()  # the run's plan, or _Refused
        self.summary: dict | None = None  # once the loop has ended: its summary, or the error that ended it
        self.error: BaseException | None = None
        self.timeout = settings.request_timeout
        # in a context of its own, whatever a thread inherits: what it prints goes to the engine's request of the
        # moment (ipykernel's fallback), begin_chief's, then go_on_chief's
        self.thread = threading.Thread(target=contextvars.Context().run, args=(self._run, spec, settings, train_fn),
                                       name="pscluster-chief", daemon=True)
        self.thread.start()

    def _run(self, spec: ClusterSpec, settings: TrainPlan, train_fn) -> None:
        from .context import run_loop

        try:
            self.summary = run_loop(spec, 0, settings, train_fn, planned=self._planned)
        except BaseException as e:  # noqa: BLE001 - begin_chief or go_on_chief raises it
            self.error = e
            if not self.registered.done():
                self.registered.set_exception(e)

    def _planned(self, model, modules, optimizers) -> TrainPlan:
        self.registered.set_result((model, modules, optimizers))
        try:
            return self.plan.result(timeout=self.timeout)
        except TimeoutError:
            raise RuntimeTimeout(f"worker 0 was sent no plan within {self.timeout:.0f}s of its loop's first training "
                                 "call (the notebook's kernel was interrupted or lost): run it again") from None


_chief: _Chief | None = None  # the chief this engine's loop holds at its first training call, waiting for its plan


def begin_chief(spec_json: str, settings_json: str, code: bytes) -> bytes | ConfigError:
    """Call the shipped ``train_fn`` (``code``: cloudpickle of ``(train_fn,)``) as worker 0 of a run whose plan is
    still to be made (``settings_json``: the run's settings, ``context.settings_plan``), in a thread of this engine,
    up to its loop's first training call, where it waits for ``go_on_chief`` (see ``_Chief``); what it prints until
    then is this call's output. Returns what it registered by then, as ``torch.save`` bytes (cloudpickle within)
    of (its model, module names, optimizer specs in the run's order), which the caller loads with its tensors on
    the CPU; or the ConfigError that says in one line what is wrong with ``train_fn`` (it failed before that
    call, registered no model or optimizer, returned without one)."""
    global _chief
    cancel_chief()  # one that an interrupted caller left waiting
    (train_fn,) = cloudpickle.loads(code)
    chief = _Chief(ClusterSpec.from_json(spec_json), TrainPlan.from_json(settings_json), train_fn)
    try:
        registered = chief.registered.result()
    except ConfigError as e:
        return e
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return ConfigError(f"train_fn fails on worker 0 before its loop's first step: {type(e).__name__}: {first} "
                           "— fix train_fn")
    _chief = chief
    saved = io.BytesIO()
    torch.save(registered, saved, pickle_module=cloudpickle)
    return saved.getvalue()


def go_on_chief(plan_json: str) -> dict:
    """The run's plan, as the kernel recorded it, to the chief that ``begin_chief`` left waiting: its loop joins
    the run and trains on in its thread, and this call ends with it (its summary or its error, as
    ``train_worker``'s); what the loop prints meanwhile is this call's output."""
    global _chief
    chief, _chief = _chief, None
    chief.plan.set_result(TrainPlan.from_json(plan_json))
    chief.thread.join()
    if chief.error is not None:
        raise chief.error  # its traceback: this call's frames, then the loop's (no frame of a Future between)
    return chief.summary


def cancel_chief() -> None:
    """End the loop of the chief that ``begin_chief`` left waiting, if any (its run was refused): ``_Refused`` is
    raised in it where it waits, and this returns once it has unwound (at most its ``request_timeout``)."""
    global _chief
    chief, _chief = _chief, None
    if chief is not None:
        chief.plan.set_exception(_Refused())
        chief.thread.join(chief.timeout)


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
