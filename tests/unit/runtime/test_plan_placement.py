"""Pure planning functions: placement, role assignment, devices, TrainPlan."""

import pytest
import torch

from pscluster.cluster.roles import EngineInfo, assign_roles, worker_devices
from pscluster.errors import ConfigError
from pscluster.runtime.plan import TrainPlan, VariableSpec, describe_variables


@pytest.fixture
def engines():
    # registration order is not engine-id order
    return [EngineInfo(engine_id=i, host="h", pid=1000 + i) for i in (4, 0, 3, 1, 2)]


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def plan(**changes) -> TrainPlan:
    kw = dict(run_id=1, mode="sync", steps=10, batch_size=8, optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    return TrainPlan.of(**{**kw, **changes})


# --- placement -----------------------------------------------------------------------------


def test_describe_variables(model):
    variables = describe_variables(model, 2)
    assert [(v.id, v.name, v.shape, v.dtype, v.ps) for v in variables] == [
        (0, "0.weight", (3, 4), "float32", 0), (1, "0.bias", (3,), "float32", 1),
        (2, "2.weight", (2, 3), "float32", 0), (3, "2.bias", (2,), "float32", 1)]
    assert variables[0].nbytes == 48 and variables[0].placement == "0.weight: /job:ps/task:0"
    assert VariableSpec(0, "e", (10, 4), "float16", 0).nbytes == 80


def test_describe_variables_partitions_and_marks_sparse_embeddings():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.EmbeddingBag(10, 4, sparse=True), "fc": torch.nn.Linear(4, 1)})
    variables = describe_variables(model, 2, placement="greedy", partition={"emb": 3})
    assert [(v.name, v.parameter, v.start, v.shape, v.sparse) for v in variables] == [
        ("emb.weight/part_0", "emb.weight", 0, (4, 4), True), ("emb.weight/part_1", "emb.weight", 4, (3, 4), True),
        ("emb.weight/part_2", "emb.weight", 7, (3, 4), True), ("fc.weight", "fc.weight", 0, (1, 4), False),
        ("fc.bias", "fc.bias", 0, (1,), False)]
    assert [v.ps for v in variables] == [0, 1, 1, 0, 0]  # greedy: 64 B, then 48 B to the other, ...
    assert variables[1].placement == "emb.weight/part_1: /job:ps/task:1 (rows 4-6, 48 B)"
    assert TrainPlan.from_json(plan(variables=variables).to_json()).variables == variables


# --- roles and devices ---------------------------------------------------------------------


@pytest.mark.parametrize("gpus, devices", [(0, ["cpu"] * 3), (2, ["cuda:0", "cuda:1", "cuda:0"]),
                                           (4, ["cuda:0", "cuda:1", "cuda:2"])])
def test_worker_devices(gpus, devices):
    assert worker_devices(3, gpus) == devices


def test_worker_devices_negative_gpus():
    with pytest.raises(ConfigError, match="gpus=-1: use 0"):
        worker_devices(2, -1)


@pytest.mark.parametrize("gpus, devices", [(0, ["cpu", "cpu"]), (2, ["cuda:0", "cuda:1"])])
def test_assign_roles_puts_ps_on_the_lowest_engine_ids(engines, gpus, devices):
    spec = assign_roles(engines, 2, 2, gpus=gpus, name="c", secret="ab" * 16)
    assert [(t.role, t.index, t.engine_id, t.pid, t.device) for t in spec.ps] == [
        ("ps", 0, 0, 1000, "cpu"), ("ps", 1, 1, 1001, "cpu")]
    assert [(t.role, t.index, t.engine_id, t.device) for t in spec.workers] == [
        ("worker", 0, 2, devices[0]), ("worker", 1, 3, devices[1])]
    assert spec.chief.engine_id == 2
    assert spec.name == "c" and spec.secret == "ab" * 16
    assert all(t.host == "127.0.0.1" for t in spec.ps + spec.workers)


def test_assign_roles_with_too_few_engines(engines):
    with pytest.raises(ConfigError, match="5 engines for 2 ps \\+ 4 workers: start more engines"):
        assign_roles(engines, 2, 4)


# --- TrainPlan -----------------------------------------------------------------------------


def test_train_plan_json_round_trip(model):
    p = plan(variables=describe_variables(model, 2),
             mode="async", optimizer="Adam", optimizer_kwargs={"lr": 0.01, "amsgrad": True, "betas": (0.8, 0.9)},
             optimizer_groups=({"params": ["*.bias"], "weight_decay": 0.0},), scheduler="StepLR",
             scheduler_options={"step_size": 10}, metrics_address="tcp://127.0.0.1:5555", seed=3, num_workers=2,
             replicas_to_aggregate=2, pipeline=True, max_grad_norm=1.5, on_nonfinite="skip", buffers="average",
             state_keys=(("0.weight", "0.weight"),))
    back = TrainPlan.from_json(p.to_json())
    assert back == p
    assert back.optimizer_spec.to_dict() == p.optimizer_spec.to_dict()
    assert isinstance(back.variables[0].shape, tuple)
    assert [v.name for v in back.variables_on(1)] == ["0.bias", "2.bias"]


@pytest.mark.parametrize("changes, problem", [
    ({"mode": "bsp"}, "mode='bsp': use 'sync', 'async' or 'ssp'"),
    ({"mode": "ssp", "staleness_bound": -1}, "staleness_bound=-1: use an integer >= 0"),
    ({"pipeline": True}, "pipeline=True with mode='sync': use mode='async'"),
    ({"mode": "ssp", "pipeline": True}, "pipeline=True with mode='ssp': use mode='async'"),
    ({"mode": "async", "pipeline": True, "variables": (VariableSpec(0, "emb.weight", (9, 4), "float32", 0,
                                                                    sparse=True),)},
     "pipeline=True with sparse embeddings: .* build them with sparse=False"),
    ({"steps": 0}, "steps=0: use a number of global steps >= 1"),
    ({"steps": 2.5}, "steps=2.5: use a number of global steps >= 1"),
    ({"batch_size": -1}, "batch_size=-1"),
    ({"replicas_to_aggregate": 0}, "replicas_to_aggregate=0"),
    ({"run_id": 0}, "run_id must fit in 32 bits"),
    ({"run_id": 2**32}, "run_id must fit in 32 bits"),
    ({"request_timeout": 0}, "request_timeout=0: use a number of seconds > 0"),
    ({"optimizer": "nosuchopt"}, "unknown optimizer 'nosuchopt': use a torch.optim class"),
    ({"optimizer_kwargs": {"betas": object()}}, "optimizer option betas=<object object at .*> has no JSON form"),
    ({"scheduler_options": {"step_size": 10}}, "scheduler_options without a scheduler: give scheduler="),
    ({"on_nonfinite": "ignore"}, "on_nonfinite='ignore': use 'fail'"),
    ({"max_grad_norm": 0}, "max_grad_norm=0: use a positive number"),
    ({"buffers": "rank0"}, "buffers='rank0': use 'chief'"),
])
def test_train_plan_validation(changes, problem):
    with pytest.raises(ConfigError, match=problem) as info:
        plan(**changes)
    assert "\n" not in str(info.value)


