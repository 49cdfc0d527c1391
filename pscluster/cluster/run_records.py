"""A new run in the run store, for a notebook's ``Cluster.train`` and a script's chief alike: its row, its
checkpoint folder and the plan that names both. ``resume`` continues an earlier run from its checkpoint folder,
as TF's ``MonitoredTrainingSession`` does when it is given the same ``checkpoint_dir`` again:

- ``resume="latest"``: the newest earlier run of the same ``name``; none yet: the run starts from scratch
  (so a notebook cell with it runs the same the first time and every time after);
- ``resume=<run id>``: that run, whatever its name.

The run then writes its checkpoints into that folder too, and its chief starts from the latest one there.

A run that will start from a checkpoint says so (a ``Notice``: one line and the event ``resuming``), naming the
run that wrote it (its manifest's ``run_id``, that run's settings from this store), its step and its mode. The
settings of ``EXPERIMENT`` make a run another experiment: in a script's default folder (``checkpoints/<name>``,
shared by the script's runs), a run whose settings differ from those of the checkpoint's run does not continue it:
it takes the first of ``<name>.2``, ``<name>.3``... that holds a checkpoint of a run with its settings (and
continues that one) or none, and says why in one line (event ``not_resuming``). A folder asked for
(``checkpoint_dir=``, ``resume=``) is continued whatever the settings, the line naming each difference.

A run from scratch (``restore=False``) in a folder that holds checkpoints (given, or a script's default folder)
first moves them into its subfolder ``before-run-<run id>`` (``checkpoint.set_aside``) and says so in one line
(event ``set_aside``): the folder is then the new run's alone (its pruning deletes no other run's checkpoints and
no other run's pruning its steps; a later restore from the folder takes the new run's latest), and what was
trained restores from the subfolder.

``end_orphans``: a script's chief started again (after a kill, or the whole job) marks the runs it takes over
(not ended, same checkpoint folder: their chief is gone) ``failed``, naming the run that continues them.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from ..metrics.store import UNENDED, RunStore
from ..runtime import checkpoint
from ..runtime.options import OPTIONS
from ..runtime.plan import TrainPlan
from ..runtime.policies import POLICIES, policy_for
from ..runtime.tagged import shown

# the settings that make a run another experiment than the run whose checkpoint it would start from: how the ps
# tasks combine the workers' gradients, the optimizer with its options, groups and schedule, what each step sees.
# Not ``steps`` (a larger target continuing a run is what resuming is for), nor where the variables live, how
# they travel, how often checkpoints are written or how the loss is logged
EXPERIMENT = ("mode", "num_workers", "replicas_to_aggregate", "staleness_bound", "pipeline", "optimizer",
              "optimizer_kwargs", "optimizer_groups", "scheduler", "scheduler_options", "more_optimizers",
              "batch_size", "max_grad_norm", "precision", "seed")


@dataclass(frozen=True)
class Resumed:
    """The earlier run a new one continues: its id and its checkpoint folder."""

    run_id: int
    checkpoint_dir: str


@dataclass(frozen=True)
class Notice:
    """What a new run says about the checkpoint it starts from, or does not: ``line``, shown with the run's log
    lines, and the event that records it, ``kind`` (``resuming``, ``not_resuming``, ``set_aside``) with
    ``detail``."""

    kind: str
    line: str
    detail: dict


@dataclass(frozen=True)
class _Found:
    """The checkpoint a run restoring from ``folder`` starts from: its ``step``, the run that wrote it, and that
    run's row in the store (None when the store's run of that id wrote elsewhere: another store's)."""

    folder: Path
    step: int
    run_id: int
    record: dict | None


def create_run(store: RunStore, plan: TrainPlan, *, name: str | None, cluster: str, spec: dict, code: str | None,
               default_dir: Callable[[int], Path], checkpoint_dir=None, resume: str | int | None = None,
               own_default: bool = False) -> tuple[TrainPlan, list[Notice]]:
    """``plan`` as run ``run_id`` of ``store`` (recorded with its settings and placement) and what it says of the
    checkpoint it starts from (see the module). Its checkpoint folder: ``checkpoint_dir``, else the resumed run's,
    else ``default_dir(run_id)``. With ``own_default`` (a notebook's folders, named by run id) a default folder
    that already holds anything was left by a run of an earlier store of the same path (deleted and made again):
    a fresh one beside it is taken, so a new run never starts from another store's checkpoints. Without it (a
    script's default folder, named by the script, shared by its runs on purpose) a run with ``restore`` takes the
    first folder of its family whose checkpoint's run has its ``EXPERIMENT`` settings, or holds none. A given or
    resumed folder whose latest checkpoint does not fit the plan's model is refused now (CheckpointError naming
    the fix), with nothing recorded. A run without ``restore`` sets the checkpoints of its folder aside."""
    resumed = _resumed(store, name, resume, checkpoint_dir, plan.restore, default_dir)
    chosen = checkpoint_dir or (resumed.checkpoint_dir if resumed else None)
    notices = []
    if chosen is not None and plan.restore:
        checkpoint.check_fits(chosen, plan.variables)
        asked = f"resume={resume!r}" if resumed else "checkpoint_dir="
        notices = _continued(store, plan, Path(chosen), asked, resumed)
    elif resume == "latest":
        notices = [Notice("resuming", f"resume='latest': no earlier run named {name!r}: this run starts from scratch",
                          {"run": None, "from": "scratch: no earlier run of this name"})]
    run_id = store.create_run(name=name, cluster=cluster, mode=plan.mode, config=_config(plan), spec=spec,
                              code=code)
    if chosen is not None:
        directory = Path(chosen)
    elif own_default:
        directory = _unused(Path(default_dir(run_id)))
    elif plan.restore:
        directory, said = _shared(store, plan, Path(default_dir(run_id)))
        notices += said
    else:
        directory = Path(default_dir(run_id))
    if not plan.restore:
        notices += _set_aside(store, directory, run_id)
    plan = replace(plan, run_id=run_id, checkpoint_dir=str(directory))
    store.set_config(run_id, _config(plan))
    store.record_placement(run_id, plan.variables)
    return plan, notices


def _config(plan: TrainPlan) -> dict:
    """What the store keeps of a run's settings: the plan's, and what they mean for the views (which do not
    import the runtime): ``aggregates_steps``, whether each global step waits for the workers' gradients, and
    ``shown``, the settings that tell runs apart (the workers, the schedule, and the options defined as shown but
    those only other modes read)."""
    policy = policy_for(plan)
    others = {o for p in POLICIES.values() for o in p.options} - set(policy.options)
    return {**plan.settings(), "aggregates_steps": policy.aggregates_steps,
            "shown": ["num_workers", "scheduler", *(name for name, o in OPTIONS.items() if o.shown and
                                                    name not in others and name in plan.options)]}


def _unused(directory: Path) -> Path:
    """``directory``, or when it holds anything, the first of ``<name>.2``, ``<name>.3``... that does not exist."""
    if not directory.exists() or not any(directory.iterdir()):
        return directory
    k = 2
    while directory.with_name(f"{directory.name}.{k}").exists():
        k += 1
    return directory.with_name(f"{directory.name}.{k}")


def _shared(store: RunStore, plan: TrainPlan, default: Path) -> tuple[Path, list[Notice]]:
    """The folder of a run of a script's shared ``default`` folder, and what it says: the first of ``default``,
    ``<name>.2``... (those that exist) that holds no checkpoint (a fresh start) or the checkpoint of a run with the
    settings of ``plan`` (it continues that run); else a new folder, and a line naming the run of ``default``'s
    checkpoint and why this one does not continue it."""
    refused = None  # (found, differences) of the first folder passed over
    folder, k = default, 2
    while folder.exists():
        found = _latest(store, folder)
        if found is None:
            return folder, []
        differs = _differences(found, plan)
        if not differs:
            return folder, [_resuming(found, differs, "")]
        refused = refused or (found, differs)
        folder, k = default.with_name(f"{default.name}.{k}"), k + 1
    if refused is None:
        return folder, []
    found, differs = refused
    line = (f"not resuming {_described(found)} from its checkpoint at global step {found.step} in {found.folder}: "
            f"{_said(differs)}; this run starts from scratch in {folder} (checkpoint_dir={str(found.folder)!r} "
            "continues it anyway)")
    return folder, [Notice("not_resuming", line, {"run": found.run_id, "step": found.step,
                                                  "checkpoint_dir": str(found.folder), "differs": differs,
                                                  "into": str(folder)})]


def _set_aside(store: RunStore, directory: Path, run_id: int) -> list[Notice]:
    """What run ``run_id``, from scratch in ``directory``, says of the checkpoints it moved out of its way there
    (see the module); nothing when there were none."""
    into = checkpoint.set_aside(directory, f"before-run-{run_id}")
    if into is None:
        return []
    found = _latest(store, into)
    run, step = (found.run_id, found.step) if found is not None else (None, None)
    held = f"the newest: global step {step} of run {run}" if found is not None else "none of them committed"
    line = (f"restore=False: the checkpoints in {directory} ({held}) were moved to {into}; this run starts from "
            f"scratch in {directory}")
    return [Notice("set_aside", line, {"checkpoint_dir": str(directory), "into": str(into), "run": run, "step": step})]


def _continued(store: RunStore, plan: TrainPlan, folder: Path, asked: str, resumed: Resumed | None) -> list[Notice]:
    """What a run restoring from ``folder`` as ``asked`` says: the checkpoint it continues and how that run's
    settings differ from ``plan``'s (continued all the same: asked for); a resumed run that left no checkpoint,
    that this run starts from scratch; nothing for a given folder that holds none."""
    found = _latest(store, folder)
    if found is not None:
        return [_resuming(found, _differences(found, plan), asked)]
    if resumed is None:
        return []
    return [Notice("resuming", f"{asked}: run {resumed.run_id} left no checkpoint in {folder}: this run starts from "
                               "scratch there", {"run": resumed.run_id, "step": None, "checkpoint_dir": str(folder)})]


def _latest(store: RunStore, folder: Path) -> _Found | None:
    """The newest checkpoint in ``folder`` whose manifest reads (the one a chief restoring from it takes, unless
    its shards fail their checks), or None."""
    for step in reversed(checkpoint.committed_steps(folder)):
        try:
            run_id = int(json.loads(checkpoint.manifest_path(folder, step).read_text())["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # the chief's ``checkpoint.latest`` refuses it too, and takes the one before
        record = store.run(run_id)
        wrote_here = record is not None and _same_folder((record["config"] or {}).get("checkpoint_dir"), folder)
        return _Found(folder, step, run_id, record if wrote_here else None)
    return None


def _same_folder(a: str | None, b: Path) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def _differences(found: _Found, plan: TrainPlan) -> dict[str, list]:
    """``{setting: [the checkpoint run's, plan's]}`` for each of ``EXPERIMENT`` they differ in (those its record
    holds; none for a run this store does not know)."""
    if found.record is None:
        return {}
    then, now = found.record["config"] or {}, json.loads(json.dumps(plan.settings()))
    return {k: [then[k], now[k]] for k in EXPERIMENT if k in then and then[k] != now[k]}


def _said(differs: dict[str, list]) -> str:
    return "; ".join(f"its {k} was {shown(then)}, this run's is {shown(now)}" for k, (then, now) in differs.items())


def _described(found: _Found) -> str:
    """``run 3 "mnist" (sync, 2 workers)``."""
    config = found.record["config"] or {}
    workers = config.get("num_workers")
    return (f'run {found.run_id} "{found.record["name"]}" ({found.record["mode"]}, {workers} '
            f'worker{"" if workers == 1 else "s"})')


def _resuming(found: _Found, differs: dict[str, list], asked: str) -> Notice:
    """The line of a run that continues ``found`` (``differs``: as ``asked``, though its settings differ)."""
    if found.record is None:
        line = (f"resuming from the checkpoint at global step {found.step} in {found.folder}, written by a run "
                f"{found.run_id} this run store does not know")
        return Notice("resuming", line, {"run": found.run_id, "step": found.step, "checkpoint_dir": str(found.folder)})
    line = f"resuming {_described(found)} from its checkpoint at global step {found.step} in {found.folder}"
    if differs:
        line += f", as {asked} asks, though {_said(differs)}"
    config = found.record["config"] or {}
    return Notice("resuming", line, {"run": found.run_id, "name": found.record["name"], "mode": found.record["mode"],
                                     "workers": config.get("num_workers"), "step": found.step,
                                     "checkpoint_dir": str(found.folder), **({"differs": differs} if differs else {})})


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
