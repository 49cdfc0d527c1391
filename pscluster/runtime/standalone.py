"""Running a task without a notebook: the cluster and the task come from ``PSCLUSTER_CONFIG`` or ``TF_CONFIG``
(see ``task_config``).

Every task runs the same script, as with TF's Estimator::

    from pscluster.runtime.standalone import train_from_environment
    summary = train_from_environment(model_fn, dataset, loss_fn, optimizer="sgd", lr=0.1, steps=1000)

A ps task serves the run until it has ended and its workers have had their last answers (``PS_QUIET_S``
without a request), then returns; a worker trains and returns its summary. A ps that serves run after run
(until SIGTERM) is ``python -m pscluster.runtime``. Every worker derives the same plan (placement is a pure
function of the model), so no coordinator is needed: the chief initializes the ps tasks as usual.
"""

from __future__ import annotations

import signal
import threading

from ..errors import ConfigError, TrainingError
from ..spec import ClusterSpec, TaskSpec
from ..task_config import from_environment
from .data import training_input
from .optim import OptimizerSpec, check
from .client import PSClient
from .evaluation import evaluate
from .plan import TrainPlan, assemble, state_dict_of
from .ps import ParameterServer
from .worker import build_model, run_worker


PS_QUIET_S = 5.0


def serve_ps() -> None:
    """Serve the ps task named in the environment until SIGTERM/SIGINT or a SHUTDOWN message."""
    spec, task = from_environment()
    if task.role != "ps":
        raise ConfigError(f"{task.name} is a worker: run it from your script with train_from_environment()")
    _serve(spec, task, one_run=False)


def _serve(spec: ClusterSpec, task: TaskSpec, *, one_run: bool) -> int | None:
    """Serve ``task`` until SIGTERM/SIGINT, a SHUTDOWN message, or (``one_run``) the end of the run it serves;
    the run's last global step, if it had one."""
    server = ParameterServer(spec.key, index=task.index, host=task.host, port=task.port, encrypt=spec.encrypt).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.is_set() and server.running and not (one_run and server.done_serving(PS_QUIET_S)):
        done.wait(0.2)
    server.shutdown()
    return server.run.step if server.run is not None else None


def train_from_environment(model_fn, dataset, loss_fn=None, *, step_fn=None, optimizer="sgd", param_groups=None,
                           scheduler=None, scheduler_options: dict | None = None, mode: str = "sync",
                           steps: int = 1000, batch_size: int | None = None, replicas_to_aggregate: int | None = None,
                           seed: int = 0, log_every: int = 100, run_id: int = 1,
                           request_timeout: float = 120.0, staleness_bound: int = 2, placement="round_robin",
                           partition: dict | None = None, shared_memory: bool = True, pipeline: bool = False,
                           buffers: str = "chief", max_grad_norm: float | None = None, on_nonfinite: str = "fail",
                           precision: str = "fp32", collate_fn=None, loader_workers: int = 0,
                           prefetch_factor: int | None = None, pin_memory: bool = False, log=print,
                           test_dataset=None, **optimizer_kwargs) -> dict:
    """Train as the worker named in ``PSCLUSTER_CONFIG`` or ``TF_CONFIG`` and return its summary; as a ps task,
    serve the run until it ends and return ``{"task": index, "role": "ps", "global_step": step}``. Every
    worker must be given the same arguments (they make the same plan). ``shared_memory``: exchange values with a ps
    on the same host through shared memory (False: always over the socket). ``pipeline`` (async): compute the
    next gradients while the push-pull is in flight; ``step_fn``, ``param_groups``, ``scheduler`` (a torch name or
    an importable ``module:Class``: a ps started from PSCLUSTER_CONFIG is given no code), ``buffers``,
    ``max_grad_norm``, ``on_nonfinite``, ``precision``, the dataset (or DataLoader) and its loader options: as in
    ``Cluster.train``. ``test_dataset``: the chief evaluates the trained parameters on it at the end (its summary's
    ``test_loss``, ``test_accuracy`` and ``test_step``, the global step evaluated)."""
    spec, task = from_environment()
    if task.role == "ps":
        return {"task": task.index, "role": "ps", "global_step": _serve(spec, task, one_run=True)}
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
    summary = run_worker(spec, task.index, plan, model_fn, dataset, loss_fn, step_fn=step_fn,
                         collate_fn=collate_fn, log=log)
    if task.is_chief and test_dataset is not None:
        summary.update(_evaluate_trained(spec, plan, model, test_dataset, loss_fn, step_fn, collate_fn))
    return summary


def _evaluate_trained(spec: ClusterSpec, plan: TrainPlan, model, test_dataset, loss_fn, step_fn, collate_fn) -> dict:
    """The test loss and accuracy of the parameters the ps tasks hold at the end of the run."""
    with PSClient(spec, run_id=plan.run_id, timeout=plan.request_timeout) as client:
        reply = client.pull_all()
    if reply is None:
        raise TrainingError("the ps tasks no longer hold the run's variables: nothing to evaluate")
    model.load_state_dict(state_dict_of(plan.state_keys, assemble(plan.variables, reply.messages)), strict=False)
    result = evaluate(model, test_dataset, loss_fn, step_fn=step_fn, collate_fn=collate_fn)
    return {"test_loss": result["loss"], "test_accuracy": result["accuracy"], "test_step": reply.step}
