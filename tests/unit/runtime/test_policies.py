"""The aggregation policies (``policies``): the registry that maps a mode to its policy, the questions the rest of
the package asks of a policy, and each policy's decisions on a sequence of pushes, driven through a small fake of
the policy interface (``Server``, ``Push``: our own narrow protocol); the ps's implementation of that interface is
checked against it, and a real ps runs each policy."""

import ast
from pathlib import Path

import pytest
import torch

import pscluster
from pscluster.errors import ConfigError
from pscluster.runtime import options
from pscluster.runtime.overlap import EarlyPush
from pscluster.runtime.plan import PsConfig, TrainPlan
from pscluster.runtime.policies import LEAD_SLACK, POLICIES, SSP, Async, Policy, Push, Server, Sync, policy_for
from pscluster.runtime.policy_handles import PushRequest, RunHandle

from ..conftest import ps_config

# --- the registry ----------------------------------------------------------------------------


def test_the_modes_of_a_run_are_the_registered_policies_in_order():
    assert list(POLICIES) == ["sync", "async", "ssp"] and options.MODES == tuple(POLICIES)
    assert [POLICIES[name].name for name in POLICIES] == list(POLICIES)
    assert all(issubclass(policy, Policy) for policy in POLICIES.values())


def mode_tests(path: Path) -> list[int]:
    """The lines of ``path`` that compare something with a mode's name (``mode == "sync"``, ``in ("async",)``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            words = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
            if any(w in POLICIES for w in words if isinstance(w, str)):
                found.append(node.lineno)
    return found


def test_nothing_outside_the_policies_tests_the_mode_by_its_name():
    package = Path(pscluster.__file__).resolve().parent
    tests = {str(p.relative_to(package)): lines for p in sorted(package.rglob("*.py"))
             if p.name != "policies.py" and (lines := mode_tests(p))}
    assert not tests, f"ask runtime.policies.policy_for(mode) what the mode means instead: {tests}"


def test_policy_for_takes_a_mode_or_anything_with_one():
    assert policy_for("sync") is Sync and policy_for("async") is Async and policy_for("ssp") is SSP
    config = PsConfig.from_dict(ps_config(["w"], mode="ssp"))
    assert policy_for(config) is SSP


@pytest.mark.parametrize("mode", ["bsp", "SYNC", "", None, ["sync"]])
def test_an_unknown_mode_is_one_config_error_naming_the_modes(mode):
    with pytest.raises(ConfigError, match=r"^mode=.*: use 'sync', 'async' or 'ssp'$"):
        policy_for(mode)
    with pytest.raises(ValueError, match="use 'sync', 'async' or 'ssp'"):  # what a ps says of a bad INIT
        config = ps_config(["w"])
        PsConfig.from_dict({**config, "options": {**config["options"], "mode": mode}})


# --- what the package asks of a policy ------------------------------------------------------


def test_the_traits_of_each_policy():
    traits = {name: (p.aggregates_steps, p.counts_staleness, p.allows_pipeline) for name, p in POLICIES.items()}
    assert traits == {"sync": (True, False, False), "async": (False, True, True), "ssp": (False, True, False)}


PLAN = dict(run_id=1, steps=10, batch_size=8, optimizer="sgd", overlap=True)


@pytest.mark.parametrize("mode", list(POLICIES))
def test_a_pipeline_is_refused_where_the_policy_does_not_allow_it(mode):
    if POLICIES[mode].allows_pipeline:
        assert TrainPlan.of(**PLAN, mode=mode, pipeline=True).pipeline
    else:
        with pytest.raises(ConfigError, match=f"pipeline=True with mode='{mode}': use mode='async'"):
            TrainPlan.of(**PLAN, mode=mode, pipeline=True)


@pytest.mark.parametrize("mode", list(POLICIES))
def test_pushes_leave_during_backward_where_the_policy_sums_every_push_of_a_step(mode):
    assert EarlyPush.applies(TrainPlan.of(**PLAN, mode=mode), torch.device("cpu")) is POLICIES[mode].aggregates_steps


# --- the interface, and the ps's side of it ---------------------------------------------------


def members(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(vars(protocol).get("__annotations__", {}))


@pytest.mark.parametrize("protocol, implementation", [(Server, RunHandle), (Push, PushRequest)])
def test_the_ps_implements_every_operation_of_the_interface(protocol, implementation):
    assert members(protocol) <= set(dir(implementation)) | set(implementation.__slots__)


class FakeServer:
    """``Server`` over plain fields: records the updates, answers held pushes at release."""

    def __init__(self, *, workers=2, replicas=2, lost=()):
        self.step, self.stopped, self.replicas, self.num_workers = 0, False, replicas, workers
        self.lost = set(lost)
        self.updates = []  # (summed gradient values, count, counts)
        self.held: list[FakePush] = []

    @property
    def holding(self):
        return bool(self.held)

    def live(self):
        return [w for w in range(self.num_workers) if w not in self.lost] or [0]

    def join(self, worker):
        self.lost.discard(worker)

    def apply(self, grads, count=1, *, counts=True):
        self.updates.append(([g.item() for g in grads], count, counts))
        self.step += counts

    def release(self, ready=None):
        held, self.held = self.held, []
        for push in held:
            if ready is None or self.stopped or ready(push.worker):
                push.answers.append(("released", self.step, push.value))
            else:
                self.held.append(push)


class FakePush:
    """``Push`` of one scalar gradient; its answers as (how, step, value)."""

    def __init__(self, server, worker, step, grad=1.0, *, wants_values=True, optimizer=0):
        self.server, self.worker, self.step, self.optimizer = server, worker, step, optimizer
        self.wants_values = wants_values
        self.grads = [torch.tensor(grad)]
        self.answers, self.value, self.taken = [], None, []

    def take(self):
        self.taken, self.grads = self.grads, None  # once
        return self.taken

    def reply(self, staleness=0):
        self.answers.append(("reply", self.server.step, staleness))

    def drop(self, staleness):
        self.answers.append(("drop", self.server.step, staleness))

    def hold(self, staleness=0):
        self.value = staleness
        self.server.held.append(self)


def pushed(policy, server, worker, step, grad=1.0, **kw) -> FakePush:
    push = FakePush(server, worker, step, grad, **kw)
    policy.push(push)
    for t in push.taken:  # the request's frames are released once it is handled: a gradient kept must be a copy
        t.fill_(float("nan"))
    return push


def config(**kw) -> PsConfig:
    return PsConfig.from_dict(ps_config(["w"], **kw))


# --- sync ------------------------------------------------------------------------------------


def test_sync_holds_each_push_of_a_step_until_the_step_is_applied_and_drops_stale_ones():
    server = FakeServer(workers=2, replicas=2)
    policy = Sync(server, config())
    first = pushed(policy, server, 0, 0, 1.0)
    assert first.answers == [] and server.updates == [] and policy.waiting_for() == [1]
    assert policy.stats() == {"staleness": {}, "waiting_on": [0]}
    second = pushed(policy, server, 1, 0, 3.0, wants_values=False)
    assert server.updates == [([4.0], 2, True)]  # one update with the mean of the two: the sum and its count
    assert first.answers == [("released", 1, 0)] and second.answers == [("reply", 1, 0)]  # a PUSH: after the update
    stale = pushed(policy, server, 0, 0)
    assert stale.answers == [("drop", 1, 1)] and stale.grads is not None  # never taken
    assert policy.waiting_for() == [0, 1] and policy.stats()["waiting_on"] == []


def test_sync_with_more_replicas_than_workers_takes_an_even_share_of_each_worker():
    server = FakeServer(workers=1, replicas=2)
    policy = Sync(server, config())
    first = pushed(policy, server, 0, 0, 1.0)
    assert first.answers == [("reply", 0, 0)] and server.updates == []  # short of its quota: answered on step 0
    second = pushed(policy, server, 0, 0, 2.0)
    assert server.updates == [([3.0], 2, True)] and second.answers == [("released", 1, 0)]


def test_sync_applies_a_step_with_fewer_gradients_once_a_worker_is_lost_and_waits_for_it_from_its_gradient():
    server = FakeServer(workers=2, replicas=2)
    policy = Sync(server, config())
    first = pushed(policy, server, 0, 0, 1.0)
    server.lost.add(1)
    policy.members_changed()
    assert server.updates == [([1.0], 1, True)] and first.answers == [("released", 1, 0)]
    policy.heard_from_lost(1)  # a request of the lost worker: not a member before its gradient of the step
    assert server.lost == {1} and policy.waiting_for() == [0]
    pushed(policy, server, 1, 1, 5.0)
    assert server.lost == set() and policy.waiting_for() == [0] and len(server.updates) == 1


def test_sync_stops_waiting_for_a_worker_that_pushes_a_later_step():
    """Another ps applied this step without the worker (it learned of a membership change at another moment) and
    the worker pushes the step after: it sends no gradient of this one, which then goes on without it."""
    server = FakeServer(workers=3, replicas=3)
    policy = Sync(server, config())
    first, second = pushed(policy, server, 0, 0, 1.0), pushed(policy, server, 1, 0, 2.0)
    assert server.updates == [] and policy.waiting_for() == [2]
    ahead = pushed(policy, server, 2, 1, 5.0)
    assert server.updates == [([3.0], 2, True)] and first.answers == second.answers == [("released", 1, 0)]
    assert ahead.answers == [] and policy.waiting_for() == [0, 1]  # a gradient of the next step, which waits for all
    pushed(policy, server, 0, 1, 1.0), pushed(policy, server, 1, 1, 1.0)
    assert server.updates[1] == ([7.0], 3, True) and ahead.answers == [("released", 2, 0)]
    server.step = 3  # (a ps whose step has not seen this worker's yet: its push is dropped, and the step waits)
    early = pushed(policy, server, 0, 4, 1.0)
    assert early.answers == [("drop", 3, -1)] and policy.waiting_for() == [1, 2] and len(server.updates) == 2


def test_sync_a_step_of_another_optimizer_is_not_a_global_step():
    server = FakeServer(workers=1, replicas=1)
    policy = Sync(server, config())
    pushed(policy, server, 0, 0, 2.0, optimizer=1)
    assert server.updates == [([2.0], 1, False)] and server.step == 0


# --- async and ssp ---------------------------------------------------------------------------


def test_async_applies_each_push_alone_and_counts_its_staleness():
    server = FakeServer(workers=2, replicas=1, lost=[1])
    policy = Async(server, config(mode="async"))
    policy.heard_from_lost(1)
    assert server.lost == set()  # live again from its first request
    answers = [pushed(policy, server, w, step, float(w)).answers for w, step in [(0, 0), (1, 0), (0, 2)]]
    assert answers == [[("reply", 1, 0)], [("reply", 2, 1)], [("reply", 3, 0)]]
    assert server.updates == [([0.0], 1, True), ([1.0], 1, True), ([0.0], 1, True)]
    assert policy.waiting_for() == [] and policy.stats() == {"staleness": {"0": 2, "1": 1}, "waiting_on": []}


def test_async_holds_a_worker_that_pushed_a_quarter_more_than_the_slowest_and_a_few_pushes_more():
    # beside another process the OS can give one worker half the CPU of the other for the whole run; a worker
    # slow to start holds no one, and counts from its first push level with the others
    server = FakeServer(workers=2, replicas=1)
    policy = Async(server, config(mode="async"))  # max_lead 0.25 by default
    assert all(pushed(policy, server, 0, server.step).answers for _ in range(3 * LEAD_SLACK))  # 1 has not started
    assert pushed(policy, server, 1, server.step).answers != [] and policy.clocks[1] == 3 * LEAD_SLACK + 1  # level
    for _ in range(LEAD_SLACK + 1):
        assert pushed(policy, server, 0, server.step).answers != []  # up to LEAD_SLACK ahead, not held
    held = pushed(policy, server, 0, server.step)
    assert held.answers == [] and len(server.updates) == 4 * LEAD_SLACK + 3  # applied; its answer held
    assert policy.waiting_for() == [1]
    for _ in range(LEAD_SLACK):
        pushed(policy, server, 1, server.step)
    assert held.answers[0][0] == "released"
    policy.clocks.update({0: 100 - policy.clocks[0], 1: 100 - policy.clocks[1]})  # later: a quarter is the bound
    assert [pushed(policy, server, 0, server.step).answers != [] for _ in range(26)] == [True] * 25 + [False]
    server.lost.add(1)  # the slow one lost: the others are not held for it
    policy.members_changed()
    assert server.held == [] and policy.waiting_for() == []


def test_async_without_a_lead_bound_never_holds_and_a_joining_worker_starts_level():
    server = FakeServer(workers=2, replicas=1)
    policy = Async(server, config(mode="async", max_lead=None))
    assert all(pushed(policy, server, 0, server.step).answers for _ in range(10 * LEAD_SLACK))
    bounded = Async(server, config(mode="async"))
    bounded.clocks.update({0: 100, 1: 100})
    server.lost.add(2), setattr(server, "num_workers", 3)
    bounded.heard_from_lost(2)  # a replacement, or a worker added: level with the slowest, nobody held for it
    assert bounded.clocks[2] == 100 and pushed(bounded, server, 0, server.step).answers != []


def test_ssp_holds_a_worker_ahead_of_the_slowest_by_more_than_the_bound():
    server = FakeServer(workers=2, replicas=1)
    policy = SSP(server, config(mode="ssp", staleness_bound=1))
    assert pushed(policy, server, 0, 0).answers == [("reply", 1, 0)]  # one ahead: within the bound
    ahead = pushed(policy, server, 0, 1)
    assert ahead.answers == [] and len(server.updates) == 2  # applied, its answer held
    assert policy.waiting_for() == [1]  # the slowest, while it holds another
    assert pushed(policy, server, 1, 0).answers == [("reply", 3, 2)]
    assert ahead.answers == [("released", 3, 0)] and policy.waiting_for() == []
    assert policy.stats()["staleness"] == {"0": 2, "2": 1}


def test_ssp_releases_a_held_worker_once_the_slowest_is_lost_and_levels_a_worker_that_comes_back():
    server = FakeServer(workers=3, replicas=1)
    policy = SSP(server, config(mode="ssp", staleness_bound=1))
    pushed(policy, server, 1, 0)
    pushed(policy, server, 0, 1)
    held = pushed(policy, server, 0, 2)
    assert held.answers == [] and policy.clocks == {0: 2, 1: 1} and policy.waiting_for() == [2]
    server.lost.add(2)
    policy.members_changed()
    assert held.answers == [("released", 3, 0)] and policy.waiting_for() == []
    policy.heard_from_lost(2)
    assert server.lost == set() and policy.clocks[2] == 1  # level with the slowest of the others
    server.num_workers = 2  # scaled down: worker 2's clock is forgotten
    policy.members_changed()
    assert set(policy.clocks) == {0, 1}


def test_a_stopped_run_holds_no_answer():
    server = FakeServer(workers=2, replicas=1)
    policy = SSP(server, config(mode="ssp", staleness_bound=0))
    server.stopped = True
    assert pushed(policy, server, 0, 0).answers == [("reply", 1, 0)]


# --- a real ps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(POLICIES))
def test_a_ps_runs_the_policy_its_mode_names(start_run, mode):
    run = start_run({"w": torch.zeros(3)}, mode=mode, num_workers=1)
    worker = run.client(task=0)
    assert worker.push_pull(0, run.split([torch.ones(3)])).step == 1
    assert type(run.servers[0].run.policy) is POLICIES[mode]
    stats = worker.stats()[0]
    assert stats["mode"] == mode and stats["applied"] == 1
    assert stats["staleness"] == ({"0": 1} if POLICIES[mode].counts_staleness else {})
