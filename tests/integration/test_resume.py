"""A run that starts from a checkpoint says so, and a relaunch with other settings is a new run
(``cluster.run_records``): scripts launched twice by ``pscluster launch``, the notebook's ``checkpoint_dir``."""

import subprocess
import sys
import textwrap

import pytest
import torch

from pscluster.metrics.store import RunStore

from .conftest import mlp
from .test_script_loop import environment, summaries

pytestmark = pytest.mark.integration

# the script of a sync-against-async comparison: the mode and the step target from its arguments
SCRIPT = textwrap.dedent("""
    import json, sys, torch, pscluster
    import torch.nn.functional as F

    ctx = pscluster.init(mode=sys.argv[1], steps=int(sys.argv[2]), seed=7, log_every=1000)
    model = ctx.model(torch.nn.Linear(64, 10))
    optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in ctx.shard(pscluster.datasets.digits("train"), batch_size=32):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if ctx.should_stop():
            break
    if ctx.run is not None:
        print("SUMMARY", json.dumps({"worker": 0, "run_id": ctx.run.id, "status": ctx.run.status,
                                     "local_steps": ctx.run.local_steps}), flush=True)
""")


def launch(tmp_path, mode: str, steps: int) -> tuple[dict, str]:
    """The script on 1 ps and 2 workers: the chief's summary and everything the tasks printed."""
    script = tmp_path / "compare.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "pscluster", "launch", "--ps", "1", "--workers", "2", str(script),
                           mode, str(steps)], env=environment(tmp_path / "home"), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = summaries(done.stdout)
    assert 0 in found, f"the chief printed no summary:\n{done.stdout[-6000:]}{done.stderr[-2000:]}"
    return found[0], done.stdout


def test_a_script_launched_again_resumes_the_same_run_and_starts_another_mode_anew(tmp_path):
    """Sync, sync again with a larger target: it resumes, says so, and trains the rest. Then async: it trains its
    whole target from scratch in a folder of its own (not 0 steps from the sync run's final checkpoint, silently).
    That an async run launched again continues the async one is tests/unit/cluster/test_run_records.py's."""
    folder = tmp_path / "home" / "checkpoints" / "compare"
    first, out = launch(tmp_path, "sync", 20)
    assert "resuming" not in out
    second, out = launch(tmp_path, "sync", 30)
    assert (f'resuming run {first["run_id"]} "compare" (sync, 2 workers) from its checkpoint at global step 20 in '
            f"{folder}") in out
    assert second["run_id"] != first["run_id"] and second["local_steps"] == [10, 10]
    run_async, out = launch(tmp_path, "async", 20)
    assert run_async["run_id"] != second["run_id"] and sum(run_async["local_steps"]) >= 20
    assert (f'not resuming run {second["run_id"]} "compare" (sync, 2 workers) from its checkpoint at global step 30 '
            f"in {folder}: its mode was sync, this run's is async; this run starts from scratch in "
            f"{folder.with_name('compare.2')}") in out
    with RunStore(tmp_path / "home" / "runs.sqlite", readonly=True) as store:
        assert store.metrics(second["run_id"])["global_step"].min() == 21
        [detail] = store.events(second["run_id"]).query("kind == 'resuming'")["detail"]
        assert (detail["run"], detail["mode"], detail["workers"], detail["step"]) == (first["run_id"], "sync", 2, 20)
        assert store.metrics(run_async["run_id"])["global_step"].min() == 1
        assert store.run(run_async["run_id"])["config"]["checkpoint_dir"] == str(folder.with_name("compare.2"))
        [detail] = store.events(run_async["run_id"]).query("kind == 'not_resuming'")["detail"]
        assert detail["run"] == second["run_id"] and detail["differs"] == {"mode": ["sync", "async"]}


def test_a_notebook_run_given_a_folder_of_another_mode_continues_it_and_says_how_they_differ(cluster_1ps_2w,
                                                                                             digits_train, tmp_path):
    """A ``checkpoint_dir`` given is continued, as MonitoredTrainingSession's is; the line, in the run's logs
    (which ``run.wait()`` prints) and events, says from where and that the modes differ."""
    options = dict(lr=0.1, batch_size=32, checkpoint_dir=tmp_path / "ckpt", name="digits")
    sync = cluster_1ps_2w.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), mode="sync", steps=10,
                                **options).wait(verbose=False)
    assert not sync.events().query("kind == 'resuming'").shape[0]
    run_async = cluster_1ps_2w.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), mode="async", steps=20,
                                     **options).wait(verbose=False)
    line = (f'resuming run {sync.id} "digits" (sync, 2 workers) from its checkpoint at global step 10 in '
            f"{tmp_path / 'ckpt'}, as checkpoint_dir= asks, though its mode was sync, this run's is async")
    assert f"[controller] {line}" in run_async.logs
    [detail] = run_async.events().query("kind == 'resuming'")["detail"]
    assert detail["run"] == sync.id and detail["differs"] == {"mode": ["sync", "async"]}
    assert run_async.metrics()["global_step"].min() == 11
