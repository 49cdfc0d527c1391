"""The runtime without a notebook or ipyparallel: processes joined through PSCLUSTER_CONFIG or TF_CONFIG."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import zmq

from pscluster.spec import ClusterSpec, TaskSpec

pytestmark = pytest.mark.integration

WORKER_SCRIPT = textwrap.dedent("""
    import json, torch, pscluster
    from pscluster.runtime.standalone import train_from_environment

    def model_fn():
        return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))

    summary = train_from_environment(model_fn, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(),
                                     optimizer="sgd", lr=0.1, mode="sync", steps=40, batch_size=32,
                                     log_every=20, log=lambda line: print("LOG", line, flush=True))
    print("SUMMARY", json.dumps({k: summary[k] for k in ("task", "local_steps", "global_step")}))
""")


def free_port() -> int:
    sock = zmq.Context.instance().socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(linger=0)
    return port


def test_ps_and_workers_from_pscluster_config(tmp_path):
    spec = ClusterSpec(ps=(TaskSpec("ps", 0, port=free_port()),),
                       workers=(TaskSpec("worker", 0), TaskSpec("worker", 1)))
    script = tmp_path / "train.py"
    script.write_text(WORKER_SCRIPT)

    def launch(args, role, index):
        env = {**os.environ, "PSCLUSTER_CONFIG": spec.config_for(role, index)}
        return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    ps = launch(["-m", "pscluster.runtime"], "ps", 0)
    workers = [launch([str(script)], "worker", i) for i in range(2)]
    try:
        outputs = [w.communicate(timeout=120)[0] for w in workers]
    finally:
        ps.terminate()
        ps.wait(10)
        for w in workers:
            w.kill()
    assert ps.returncode == 0  # SIGTERM is a clean shutdown
    for i, out in enumerate(outputs):
        summary = json.loads(out.split("SUMMARY", 1)[1])
        assert summary == {"task": i, "local_steps": 40, "global_step": 40}
        assert "LOG After 20 training steps (20 global steps), loss" in out


# seed 000's "Distributed Estimator": one script, run by the ps, the chief and two workers in four terminals
ESTIMATOR_SCRIPT = textwrap.dedent("""
    import json, torch, pscluster
    from pscluster.runtime.standalone import train_from_environment

    def model_fn():
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    summary = train_from_environment(model_fn, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(),
                                     optimizer="sgd", lr=0.1, mode="sync", steps=300, batch_size=32,
                                     log_every=100, test_dataset=pscluster.datasets.digits("test"))
    print("SUMMARY", json.dumps(summary))
""")


def test_seed_000s_tf_config_layout_ps_chief_and_two_workers_as_four_processes(tmp_path):
    cluster = {"ps": [f"localhost:{free_port()}"], "chief": [f"localhost:{free_port()}"],
               "worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    script = tmp_path / "estimator.py"
    script.write_text(ESTIMATOR_SCRIPT)
    environment = {k: v for k, v in os.environ.items() if k != "PSCLUSTER_CONFIG"}
    environment["PSCLUSTER_SECRET"] = os.urandom(16).hex()

    def launch(job, index):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
        return subprocess.Popen([sys.executable, str(script)], env={**environment, "TF_CONFIG": tf_config},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    tasks = [launch("ps", 0), launch("chief", 0), launch("worker", 0), launch("worker", 1)]
    try:  # every task ends by itself, the ps once the run is over
        outputs = [t.communicate(timeout=240)[0] for t in tasks]
    finally:
        for t in tasks:
            t.kill()
    summaries = [json.loads(out.split("SUMMARY", 1)[1]) for out in outputs]
    assert [t.returncode for t in tasks] == [0, 0, 0, 0], outputs
    ps, chief, *workers = summaries
    assert ps == {"task": 0, "role": "ps", "global_step": 300}
    # TF's chief is worker 0, TF's workers 0 and 1 are workers 1 and 2: each pushed once per global step
    assert [s["task"] for s in (chief, *workers)] == [0, 1, 2]
    assert [s["local_steps"] for s in (chief, *workers)] == [300] * 3
    assert chief["test_step"] == 300 and chief["test_accuracy"] >= 0.93
    assert "test_accuracy" not in workers[0]
    assert "After 100 training steps (100 global steps)" in outputs[1]


def test_worker_config_given_to_ps_entry_point_is_a_one_line_error():
    spec = ClusterSpec(ps=(TaskSpec("ps", 0, port=1),), workers=(TaskSpec("worker", 0),))
    env = {**os.environ, "PSCLUSTER_CONFIG": spec.config_for("worker", 0)}
    done = subprocess.run([sys.executable, "-m", "pscluster.runtime"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "pscluster: /job:worker/task:0 is a worker: run it from your script with train_from_environment()"]
