"""Aggregation policies: when a ps applies the gradients workers push, and when it answers the pushes.

A run's mode names its policy (``POLICIES``, ``policy_for``); this module is the only place that maps a mode name
to behaviour. The rest of the package asks the policy class what it needs to know (``aggregates_steps``,
``counts_staleness``, ``allows_pipeline``), never the name.

- **sync** (``Sync``, TF's SyncReplicasOptimizer): gradients computed on the current step are summed until
  ``replicas_to_aggregate`` have arrived, then one averaged update is applied and the step advances; a gradient
  computed on an older step is dropped and counted. A PUSH_PULL is answered once its step's update is applied
  (the token-queue wait of TF, in one round trip). When a step aggregates more gradients than there are live
  workers, each gives several (TF's tokens: one worker with ``replicas_to_aggregate=2`` makes one global step of
  every two of its own): worker i's quota is an even share, the lower-numbered workers taking the remainder, and a
  push short of its quota is answered at once, on the same step.
- **async** (``Async``): each gradient is applied on arrival; its staleness (the current step minus the step it was
  computed on) is counted. The answer to a worker's push is held while that worker has pushed more than
  ``max_lead`` (a fraction) times more than the slowest live worker, and more than ``LEAD_SLACK`` times more: on a
  busy machine the OS can give one worker half the CPU of another (the one that shares a core with another
  process) for as long as the run lasts, and that worker's data shard would be trained on half as much. None: no
  bound (workers of different speeds, each at its own).
- **ssp** (``SSP``, bounded staleness): as async, but the answer is held while that worker has pushed more than
  ``staleness_bound`` times more than the slowest live worker, so no worker runs more than the bound ahead.

The interface, after ps-lite's request handle: a policy sees the ps through ``Server`` and each push through
``Push``, the few operations a policy needs (read the step and the members, apply an update, release held
answers; take a push's gradients, answer it, drop it or hold it), and nothing else of the ps: no socket, no
message, no optimizer. Call order, for one run:

1. ``Policy(server, config)``, once, when the run's INIT arrives.
2. ``heard_from_lost(worker)``, before a request (of any kind) of a worker in ``server.lost`` is served.
3. ``push(push)``, for each push the ps has checked and takes (of the running run, not stopped, not parked):
   the policy answers it exactly once, now (``Push.reply``, ``Push.drop``) or later (``Push.hold``, answered by
   a ``Server.release``, or by the ps when the run stops or is replaced).
4. ``members_changed()``, after each MEMBERSHIP request (workers lost; a new worker count and replicas).
5. ``waiting_for()`` (not once the run has stopped) and ``stats()``, whenever the ps reports.

Everything runs in the ps's one thread: a policy needs no lock.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from typing import AbstractSet, Callable, ClassVar, Protocol

import torch

from ..errors import ConfigError


class Server(Protocol):
    """The run's ps as its policy sees it. Reads are of the moment they are made: ``apply`` and membership changes
    move them."""

    @property
    def step(self) -> int:
        """The global step: the updates of the run's first optimizer applied so far (where the run started
        included)."""

    @property
    def stopped(self) -> bool:
        """Whether the run has ended: its later pushes are not given to the policy, and ``release`` answers every
        held request."""

    @property
    def replicas(self) -> int:
        """The gradients a step aggregates when no worker is lost (``replicas_to_aggregate``; scaling changes
        it)."""

    @property
    def num_workers(self) -> int:
        """The run's workers now (scaling changes it); they are numbered 0 to ``num_workers - 1``."""

    @property
    def lost(self) -> AbstractSet[int]:
        """The workers declared lost (or added by scaling) and not counted live again since (see ``join``)."""

    @property
    def holding(self) -> bool:
        """Whether some answer is held (``Push.hold``) and not released yet."""

    def live(self) -> list[int]:
        """The live workers in order: those not lost (worker 0 when every worker is)."""

    def join(self, worker: int) -> None:
        """Count ``worker`` live again from now (it leaves ``lost``)."""

    def apply(self, grads: list, count: int = 1, *, counts: bool = True) -> None:
        """One optimizer update with the mean of ``count`` summed gradients (``grads``: as ``Push.take`` gives them,
        or their sums; a sum kept in chunks, see ``streamed``, is added first). ``counts``: the update is a global
        step (the first optimizer's), so the step advances: checkpoints are written at it, and the run stops at its
        last step."""

    def release(self, ready: Callable[[int], bool] | None = None) -> None:
        """Answer the held pushes of the workers ``ready(worker)`` accepts (every one when None, or when the run
        has stopped) with the current values and step; the others stay held."""


class Push(Protocol):
    """One worker's push of gradients, checked against the run, given to the policy to answer exactly once."""

    worker: int  # the worker that pushed
    step: int  # the global step its gradients were computed on
    optimizer: int  # which of a user's optimizers it is for (0: the one whose updates are global steps)
    wants_values: bool  # a PUSH_PULL: its answer carries the current values of the variables

    def take(self) -> list:
        """Its gradients, once: per trained variable of the ps in order, a dense tensor, a list of one (row indices,
        row values) pair (a sparse variable) or None (a variable of another of a user's optimizers). They are
        views of the request's frames, released once the push has been handled: a policy that keeps them past
        ``push`` copies them. Taking keeps the push's buffer values for the run's buffer rule, and moves the
        gradients of variables whose step's sum is kept in chunks there (left on the meta device)."""

    def reply(self, staleness: int = 0) -> None:
        """Answer now, at the current step; ``staleness`` is the answer's value."""

    def drop(self, staleness: int) -> None:
        """Answer now that its gradients were not applied (computed ``staleness`` steps ago); counted."""

    def hold(self, staleness: int = 0) -> None:
        """Answer later, when ``Server.release`` accepts its worker (with the values and step of then)."""


class Policy(ABC):
    """What a run's ps does with the pushes it takes: one instance per run, built when the run's INIT arrives."""

    name: ClassVar[str]
    """The mode that names the policy (``TrainPlan.mode``)."""

    aggregates_steps: ClassVar[bool] = False
    """Each global step is one update with the mean of the gradients computed on that step by
    ``replicas_to_aggregate`` pushes: a worker waits for its step's update, a gradient of an older step is dropped,
    and a push's gradients are summed, never applied alone (so a push in parts may be cut short: ``overlap``)."""

    counts_staleness: ClassVar[bool] = False
    """Each push is applied as it comes, on whatever step it was computed: the ps counts its staleness."""

    allows_pipeline: ClassVar[bool] = False
    """A worker may compute its next gradient while its push is in flight (``TrainPlan.pipeline``): the gradient,
    one step older than the values it is applied to, is applied, not dropped, and no answer is held for its
    staleness."""

    options: ClassVar[tuple[str, ...]] = ()
    """The run options (``runtime.options``) that only this mode reads: the views show them for its runs alone."""

    def __init__(self, server: Server, config):
        """``config``: the run's ``plan.PsConfig``."""
        self.server = server

    @abstractmethod
    def push(self, push: Push) -> None:
        """Take ``push`` (see the module's call order) and answer it, now or later."""

    def heard_from_lost(self, worker: int) -> None:  # noqa: B027 - a policy may ignore it
        """A request of ``worker``, one of ``server.lost``, arrived (before it is served)."""

    def members_changed(self) -> None:  # noqa: B027 - a policy may ignore it
        """The lost workers, the worker count or the replicas changed (MEMBERSHIP)."""

    def waiting_for(self) -> list[int]:
        """The workers the run waits for now (reported to the controller and the dashboard)."""
        return []

    def stats(self) -> dict:
        """The policy's part of the ps's STATS reply: ``staleness`` (pushes applied, by staleness as a string) and
        ``waiting_on`` (the workers whose gradients the current step holds)."""
        return {"staleness": {}, "waiting_on": []}


class Sync(Policy):
    """See the module. A worker that joins (a replacement, or one added) is waited for from the first step it sends
    a gradient of: counted from its first pull, a ps a step ahead of another when it pulled would wait for its
    gradient of a step it never computes (it pushes the step of ps 0's reply), and hold every worker. For the same
    reason a step stops waiting for a worker that pushes a later step (``passed``): another ps, which learned of a
    membership change at another moment, applied this step without it and moved on."""

    name = "sync"
    aggregates_steps = True
    options = ("replicas_to_aggregate",)

    def __init__(self, server: Server, config):
        super().__init__(server, config)
        self.sum: list | None = None  # per trained variable: the step's summed gradient, or a list of its parts
        self.optimizer = 0  # which of a user's optimizers the step's gradients are for
        self.contributors: list[int] = []  # the worker of each gradient in the sum
        self.passed: set[int] = set()  # the workers that pushed a later step: none of this step's comes from them

    def push(self, push: Push) -> None:
        if push.step > self.server.step and push.worker not in self.passed:
            self.passed.add(push.worker)
            self.members_changed()  # the step may be complete without it: its push is then of the next one
        staleness = self.server.step - push.step
        if staleness != 0:
            push.drop(staleness)
            return
        self.server.join(push.worker)  # a gradient of this step: a member from now on
        grads = push.take()
        if self.sum is None:
            # one replica per step: applied below, before the request's frames are let go, so not copied
            self.sum = grads if self.replicas_now() == 1 else [_owned(g) for g in grads]
            self.optimizer = push.optimizer
        else:
            for total, g in zip(self.sum, grads):
                if g is None:
                    continue
                if isinstance(g, torch.Tensor):
                    if not g.is_meta:  # on the meta device: summed in chunks (see streamed)
                        total.add_(g)
                else:
                    total.extend(_owned(g))
        self.contributors.append(push.worker)
        if push.wants_values and self.contributors.count(push.worker) < self.quota(push.worker):
            # not its last gradient of this step (a quota sums to the step's count: the step cannot be complete)
            push.reply()
        elif push.wants_values:
            push.hold()
        self.members_changed()
        if not push.wants_values:
            push.reply()

    def members_changed(self) -> None:
        """Apply the step once it has its gradients (fewer are needed when workers are lost)."""
        if self.sum is not None and len(self.contributors) >= self.replicas_now():
            self.server.apply(self.sum, len(self.contributors), counts=self.optimizer == 0)
            self.sum, self.contributors, self.passed = None, [], set()
            self.server.release()

    def replicas_now(self) -> int:
        """The gradients a step aggregates: ``replicas``, at most one per worker it can come from once a worker is
        lost (or ``passed`` the step)."""
        server = self.server
        away = len(server.lost | self.passed)
        if not away:
            return server.replicas
        return max(1, min(server.replicas, server.num_workers - away))

    def quota(self, worker: int) -> int:
        """The gradients ``worker`` gives each step: one, or when the step aggregates more than there are live
        workers an even share of them, the lower-numbered workers taking one more each for the remainder.
        Every ps computes the same quotas, so each answers a worker's pushes alike."""
        server = self.server
        if server.replicas <= server.num_workers - len(server.lost):  # the usual case, on every push: one each
            return 1
        live, needed = server.live(), self.replicas_now()
        if needed <= len(live) or worker not in live:
            return 1
        return needed // len(live) + (live.index(worker) < needed % len(live))

    def waiting_for(self) -> list[int]:
        """The workers whose gradients for the current step have not all arrived yet."""
        return [w for w in self.server.live() if w not in self.passed and self.contributors.count(w) < self.quota(w)]

    def stats(self) -> dict:
        return {"staleness": {}, "waiting_on": sorted(set(self.contributors))}


LEAD_SLACK = 8  # pushes any worker may run ahead of the slowest under async's max_lead: its start, a short run


class Async(Policy):
    """See the module. A worker counts from its first push, level with the slowest of the others then (one slow to
    start holds no one), and so does one that joins (a replacement, or one added)."""

    name = "async"
    counts_staleness = True
    allows_pipeline = True
    options = ("max_lead", "pipeline")

    def __init__(self, server: Server, config):
        super().__init__(server, config)
        self.staleness: Counter = Counter()  # pushes applied, by staleness
        self.clocks: Counter = Counter()  # pushes per worker
        self.lead = config.max_lead

    def push(self, push: Push) -> None:
        staleness = self.server.step - push.step
        self.staleness[staleness] += 1
        # applied before the request's frames are let go: no copy (they are writable memory of this message
        # alone, so an optimizer that changes a gradient in place changes nothing else)
        self.server.apply(push.take(), 1, counts=push.optimizer == 0)
        if push.worker not in self.clocks:
            self.clocks[push.worker] = self._start_clock(push.worker)
        self.clocks[push.worker] += 1
        slowest = self.slowest()
        if self.clocks[push.worker] - slowest > self.allowed(slowest) and not self.server.stopped:
            push.hold(staleness)
        else:
            push.reply(staleness)
        if self.server.holding:
            self._release_within_bound(slowest)

    def allowed(self, slowest: int) -> float:
        """How many pushes a worker may be ahead of the slowest live worker (``slowest`` pushes) before its answer
        is held."""
        return math.inf if self.lead is None else max(LEAD_SLACK, self.lead * slowest)

    def heard_from_lost(self, worker: int) -> None:
        self.server.join(worker)  # no step waits for a worker: live again at once
        self.clocks[worker] = self._level(worker)

    def _level(self, worker: int) -> int:
        """The pushes of the slowest of the other live workers that count (0: none)."""
        return min((self.clocks[w] for w in self.server.live() if w != worker and self._counts(w)), default=0)

    def _counts(self, worker: int) -> bool:
        """Whether ``worker`` is among those the slowest is looked for in: from its first push on."""
        return worker in self.clocks

    def _start_clock(self, worker: int) -> int:
        """Where a worker's count starts at its first push."""
        return self._level(worker)

    def members_changed(self) -> None:
        for w in [w for w in self.clocks if w >= self.server.num_workers]:  # removed by scaling
            del self.clocks[w]
        if self.server.holding:
            self._release_within_bound(self.slowest())

    def _release_within_bound(self, slowest: int) -> None:
        allowed = self.allowed(slowest)
        self.server.release(lambda worker: self.clocks[worker] - slowest <= allowed)

    def slowest(self) -> int:
        """The pushes of the slowest live worker that counts (0: none)."""
        return min((self.clocks[w] for w in self.server.live() if self._counts(w)), default=0)

    def waiting_for(self) -> list[int]:
        """The slowest workers, while some worker is held for them."""
        if not self.server.holding:
            return []
        slowest = self.slowest()
        return [w for w in self.server.live() if self._counts(w) and self.clocks[w] == slowest]

    def stats(self) -> dict:
        return {"staleness": {str(k): v for k, v in sorted(self.staleness.items())}, "waiting_on": []}


class SSP(Async):
    """See the module. Every live worker counts from the start (one slow to start holds the others, by the bound),
    a worker that joins from the slowest of the others."""

    name = "ssp"
    allows_pipeline = False
    options = ("staleness_bound",)

    def __init__(self, server: Server, config):
        super().__init__(server, config)
        self.bound = config.staleness_bound

    def allowed(self, slowest: int) -> float:
        return self.bound

    def _counts(self, worker: int) -> bool:
        return True

    def _start_clock(self, worker: int) -> int:
        return 0


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Sync, Async, SSP)}


def policy_for(plan_or_mode) -> type[Policy]:
    """The policy class of a mode name, or of anything with a ``mode`` (a ``TrainPlan``, a ``PsConfig``); a
    ConfigError (a ValueError) naming the modes for any other name."""
    mode = plan_or_mode if isinstance(plan_or_mode, str) else getattr(plan_or_mode, "mode", plan_or_mode)
    policy = POLICIES.get(mode) if isinstance(mode, str) else None
    if policy is None:
        *first, last = (repr(name) for name in POLICIES)
        raise ConfigError(f"mode={mode!r}: use {', '.join(first)} or {last}")
    return policy


def _owned(grad):
    """A copy of a received gradient (dense, or a list of (rows, values) parts): received tensors are read-only
    views of frames that are released after the request."""
    if grad is None:  # a variable of another of a user's optimizers
        return None
    if isinstance(grad, torch.Tensor):
        return grad.clone()
    return [(rows.clone(), values.clone()) for rows, values in grad]
