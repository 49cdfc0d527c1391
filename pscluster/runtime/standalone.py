"""Running a task without a notebook: the cluster comes from ``PSCLUSTER_CONFIG``.

ps task::

    PSCLUSTER_CONFIG='{"cluster": ..., "task": {"type": "ps", "index": 0}}' python -m pscluster.runtime

worker task, from the user's own script::

    from pscluster.runtime.standalone import train_from_environment
    summary = train_from_environment(model_fn, dataset, loss_fn, optimizer="sgd", lr=0.1, steps=1000)

Every worker derives the same plan (placement is a pure function of the model),
so no coordinator is needed: the chief initializes the ps tasks as usual.
"""

from __future__ import annotations

import signal
import threading

from ..errors import ConfigError
from ..spec import from_environment
from .data import training_input
from .optim import OptimizerSpec, check
from .plan import TrainPlan
from .ps import ParameterServer
from .worker import build_model, run_worker


def serve_ps() -> None:
    """Serve the ps task named in ``PSCLUSTER_CONFIG`` until SIGTERM/SIGINT or a SHUTDOWN message."""
    spec, task = from_environment()
    if task.role != "ps":
        raise ConfigError(f"{task.name} is a worker: run it from your script with train_from_environment()")
    server = ParameterServer(spec.key, index=task.index, host=task.host, port=task.port, encrypt=spec.encrypt).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.is_set() and server.running:
        done.wait(0.2)
    server.shutdown()


def train_from_environment(model_fn, dataset, loss_fn=None, *, step_fn=None, optimizer="sgd", param_groups=None,
                           scheduler=None, scheduler_options: dict | None = None, mode: str = "sync",
                           steps: int = 1000, batch_size: int | None = None, replicas_to_aggregate: int | None = None,
                           seed: int = 0, log_every: int = 100, run_id: int = 1,
                           request_timeout: float = 120.0, staleness_bound: int = 2, placement="round_robin",
                           partition: dict | None = None, shared_memory: bool = True, pipeline: bool = False,
                           buffers: str = "chief", max_grad_norm: float | None = None, on_nonfinite: str = "fail",
                           precision: str = "fp32", collate_fn=None, loader_workers: int = 0,
                           prefetch_factor: int | None = None, pin_memory: bool = False, log=print,
                           **optimizer_kwargs) -> dict:
    """Train as the worker named in ``PSCLUSTER_CONFIG``; returns the worker's summary. Every worker
    must be given the same arguments (they make the same plan). ``shared_memory``: exchange values with a ps
    on the same host through shared memory (False: always over the socket). ``pipeline`` (async): compute the
    next gradients while the push-pull is in flight; ``step_fn``, ``param_groups``, ``scheduler`` (a torch name or
    an importable ``module:Class``: a ps started from PSCLUSTER_CONFIG is given no code), ``buffers``,
    ``max_grad_norm``, ``on_nonfinite``, ``precision``, the dataset (or DataLoader) and its loader options: as in
    ``Cluster.train``."""
    spec, task = from_environment()
    if task.role != "worker":
        raise ConfigError(f"{task.name} is a ps task: serve it with `python -m pscluster.runtime`")
    dataset, batch_size, collate_fn, loader = training_input(dataset, batch_size, collate_fn, loader_workers,
                                                             prefetch_factor, pin_memory)
    model = build_model(model_fn, seed)
    spec_of_optimizer = OptimizerSpec(optimizer, optimizer_kwargs, groups=param_groups or (), scheduler=scheduler,
                                      scheduler_options=scheduler_options or {})
    check(model, spec_of_optimizer, steps=steps)
    plan = TrainPlan.for_model(model, spec_of_optimizer, num_ps=len(spec.ps), placement=placement,
                               partition=partition, run_id=run_id, mode=mode, steps=steps, batch_size=batch_size,
                               replicas_to_aggregate=replicas_to_aggregate or len(spec.workers),
                               num_workers=len(spec.workers), staleness_bound=staleness_bound, seed=seed,
                               log_every=log_every, request_timeout=request_timeout, shared_memory=shared_memory,
                               pipeline=pipeline, buffers=buffers, max_grad_norm=max_grad_norm,
                               on_nonfinite=on_nonfinite, precision=precision, loader=loader)
    return run_worker(spec, task.index, plan, model_fn, dataset, loss_fn, step_fn=step_fn, collate_fn=collate_fn,
                      log=log)
