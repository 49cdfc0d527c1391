"""A process's cluster and task from its environment: TF_CONFIG as TensorFlow writes it (seed 000's layout),
PSCLUSTER_CONFIG first when both are set, and a one-line error naming the fix for each mistake."""

import json

import pytest

from pscluster import environ
from pscluster.errors import ConfigError
from pscluster.spec import ClusterSpec, TaskSpec
from pscluster.task_config import from_environment

SECRET = "0123456789abcdef" * 2
SEED_000 = {"ps": ["localhost:2221"], "chief": ["localhost:2222"], "worker": ["localhost:2223", "localhost:2224"]}


def tf_config(monkeypatch, cluster=SEED_000, task=None, *, secret=SECRET):
    monkeypatch.delenv(environ.CONFIG, raising=False)
    monkeypatch.delenv(environ.SECRET_FILE, raising=False)
    monkeypatch.setenv(environ.TF_CONFIG, json.dumps({"cluster": cluster, "task": task or {"type": "ps", "index": 0}}))
    if secret is None:
        monkeypatch.delenv(environ.SECRET, raising=False)
    else:
        monkeypatch.setenv(environ.SECRET, secret)


def one_line_error(*fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        from_environment()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize("job, index, worker", [("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2)])
def test_seed_000s_chief_and_workers_are_workers_0_1_2(monkeypatch, job, index, worker):
    tf_config(monkeypatch, task={"type": job, "index": index})
    spec, task = from_environment()
    assert [(t.host, t.port) for t in spec.ps] == [("localhost", 2221)]
    assert [t.host for t in spec.workers] == ["localhost"] * 3
    assert task == spec.workers[worker] and task.is_chief == (job == "chief")
    assert spec.key == bytes.fromhex(SECRET)


def test_a_ps_task_serves_on_its_listed_address(monkeypatch):
    tf_config(monkeypatch, cluster={"ps": ["10.0.0.1:2221", "10.0.0.2:2222"], "worker": ["10.0.0.3:1"]},
              task={"type": "ps", "index": 1})
    spec, task = from_environment()
    assert task == spec.ps[1] and task.address == "tcp://10.0.0.2:2222"


def test_without_a_chief_worker_0_is_the_chief_as_in_tf_1(monkeypatch):
    tf_config(monkeypatch, cluster={"ps": ["h:1"], "worker": ["h:2", "h:3"]}, task={"type": "worker", "index": 0})
    spec, task = from_environment()
    assert len(spec.workers) == 2 and task.is_chief


def test_an_evaluator_is_a_task_of_its_own_that_trains_nothing(monkeypatch):
    tf_config(monkeypatch, cluster={**SEED_000, "evaluator": ["localhost:2225"]}, task={"type": "evaluator"})
    spec, task = from_environment()
    assert task == spec.evaluator and task.name == "/job:evaluator/task:0"
    assert len(spec.workers) == 3 and spec.task("evaluator", 0) is task
    assert ClusterSpec.from_json(spec.to_json()) == spec  # PSCLUSTER_CONFIG carries it as well
    tf_config(monkeypatch, task={"type": "chief", "index": 0})
    assert from_environment()[0].evaluator is None


def test_pscluster_config_comes_first_and_needs_no_secret_variable(monkeypatch):
    tf_config(monkeypatch, secret=None)
    spec = ClusterSpec(ps=(TaskSpec("ps", 0, port=5000),), workers=(TaskSpec("worker", 0), TaskSpec("worker", 1)))
    monkeypatch.setenv(environ.CONFIG, spec.config_for("worker", 1))
    assert from_environment() == (spec, spec.workers[1])


def test_the_secret_from_a_file(monkeypatch, tmp_path):
    tf_config(monkeypatch, secret=None)
    (tmp_path / "key").write_text(SECRET.upper() + "\n")
    monkeypatch.setenv(environ.SECRET_FILE, str(tmp_path / "key"))
    assert from_environment()[0].key == bytes.fromhex(SECRET)
    monkeypatch.setenv(environ.SECRET_FILE, str(tmp_path / "missing"))
    one_line_error("cannot read PSCLUSTER_SECRET_FILE", "missing", "point it at a file")


def test_without_a_secret_one_line_says_how_to_make_one(monkeypatch):
    tf_config(monkeypatch, secret=None)
    one_line_error("needs its data-plane key", "export PSCLUSTER_SECRET=", "secrets.token_hex(16)",
                   "PSCLUSTER_SECRET_FILE")


@pytest.mark.parametrize("secret", ["not hex at all", "abcd"], ids=["not-hex", "too-short"])
def test_a_weak_or_garbled_secret_is_refused(monkeypatch, secret):
    tf_config(monkeypatch, secret=secret)
    one_line_error("PSCLUSTER_SECRET is not a key of 16 or more bytes in hex", "secrets.token_hex(16)")


@pytest.mark.parametrize("cluster, task, fragments", [
    (SEED_000, {"type": "chief", "index": 1}, ["chief 1", "one chief (index 0)"]),
    ({"ps": ["h:1"], "worker": ["h:2"]}, {"type": "chief", "index": 0}, ["no chief", 'add "chief"']),
    (SEED_000, {"type": "worker", "index": 2}, ["worker 2", "lists 2 worker task(s)", "counts from 0"]),
    (SEED_000, {"type": "master", "index": 0}, ["must name this process's job", "ps, chief, worker, evaluator"]),
    (SEED_000, {"type": "worker", "index": -1}, ["task index -1", "integer >= 0"]),
    (SEED_000, {"type": "evaluator", "index": 0}, ["evaluator 0", "no evaluator", 'add "evaluator"']),
    ({**SEED_000, "evaluator": ["h:5"]}, {"type": "evaluator", "index": 1}, ["evaluator 1", "one evaluator"]),
    ({**SEED_000, "master": ["h:1"]}, None, ["names the job 'master'", "ps, chief, worker, evaluator"]),
    ({"ps": "localhost:2221", "worker": ["h:2"]}, None, ["the ps job must be a list", "localhost:2222"]),
    ({"ps": ["localhost"], "worker": ["h:2"]}, None, ["ps address 'localhost' is not host:port"]),
    ({"ps": [], "worker": ["h:2"]}, None, ["no ps task"]),
    ({"ps": ["h:1"]}, None, ["no chief and no worker"]),
    ({**SEED_000, "chief": ["h:1", "h:2"]}, None, ["2 chief tasks"]),
    ({**SEED_000, "evaluator": ["h:1", "h:2"]}, None, ["2 evaluator tasks"]),
], ids=["chief-1", "no-chief-listed", "worker-out-of-range", "unknown-type", "negative-index", "no-evaluator-listed",
        "evaluator-1", "two-evaluators",
        "unknown-job", "job-not-a-list", "no-port", "no-ps", "no-worker", "two-chiefs"])
def test_mistakes_in_tf_config(monkeypatch, cluster, task, fragments):
    tf_config(monkeypatch, cluster=cluster, task=task)
    one_line_error("TF_CONFIG", *fragments)


def test_tf_config_that_is_not_json(monkeypatch):
    tf_config(monkeypatch)
    monkeypatch.setenv(environ.TF_CONFIG, "{'cluster': {}}")
    one_line_error("TF_CONFIG does not parse as JSON", "column 2")
    monkeypatch.setenv(environ.TF_CONFIG, "[]")
    one_line_error('TF_CONFIG has no "cluster"')


def test_neither_variable_set(monkeypatch):
    monkeypatch.delenv(environ.CONFIG, raising=False)
    monkeypatch.delenv(environ.TF_CONFIG, raising=False)
    one_line_error("neither PSCLUSTER_CONFIG nor TF_CONFIG is set", "ClusterSpec.config_for(role, index)")
