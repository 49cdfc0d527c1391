"""A new run's row, checkpoint folder and plan (``cluster.run_records``): ``resume`` finds the earlier run and
its folder in a real run store, and every contradiction is a one-line error before anything is recorded."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pscluster.cluster.run_records import create_run, end_orphans
from pscluster.errors import ConfigError
from pscluster.metrics.store import RunStore
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
    first, resumed = new(store, plan, name="mnist", resume="latest")
    assert resumed is None and first.checkpoint_dir == str(tmp_path / f"run-{first.run_id}")
    assert store.run(first.run_id)["config"]["checkpoint_dir"] == first.checkpoint_dir
    assert len(store.placement(first.run_id)) == 2
    new(store, plan, name="other")
    second, resumed = new(store, plan, name="mnist", resume="latest")
    assert (resumed.run_id, resumed.checkpoint_dir) == (first.run_id, first.checkpoint_dir)
    assert second.checkpoint_dir == first.checkpoint_dir and second.run_id > first.run_id
    third, resumed = new(store, plan, name="renamed", resume=first.run_id)
    assert resumed.run_id == first.run_id and third.checkpoint_dir == first.checkpoint_dir


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
        new(store, replace(plan, restore=False), name="a", resume="latest")


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
