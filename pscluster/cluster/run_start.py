"""Starting a run under its supervisor: the one way every run begins, a notebook's (``Cluster.train``, ``Cluster.run``,
``cluster.session``) and a script's chief's (``pscluster.train``'s ``TF_CONFIG`` scripts, a script's own loop).

``start_run`` records the run (``run_records.create_run``: its row, its checkpoint folder and what it says of the
checkpoint it starts from), builds the supervisor that follows it and commits its checkpoints, has it say the
run's notices (as events, and in its log lines), starts the workers through ``launch``, and returns the ``Run``
handle on it. ``adopt_run``: a supervisor in this process for a run another process started and trains still.
What differs between the entries is given, not written again: where a run's checkpoints go by default, whether a
script's chief takes over runs its earlier self left (``run_records.end_orphans``), how workers are started.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from ..metrics.store import RunStore
from ..runtime.options import START, defaults
from ..runtime.plan import TrainPlan
from ..runtime.seeding import build_model
from ..runtime.steps import traceable_inputs
from ..spec import ClusterSpec
from . import run_records
from .checkpoint_commits import CheckpointCoordinator
from .model_code import ModelCode
from .run import Run
from .supervisor import Supervisor


def start_run(store: RunStore, spec: ClusterSpec, plan: TrainPlan, started: Mapping, *,
              launch: Callable[[Supervisor], list], cluster: str, code: str | None, scripted: bool = False,
              model_fn=None, loss_fn=None, step_fn=None, collate_fn=None, test_dataset=None, example_batch=None,
              tasks=None, payload: bytes = b"", log: Callable[[str], None] | None = None, **metrics) -> Run:
    """Run ``plan`` of ``spec`` as a new run of ``store``, started: its workers begun by ``launch(supervisor)``
    (their results, as ``Supervisor.start`` takes them), its plan with the run's id and checkpoint folder; the
    ``Run`` handle on its supervisor. ``started``: the run's options read at its start (``options.START``; an
    entry that does not take one of them has it at its default).

    ``name``, ``cluster``, ``code``, ``checkpoint_dir`` and ``resume``: the run's record (see
    ``run_records.create_run``). Its checkpoints go, unless told otherwise, to a folder beside the store: a
    notebook's run to ``checkpoints/run-<id>``, its own; a script's (``scripted``: its chief) to
    ``checkpoints/<name>``, shared by the script's runs, and the chief takes over the runs of that folder its
    earlier self left unended (``run_records.end_orphans``). ``checkpoint_secs`` and ``keep_checkpoints``: its
    ``CheckpointCoordinator``. ``model_fn``, ``loss_fn``, ``step_fn`` and ``collate_fn``: the user's code
    (``ModelCode``), with which the supervisor evaluates the model on ``test_dataset`` every ``eval_every`` global
    steps and at the end; ``example_batch``: a batch on which the model's graph is traced for TensorBoard.
    ``tasks`` (the cluster, ``recovery.Tasks``), ``payload`` and ``metrics`` (where the tasks' metrics arrive):
    the supervisor's. ``log``: where the run's notices are printed too (the supervisor records and shows them
    anyway)."""
    started = {**defaults(START), **started}
    name, checkpoint_dir, resume = started["name"], started["checkpoint_dir"], started["resume"]
    checkpoints = Path(store.path).parent / "checkpoints"
    plan, notices = run_records.create_run(
        store, plan, name=name, cluster=cluster, spec=spec.public_dict(), code=code, checkpoint_dir=checkpoint_dir,
        resume=resume, own_default=not scripted,
        default_dir=(lambda _: checkpoints / name) if scripted else (lambda run_id: checkpoints / f"run-{run_id}"))
    if scripted:
        run_records.end_orphans(store, plan)
    code = ModelCode(model_fn, plan.seed, loss_fn, step_fn, collate_fn)
    supervisor = Supervisor(spec, plan, store, tasks=tasks, payload=payload,
                            checkpoints=CheckpointCoordinator(store, every_s=started["checkpoint_secs"] or None,
                                                              keep=started["keep_checkpoints"]),
                            evaluator=None if test_dataset is None else code.evaluator(test_dataset),
                            eval_every=started["eval_every"], **metrics)
    inputs = traceable_inputs(example_batch, step_fn)
    if inputs is not None:
        supervisor.event_files.trace_graph(build_model(model_fn, plan.seed), inputs)
    for notice in notices:
        supervisor.say(notice.kind, notice.line, notice.detail)
        if log is not None:
            log(notice.line)
    supervisor.start(launch)
    return Run(supervisor, code)


def adopt_run(spec: ClusterSpec, plan: TrainPlan, store: RunStore, worker_results, *, tasks, payload: bytes) -> Run:
    """Follow a run that another process started (on a detached cluster) and trains still: its metrics are
    received again at the address its tasks send to, and it is finalized here. Its model and loss functions stay
    on the engines (``state_dict()`` works, ``model()`` does not)."""
    host, port = plan.metrics_address[len("tcp://"):].rsplit(":", 1) if plan.metrics_address else ("127.0.0.1", 0)
    supervisor = Supervisor(spec, plan, store, tasks=tasks, payload=payload, metrics_port=int(port),
                            metrics_host=host)
    supervisor.note("adopted", "controller", {"pid": os.getpid()})
    supervisor.start(lambda _: worker_results, adopted=True)
    return Run(supervisor)
