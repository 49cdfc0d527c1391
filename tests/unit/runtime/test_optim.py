"""The optimizer spec, built as a ps builds it, against plain torch loops."""

import functools
import json
import time
import warnings
from collections import Counter

import cloudpickle
import pytest
import torch
from torch.optim import lr_scheduler

from pscluster.errors import ConfigError
from pscluster.runtime import checkpoint, optim, tagged
from pscluster.runtime.optim import (OptimizerSpec, build, check, optimizer_name, register, resolve_optimizer,
                                     resolve_scheduler, shipped)

STEPS = 50


class MyOptimizer(torch.optim.SGD):
    """An optimizer from outside torch.optim, found by its ``module:Class`` path."""


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.bn1 = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.bn1(self.norm(self.fc1(x)).relu()))


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def backward(model: torch.nn.Module, step: int) -> None:
    model.zero_grad(set_to_none=True)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1000 + step))
    model(x).pow(2).mean().backward()


def torch_loop(model, optimizer, scheduler=None, steps=STEPS) -> list[list[float]]:
    """What a torch user writes; the learning rates each update used."""
    lrs = []
    for s in range(steps):
        backward(model, s)
        lrs.append([float(g["lr"]) for g in optimizer.param_groups])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return lrs


def ps_loop(model, opts, start=0, steps=STEPS) -> list[list[float]]:
    """What the ps tasks do (each PsOptimizer over its own variables); the learning rates of each update."""
    lrs = []
    for s in range(start, steps):
        backward(model, s)
        for opt in opts:
            opt.step(s)
        lrs.append(opts[0].lr)
        assert all(opt.lr == opts[0].lr for opt in opts)
    return lrs


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module, tol=1e-6) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=name)


def warmup(step: int, warmup: int = 10) -> float:
    """Linear warmup, then halving every 20 steps."""
    return min(1.0, (step + 1) / warmup) * 0.5 ** (step // 20)


NO_DECAY = ["*.bias", "*norm*", "bn*"]


# --- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, cls", [
    ("sgd", torch.optim.SGD), ("ADAMW", torch.optim.AdamW), ("rmsprop", torch.optim.RMSprop),
    ("torch.optim:SGD", torch.optim.SGD), ("torch.optim.adam:Adam", torch.optim.Adam),
    (f"{__name__}:MyOptimizer", MyOptimizer),
])
def test_resolve_optimizer(name, cls):
    assert resolve_optimizer(name) is cls


@pytest.mark.parametrize("name", ["Optimizer", "adamx", "no.such.module:Opt", "torch.optim:NoSuch",
                                  "os:getcwd", "torch.optim:Optimizer"])
def test_resolve_optimizer_refuses_what_is_not_an_optimizer(name):
    with pytest.raises(ConfigError, match="(?i)optimizer"):
        resolve_optimizer(name)


@pytest.mark.parametrize("given, name", [(torch.optim.SGD, "SGD"), ("adam", "Adam"), ("ADAMW", "AdamW"),
                                         (MyOptimizer, f"{__name__}:MyOptimizer")])
def test_optimizer_name_is_one_spelling_of_each(given, name):
    """A torch name in any case is spelt as torch does, so one optimizer reads the same everywhere it shows."""
    assert optimizer_name(given) == OptimizerSpec(given).optimizer == name
    assert resolve_optimizer(name) is (given if isinstance(given, type) else getattr(torch.optim, name))


@pytest.mark.parametrize("given", [42, torch.nn.Linear, "bogus"])
def test_optimizer_name_refuses(given):
    with pytest.raises(ConfigError):
        optimizer_name(given)


def test_scheduler_names():
    assert resolve_scheduler("steplr") is lr_scheduler.StepLR
    assert resolve_scheduler("torch.optim.lr_scheduler:OneCycleLR") is lr_scheduler.OneCycleLR
    assert OptimizerSpec(scheduler=lr_scheduler.CosineAnnealingLR, scheduler_options={"T_max": 5}).scheduler \
        == "CosineAnnealingLR"
    assert OptimizerSpec(scheduler=f"{__name__}:warmup").scheduler == f"{__name__}:warmup"


# --- the spec as JSON -------------------------------------------------------------------------


def test_kwargs_round_trip_through_json_to_torch():
    spec = OptimizerSpec(torch.optim.Adam, {"lr": torch.tensor(0.01), "betas": (0.9, 0.98), "eps": 1e-8,
                                            "amsgrad": True, "foreach": None},
                         groups=[{"params": "*.bias", "betas": (0.8, 0.9), "lr": torch.tensor([0.5])[0]}],
                         scheduler="MultiStepLR", scheduler_options={"milestones": [5, 10], "gamma": 0.5})
    data = json.loads(json.dumps(spec.to_dict()))
    again = OptimizerSpec.from_dict(data)
    assert again == spec and again.to_dict() == data
    assert OptimizerSpec.from_dict(again.to_dict()) == spec  # the JSON form is accepted as given
    opt = build(list(net().named_parameters()), again).optimizers[0]
    assert type(opt) is torch.optim.Adam
    assert opt.defaults["betas"] == (0.9, 0.98) and isinstance(opt.defaults["betas"], tuple)
    assert isinstance(opt.defaults["lr"], torch.Tensor) and opt.defaults["lr"].dtype == torch.float32
    assert float(opt.defaults["lr"]) == pytest.approx(0.01, rel=1e-7)
    assert opt.defaults["amsgrad"] is True and opt.defaults["eps"] == 1e-8
    bias, default = opt.param_groups
    assert bias["betas"] == (0.8, 0.9) and default["betas"] == (0.9, 0.98)
    assert float(bias["lr"]) == 0.5 and float(default["lr"]) == pytest.approx(0.01)


def test_spec_refusals_at_construction():
    with pytest.raises(ConfigError, match="ReduceLROnPlateau needs a validation metric.*StepLR"):
        OptimizerSpec("SGD", scheduler="ReduceLROnPlateau")
    with pytest.raises(ConfigError, match="validation metric"):
        OptimizerSpec("SGD", scheduler=lr_scheduler.ReduceLROnPlateau)
    with pytest.raises(ConfigError, match="composes scheduler objects"):
        OptimizerSpec("SGD", scheduler="SequentialLR")
    with pytest.raises(ConfigError, match="unknown scheduler 'steplr2'"):
        OptimizerSpec("SGD", scheduler="steplr2")
    with pytest.raises(ConfigError, match="unknown optimizer 'adamx'"):
        OptimizerSpec("adamx")
    with pytest.raises(ConfigError, match="optimizer option lr=<object.*has no JSON form"):
        OptimizerSpec("SGD", {"lr": object()})
    with pytest.raises(ConfigError, match="at most 1024 elements"):
        OptimizerSpec("SGD", {"lr": torch.zeros(2000)})
    with pytest.raises(ConfigError, match="last_epoch"):
        OptimizerSpec("SGD", scheduler="StepLR", scheduler_options={"step_size": 2, "last_epoch": 5})
    with pytest.raises(ConfigError, match="without a scheduler"):
        OptimizerSpec("SGD", scheduler_options={"step_size": 2})
    with pytest.raises(ConfigError, match="group 0 .*'params'"):
        OptimizerSpec("SGD", groups=[{"weight_decay": 0.0}])
    with pytest.raises(ConfigError, match="choose parameters with groups"):
        OptimizerSpec("SGD", {"params": ["*"]})
    with pytest.raises(ConfigError, match="spec keys"):
        OptimizerSpec.from_dict({"optimizer": "SGD", "lr": 0.1})


@pytest.mark.parametrize("spec, message", [
    (OptimizerSpec("SGD", {"lr": 0.1, "momentun": 0.9}),
     "optimizer SGD refused momentun=0.9: SGD.__init__() got an unexpected keyword argument 'momentun' — "
     "pass the optimizer's own options"),
    (OptimizerSpec("SGD", {"lr": -1.0}), "optimizer SGD refused lr=-1.0: Invalid learning rate: -1.0 —"),
    (OptimizerSpec("SGD", {"lr": 0.1}, groups=[{"params": ["*.bias"], "weight_decay": -1.0}]),
     "optimizer SGD group 0 refused weight_decay=-1.0: Invalid weight_decay value: -1.0"),
    (OptimizerSpec("SGD", {"lr": 0.1}, groups=[{"params": ["*.bias"], "wd": 0.0}]),
     "optimizer SGD group 0 refused wd=0.0: SGD.__init__() got an unexpected keyword argument 'wd'"),
    (OptimizerSpec("SGD", {"lr": 0.1}, groups=[{"params": ["*.bais"]}]),
     "group 0 pattern '*.bais' matches no trainable parameter: use names as model.named_parameters() gives "
     "them (e.g. 'fc1.weight')"),
    (OptimizerSpec("SGD", {"lr": 0.1}, scheduler="StepLR", scheduler_options={"step_sz": 3}),
     "scheduler StepLR refused step_sz=3: StepLR.__init__() got an unexpected keyword argument 'step_sz' — "
     "pass the scheduler's own options"),
    (OptimizerSpec("SGD", {"lr": 0.1}, scheduler="StepLR"), "scheduler StepLR failed: StepLR.__init__() missing"),
    (OptimizerSpec("Adagrad", {"lr": 0.1}, scheduler="OneCycleLR", scheduler_options={"max_lr": 1, "total_steps": 9}),
     "scheduler OneCycleLR refused max_lr=1, total_steps=9: optimizer must support momentum"),
    (OptimizerSpec("SGD", {"lr": 0.1}, scheduler=f"{__name__}:warmup", scheduler_options={"warm": 3}),
     f"schedule {__name__}:warmup (at step 0) refused warm=3: warmup() got an unexpected keyword argument 'warm'"),
    (OptimizerSpec("LBFGS"), "optimizer LBFGS step failed: LBFGS.step() missing 1 required positional argument: "
                             "'closure' — a ps calls step() without a closure"),
])
def test_check_says_what_torch_refused_on_one_line(spec, message):
    with pytest.raises(ConfigError) as info:
        check(net(), spec)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_check_refuses_a_schedule_that_ends_before_the_run():
    spec = OptimizerSpec("Adam", scheduler="OneCycleLR", scheduler_options={"max_lr": 0.1, "total_steps": 100})
    check(net(), spec, steps=101)  # the update from step 100 uses the schedule's last rate, as in torch
    with pytest.raises(ConfigError, match="schedule OneCycleLR at the run's last step 101 failed: Tried to step 101 "
                                          "times.* — make it cover the run's 102 steps"):
        check(net(), spec, steps=102)


def test_check_gives_the_optimizer_only_trainable_parameters():
    model = net()
    model.fc1.requires_grad_(False)
    check(model, OptimizerSpec("SGD", {"lr": 0.1}, groups=[{"params": ["fc2.*"], "lr": 0.01}]))
    with pytest.raises(ConfigError, match="'fc1.\\*' matches no trainable parameter"):
        check(model, OptimizerSpec("SGD", {"lr": 0.1}, groups=[{"params": ["fc1.*"], "lr": 0.01}]))
    model.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        check(model, OptimizerSpec("SGD", {"lr": 0.1}))


# --- parameter groups ----------------------------------------------------------------------------


def test_groups_train_as_torch_param_groups():
    reference, ours = net(), net()
    named = dict(reference.named_parameters())
    no_decay = [p for n, p in named.items() if n.endswith(".bias") or "norm" in n or n.startswith("bn")]
    decay = [p for p in named.values() if all(p is not q for q in no_decay)]
    torch_opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}, {"params": decay}],
                                  lr=1e-2, weight_decay=0.1, betas=(0.9, 0.98), fused=True)  # as a ps builds it
    spec = OptimizerSpec("AdamW", {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.98)},
                         groups=[{"params": NO_DECAY, "weight_decay": 0.0, "lr": 3e-3}])
    check(ours, spec)
    opt = build(list(ours.named_parameters()), spec)
    assert [len(g["params"]) for g in opt.optimizers[0].param_groups] == [len(no_decay), len(decay)]
    assert torch_loop(reference, torch_opt, steps=30) == ps_loop(ours, [opt], steps=30)
    assert_same_params(reference, ours)


def test_row_shards_join_the_group_of_their_parameter():
    parts = [(f"emb.weight/part_{k}", torch.nn.Parameter(torch.zeros(2, 3))) for k in range(2)]
    opt = build(parts + [("fc.bias", torch.nn.Parameter(torch.zeros(3)))],
                OptimizerSpec("SGD", {"lr": 0.1}, groups=[{"params": "emb.weight", "lr": 0.5}]))
    assert [len(g["params"]) for g in opt.optimizers[0].param_groups] == [2, 1]


# --- schedules --------------------------------------------------------------------------------------

SCHEDULES = {
    "StepLR": ("StepLR", {"step_size": 7, "gamma": 0.5}, lambda o: lr_scheduler.StepLR(o, 7, 0.5)),
    "MultiStepLR": ("MultiStepLR", {"milestones": [10, 25]},
                    lambda o: lr_scheduler.MultiStepLR(o, [10, 25])),
    "warmup": (warmup, {}, lambda o: lr_scheduler.LambdaLR(o, warmup)),
    "warmup5": (warmup, {"warmup": 5}, lambda o: lr_scheduler.LambdaLR(o, functools.partial(warmup, warmup=5))),
    "OneCycleLR": ("OneCycleLR", {"max_lr": [0.05, 0.1], "total_steps": STEPS},
                   lambda o: lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.1], total_steps=STEPS)),
    "CosineAnnealingLR": ("CosineAnnealingLR", {"T_max": 20, "eta_min": 1e-3},
                          lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=1e-3)),
    "CosineAnnealingWarmRestarts": ("CosineAnnealingWarmRestarts", {"T_0": 6, "T_mult": 2},
                                    lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=6, T_mult=2)),
    "CyclicLR": ("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 8},
                 lambda o: lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=8)),
}


def sgd_spec(schedule: str, **changes) -> OptimizerSpec:
    scheduler, options, _ = SCHEDULES[schedule]
    return OptimizerSpec(**{"optimizer": "SGD", "kwargs": {"lr": 0.1, "momentum": 0.9},
                            "groups": [{"params": ["*.bias"], "lr": 0.05}], "scheduler": scheduler,
                            "scheduler_options": options, **changes})


def torch_sgd(model, schedule: str):
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    rest = [p for n, p in model.named_parameters() if not n.endswith(".bias")]
    optimizer = torch.optim.SGD([{"params": biases, "lr": 0.05}, {"params": rest}], lr=0.1, momentum=0.9)
    return optimizer, SCHEDULES[schedule][2](optimizer)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_schedules_step_on_the_global_step_as_a_torch_loop(schedule):
    reference, ours = net(), net()
    expected = torch_loop(reference, *torch_sgd(reference, schedule))
    check(ours, sgd_spec(schedule))
    got = ps_loop(ours, [build(list(ours.named_parameters()), sgd_spec(schedule))])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert len({tuple(lrs) for lrs in got}) > 2  # the rate did change
    assert_same_params(reference, ours)


def test_ps_tasks_holding_parts_of_a_model_agree_with_one_optimizer():
    spec = OptimizerSpec("AdamW", {"lr": 1e-2, "weight_decay": 0.1}, groups=[{"params": NO_DECAY, "weight_decay": 0.0}],
                         scheduler="OneCycleLR", scheduler_options={"max_lr": 0.05, "total_steps": STEPS})
    whole, split = net(), net()
    named = list(split.named_parameters())
    expected = ps_loop(whole, [build(list(whole.named_parameters()), spec)])
    ps0, ps1 = build(named[0::2], spec), build(named[1::2], spec)
    assert ps_loop(split, [ps0, ps1]) == expected
    assert_same_params(whole, split)
    assert ps0.schedule_state() == ps1.schedule_state()


@pytest.mark.parametrize("schedule", ["StepLR", "MultiStepLR", "warmup5", "OneCycleLR", "CosineAnnealingWarmRestarts"])
@pytest.mark.parametrize("saved", [True, False], ids=["from-state", "fast-forward"])
def test_a_restored_ps_continues_the_schedule(schedule, saved):
    restart = 20
    reference, ours = net(), net()
    expected = ps_loop(reference, [build(list(reference.named_parameters()), sgd_spec(schedule))])
    first = build(list(ours.named_parameters()), sgd_spec(schedule))
    ps_loop(ours, [first], steps=restart)
    # what a checkpoint at `restart` holds: values, per-variable state, the schedule state as JSON
    values = {n: p.detach().clone() for n, p in ours.named_parameters()}
    states = {n: checkpoint.decode_state(checkpoint.encode_state(first.state(p))) for n, p in ours.named_parameters()}
    schedule_state = json.loads(json.dumps(first.schedule_state()))
    restored = net(seed=1)
    restored.load_state_dict(ours.state_dict())
    second = build(list(restored.named_parameters()), sgd_spec(schedule))
    for n, p in restored.named_parameters():
        assert torch.equal(p, values[n])
        second.load_state(p, states[n])
    second.restore(restart, schedule_state if saved else None)
    got = ps_loop(restored, [second], start=restart)
    torch.testing.assert_close(got, expected[restart:], rtol=1e-12, atol=1e-12)
    assert_same_params(reference, restored)


def test_fast_forward_of_a_million_steps():
    spec = OptimizerSpec("SGD", {"lr": 0.1}, scheduler=warmup)
    opt = build([("w", torch.nn.Parameter(torch.zeros(3)))], spec)
    start = time.perf_counter()
    opt.restore(10**6)
    assert time.perf_counter() - start < 0.1  # a function of the step: a jump, not a million steps
    assert opt.plain_sgd_rate(10**6) == 0.1 * warmup(10**6)
    step_lr = build([("w", torch.nn.Parameter(torch.zeros(3)))],
                    OptimizerSpec("SGD", {"lr": 0.1}, scheduler="StepLR", scheduler_options={"step_size": 1000}))
    step_lr.restore(20_000)  # one scheduler step per global step
    assert step_lr.plain_sgd_rate(20_000) == pytest.approx(0.1 * 0.1 ** 20, rel=1e-12)
    with pytest.raises(ValueError, match="steps only go forward"):
        step_lr.step(5)


def test_restore_refuses_the_state_of_another_spec():
    state = build(list(net().named_parameters()), sgd_spec("StepLR")).schedule_state()
    other = build(list(net().named_parameters()), sgd_spec("StepLR", groups=[]))
    with pytest.raises(ConfigError, match="restore from a checkpoint of this step and optimizer spec"):
        other.restore(1, state)
    assert build(list(net().named_parameters()), OptimizerSpec("SGD")).schedule_state() == {}


# --- the plain-SGD fast path --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    OptimizerSpec("SGD", {"lr": 0.1, "momentum": 0.9}), OptimizerSpec("SGD", {"lr": 0.1, "weight_decay": 1e-4}),
    OptimizerSpec("SGD", {"lr": 0.1, "maximize": True}), OptimizerSpec("Adam"), OptimizerSpec(MyOptimizer),
    OptimizerSpec("SGD", {"lr": 0.1}, groups=[{"params": "*.bias", "lr": 0.2}]),
    OptimizerSpec("SGD", {"lr": 0.1}, scheduler="OneCycleLR", scheduler_options={"max_lr": 1, "total_steps": 9}),
])
def test_plain_sgd_rate_is_none_unless_the_update_is_plain_sgd(spec):
    assert build(list(net().named_parameters()), spec).plain_sgd_rate(0) is None


def test_plain_sgd_rate_follows_the_schedule():
    reference, ours = net(), net()
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = torch_loop(reference, torch_opt, lr_scheduler.StepLR(torch_opt, 7, 0.5))
    opt = build(list(ours.named_parameters()),
                OptimizerSpec("SGD", {"lr": 0.1}, scheduler="StepLR", scheduler_options={"step_size": 7, "gamma": 0.5}))
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scheduler steps without optimizer.step(): torch's warning is not ours
        for s in range(STEPS):
            backward(ours, s)
            lr = opt.plain_sgd_rate(s)
            with torch.no_grad():  # the ps's fast path
                torch._foreach_add_(list(ours.parameters()), [p.grad for p in ours.parameters()], alpha=-lr)
            got.append([lr])
    assert got == expected
    assert_same_params(reference, ours, tol=1e-7)
    plain = build([("w", torch.nn.Parameter(torch.zeros(2)))], OptimizerSpec("SGD", {"lr": 0.5}))
    assert plain.plain_sgd_rate(9) == 0.5
    named = list(net().named_parameters())  # a user's loop's SGD: one group of every variable, the default one empty
    loops = build(named, OptimizerSpec("SGD", {"lr": 0.1}, groups=[{"params": [n for n, _ in named], "lr": 0.2}]))
    assert loops.plain_sgd_rate(0) == 0.2


# --- sparse variables -------------------------------------------------------------------------------


class Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(20, 4, sparse=True)
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, rows):
        return self.fc(self.emb(rows))


def test_sparse_embeddings_get_sparse_adam_as_torch_users_write_it():
    torch.manual_seed(0)
    reference = Tower()
    ours = Tower()
    ours.load_state_dict(reference.state_dict())
    dense = torch.optim.Adam([{"params": [reference.fc.bias], "lr": 0.05}, {"params": [reference.fc.weight]}],
                             lr=0.01, weight_decay=0.1)
    sparse = torch.optim.SparseAdam([reference.emb.weight], lr=0.01)
    spec = OptimizerSpec("Adam", {"lr": 0.01, "weight_decay": 0.1}, groups=[{"params": "*.bias", "lr": 0.05}])
    check(ours, spec)
    named = list(ours.named_parameters())
    opt = build(named, spec, sparse=[n == "emb.weight" for n, _ in named])
    assert [type(o) for o in opt.optimizers] == [torch.optim.Adam, torch.optim.SparseAdam]
    assert "weight_decay" not in opt.optimizers[1].defaults
    for s in range(10):
        rows = torch.randint(0, 20, (8, 3), generator=torch.Generator().manual_seed(s))
        for model in (reference, ours):
            model.zero_grad(set_to_none=True)
            model(rows).pow(2).mean().backward()
        dense.step()
        sparse.step()
        opt.step(s)
    assert_same_params(reference, ours)
    assert set(opt.state(ours.emb.weight)) == {"step", "exp_avg", "exp_avg_sq"}


def test_sparse_embeddings_refuse_optimizers_without_a_sparse_update():
    with pytest.raises(ConfigError, match="RMSprop cannot update sparse embeddings: use SGD, Adagrad or Adam"):
        check(Tower(), OptimizerSpec("RMSprop"))
    opt = build(list(Tower().named_parameters()), OptimizerSpec("Adagrad", {"lr": 0.1}), sparse=[True, False, False])
    assert [type(o) for o in opt.optimizers] == [torch.optim.Adagrad, torch.optim.Adagrad]
    assert opt.plain_sgd_rate(0) is None


# --- objects shipped to the ps tasks -------------------------------------------------------------------


def notebook_class():
    """What a notebook cell defines: a class of module __main__, which no ps can import."""
    class ClippedSGD(torch.optim.SGD):
        def __init__(self, params, clip: float = 1.0, **kwargs):
            super().__init__(params, **kwargs)
            self.clip = clip

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.clamp_(-self.clip, self.clip)
            return super().step(closure)

    ClippedSGD.__module__, ClippedSGD.__qualname__ = "__main__", "ClippedSGD"
    return ClippedSGD


def test_notebook_objects_are_shipped_and_resolved_by_name(monkeypatch):
    clipped_sgd = notebook_class()
    spec = OptimizerSpec(clipped_sgd, {"lr": 0.1, "clip": 1e-3}, scheduler=lambda step: 0.9 ** step)
    assert spec.optimizer == "__main__:ClippedSGD" and spec.scheduler.startswith(f"{__name__}:")
    objects = shipped(spec)
    assert objects == {"__main__:ClippedSGD": clipped_sgd, spec.scheduler: objects[spec.scheduler]}
    check(net(), spec)
    data = json.dumps(spec.to_dict())
    wire = cloudpickle.dumps(objects)  # what the controller sends through ipyparallel

    monkeypatch.setattr(optim, "_registry", {})  # a ps engine: nothing registered yet
    received = OptimizerSpec.from_dict(json.loads(data))
    with pytest.raises(ConfigError, match="optimizer '__main__:ClippedSGD' not found.*pass the object itself"):
        build(list(net().named_parameters()), received)
    register(cloudpickle.loads(wire))
    reference, ours = net(), net()
    opt = build(list(ours.named_parameters()), received)
    assert type(opt.optimizers[0]).__name__ == "ClippedSGD"
    assert shipped(OptimizerSpec("torch.optim:SGD")) == {} and shipped(OptimizerSpec(MyOptimizer)) != {}
    lrs = ps_loop(ours, [opt], steps=5)
    for s in range(5):
        backward(reference, s)
        with torch.no_grad():
            for p in reference.parameters():
                p.sub_(0.1 * 0.9 ** s * p.grad.clamp(-1e-3, 1e-3))
    assert lrs == [[pytest.approx(0.1 * 0.9 ** s, rel=1e-12)] for s in range(5)]
    assert_same_params(reference, ours)


def test_importable_names_need_no_registry(monkeypatch):
    monkeypatch.setattr(optim, "_registry", {})
    spec = OptimizerSpec(f"{__name__}:MyOptimizer", {"lr": 0.1}, scheduler=f"{__name__}:warmup")
    opt = build(list(net().named_parameters()), OptimizerSpec.from_dict(spec.to_dict()))
    assert type(opt.optimizers[0]) is MyOptimizer and shipped(spec) == {}
    assert opt.plain_sgd_rate(3) is None  # a subclass may do more than SGD
    with pytest.raises(ConfigError, match="register"):
        register({"no-colon": warmup})


class Halving(lr_scheduler.LRScheduler):
    """A scheduler class of the user's: its functions are rebuilt at a restore, the rest is saved."""

    def __init__(self, optimizer, every: int = 5, last_epoch: int = -1):
        self.every = every
        self.rule = lambda step: 0.5 ** (step // every)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [base * self.rule(self.last_epoch) for base in self.base_lrs]


def test_a_scheduler_class_of_the_user_restores_from_its_state():
    spec = OptimizerSpec("SGD", {"lr": 0.1}, scheduler=Halving, scheduler_options={"every": 3})
    assert spec.scheduler == f"{__name__}:Halving" and shipped(spec) == {spec.scheduler: Halving}
    check(net(), spec)
    first = build(list(net().named_parameters()), spec)
    for s in range(10):
        first.plain_sgd_rate(s)
    second = build(list(net().named_parameters()), spec)
    second.restore(10, json.loads(json.dumps(first.schedule_state())))
    assert second.plain_sgd_rate(10) == first.plain_sgd_rate(10) == 0.1 * 0.5 ** 3


def test_a_schedule_state_without_a_json_form_is_refused_at_check():
    class Locked(Halving):
        def __init__(self, optimizer, **kwargs):
            self.when = object()
            super().__init__(optimizer, **kwargs)

    with pytest.raises(ConfigError, match=r"state of scheduler Locked\['when'\]=<object.*has no JSON form"):
        check(net(), OptimizerSpec("SGD", {"lr": 0.1}, scheduler=Locked))


def test_a_ps_holding_only_sparse_variables_keeps_the_schedule():
    spec = OptimizerSpec("Adam", {"lr": 0.01}, scheduler="StepLR", scheduler_options={"step_size": 2})
    opt = build([("emb.weight/part_1", torch.nn.Parameter(torch.zeros(4, 2)))], spec, sparse=[True])
    assert [type(o) for o in opt.optimizers] == [torch.optim.Adam, torch.optim.SparseAdam]
    for s in range(5):
        opt.optimizers[1].param_groups[0]["params"][0].grad = torch.zeros(4, 2).to_sparse()
        opt.step(s)
    assert opt.lr == [pytest.approx(0.01 * 0.1 ** 2)] and opt.schedule_state()["step"] == 4


# --- large variables stepped in chunks (a ps applying a gradient as its parts arrive) -----------------------
CHUNKED = [("Adam", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}), ("AdamW", {"lr": 0.01}),
           ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}), ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
           ("NAdam", {"lr": 0.01}), ("RAdam", {"lr": 0.01}), ("Rprop", {"lr": 0.01}), ("ASGD", {"lr": 0.01}),
           ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}), ("Adagrad", {"lr": 0.1, "lr_decay": 0.01}),
           ("Adamax", {"lr": 0.01}), ("Adadelta", {"lr": 1.0})]


def chunked_and_plain(name: str, kwargs: dict, chunk: int):
    """A (7, 5) variable and a bias on a ps optimizer that steps the variable in chunks of ``chunk`` elements,
    and the same in a plain torch optimizer."""
    torch.manual_seed(0)
    values = [torch.randn(7, 5), torch.randn(3)]
    ps = [torch.nn.Parameter(v.clone()) for v in values]
    plain = [torch.nn.Parameter(v.clone()) for v in values]
    opt = build([("w", ps[0]), ("b", ps[1])], OptimizerSpec(name, kwargs), chunk_numel=[chunk, chunk])
    return ps, opt, plain, getattr(torch.optim, name)(plain, **kwargs)


def plain_step(plain, reference, grads):
    for p, g in zip(plain, grads):
        p.grad = g.clone()
    reference.step()


def ps_step(opt, step: int, ps, grads, chunks=None):
    """Step ``ps`` (the variable, the bias) on ``opt``: whole, as a ps applies a push put together, or with the
    variable's chunks (of 10 elements) in the order ``chunks`` gives, each on its own, as its parts arrive."""
    for k in chunks or ():
        opt.step_chunk(step, ps[0], k, grads[0].reshape(-1)[10 * k:10 * k + 10].clone())
    for p, g in zip(ps, grads):
        if p is ps[1] or chunks is None:
            p.grad = g.clone()
    opt.step(step)
    for p in ps:
        p.grad = None


@pytest.mark.parametrize("name, kwargs", CHUNKED, ids=[f"{n}-{'-'.join(k)}" for n, k in CHUNKED])
def test_an_elementwise_optimizer_steps_a_large_variable_chunk_by_chunk_as_torch_steps_it_whole(name, kwargs):
    ps, opt, plain, reference = chunked_and_plain(name, kwargs, chunk=10)
    assert opt.chunk_numel(ps[0]) == 10 and opt.chunk_numel(ps[1]) is None  # 35 elements in 4 chunks; 3 whole
    for step in range(6):
        grads = [torch.randn(7, 5), torch.randn(3)]
        ps_step(opt, step, ps, grads, None if step % 2 else [3, 2, 1, 0])
        plain_step(plain, reference, grads)
        for a, b in zip(ps, plain):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    state, expected = opt.state(ps[0]), reference.state[plain[0]]
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        got = state[key]
        assert torch.is_tensor(got) == torch.is_tensor(value) and (not torch.is_tensor(value) or got.shape == value.shape)
        torch.testing.assert_close(got, value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name, kwargs", CHUNKED[:3], ids=[n for n, _ in CHUNKED[:3]])
def test_a_chunked_variable_restored_from_a_checkpoint_goes_on_as_torch_does(name, kwargs, tmp_path):
    ps, opt, plain, reference = chunked_and_plain(name, kwargs, chunk=10)
    for step in range(3):
        grads = [torch.randn(7, 5), torch.randn(3)]
        ps_step(opt, step, ps, grads)
        plain_step(plain, reference, grads)
    saved = checkpoint.shard_tensors(["w", "b"], ps, [opt.state(p) for p in ps])
    checkpoint.write_tensors(tmp_path / "shard", saved)
    values, states = checkpoint.split_state(checkpoint.read_tensors(tmp_path / "shard"))
    again = [torch.nn.Parameter(values[n].clone()) for n in ("w", "b")]
    restored = build([("w", again[0]), ("b", again[1])], OptimizerSpec(name, kwargs), chunk_numel=[10, 10])
    for p, n in zip(again, ("w", "b")):
        restored.load_state(p, states[n])
    restored.restore(3)
    for step in range(3, 6):
        grads = [torch.randn(7, 5), torch.randn(3)]
        ps_step(restored, step, again, grads, range(4))
        plain_step(plain, reference, grads)
    for a, b in zip(again, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_variable_moved_to_new_memory_is_stepped_there_and_other_optimizers_step_it_whole():
    ps, opt, plain, reference = chunked_and_plain("Adam", {"lr": 0.1}, chunk=10)
    ps[0].data = ps[0].detach().clone()  # as a ps does while a reply still sends the old memory
    opt.moved(ps[0])
    grads = [torch.randn(7, 5), torch.randn(3)]
    ps_step(opt, 0, ps, grads, range(4))
    plain_step(plain, reference, grads)
    torch.testing.assert_close(ps[0], plain[0], rtol=0, atol=1e-6)
    w = torch.nn.Parameter(torch.zeros(7, 5))  # a class outside torch.optim may look at a variable whole
    assert build([("w", w)], OptimizerSpec(MyOptimizer, {"lr": 0.1}), chunk_numel=[10]).chunk_numel(w) is None


def test_optimizer_state_of_another_shape_is_refused_before_a_fused_kernel_reads_it():
    ps, opt, _, _ = chunked_and_plain("Adam", {"lr": 0.1}, chunk=10)
    state = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(7, 4), "exp_avg_sq": torch.zeros(7, 5)}
    with pytest.raises(ValueError, match=r"'exp_avg' of shape \(7, 4\) for a variable of shape \(7, 5\)"):
        opt.load_state(ps[0], state)  # a variable stepped in chunks
    with pytest.raises(ValueError, match="restore from a checkpoint of this model"):  # one stepped whole
        opt.load_state(ps[1], {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(3)})


# --- parameter groups as torch builds them, and a user's own optimizer --------------------------------------------


def tied_net():
    net = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                              torch.nn.Linear(4, 5, bias=False))
    net[3].weight = net[0].weight  # tied: one parameter, named once
    return net


def test_groups_of_tensors_are_named_as_the_model_names_them():
    net = tied_net()
    decay = [p for p in net.parameters() if p.dim() >= 2]
    groups = optim.named_groups([{"params": decay, "weight_decay": 0.1},
                                 {"params": (p for p in net.parameters() if p.dim() < 2), "weight_decay": 0.0}],
                                list(net.named_parameters()))
    assert groups[0] == {"params": ["0.weight", "1.weight"], "weight_decay": 0.1}
    assert groups[1]["params"] == ["1.bias", "2.weight", "2.bias"]
    spec = optim.OptimizerSpec("AdamW", {"lr": 0.1}, groups=groups)
    optim.check(net, spec)  # each exact name matches its parameter


def test_a_tensor_of_another_model_is_one_short_line():
    with pytest.raises(ConfigError) as e:
        optim.named_groups([{"params": [torch.nn.Parameter(torch.zeros(1000, 1000))]}], [])
    assert "group 0 params[0]" in str(e.value) and len(str(e.value)) < 200


def test_a_malformed_group_is_described_not_printed():
    with pytest.raises(ConfigError) as e:
        optim.OptimizerSpec("SGD", {"lr": 0.1}, groups=[{"params": [torch.zeros(100, 100), 3]}])
    assert "a list of 2 (Tensor, int)" in str(e.value) and len(str(e.value)) < 300


def test_a_torch_optimizer_becomes_the_spec_a_ps_builds_again():
    net = tied_net()
    net[2].requires_grad_(False)  # frozen: the ps keeps them, no group names them
    opt = torch.optim.AdamW([{"params": [net[0].weight, net[1].weight]},
                             {"params": [net[1].bias, net[2].weight], "weight_decay": 0.0, "betas": (0.8, 0.9)}],
                            lr=3e-3, betas=(0.9, 0.95))
    spec = optim.spec_of(opt, list(net.named_parameters()))
    assert spec.optimizer == "AdamW" and "decoupled_weight_decay" not in spec.kwargs  # what AdamW() takes only
    assert spec.kwargs["lr"] == 3e-3 and spec.kwargs["fused"] is None  # the implementation as the user chose it
    assert [g["params"] for g in spec.groups] == [["0.weight", "1.weight"], ["1.bias"]]
    assert {k: v for k, v in spec.groups[1].items() if k != "params"} == {"weight_decay": 0.0,
                                                                          "betas": {"$tuple": [0.8, 0.9]}}
    built = optim.build([(n, p) for n, p in net.named_parameters() if p.requires_grad], spec)
    dense = built.optimizers[0]
    assert [len(g["params"]) for g in dense.param_groups] == [2, 1, 0] and dense.defaults.get("fused") is None
    with pytest.raises(ConfigError, match="group 0 of the optimizer holds no trainable parameter"):
        optim.spec_of(torch.optim.SGD([net[2].weight], lr=0.1), list(net.named_parameters()))


@pytest.mark.parametrize("spec, message", [
    (dict(kwargs={"lr": float("nan")}), "optimizer option lr=nan: give a finite number"),
    (dict(optimizer="adam", kwargs={"lr": 0.1, "betas": (0.9, float("inf"))}), "optimizer option betas=inf"),
    (dict(groups=[{"params": ["*.bias"], "lr": float("-inf")}]), "group 0 option lr=-inf: give a finite number"),
    (dict(kwargs={"lr": torch.tensor(float("nan"))}), "optimizer option lr: a tensor with NaN"),
    (dict(scheduler="StepLR", scheduler_options={"step_size": 1, "gamma": float("nan")}),
     "scheduler option gamma=nan"),
])
def test_a_non_finite_option_is_refused_where_the_spec_is_made(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OptimizerSpec(**spec)


def test_a_non_finite_option_set_by_a_loop_is_refused_before_it_is_pushed():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.1)
    assert optim.group_options(optimizer) == [{"lr": 0.1, "momentum": 0, "dampening": 0, "weight_decay": 0},
                                              {"lr": 0.5, "momentum": 0, "dampening": 0, "weight_decay": 0}]
    optimizer.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ConfigError, match="param group 1 of SGD has lr=nan: the loop .* give a finite number"):
        optim.group_options(optimizer)


def test_a_keyword_neither_the_caller_nor_the_optimizer_takes_names_the_closest_of_both():
    def train(model, *, steps=1, mode="sync", **optimizer_kwargs):
        pass

    optim.check_keywords("sgd", {"lr": 0.1, "momentum": 0.9}, of=train, caller="train()")  # SGD's own: fine
    with pytest.raises(ConfigError, match=r"^train\(\) got unknown option 'stpes', neither its own nor SGD's: did "
                                          r"you mean 'steps'\?$"):
        optim.check_keywords(torch.optim.SGD, {"stpes": 3}, of=train, caller="train()")
    with pytest.raises(ConfigError, match=r"did you mean 'momentum'\?$"):
        optim.check_keywords("sgd", {"momentun": 0.9}, of=train, caller="train()")

    class AnyOption(torch.optim.SGD):
        def __init__(self, params, lr=0.1, **extra):
            super().__init__(params, lr=lr)

    optim.check_keywords(AnyOption, {"stpes": 3}, of=train, caller="train()")  # it takes any keyword
    optim.check_keywords("no such optimizer", {"stpes": 3}, of=train, caller="train()")  # refused where it is built


@pytest.mark.parametrize("value, as_written", [
    ((0.9, 0.999), "(0.9, 0.999)"), ((0.5,), "(0.5,)"), ([1, (2, 3)], "[1, (2, 3)]"),
    (Counter({3: 2}), "Counter({3: 2})"),
    (torch.tensor([0.5, 0.25]), "tensor([0.5, 0.25])"), (torch.tensor(0.1, dtype=torch.float64), "tensor(0.1)"),
    ({"a": (1, 2)}, "{'a': (1, 2)}"), ("cosine", "cosine"), (None, "None")])
def test_an_option_s_json_form_is_shown_as_it_was_written(value, as_written):
    # the views show the run store's options (they load no torch): never the form's tags ({'$tuple': [...]})
    form = json.loads(json.dumps(optim._encode(value, "option")))
    assert tagged.shown(form) == as_written
