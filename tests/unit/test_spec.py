"""ClusterSpec / TaskSpec: validation, JSON form, PSCLUSTER_CONFIG."""

import json

import pytest

from pscluster import environ
from pscluster.errors import ConfigError
from pscluster.spec import ClusterSpec, TaskSpec
from pscluster.task_config import from_environment


@pytest.fixture
def spec():
    return ClusterSpec(ps=(TaskSpec("ps", 0, port=5000), TaskSpec("ps", 1, host="10.0.0.2", port=5001)),
                       workers=(TaskSpec("worker", 0, device="cuda:1", engine_id=3, pid=123),
                                TaskSpec("worker", 1), TaskSpec("worker", 2)),
                       name="demo")


def assert_one_line(error: Exception, *fragments: str):
    message = str(error)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_json_round_trip_is_equal(spec):
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert ClusterSpec.from_dict(json.loads(spec.to_json())).secret == spec.secret


def test_encrypt_survives_json_and_defaults_to_off(spec):
    assert not spec.encrypt
    encrypted = ClusterSpec(ps=spec.ps, workers=spec.workers, encrypt=True)
    back = ClusterSpec.from_json(encrypted.to_json())
    assert back == encrypted and back.encrypt and back.public_dict()["encrypt"] is True
    old = {k: v for k, v in json.loads(spec.to_json()).items() if k != "encrypt"}  # a spec from before the field
    assert ClusterSpec.from_dict(old) == spec
    with pytest.raises(ConfigError) as info:
        ClusterSpec(ps=spec.ps, workers=spec.workers, encrypt="yes")
    assert_one_line(info.value, "encrypt='yes': use True or False")


def test_secret_is_random_hex_and_not_in_repr(spec):
    other = ClusterSpec(ps=spec.ps, workers=spec.workers)
    assert other.secret != spec.secret
    assert len(spec.key) == 16 and spec.key == bytes.fromhex(spec.secret)
    assert spec.secret not in repr(spec)


def test_task_names_chief_and_addresses(spec):
    assert spec.ps[0].name == "/job:ps/task:0"
    assert spec.workers[2].name == "/job:worker/task:2"
    assert spec.chief is spec.workers[0] and spec.chief.is_chief
    assert not spec.workers[1].is_chief and not spec.ps[0].is_chief
    assert spec.ps[1].address == "tcp://10.0.0.2:5001"
    assert spec.task("worker", 2) is spec.workers[2]


def test_with_ps_ports_changes_only_the_ps_ports(spec):
    moved = spec.with_ps_ports([6000, 6001])
    assert [t.port for t in moved.ps] == [6000, 6001]
    assert moved.workers == spec.workers and moved.secret == spec.secret
    assert [t.port for t in spec.ps] == [5000, 5001]  # the original is unchanged
    with pytest.raises(ValueError):
        spec.with_ps_ports([6000])


@pytest.mark.parametrize("role, index", [("ps", 1), ("worker", 0), ("worker", 2)])
def test_config_for_and_from_environment(spec, monkeypatch, role, index):
    monkeypatch.setenv(environ.CONFIG, spec.config_for(role, index))
    cluster, task = from_environment()
    assert cluster == spec
    assert task == spec.task(role, index) and task.role == role and task.index == index


@pytest.mark.parametrize("role, index, fragments", [
    ("chief", 0, ["unknown role 'chief'", "use 'ps', 'worker' or 'evaluator'"]),
    ("worker", 3, ["no worker task 3", "this cluster has 3"]),
    ("ps", -1, ["no ps task -1"]),
])
def test_config_for_unknown_task(spec, role, index, fragments):
    with pytest.raises(ConfigError) as info:
        spec.config_for(role, index)
    assert_one_line(info.value, *fragments)


@pytest.mark.parametrize("make, fragments", [
    (lambda: ClusterSpec(ps=(), workers=(TaskSpec("worker", 0),)), ["at least one ps task", "ps >= 1"]),
    (lambda: ClusterSpec(ps=(TaskSpec("ps", 0),), workers=()), ["at least one worker", "workers >= 1"]),
    (lambda: ClusterSpec(ps=(TaskSpec("ps", 1),), workers=(TaskSpec("worker", 0),)),
     ["ps tasks must be numbered 0..0"]),
    (lambda: ClusterSpec(ps=(TaskSpec("ps", 0),), workers=(TaskSpec("worker", 1), TaskSpec("worker", 0))),
     ["worker tasks must be numbered 0..1"]),
    (lambda: ClusterSpec(ps=(TaskSpec("ps", 0),), workers=(TaskSpec("ps", 0),)),
     ["worker tasks must be numbered"]),
    (lambda: TaskSpec("chief", 0), ["unknown role 'chief'", "use 'ps', 'worker' or 'evaluator'"]),
    (lambda: TaskSpec("ps", -1), ["negative", "start at 0"]),
    (lambda: TaskSpec("worker", 0, device="gpu:0"), ["device 'gpu:0'", "use 'cpu' or 'cuda:<n>'"]),
], ids=["no-ps", "no-worker", "ps-misnumbered", "workers-out-of-order", "role-in-wrong-list", "bad-role",
        "negative-index", "bad-device"])
def test_invalid_specs(make, fragments):
    with pytest.raises(ConfigError) as info:
        make()
    assert_one_line(info.value, *fragments)


def test_from_json_of_garbage(spec):
    with pytest.raises(ConfigError) as info:
        ClusterSpec.from_json("{not json")
    assert_one_line(info.value, "does not parse", "to_json()")
    with pytest.raises(ConfigError) as info:
        ClusterSpec.from_json('{"ps": []}')
    assert_one_line(info.value, "not a ClusterSpec", "expected keys name, secret, ps, worker")


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_unset_config(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(environ.CONFIG, raising=False)
    else:
        monkeypatch.setenv(environ.CONFIG, value)
    monkeypatch.delenv(environ.TF_CONFIG, raising=False)
    with pytest.raises(ConfigError) as info:
        from_environment()
    assert_one_line(info.value, "PSCLUSTER_CONFIG nor TF_CONFIG is set", "ClusterSpec.config_for(role, index)")


def _config(spec, **task):
    return json.dumps({"cluster": spec.to_dict(), "task": task})


@pytest.mark.parametrize("make, fragments", [
    (lambda spec: "{not json", ["PSCLUSTER_CONFIG is not valid", '"task"']),
    (lambda spec: "[1, 2]", ["PSCLUSTER_CONFIG is not valid"]),
    (lambda spec: json.dumps({"cluster": spec.to_dict()}), ["PSCLUSTER_CONFIG is not valid"]),
    (lambda spec: _config(spec, type="worker"), ["PSCLUSTER_CONFIG is not valid"]),
    (lambda spec: _config(spec, type="worker", index="one"), ["PSCLUSTER_CONFIG is not valid"]),
    (lambda spec: _config(spec, type="worker", index=7), ["no worker task 7"]),
    (lambda spec: _config(spec, type="chief", index=0), ["unknown role 'chief'"]),
    (lambda spec: json.dumps({"cluster": {"ps": []}, "task": {"type": "ps", "index": 0}}), ["not a ClusterSpec"]),
    (lambda spec: json.dumps({"cluster": {**spec.to_dict(), "ps": [{"role": "ps", "index": 0, "device": None}]},
                              "task": {"type": "ps", "index": 0}}), ["device None"]),
], ids=["not-json", "a-list", "no-task", "no-index", "index-not-a-number", "index-out-of-range", "bad-type",
        "bad-cluster", "device-null"])
def test_malformed_config(spec, monkeypatch, make, fragments):
    monkeypatch.setenv(environ.CONFIG, make(spec))
    with pytest.raises(ConfigError) as info:
        from_environment()
    assert_one_line(info.value, *fragments)
