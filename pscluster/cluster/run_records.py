"""A new run in the run store, for a notebook's ``Cluster.train`` and a script's chief alike: its row, its
checkpoint folder and the plan that names both. ``resume`` continues an earlier run from its checkpoint folder,
as TF's ``MonitoredTrainingSession`` does when it is given the same ``checkpoint_dir`` again:

- ``resume="latest"``: the newest earlier run of the same ``name``; none yet: the run starts from scratch
  (so a notebook cell with it runs the same the first time and every time after);
- ``resume=<run id>``: that run, whatever its name.

The run then writes its checkpoints into that folder too, and its chief starts from the latest one there.

``end_orphans``: a script's chief started again (after a kill, or the whole job) marks the runs it takes over
(not ended, same checkpoint folder: their chief is gone) ``failed``, naming the run that continues them.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from ..metrics.store import UNENDED, RunStore
from ..runtime import checkpoint
from ..runtime.plan import TrainPlan
from ..runtime.policies import policy_for


@dataclass(frozen=True)
class Resumed:
    """The earlier run a new one continues: its id and its checkpoint folder."""

    run_id: int
    checkpoint_dir: str


def create_run(store: RunStore, plan: TrainPlan, *, name: str | None, cluster: str, spec: dict, code: str | None,
               default_dir: Callable[[int], Path], checkpoint_dir=None, resume: str | int | None = None,
               own_default: bool = False) -> tuple[TrainPlan, Resumed | None]:
    """``plan`` as run ``run_id`` of ``store`` (recorded with its settings and placement) and the run it resumes.
    Its checkpoint folder: ``checkpoint_dir``, else the resumed run's, else ``default_dir(run_id)``. With
    ``own_default`` (a notebook's folders, named by run id) a default folder that already holds anything was left
    by a run of an earlier store of the same path (deleted and made again): a fresh one beside it is taken, so a
    new run never starts from another store's checkpoints (a script's default folder, named by the script, is
    shared by its runs on purpose). A given or resumed folder whose latest checkpoint does not fit the plan's
    model is refused now (CheckpointError naming the fix), with nothing recorded."""
    resumed = _resumed(store, name, resume, checkpoint_dir, plan.restore, default_dir)
    chosen = checkpoint_dir or (resumed.checkpoint_dir if resumed else None)
    if chosen is not None and plan.restore:
        checkpoint.check_fits(chosen, plan.variables)
    run_id = store.create_run(name=name, cluster=cluster, mode=plan.mode, config=_config(plan), spec=spec,
                              code=code)
    directory = chosen or (_unused(Path(default_dir(run_id))) if own_default else default_dir(run_id))
    plan = replace(plan, run_id=run_id, checkpoint_dir=str(directory))
    store.set_config(run_id, _config(plan))
    store.record_placement(run_id, plan.variables)
    return plan, resumed


def _config(plan: TrainPlan) -> dict:
    """What the store keeps of a run's settings: the plan's, and what its mode means for the views (which do not
    import the runtime): ``aggregates_steps``, whether each global step waits for the workers' gradients."""
    return {**plan.settings(), "aggregates_steps": policy_for(plan).aggregates_steps}


def _unused(directory: Path) -> Path:
    """``directory``, or when it holds anything, the first of ``<name>.2``, ``<name>.3``... that does not exist."""
    if not directory.exists() or not any(directory.iterdir()):
        return directory
    k = 2
    while directory.with_name(f"{directory.name}.{k}").exists():
        k += 1
    return directory.with_name(f"{directory.name}.{k}")


def _resumed(store: RunStore, name, resume, checkpoint_dir, restore: bool, default_dir) -> Resumed | None:
    if resume is None or resume is False:
        return None
    if checkpoint_dir is not None:
        raise ConfigError("give resume= or checkpoint_dir=, not both: resume continues in the earlier run's "
                          "checkpoint folder")
    if not restore:
        raise ConfigError("resume= starts from the earlier run's latest checkpoint: drop restore=False")
    if resume == "latest":
        if not name:
            raise ConfigError("resume='latest' continues the newest earlier run of the same name: give name=...")
        runs = store.runs()
        earlier = runs[runs["name"] == name]
        if earlier.empty:
            return None
        run_id = int(earlier["id"].iloc[0])
    elif isinstance(resume, numbers.Integral) and not isinstance(resume, bool):
        run_id = int(resume)
        if store.run(run_id) is None:
            raise ConfigError(f"resume={run_id}: the run store {store.path} has no run {run_id}: see pscluster.runs()")
    else:
        raise ConfigError(f"resume={resume!r}: give 'latest' (the newest run of the same name) or a run id")
    config = store.run(run_id)["config"] or {}
    return Resumed(run_id, str(config.get("checkpoint_dir") or default_dir(run_id)))


def end_orphans(store: RunStore, plan: TrainPlan) -> list[int]:
    """Mark ``failed`` every other run of ``store`` that has not ended and writes into ``plan``'s checkpoint
    folder: two live runs never share one, so their chief is gone and run ``plan.run_id`` continues them.
    Their ids."""
    runs = store.runs()
    ended = []
    for run_id in runs[runs["status"].isin(UNENDED) | runs["owner_lost"].notna()]["id"]:
        config = store.run(int(run_id))["config"] or {}
        if int(run_id) != plan.run_id and config.get("checkpoint_dir") == plan.checkpoint_dir:
            error = f"its chief was lost: run {plan.run_id} continues it from its latest checkpoint"
            store.set_status(int(run_id), "failed", failure={"cause": error, "task": "chief", "step": None,
                                                             "traceback": None})
            store.add_event(int(run_id), "controller", "end", {"status": "failed", "error": error})
            ended.append(int(run_id))
    return ended
