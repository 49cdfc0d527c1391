"""The user's own loop in a script (``pscluster.init()``), every task a process of its own: started by
``pscluster launch`` (as torchrun starts ranks), and by hand with TF_CONFIG."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pscluster
from pscluster.runtime.network import free_port
from pscluster.metrics.store import RunStore
from pscluster.runtime import checkpoint

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import json, sys, torch, pscluster
    import torch.nn.functional as F

    ctx = pscluster.init(mode="sync", steps=int(sys.argv[1]), seed=7, log_every=20)
    torch.manual_seed(ctx.seed)
    model = ctx.model(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
    optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in ctx.endless_shard(pscluster.datasets.digits("train"), batch_size=32):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        ctx.log(loss=loss.item())
        if ctx.should_stop():
            break
    out = {"worker": ctx.worker_index, "global_step": ctx.global_step, "seed": ctx.seed}
    if ctx.run is not None:
        out.update(run_id=ctx.run.id, status=ctx.run.status, local_steps=ctx.run.local_steps)
    print("SUMMARY", json.dumps(out), flush=True)
""")


def summaries(output: str) -> dict[int, dict]:
    found = [json.loads(line.split("SUMMARY ", 1)[1]) for line in output.splitlines() if "SUMMARY " in line]
    return {s["worker"]: s for s in found}


def environment(home, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PSCLUSTER_CONFIG", "TF_CONFIG")}
    return {**env, "PSCLUSTER_HOME": str(home), **extra}


def test_pscluster_launch_runs_a_script_s_loop_on_a_local_cluster(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "pscluster", "launch", "--ps", "2", "--workers", "2", str(script),
                           "60"], env=environment(tmp_path / "home"), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = summaries(done.stdout)
    assert out[0]["status"] == "finished" and out[0]["local_steps"] == [60, 60] and out[1]["global_step"] == 60
    assert out[0]["seed"] == 7 and out[1]["seed"] != 7  # each worker's own stream
    assert "[worker:1] After 20 training steps (20 global steps)" in done.stdout
    with RunStore(tmp_path / "home" / "runs.sqlite", readonly=True) as store:
        run = store.run(out[0]["run_id"])
        assert run["name"] == "train" and run["status"] == "finished" and "pscluster.init" in run["code"]
        assert set(store.metrics(out[0]["run_id"])["worker"]) == {0, 1}


def test_a_tf_config_job_runs_the_same_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cluster = {"ps": [f"localhost:{free_port()}"], "chief": [f"localhost:{free_port()}"],
               "worker": [f"localhost:{free_port()}"]}
    secret = os.urandom(16).hex()
    processes = [subprocess.Popen([sys.executable, str(script), "40"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=environment(tmp_path / "home", PSCLUSTER_SECRET=secret,
                                                  TF_CONFIG=json.dumps({"cluster": cluster,
                                                                        "task": {"type": role, "index": 0}})))
                 for role in ("ps", "chief", "worker")]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in processes] == [0, 0, 0], [o[-2000:] for o in outputs]
    chief, worker = summaries(outputs[1])[0], summaries(outputs[2])[1]
    assert chief["status"] == "finished" and chief["local_steps"] == [40, 40] and worker["global_step"] == 40
    run = pscluster.open_run("train", store=tmp_path / "home" / "runs.sqlite")
    assert run.status == "finished" and run.summary()["global_step"] == 40
    saved = run.events().query("kind == 'checkpoint'")["detail"].iloc[-1]
    assert saved["step"] == 40
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    model.load_state_dict(checkpoint.Checkpoint.load(saved["path"]).state_dict())  # the final checkpoint, strictly


GAN_SCRIPT = textwrap.dedent("""
    import sys, torch, pscluster
    sys.path.insert(0, {root!r})
    from tests.integration.loops import gan_pscluster

    torch.set_num_threads(1)
    ctx = pscluster.init(mode="sync", steps=30, seed=3)
    gan_pscluster.main(ctx)
    if ctx.run is not None:
        torch.save(ctx.run.state_dict(), sys.argv[1])
""")


def test_a_script_s_loop_with_two_optimizers_is_the_plain_loop(tmp_path):
    """A GAN script registers its two optimizers before its loop: the run starts at the loop's first call, with
    both (a script, unlike Cluster.run, says nothing beforehand of how many it registers)."""
    from .loops import gan_plain
    from .test_user_loop import max_diff, threads

    script = tmp_path / "gan.py"
    script.write_text(GAN_SCRIPT.format(root=str(Path(__file__).resolve().parents[2])))
    done = subprocess.run([sys.executable, "-m", "pscluster", "launch", "--ps", "1", "--workers", "1", str(script),
                           str(tmp_path / "state.pt")], env=environment(tmp_path / "home"), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with threads(1):
        netG, netD, _ = gan_plain.main(seed=3, steps=30)
    expected = {**{f"Generator.{k}": v for k, v in netG.state_dict().items()},
                **{f"Discriminator.{k}": v for k, v in netD.state_dict().items()}}
    assert max_diff(torch.load(tmp_path / "state.pt"), expected) <= 1e-5
