"""The evaluator task of a script's cluster (TF's ``train_and_evaluate`` evaluator): a process of its own that
evaluates every checkpoint the run commits on the test dataset while the workers train, so evaluation never
holds up training, however large the test set.

It learns the run (id, checkpoint folder) from the ps tasks once the chief has started it, then, oldest
first, evaluates each checkpoint the run commits (not those of earlier runs in the same folder): into the run store
(``run.evaluations()``, the dashboard's convergence chart) and into TensorBoard's ``eval`` folder of the run,
one line each on ``log``. A checkpoint pruned before its turn is passed over. It ends once it has evaluated
the run's last step (``plan.steps``: at once, though the ps tasks end with the run), or the run is closed, or
the ps tasks stay silent for ``GONE_S`` (after one last look for new checkpoints). A chief started again starts
a new run from the latest checkpoint; the evaluator follows it there, and through a lost ps's recovery.

The checkpoints are read where the ps tasks write them and the evaluations written into the chief's run
store: run the evaluator where both are (the chief's machine, or a shared filesystem), as TF's evaluator
reads the model directory.
"""

from __future__ import annotations

import time

from ..errors import CheckpointError, ConfigError
from ..metrics.store import RunStore
from ..metrics.tensorboard import EventWriter, run_logdir
from ..runtime import checkpoint, standalone
from ..runtime.evaluation import evaluate
from ..runtime.plan import TrainPlan
from ..runtime.seeding import build_model
from ..spec import ClusterSpec

POLL_S = 0.5  # how often the checkpoint folder and the ps tasks are looked at
STATS_TIMEOUT_S = 5.0  # a ps that does not answer a poll within this is taken as gone
GONE_S = 60.0  # the ps tasks silent this long: the run is over (a lost ps is started again sooner)


def evaluate_checkpoints(spec: ClusterSpec, plan: TrainPlan, model_fn, test_dataset, loss_fn, *, step_fn=None,
                         collate_fn=None, store=None, log=print) -> dict:
    """Evaluate the checkpoints of the run the chief starts on ``spec`` (see the module docstring); the
    evaluator's summary: ``{"task", "role": "evaluator", "run_id", "evaluated": [steps]}``."""
    if test_dataset is None:
        raise ConfigError("the evaluator task evaluates test_dataset: give train_from_environment(..., "
                          "test_dataset=...) in the script")
    runs = RunStore(store)
    model = build_model(model_fn, plan.seed)
    evaluated: list[int] = []
    seen = -1  # the newest checkpoint step looked at, evaluated or passed over
    answered = time.monotonic()  # when the ps tasks last answered
    run = standalone.started_run(spec, plan.request_timeout, waiting=lambda: standalone.check_options(plan, model))
    writer = _open_run(runs, run)
    try:
        while True:
            for step in checkpoint.committed_steps(run["checkpoint_dir"]):
                if step <= seen:
                    continue
                seen = step
                result = _evaluate(model, run, step, test_dataset, loss_fn, step_fn, collate_fn)
                if result is not None:
                    runs.add_evaluation(run["run_id"], step, result["loss"], result["accuracy"])
                    writer.add_evaluation(step, result["loss"], result["accuracy"])
                    evaluated.append(step)
                    if log is not None:
                        log(f"[evaluator] global step {step}: loss {result['loss']:.4f}"
                            + (f", accuracy {result['accuracy']:.4f}" if result["accuracy"] is not None else ""))
            if evaluated and evaluated[-1] >= plan.steps:
                break  # the run's last step: nothing newer will come (the ps tasks may have ended already)
            held = standalone.held_runs(spec, timeout=STATS_TIMEOUT_S)
            if held is not None:
                answered = time.monotonic()
            if time.monotonic() - answered > GONE_S or held is not None and (
                    any(s.get("finalized") for s in held)
                    or all(s.get("stopped") for s in held) and seen >= max(s.get("step", 0) for s in held)):
                if max(checkpoint.committed_steps(run["checkpoint_dir"]), default=-1) > seen:
                    continue  # the final checkpoint was committed as the run ended: evaluate it first
                break
            if held is None:  # a ps lost, and perhaps started again: the run goes on from its next attempt
                time.sleep(POLL_S)
                continue
            ids = {s.get("run_id") for s in held}
            if len(ids) == 1 and None not in ids and ids != {run["run_id"]}:  # the chief started a new run
                writer.close()
                run = held[0]
                writer = _open_run(runs, run)
            time.sleep(POLL_S)
    finally:
        writer.close()
        runs.close()
    return {"task": 0, "role": "evaluator", "run_id": run["run_id"], "evaluated": evaluated}


def _open_run(runs: RunStore, run: dict) -> EventWriter:
    """The TensorBoard writer of ``run`` (the ps tasks' STATS of it), once its row is in ``runs``."""
    record = runs.run(run["run_id"])
    if record is None:
        raise ConfigError(f"the run store {runs.path} has no run {run['run_id']}, which the chief started: run the "
                          "evaluator with the chief's run store (store=..., or the same PSCLUSTER_HOME)")
    return EventWriter(run_logdir(runs.path, record["name"], run["run_id"]))


def _evaluate(model, run: dict, step: int, test_dataset, loss_fn, step_fn, collate_fn) -> dict | None:
    """``model`` with the state of ``run``'s checkpoint ``step`` evaluated, or None when it was pruned, is
    refused, or is an earlier run's."""
    try:
        ckpt = checkpoint.Checkpoint.load(checkpoint.manifest_path(run["checkpoint_dir"], step))
    except (CheckpointError, FileNotFoundError):
        return None
    if ckpt.run_id != run["run_id"]:
        return None
    model.load_state_dict(ckpt.state_dict())
    return evaluate(model, test_dataset, loss_fn, step_fn=step_fn, collate_fn=collate_fn)
