"""A new run's row, checkpoint folder and plan (``cluster.run_records``): ``resume`` finds the earlier run and
its folder in a real run store, and every contradiction is a one-line error before anything is recorded."""

import ast
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pscluster.cluster.run_records import create_run, end_orphans
from pscluster.errors import ConfigError
from pscluster.metrics.store import RunStore
from pscluster.runtime import checkpoint
from pscluster.runtime.optim import OptimizerSpec
from pscluster.runtime.plan import TrainPlan


@pytest.fixture
def store(tmp_path):
    with RunStore(tmp_path / "runs.sqlite") as s:
        yield s


@pytest.fixture
def plan():
    return TrainPlan.for_model(torch.nn.Linear(4, 2), OptimizerSpec("sgd", {"lr": 0.1}), num_ps=2, run_id=1,
                               mode="sync", steps=10, batch_size=8, restore=True)


def new(store, plan, **kw):
    kw.setdefault("default_dir", lambda run_id: Path(store.path).parent / f"run-{run_id}")
    return create_run(store, plan, cluster="c", spec={"ps": [], "worker": []}, code=None, **kw)


def test_a_run_records_its_folder_and_a_resumed_one_writes_into_the_same(store, plan, tmp_path):
    first, said = new(store, plan, name="mnist", resume="latest")
    assert [n.line for n in said] == ["resume='latest': no earlier run named 'mnist': this run starts from scratch"]
    assert first.checkpoint_dir == str(tmp_path / f"run-{first.run_id}")
    assert store.run(first.run_id)["config"]["checkpoint_dir"] == first.checkpoint_dir
    assert len(store.placement(first.run_id)) == 2
    new(store, plan, name="other")
    second, said = new(store, plan, name="mnist", resume="latest")
    assert [n.line for n in said] == [f"resume='latest': run {first.run_id} left no checkpoint in "
                                      f"{first.checkpoint_dir}: this run starts from scratch there"]
    assert second.checkpoint_dir == first.checkpoint_dir and second.run_id > first.run_id
    third, said = new(store, plan, name="renamed", resume=first.run_id)
    assert third.checkpoint_dir == first.checkpoint_dir and said[0].detail["run"] == first.run_id


def committed(run: TrainPlan, step: int, folder=None) -> None:
    """A checkpoint of ``run`` at ``step`` in its folder, as the chief commits one (the manifest is what a new run
    reads of it)."""
    folder = Path(folder or run.checkpoint_dir)
    checkpoint.step_dir(folder, step).mkdir(parents=True)
    checkpoint.commit(folder, step, run.run_id, run.variables, run.optimizer, run.optimizer_kwargs,
                      [{"ps": 0, "file": "shard-0.pt", "bytes": 0, "sha256": ""}])


def test_a_script_run_continues_the_checkpoint_of_its_folder_when_its_settings_are_the_same(store, plan, tmp_path):
    shared = tmp_path / "checkpoints" / "job"
    first, said = new(store, plan, name="job", default_dir=lambda _: shared)
    assert said == [] and first.checkpoint_dir == str(shared)
    committed(first, 10)
    again, said = new(store, plan.replace(steps=30), name="job", default_dir=lambda _: shared)  # a larger target
    assert again.checkpoint_dir == str(shared)
    assert [(n.kind, n.line) for n in said] == [("resuming", f'resuming run {first.run_id} "job" (sync, 1 worker) '
                                                              f"from its checkpoint at global step 10 in {shared}")]
    assert said[0].detail == {"run": first.run_id, "name": "job", "mode": "sync", "workers": 1, "step": 10,
                              "checkpoint_dir": str(shared)}


def test_a_script_run_with_other_settings_starts_in_a_folder_of_its_own_and_says_why(store, plan, tmp_path):
    """The default folder of a script is shared by its runs: one of another mode (or optimizer...) is another
    experiment, which starts from scratch beside it, and continues there when launched again the same way."""
    shared = tmp_path / "checkpoints" / "job"
    sync, _ = new(store, plan, name="job", default_dir=lambda _: shared)
    committed(sync, 10)
    run_async, said = new(store, plan.replace(mode="async"), name="job", default_dir=lambda _: shared)
    assert run_async.checkpoint_dir == str(shared.with_name("job.2"))
    assert [(n.kind, n.line) for n in said] == [(
        "not_resuming", f'not resuming run {sync.run_id} "job" (sync, 1 worker) from its checkpoint at global step 10 '
        f"in {shared}: its mode was sync, this run's is async; this run starts from scratch in "
        f"{shared.with_name('job.2')} (checkpoint_dir={str(shared)!r} continues it anyway)")]
    assert said[0].detail["differs"] == {"mode": ["sync", "async"]}
    committed(run_async, 20)
    again, said = new(store, plan.replace(mode="async"), name="job", default_dir=lambda _: shared)
    assert again.checkpoint_dir == run_async.checkpoint_dir and said[0].kind == "resuming"
    assert said[0].detail["run"] == run_async.run_id and said[0].detail["step"] == 20
    other = OptimizerSpec("adam", {"lr": 0.1})
    adam, said = new(store, plan.replace(optimizer=other.optimizer, optimizer_kwargs=other.kwargs), name="job",
                     default_dir=lambda _: shared)
    assert adam.checkpoint_dir == str(shared.with_name("job.3"))
    assert "its optimizer was SGD, this run's is Adam" in said[0].line
    fewer, said = new(store, plan.replace(num_workers=2, replicas_to_aggregate=2), name="job",
                      default_dir=lambda _: shared)
    assert "its num_workers was 1, this run's is 2; its replicas_to_aggregate was 1, this run's is 2" in said[0].line


def test_a_folder_asked_for_is_continued_whatever_the_settings_and_the_line_says_how_they_differ(store, plan, tmp_path):
    folder = tmp_path / "mine"
    sync, said = new(store, plan, name="a", checkpoint_dir=folder)
    assert said == []  # nothing there yet
    committed(sync, 10)
    run_async, said = new(store, plan.replace(mode="async"), name="b", checkpoint_dir=folder)
    assert run_async.checkpoint_dir == str(folder)
    assert said[0].line == (f'resuming run {sync.run_id} "a" (sync, 1 worker) from its checkpoint at global step 10 '
                            f"in {folder}, as checkpoint_dir= asks, though its mode was sync, this run's is async")
    _, said = new(store, plan.replace(seed=5), name="c", resume=sync.run_id)
    assert said[0].line.endswith(f"as resume={sync.run_id} asks, though its seed was 0, this run's is 5")
    fresh, said = new(store, plan.replace(mode="async", restore=False), name="d", checkpoint_dir=folder)
    aside = folder / f"before-run-{fresh.run_id}"  # the folder is the run's from scratch alone, nothing lost
    assert fresh.checkpoint_dir == str(folder) and checkpoint.committed_steps(aside) == [10]
    assert checkpoint.committed_steps(folder) == [] and [(n.kind, n.line) for n in said] == [(
        "set_aside", f"restore=False: the checkpoints in {folder} (the newest: global step 10 of run {sync.run_id}) "
        f"were moved to {aside}; this run starts from scratch in {folder}")]
    assert new(store, plan.replace(restore=False), name="e", checkpoint_dir=folder)[1] == []  # nothing there now


def test_a_checkpoint_of_a_run_the_store_does_not_know_is_continued_and_said(store, plan, tmp_path):
    folder = tmp_path / "elsewhere"
    committed(plan.replace(run_id=77), 40, folder)
    _, said = new(store, plan.replace(mode="async"), name="a", checkpoint_dir=folder)
    assert said[0].line == (f"resuming from the checkpoint at global step 40 in {folder}, written by a run 77 this "
                            "run store does not know")


@pytest.mark.parametrize("kw, fragment", [
    (dict(name=None, resume="latest"), "give name="),
    (dict(name="a", resume="newest"), "give .latest. \\(the newest run of the same name\\) or a run id"),
    (dict(name="a", resume=99), "has no run 99"),
    (dict(name="a", resume="latest", checkpoint_dir="/x"), "resume= or checkpoint_dir=, not both"),
], ids=["no-name", "unknown-word", "no-such-run", "both"])
def test_contradictions_are_one_line_errors_that_record_nothing(store, plan, kw, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        new(store, plan, **kw)
    assert "\n" not in str(info.value) and store.runs().empty


def test_resume_with_restore_off_is_refused(store, plan):
    with pytest.raises(ConfigError, match="drop restore=False"):
        new(store, plan.replace(restore=False), name="a", resume="latest")


def test_a_chief_started_again_ends_the_unended_runs_of_its_folder_only(store, plan):
    done, _ = new(store, plan, name="job", default_dir=lambda _: "/ckpt/job")
    killed, _ = new(store, plan, name="job", default_dir=lambda _: "/ckpt/job")
    elsewhere, _ = new(store, plan, name="other", default_dir=lambda _: "/ckpt/other")
    store.set_status(done.run_id, "finished")
    for p in (killed, elsewhere):
        store.set_status(p.run_id, "training")
    again, _ = new(store, plan, name="job", default_dir=lambda _: "/ckpt/job")
    assert end_orphans(store, again) == [killed.run_id]
    assert [store.run(p.run_id)["status"] for p in (done, killed, elsewhere, again)] == [
        "finished", "failed", "training", "starting"]
    assert f"run {again.run_id} continues it" in store.events(killed.run_id)["detail"].iloc[-1]["error"]
    assert store.run(killed.run_id)["failure"] == {"cause": f"its chief was lost: run {again.run_id} continues it "
                                                            "from its latest checkpoint", "task": "chief",
                                                   "step": None, "traceback": None}


def test_a_store_made_again_at_the_same_path_never_takes_the_old_runs_checkpoints(store, plan, tmp_path):
    """The runs.sqlite deleted and the notebook run again: run ids start at 1 again, and run 1's default folder
    holds the old run 1's checkpoints, which the new run 1 must not restore (it would train nothing when the old
    one had reached the same step target). A script's folder, named by the script, is shared on purpose."""
    def folder(run_id):
        return tmp_path / "checkpoints" / f"run-{run_id}"

    old, _ = new(store, plan, name="mnist", default_dir=folder, own_default=True)
    (Path(old.checkpoint_dir) / "step-000000010").mkdir(parents=True)
    store.close()
    Path(store.path).unlink()
    with RunStore(tmp_path / "runs.sqlite") as again:
        first, _ = new(again, plan, name="mnist", default_dir=folder, own_default=True)
        second, _ = new(again, plan, name="mnist", default_dir=folder, own_default=True)
        script, _ = new(again, plan, name="job", default_dir=lambda _: folder(1))
    assert first.run_id == old.run_id and first.checkpoint_dir == str(folder(1).with_name("run-1.2"))
    assert second.checkpoint_dir == str(folder(second.run_id))  # its own folder was free
    assert script.checkpoint_dir == str(folder(1))


def test_a_run_s_row_is_written_by_its_supervisor_alone_but_for_its_record_lease_and_the_orphan_sweep():
    """The methods of ``RunStore`` that change a row of ``runs`` are called from the supervisor, from
    ``run_records`` (``create_run``, which records the run before its supervisor starts, and ``end_orphans``) and
    from the lease, nowhere else (docs/maintainers.md, "One owner per run")."""
    package = Path(__file__).parents[3] / "pscluster"
    store = ast.parse((package / "metrics" / "store.py").read_text())
    writers = {f.name for f in ast.walk(store) if isinstance(f, ast.FunctionDef) and any(
        isinstance(c, ast.Constant) and isinstance(c.value, str) and re.search(r"(UPDATE|INSERT INTO) runs\b", c.value)
        for c in ast.walk(f))}
    assert {"create_run", "set_status", "renew_lease"} <= writers
    callers = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for function in (f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for call in (c for c in ast.walk(function) if isinstance(c, ast.Call)):
                receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
                # a handler's own set_status (tornado's) and the module function run_records.create_run are not
                # the store's
                if receiver is not None and call.func.attr in writers and path.name != "store.py" and not (
                        isinstance(receiver, ast.Name) and receiver.id in ("self", "run_records")):
                    callers.add((path.name if path.name != "run_records.py" else f"run_records.{function.name}"))
    assert callers == {"supervisor.py", "lease.py", "run_records.create_run", "run_records.end_orphans"}
