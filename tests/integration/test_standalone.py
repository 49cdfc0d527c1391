"""Training from a script, without a notebook or ipyparallel: every task a process of its own, joined through
PSCLUSTER_CONFIG or TF_CONFIG and nothing but environment variables; the chief supervises the run, into the
run store, as a notebook's kernel does."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pscluster
from pscluster.cluster.script_evaluator import GONE_S
from pscluster.metrics.store import RunStore
from pscluster.widgets.dashboard import Dashboard
from pscluster.runtime.network import free_port
from pscluster.spec import ClusterSpec, TaskSpec

pytestmark = pytest.mark.integration

# seed 000's "Distributed Estimator": one script, run by every task
SCRIPT = textwrap.dedent("""
    import json, sys, torch, pscluster

    def model_fn():
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    result = pscluster.train_from_environment(
        model_fn, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), optimizer="sgd", lr=0.1,
        mode="sync", steps=int(sys.argv[1]), batch_size=32, log_every=100, checkpoint_every=100,
        test_dataset=pscluster.datasets.digits("test"), log=lambda line: print("LOG", line, flush=True))
    if isinstance(result, pscluster.Run):  # the chief
        result = {"run_id": result.id, "global_step": result.global_step, "local_steps": result.local_steps}
    print("SUMMARY", json.dumps(result))
""")


def start(script, steps: int, home, **config):
    """The process of one task: this interpreter running ``script`` with nothing but environment variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("PSCLUSTER_CONFIG", "TF_CONFIG")}
    # one torch thread per task, as a scheduler gives each task its own cores: four or five tasks of a thread per
    # core each, on a small machine, spend their steps in OpenMP's spinning (ten times slower under load)
    env.update(PSCLUSTER_HOME=str(home), OMP_NUM_THREADS="1", **config)
    return subprocess.Popen([sys.executable, str(script), str(steps)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(processes, timeout: float = 240) -> list[dict]:
    """Each process's printed summary, once every one has ended by itself with exit status 0."""
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert [p.returncode for p in processes] == [0] * len(processes), outputs
    return [json.loads(out.split("SUMMARY", 1)[1]) for out in outputs], outputs


def training_run(home) -> int | None:
    """The id of the run store's run that is training now, if any."""
    if not (home / "runs.sqlite").exists():
        return None
    runs = pscluster.runs(home / "runs.sqlite")
    training = runs[runs["status"] == "training"]
    return None if training.empty else int(training["id"].iloc[0])


@pytest.fixture
def estimator(tmp_path):
    script = tmp_path / "estimator.py"
    script.write_text(SCRIPT)
    return script


def seed_000_job(script, steps: int, home, cluster: dict, secret: str):
    """Seed 000's four terminals: a ps, the chief and two workers (and the evaluator when ``cluster`` lists
    one, last)."""
    def task(job, index):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
        return start(script, steps, home, TF_CONFIG=tf_config, PSCLUSTER_SECRET=secret)
    return [task("ps", 0), task("chief", 0), task("worker", 0), task("worker", 1),
            *([task("evaluator", 0)] if "evaluator" in cluster else [])]


def live_dashboard(home, job, timeout: float = 180) -> dict[str, list]:
    """What a notebook's dashboard of the script's run shows while it trains: the convergence chart's loss
    curves by name, once it shows every worker's; {} when the run ends first (or a task of ``job`` does). The
    dashboard is opened as soon as the run trains and refreshed, as a notebook's is, until then: a job of a
    torch thread a task trains its few hundred steps in about a second."""
    deadline = time.monotonic() + timeout
    while training_run(home) is None:
        if time.monotonic() > deadline or any(p.poll() is not None for p in job):
            return {}
        time.sleep(0.1)
    run = pscluster.open_run("estimator", store=home / "runs.sqlite")
    dashboard = Dashboard(run.store.path, run.id)
    try:
        while not dashboard.refresh() and time.monotonic() < deadline:
            shown = {trace["name"]: list(trace["y"]) for trace in dashboard.panels["convergence"].spec().traces
                     if trace.get("yaxis") == "y" and trace["name"] in ("worker 0", "worker 1", "worker 2")}
            if len(shown) == 3 and all(shown.values()):
                return shown
            time.sleep(0.05)
        return {}
    finally:
        dashboard.stop()


def test_seed_000s_tf_config_job_trains_into_the_run_store_and_resumes_when_started_again(estimator, tmp_path):
    cluster = {"ps": [f"localhost:{free_port()}"], "chief": [f"localhost:{free_port()}"],
               "worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"],
               "evaluator": [f"localhost:{free_port()}"]}
    secret, home = os.urandom(16).hex(), tmp_path / "home"
    job = seed_000_job(estimator, 300, home, cluster, secret)
    # while it trains, another process (a notebook) sees the run, and its dashboard every worker's loss
    shown = live_dashboard(home, job)
    assert len(shown) == 3 and all(shown.values()), shown
    (ps, chief, *workers, evaluator), outputs = finish(job)
    assert ps == {"task": 0, "role": "ps", "global_step": 300}  # the ps ended by itself, once the run was over
    # TF's chief is worker 0 and TF's workers 0 and 1 are workers 1 and 2: each pushed once per global step
    assert (chief["global_step"], chief["local_steps"]) == (300, [300, 300, 300])
    assert [(w["task"], w["local_steps"]) for w in workers] == [(1, 300), (2, 300)]
    # the chief prints every worker's progress, as a notebook does
    assert all(f"[worker:{i}] After 300 training steps (300 global steps)" in outputs[1] for i in range(3))

    runs = pscluster.runs(home / "runs.sqlite")
    assert list(runs["name"]) == ["estimator"] and list(runs["status"]) == ["finished"]
    # the evaluator evaluated each checkpoint as it was committed, and the chief evaluated nothing itself
    assert evaluator == {"task": 0, "role": "evaluator", "run_id": chief["run_id"], "evaluated": [100, 200, 300]}
    assert "[evaluator] global step 300: loss" in outputs[4]
    with RunStore(home / "runs.sqlite") as store:
        run_id = chief["run_id"]
        assert sorted(store.metrics(run_id)["worker"].unique()) == [0, 1, 2]
        evaluations = store.evaluations(run_id)
        assert list(evaluations["global_step"]) == [100, 200, 300] and evaluations["accuracy"].iloc[-1] >= 0.93
        checkpoints = store.events(run_id).query("kind == 'checkpoint'")
        assert [d["step"] for d in checkpoints["detail"]] == [100, 200, 300]
        assert "checkpoints/estimator" in checkpoints["detail"].iloc[-1]["path"]
    assert_evaluator_charts(home, "estimator", run_id, [100, 200, 300])

    # the whole job started again, to 400 steps: it goes on from the latest checkpoint, as
    # MonitoredTrainingSession does, never from 0
    job = seed_000_job(estimator, 400, home, cluster, secret)
    job[1].wait(timeout=240)  # the chief: the run is over (the job prints a few lines: no pipe fills up)
    job[-1].wait(timeout=GONE_S / 2)  # the evaluator ends with it, not after the ended ps tasks' silence
    (ps, chief, *workers, evaluator), _ = finish(job)
    assert ps["global_step"] == 400 and chief["global_step"] == 400
    assert chief["local_steps"] == [100, 100, 100]
    assert evaluator["evaluated"] == [400]  # not the earlier run's checkpoints in the same folder
    with RunStore(home / "runs.sqlite") as store:
        resumed = chief["run_id"]
        assert store.metrics(resumed)["global_step"].min() == 301
        assert [d["step"] for d in store.events(resumed).query("kind == 'restored'")["detail"]] == [300]
        assert store.evaluations(resumed)["accuracy"].iloc[-1] >= 0.93
    assert list(pscluster.runs(home / "runs.sqlite")["status"]) == ["finished", "finished"]

    # and once more to 400: the target is reached already; every task says so and ends by itself, as TF's
    # StopAtStepHook does, none waiting for steps that will not come
    (ps, chief, *workers, evaluator), outputs = finish(seed_000_job(estimator, 400, home, cluster, secret),
                                                       timeout=120)
    assert ps["global_step"] == chief["global_step"] == 400 and chief["local_steps"] == [0, 0, 0]
    assert [w["local_steps"] for w in workers] == [0, 0]
    said = f"run {chief['run_id']}: the target step 400 is reached already"
    assert all(said in out for out in outputs[1:4]), outputs
    assert list(pscluster.runs(home / "runs.sqlite")["status"]) == ["finished"] * 3


def assert_evaluator_charts(home, name: str, run_id: int, steps: list[int]) -> None:
    """TensorBoard's own reader finds the evaluator's accuracy at each of ``steps`` in the run's eval folder."""
    accumulator = EventAccumulator(str(home / "tensorboard" / f"{name}-{run_id}" / "eval"))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("accuracy")] == steps


def committed_steps(home) -> list[int]:
    """The checkpoint steps committed in the run that is training now (none yet: [])."""
    if (run_id := training_run(home)) is None:
        return []
    with RunStore(home / "runs.sqlite") as store:
        events = store.events(run_id)
    return [d["step"] for d in events.query("kind == 'checkpoint'")["detail"]]


def wait_for_a_checkpoint(home, processes, before: str, timeout: float = 180) -> None:
    """Wait until the run training now has committed a checkpoint, while every one of ``processes`` lives; else
    fail saying why (``before``: what the test was about to do), with what each task printed."""
    started = time.monotonic()
    while not committed_steps(home):
        ended = [p for p in processes if p.poll() is not None]
        if ended or time.monotonic() - started > timeout:
            for p in processes:
                p.kill()
            printed = "\n".join(f"--- task {i} (exit status {p.wait()}):\n{p.stdout.read()}"
                                for i, p in enumerate(processes))
            why = f"{len(ended)} task(s) ended" if ended else "none came"
            pytest.fail(f"no checkpoint within {time.monotonic() - started:.0f}s before {before}: {why}\n{printed}")
        time.sleep(0.1)


def test_a_chief_killed_and_started_again_resumes_from_the_latest_checkpoint_and_the_workers_join_it(estimator,
                                                                                                     tmp_path):
    cluster = {"ps": [f"localhost:{free_port()}"], "chief": [f"localhost:{free_port()}"],
               "worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    secret, home = os.urandom(16).hex(), tmp_path / "home"
    ps, chief, *workers = seed_000_job(estimator, 600, home, cluster, secret)
    wait_for_a_checkpoint(home, [ps, chief, *workers], "the chief was to be killed")
    chief.kill()  # SIGKILL, mid run: its supervisor dies with it
    chief.wait(10)
    again = start(estimator, 600, home, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "chief",
                                                                                              "index": 0}}),
                  PSCLUSTER_SECRET=secret)
    (ps, chief, *workers), outputs = finish([ps, again, *workers])
    assert ps["global_step"] == chief["global_step"] == 600
    assert all("was started again by its chief: joining the new one" in out for out in outputs[2:])
    with RunStore(home / "runs.sqlite") as store:
        resumed = chief["run_id"]
        [restored] = [d["step"] for d in store.events(resumed).query("kind == 'restored'")["detail"]]
        # the latest committed checkpoint, never 0: one of checkpoint_every=100's, or of the evaluations' (every
        # 60 steps, a tenth of the run: the ps tasks write a checkpoint there to evaluate)
        assert restored >= 60 and (restored % 100 == 0 or restored % 60 == 0), restored
        assert store.metrics(resumed)["global_step"].min() == restored + 1
        assert store.evaluations(resumed)["accuracy"].iloc[-1] >= 0.93
        # the killed chief's run does not stay "training": the chief started again ended it
        [killed] = [int(i) for i in store.runs()["id"] if i != resumed]
        assert store.run(killed)["status"] == "failed"
        assert store.events(killed).query("kind == 'end'")["detail"].tolist() == [
            {"status": "failed", "error": f"its chief was lost: run {resumed} continues it from its latest checkpoint"}]
    assert chief["local_steps"] == [600 - restored] * 3


def test_a_chief_sent_sigterm_stops_its_run_releases_its_workers_and_ends_by_that_signal(estimator, tmp_path):
    cluster = {"ps": [f"localhost:{free_port()}"], "chief": [f"localhost:{free_port()}"],
               "worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    secret, home = os.urandom(16).hex(), tmp_path / "home"
    ps, chief, *workers = job = seed_000_job(estimator, 10**6, home, cluster, secret)
    wait_for_a_checkpoint(home, job, "the chief was to be sent SIGTERM")
    chief.terminate()  # what a scheduler sends to preempt the job
    try:
        outputs = [p.communicate(timeout=120)[0] for p in job]
    finally:
        for p in job:
            p.kill()
    assert chief.returncode == -signal.SIGTERM, outputs[1]
    assert [p.returncode for p in (ps, *workers)] == [0, 0, 0], outputs  # the ps and the workers end by themselves
    summaries = [json.loads(out.split("SUMMARY", 1)[1]) for out in (outputs[0], *outputs[2:])]
    with RunStore(home / "runs.sqlite") as store:
        [run] = store.runs().itertuples()
        assert run.status == "stopped" and run.owner_lost is None
        stopped_at = summaries[0]["global_step"]  # the ps's
        checkpoints = [d["step"] for d in store.events(run.id).query("kind == 'checkpoint'")["detail"]]
        assert 0 < stopped_at < 10**6 and max(checkpoints) == stopped_at  # the final checkpoint holds it
        assert store.events(run.id).query("kind == 'end'")["detail"].tolist()[0]["status"] == "stopped"


def test_the_whole_job_killed_mid_run_and_started_again_resumes_from_its_latest_checkpoint(estimator, tmp_path):
    cluster = {"ps": [f"localhost:{free_port()}"], "chief": [f"localhost:{free_port()}"],
               "worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    secret, home = os.urandom(16).hex(), tmp_path / "home"
    job = seed_000_job(estimator, 600, home, cluster, secret)
    wait_for_a_checkpoint(home, job, "the job was to be killed")
    for p in job:  # the machine lost power, or the scheduler killed the whole job
        p.kill()
    for p in job:
        p.wait(10)
    (ps, chief, *workers), _ = finish(seed_000_job(estimator, 600, home, cluster, secret))
    assert ps["global_step"] == chief["global_step"] == 600
    with RunStore(home / "runs.sqlite") as store:
        resumed = chief["run_id"]
        [restored] = [d["step"] for d in store.events(resumed).query("kind == 'restored'")["detail"]]
        # the latest committed checkpoint, never 0: one of checkpoint_every=100's, or of the evaluations' (every
        # 60 steps, a tenth of the run: the ps tasks write a checkpoint there to evaluate)
        assert restored >= 60 and (restored % 100 == 0 or restored % 60 == 0), restored
        assert chief["local_steps"] == [600 - restored] * 3
        assert store.evaluations(resumed)["accuracy"].iloc[-1] >= 0.93
        # the killed job's run is not left "training": the chief started again ended it
        assert [store.run(i)["status"] for i in sorted(store.runs()["id"])] == ["failed", "finished"]


def test_a_ps_killed_and_started_again_by_its_scheduler_costs_a_few_steps_and_the_workers_rejoin(estimator,
                                                                                                   tmp_path):
    cluster = {"ps": [f"localhost:{free_port()}", f"localhost:{free_port()}"], "chief": [f"localhost:{free_port()}"],
               "worker": [f"localhost:{free_port()}"]}
    secret, home = os.urandom(16).hex(), tmp_path / "home"

    def task(job, index):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
        return start(estimator, 1000, home, TF_CONFIG=tf_config, PSCLUSTER_SECRET=secret)
    ps0, ps1, chief, worker = task("ps", 0), task("ps", 1), task("chief", 0), task("worker", 0)
    wait_for_a_checkpoint(home, [ps0, ps1, chief, worker], "the ps was to be killed")
    ps1.kill()  # SIGKILL mid run; its scheduler starts it again a moment later, with the same config
    ps1.wait(10)
    time.sleep(1.0)
    (ps0, again, chief, worker), outputs = finish([ps0, task("ps", 1), chief, worker])
    assert ps0["global_step"] == again["global_step"] == chief["global_step"] == 1000
    with RunStore(home / "runs.sqlite") as store:
        run_id = chief["run_id"]
        assert store.run(run_id)["status"] == "finished"
        events = store.events(run_id)
        assert "ps:1" in set(events.query("kind == 'lost'")["task"])
        [restarting] = events.query("kind == 'restarting'")["detail"].tolist()
        assert restarting["attempt"] == 1 and restarting["from_step"] >= 100  # never from 0
        assert store.evaluations(run_id)["accuracy"].iloc[-1] >= 0.93
    assert "lost a ps (PeerLost): joining its next attempt" in outputs[3] or "stopped attempt 0" in outputs[3]
    assert worker["global_step"] == 1000


def test_a_worker_killed_and_started_again_by_its_scheduler_rejoins_the_run(estimator, tmp_path):
    cluster = {"ps": [f"localhost:{free_port()}"], "chief": [f"localhost:{free_port()}"],
               "worker": [f"localhost:{free_port()}"]}
    secret, home = os.urandom(16).hex(), tmp_path / "home"

    def task(job, index):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
        return start(estimator, 600, home, TF_CONFIG=tf_config, PSCLUSTER_SECRET=secret)
    ps, chief, worker = task("ps", 0), task("chief", 0), task("worker", 0)
    wait_for_a_checkpoint(home, [ps, chief, worker], "the worker was to be killed")
    worker.kill()
    worker.wait(10)
    time.sleep(1.0)  # meanwhile the sync run waits for its gradients
    (ps, chief, worker), _ = finish([ps, chief, task("worker", 0)])
    assert ps["global_step"] == chief["global_step"] == worker["global_step"] == 600
    # the restarted worker gave a gradient to every global step from the one it joined at
    assert 0 < worker["local_steps"] < 600 and chief["local_steps"][0] == 600
    with RunStore(home / "runs.sqlite") as store:
        assert store.run(chief["run_id"])["status"] == "finished"
        assert store.evaluations(chief["run_id"])["accuracy"].iloc[-1] >= 0.93


def test_ps_and_workers_from_pscluster_config(estimator, tmp_path):
    spec = ClusterSpec(ps=(TaskSpec("ps", 0, port=free_port()),),
                       workers=(TaskSpec("worker", 0), TaskSpec("worker", 1)))
    ps = subprocess.Popen([sys.executable, "-m", "pscluster.runtime"], text=True,
                          env={**os.environ, "PSCLUSTER_CONFIG": spec.config_for("ps", 0)})
    workers = [start(estimator, 100, tmp_path, PSCLUSTER_CONFIG=spec.config_for("worker", i)) for i in range(2)]
    try:
        (chief, worker), outputs = finish(workers, timeout=120)
    finally:  # this ps serves run after run: it ends on SIGTERM
        ps.terminate()
        ps.wait(10)
    assert ps.returncode == 0
    assert (chief["global_step"], chief["local_steps"]) == (100, [100, 100])
    assert (worker["task"], worker["local_steps"], worker["global_step"]) == (1, 100, 100)
    assert "[worker:1] After 100 training steps (100 global steps)" in outputs[0]  # the chief prints them all
    assert "LOG After 100 training steps (100 global steps), loss" in outputs[1]  # a worker, its own


def test_a_worker_says_what_torch_refuses_of_the_options_as_the_chief_does(tmp_path):
    """Options the chief refuses (it ends before it starts the run) are refused by a worker waiting for that run
    too, in the same words: a worker whose run starts builds no optimizer to check them."""
    script = tmp_path / "estimator.py"
    script.write_text(SCRIPT.replace("lr=0.1", "lr=-1.0"))
    spec = ClusterSpec(ps=(TaskSpec("ps", 0, port=free_port()),),
                       workers=(TaskSpec("worker", 0), TaskSpec("worker", 1)))
    ps = subprocess.Popen([sys.executable, "-m", "pscluster.runtime"], text=True,
                          env={**os.environ, "PSCLUSTER_CONFIG": spec.config_for("ps", 0)})
    try:
        chief, worker = (start(script, 100, tmp_path, PSCLUSTER_CONFIG=spec.config_for("worker", i)) for i in range(2))
        said = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in (chief, worker)]
    finally:
        ps.terminate()
        ps.wait(10)
    assert chief.returncode != 0 and worker.returncode != 0
    assert said[0] == said[1] and said[0].startswith("pscluster.errors.ConfigError: ") and "-1.0" in said[0], said


def test_worker_config_given_to_ps_entry_point_is_a_one_line_error():
    spec = ClusterSpec(ps=(TaskSpec("ps", 0, port=1),), workers=(TaskSpec("worker", 0),))
    env = {**os.environ, "PSCLUSTER_CONFIG": spec.config_for("worker", 0)}
    done = subprocess.run([sys.executable, "-m", "pscluster.runtime"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "pscluster: /job:worker/task:0 is a worker: run it from your script with train_from_environment()"]
