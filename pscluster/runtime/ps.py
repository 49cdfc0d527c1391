"""The ps server: holds one run's variables and their optimizer state, applies updates.

One thread, one ROUTER socket (``router``: every message is checked before it is served). Each run is set up by
the chief's INIT message (variables, initial values, optimizer, mode: ``run_state``), so a ps needs nothing but its
address and the cluster secret to start. What a push does is the run's policy's (``policies``: sync, async, SSP):
the ps gives it each push it takes and itself as ps-lite's request handles (``policy_handles``). Sparse
variables are pulled and pushed by rows (``gradients``), updates are applied by ``updates``.

Once the step target is reached (or STOP arrives), replies carry Flag.STOPPED and
later gradients are not applied. A clean stop of several ps tasks takes two STOPs: the first (meta
{"hold": true}) parks each ps at its current step, holding the pushes that arrive; its replies say where
each parked. The second (meta {"at_step": T}, T the highest of those) lets a ps behind apply held and
arriving pushes up to T: every ps ends on step T, which the final checkpoint holds. A ps parked for
``PARK_S`` without the second STOP stops where it is.

Checkpoints: when the run has a checkpoint directory, the ps writes its shard (variables and optimizer
state, see ``checkpoint.py``) every ``checkpoint_every`` steps and every ``eval_every`` steps (the controller
evaluates those), at steps asked for by CHECKPOINT, and at the end; the controller commits a checkpoint once every
ps has written its shard of one step. INIT can carry optimizer state and a starting step: a restore. Between
shards, the ps keeps a copy of its state as often as a small share of its time allows (``keep_state_copy``): a
lost ps's optimizer state comes back from it (``rescue``).

Membership (MEMBERSHIP): lost workers are left out (the policy stops waiting for them: sync aggregates the
gradients of the live workers only, SSP measures the slowest among them) and count as live again from their next
request (sync: from their first gradient of the current step). The worker count can change during a run
(scaling): added workers count the same way; a removed worker's next push or pull is answered STOPPED, so it ends.

Hostile input (``router`` checks every message): a signed, fresh request of a worker the run declared lost
(MEMBERSHIP "lost": it hung, and has a replacement) is refused with an ERROR reply that ends it (counted as
fenced): a worker that wakes up never trains beside its replacement. A request that does not fit the run
(variables, shapes, dtypes, rows, steps, worker counts out of range) is refused and counted as malformed; once a
run is initialized its requests are held to the sizes of its own variables (``protocol.Limits``). The counters
reach the run store as "rejected" events (``_report``) and are in the STATS reply.

An update that would make a value or an optimizer slot NaN or infinite is refused whole (``update_guard``): the
run fails at the step it had reached, every worker request from then on answered ERROR with the cause.

The owner's lease: a script's chief renews its run's lease on the ps tasks (STATS with meta {"lease": {"owner": who,
"seconds": S}}, ``cluster.lease``); ``owner_lost`` says so once S seconds of this ps's serving pass without a
renewal (a ps busy in one request for ``BUSY_S`` counts its lease again from then: the renewals wait behind its
work). A ps serving one run (``standalone.serve_run``) then ends.

Same host: a worker may map a shared-memory lane for its session (SHARE, see ``lanes``); its pushes then
leave their dense gradients in the lane and the parameters of its replies are written there, and its requests
and their replies may ring a bell instead of crossing the socket (``bells``). A run keeps
at most ``MAX_LANES`` lanes (least recently mapped first out); a new run's INIT drops them all.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
import zmq

from ..errors import MalformedMessage, NonFiniteUpdate, ProtocolError, Refused
from . import gradients, protocol, updates
from .emitter import MetricsEmitter
from .lanes import Lane, LaneError, value_set
from .plan import PsConfig
from .policies import policy_for
from .policy_handles import PushRequest, RunHandle
from .protocol import Flag, Message, Op
from .router import Router
from .run_state import RunState
from .streamed import streamed_push

# torch's sparse optimizers build sparse tensors without stating whether to check them; ours are checked
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled", category=UserWarning)

PARK_S = 30.0  # how long a ps parked by a first STOP waits for the second
MAX_WORKERS = protocol.NO_TASK  # worker task ids are 16 bits, NO_TASK excepted
MAX_LANES = 1024
BUSY_S = 2.0  # a ps whose ticks stop this long was busy in one request (a large shard's write, a large update)
PASSED = "has passed"  # in the refusal of a CHECKPOINT at a step the ps is past: the controller asks again
_WORKER_OPS = (Op.PULL, Op.PUSH, Op.PUSH_PULL)


class ParameterServer(Router):
    """Serves one ps task on ``tcp://host:port`` (port 0: a free port, see ``.port``), its messages signed
    with ``key``; ``encrypt``: as a ZeroMQ CURVE server (see ``curve``). ``max_frame_bytes``: the largest
    frame it receives (default: the largest the protocol sends, whatever the model)."""

    def __init__(self, key: bytes, *, index: int = 0, host: str = "127.0.0.1", port: int = 0,
                 context: zmq.Context | None = None, encrypt: bool = False,
                 max_frame_bytes: int = protocol.MAX_FRAME_BYTES):
        super().__init__(key, host=host, port=port, context=context, encrypt=encrypt,
                         max_frame_bytes=max_frame_bytes, name=f"ps-{index}")
        self.index = index
        self.run: RunState | None = None
        # (run id, attempt or None for every attempt): STOP can arrive before the chief's INIT
        self._stop_requested: set[tuple[int, int | None]] = set()
        self._past_runs: set[int] = set()
        self._lanes: OrderedDict[bytes, Lane] = OrderedDict()  # session nonce -> its shared-memory lane
        self.lease: OwnerLease | None = None  # the latest an owner renewed here
        self._ticked = self._serving_since = time.monotonic()

    # --- lifecycle -----------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._ticked > BUSY_S:
            self._serving_since = now
        self._ticked = now
        self._report()
        self._check_park()
        super()._tick()

    @property
    def owner_lost(self) -> str | None:
        """Why the run's owner is gone (its lease ran out), or None: it renews its lease, or never held one."""
        lease = self.lease
        if lease is None or self._ticked - max(lease.renewed, self._serving_since) <= lease.seconds:
            return None
        return (f"run {lease.run_id}'s owner ({lease.owner}) has not renewed its lease for {lease.seconds:g}s: the "
                "run's chief is gone")

    def _report(self, *, now: bool = False) -> None:
        """Send this ps's counters for the current run to the collector (never blocks)."""
        run = self.run
        if run is None or run.emitter is None:
            return
        run.emitter.emit("ps", step=run.step, pushes=run.pushes, pulls=run.pulls, applied=run.applied,
                         dropped_stale=run.dropped_stale, late=run.late, bytes_in=self.bytes_in,
                         bytes_out=self.bytes_out, waiting_for=run.waiting_for(), lr=run.optimizer.lr[-1])
        rejected = dict(self.rejected)
        if rejected != run.reported_rejected and any(rejected.values()):
            # this ps's totals by reason, stored as a "rejected" event when they change
            run.emitter.emit("rejected", **rejected)
            run.reported_rejected = rejected
        if now:
            run.emitter.flush()

    def _close_run(self) -> None:
        if self.run is not None and self.run.emitter is not None:
            self._report(now=True)
            self.run.emitter.close()
            self.run.emitter = None

    _closing = _close_run  # as the server ends

    def done_serving(self, quiet_s: float) -> bool:
        """Whether the run this server holds is over: its supervisor closed it, or it ended and no request
        came for ``quiet_s`` seconds (a supervisor that died before closing it)."""
        run = self.run
        return run is not None and (run.finalized or run.stopped and time.monotonic() - self.last_request > quiet_s)

    # --- dispatch ------------------------------------------------------------------
    def _limits(self, body) -> protocol.Limits:
        """What a message may hold: a running run's requests are held to the sizes of its variables; INIT
        (of the next run, or a restart) and anything before a run to the server's limits."""
        run = self.run
        if run is None or run.stopped or not body or protocol.peek_op(body[0]) == Op.INIT:
            return protocol.DEFAULT_LIMITS
        return run.limits

    def _streamed(self, head: Message):
        return streamed_push(self, self.run, head)

    def _reply(self, identity: bytes, req: Message, op: Op, *, flags=Flag.NONE, value: int = 0,
               wait_us: int = 0, with_params: bool = False, meta: dict | None = None) -> None:
        run = self.run
        if run is not None and run.refused_update and req.op in _WORKER_OPS and req.run_id == run.run_id:
            op, flags, with_params, meta = Op.ERROR, Flag.NONE, False, {"error": run.refused_update}
        reply = Message(op=op, flags=flags, run_id=req.run_id, request_id=req.request_id, nonce=req.nonce,
                        step=run.step if run else 0, value=value, wait_us=wait_us, meta=meta)
        if run is not None and run.stopped:
            reply.flags |= Flag.STOPPED
        tags = None
        lane = self._lanes.get(req.nonce) if with_params and req.flags & Flag.SHARED else None
        if lane is not None:
            with torch.no_grad():
                for slot, p in zip(lane.values[value_set(req.flags)], run.dense_params):
                    slot.copy_(p)
            reply.flags |= req.flags & (Flag.SHARED | Flag.SECOND)
            self.bytes_out += lane.nbytes
        elif with_params:
            reply.ids = run.dense_ids
            reply.tensors, tags = run.params_snapshot()
            if run.zero_copy:
                run.sending.append(self._send(identity, reply, tags, track=True))
                return
        self._send(identity, reply, tags)

    def _current(self, identity: bytes, msg: Message) -> RunState | None:
        """The run a request is about, or None after answering NOT_READY / ERROR."""
        run = self.run
        if run is None or run.run_id != msg.run_id:
            if msg.run_id in self._past_runs:  # "over": the client raises RunOver
                self._reply(identity, msg, Op.ERROR, meta={
                    "error": f"run {msg.run_id} is over: ps {self.index} serves run {run.run_id}", "over": True})
            elif self._stopped_before_init(msg):
                self._reply(identity, msg, Op.NOT_READY, meta={"stopped": True})
            else:
                self._reply(identity, msg, Op.NOT_READY)
            return None
        if msg.task != protocol.NO_TASK and msg.task >= run.num_workers and msg.op in _WORKER_OPS:
            # removed by scaling: this answer ends it
            self._reply(identity, msg, Op.OK if msg.op is Op.PUSH else Op.PARAMS, flags=Flag.STOPPED | Flag.DROPPED)
            return None
        if msg.task in run.lost:
            run.policy.heard_from_lost(msg.task)
        return run

    def _stopped_before_init(self, msg: Message) -> bool:
        """Whether the run (its attempt) ``msg`` is about was stopped before its chief initialized it here: the
        chief failed first, or a stop came at once."""
        attempt = (msg.meta or {}).get("attempt")
        return (msg.run_id, None) in self._stop_requested or \
            (isinstance(attempt, int) and (msg.run_id, attempt) in self._stop_requested)

    # --- requests ------------------------------------------------------------------
    def _hello(self, identity, msg):
        self._reply(identity, msg, Op.OK, value=protocol.PROTOCOL_VERSION,
                    meta={"ps": self.index, "max_frame_bytes": self.max_frame_bytes})

    def _share(self, identity, msg):
        """Map the shared-memory lane a worker on this host created for its session, and open its bell when it
        made one (``bells``); value 1: mapped, 0: not (another host, or no such segments: the worker goes on over
        the socket); meta "bell": whether the bell opened."""
        run = self._current(identity, msg)
        if run is None:
            return
        if msg.task == protocol.NO_TASK:
            raise MalformedMessage("lanes are for workers: SHARE from the controller")
        try:
            lane = Lane.attach(run.dense_ids, run.dense_params, msg.meta or {})
        except LaneError as e:
            self._reply(identity, msg, Op.OK, value=0, meta={"error": str(e)})
            return
        lane.unlink()
        protocol.remember(self._lanes, msg.nonce, lane, MAX_LANES)
        bell = "bell" in msg.meta and self.bells.open(msg.nonce, identity, msg.meta["bell"])
        self._reply(identity, msg, Op.OK, value=1, meta={"bell": bell})

    def _init(self, identity, msg):
        try:
            cfg = PsConfig.from_dict(msg.meta or {})
        except ValueError as e:
            raise MalformedMessage(f"bad INIT: {e}") from None
        if self.run is not None and self.run.run_id == msg.run_id and self.run.attempt >= cfg.attempt:
            if self.run.attempt > cfg.attempt:  # a chief of an attempt that failed, come back: fenced off
                raise MalformedMessage(f"INIT of attempt {cfg.attempt}: this run is at attempt {self.run.attempt}")
            self._reply(identity, msg, Op.OK)  # already initialized: the chief retried
            return
        try:
            run = RunState.from_init(msg, cfg)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise MalformedMessage(f"bad INIT: {e}") from None
        run.policy = policy_for(cfg)(RunHandle(run, self._apply, self._release_waiting), cfg)
        self._release_waiting()
        if self.run is not None:
            if self.run.run_id != run.run_id:
                self._past_runs.add(self.run.run_id)
            self._close_run()
        self._lanes.clear()
        if cfg.metrics_address:
            run.emitter = MetricsEmitter(cfg.metrics_address, f"ps:{self.index}", self.key, context=self._ctx,
                                         run_id=run.run_id)
        run.stopped = bool({(run.run_id, None), (run.run_id, run.attempt)} & self._stop_requested) \
            or run.step >= run.steps
        self.run = run
        self._reply(identity, msg, Op.OK)

    def _pull(self, identity, msg):
        run = self._current(identity, msg)
        if run is None:
            return
        if (msg.meta or {}).get("attempt", run.attempt) != run.attempt:  # the run restarts: not INIT yet
            self._reply(identity, msg, Op.NOT_READY)
            return
        run.pulls += 1
        meta = msg.meta or {}
        if meta.get("all") or meta.get("frozen"):
            # every variable, sparse ones whole (the controller's pull), or the frozen ones (a worker's, once)
            chosen = [i for i, kind in enumerate(run.kinds) if meta.get("all") or kind == "frozen"]
            reply = Message(op=Op.PARAMS, run_id=msg.run_id, request_id=msg.request_id, nonce=msg.nonce,
                            step=run.step, ids=[run.ids[i] for i in chosen],
                            tensors=[run.params[i].detach().clone() for i in chosen])
            self._send(identity, reply)
            return
        if msg.task != protocol.NO_TASK:
            run.pulled.add(msg.task)
        self._reply(identity, msg, Op.PARAMS, with_params=True)

    def _pull_rows(self, identity, msg):
        """Rows of sparse variables: the request holds, per variable, a 1-D int64 tensor of row indices."""
        run = self._current(identity, msg)
        if run is None:
            return
        if msg.task == protocol.NO_TASK:
            raise MalformedMessage("rows are pulled by workers: PULL_ROWS from the controller")
        rows = [gradients.sparse_rows(run, vid, index) for vid, index in zip(msg.ids, msg.tensors)]
        run.pulls += 1
        self._send(identity, Message(op=Op.PARAMS, flags=Flag.STOPPED if run.stopped else Flag.NONE,
                                     run_id=msg.run_id, request_id=msg.request_id, nonce=msg.nonce,
                                     step=run.step, ids=list(msg.ids), tensors=rows))

    def _push(self, identity, msg):
        run = self._current(identity, msg)
        if run is None:
            return
        if msg.task == protocol.NO_TASK:
            raise MalformedMessage("gradients come from workers: PUSH from the controller")
        if not 0 <= msg.step <= run.steps:
            raise MalformedMessage(f"gradients computed on step {msg.step}: a run of {run.steps} steps has "
                                   f"steps 0..{run.steps}")
        meta = msg.meta or {}
        optimizer_set = meta.get("optimizer", 0)  # a user's loop with several optimizers: whose step this is
        if isinstance(optimizer_set, bool) or not isinstance(optimizer_set, int) or \
                not 0 <= optimizer_set < run.optimizer_sets:
            raise MalformedMessage(f"push for optimizer {optimizer_set!r}: this run has {run.optimizer_sets}")
        grads, buffers = self._gradients(run, msg, optimizer_set)
        if meta.get("groups") is not None:
            try:
                run.optimizer.set_options(meta["groups"], optimizer_set)  # checked whole before any is set
            except (TypeError, ValueError) as e:
                raise MalformedMessage(f"push's group options: {e}") from None
        if run.park_at is not None and run.step >= run.park_at and not run.stopped:
            run.parked.append((identity, _held(msg)))  # answered by the second STOP
            return
        run.pushes += 1
        with_params = msg.op is Op.PUSH_PULL
        if run.stopped:
            run.late += 1
            self._reply(identity, msg, Op.PARAMS if with_params else Op.OK, flags=Flag.DROPPED,
                        with_params=with_params)
            return
        run.policy.push(PushRequest(run, self._reply, identity, msg, grads, buffers, optimizer_set))

    def _gradients(self, run: RunState, msg: Message, optimizer_set: int = 0) -> tuple[list, list[torch.Tensor]]:
        """The gradients and buffer values of push ``msg`` (see ``gradients.read_push``); with ``Flag.SHARED`` the
        dense ones are in the session's lane. Raises ProtocolError on anything that does not fit."""
        ids, tensors = msg.ids, msg.tensors
        if msg.flags & Flag.SHARED:
            lane = self._lanes.get(msg.nonce)
            if lane is None:
                raise ProtocolError("a push through a shared-memory lane this session did not map (SHARE first)")
            ids, tensors = lane.ids + ids, lane.grads + tensors
            self.bytes_in += lane.nbytes
        return gradients.read_push(run, ids, tensors, self.index, optimizer_set)

    def _stats(self, identity, msg):
        if isinstance(msg.meta, dict) and msg.meta.get("lease") is not None:
            self.lease = OwnerLease.renewed_by(msg)
        run = self.run
        meta = {"ps": self.index, "rejected": dict(self.rejected), "failed_requests": self.failed_requests,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "bells": len(self.bells),
                "bell_requests": self.bell_requests}
        if run is not None:
            meta.update(run_id=run.run_id, attempt=run.attempt, metrics_address=run.metrics_address,
                        checkpoint_dir=run.checkpoint_dir, mode=run.mode, step=run.step, steps=run.steps,
                        stopped=run.stopped, finalized=run.finalized,
                        pushes=run.pushes, pulls=run.pulls, pulled=sorted(run.pulled), applied=run.applied,
                        dropped_stale=run.dropped_stale, late=run.late, **run.policy.stats(),
                        variables=run.names, lanes=len(self._lanes), options=dict(run.options))
        self._reply(identity, msg, Op.OK, meta=meta)

    def _stop_run(self, identity, msg):
        """Stop now, or (meta {"at_step": S}) once step S is applied; meta {"hold": true}: park at the current
        step, and answer it (the first of two STOPs that end every ps on the same step). Meta {"attempt": A}:
        only attempt A of the run (a failed attempt's stop must not end the next one). Meta {"closed": true}:
        stop now, and the run is over for good (its supervisor has finalized it)."""
        run = self.run
        meta = msg.meta or {}
        attempt = None if meta.get("attempt") is None else int(meta["attempt"])
        if run is None or run.run_id != msg.run_id or (attempt is not None and attempt > run.attempt):
            self._stop_requested.add((msg.run_id, attempt))
            self._reply(identity, msg, Op.OK)
            return
        if attempt is not None and attempt < run.attempt:  # that attempt is over: this ps serves a later one
            self._reply(identity, msg, Op.OK, value=run.step)
            return
        if meta.get("closed"):
            run.finalized = True
        if meta.get("hold") and not run.stopped:
            if run.park_at is None:
                run.park_at, run.parked_since = run.step, time.monotonic()
            self._reply(identity, msg, Op.OK, value=run.park_at)
            return
        self._end_at(run, meta.get("at_step"))
        self._reply(identity, msg, Op.OK, value=run.step if run.stopped else run.steps)  # where it ends

    def _end_at(self, run: RunState, at_step) -> None:
        """The run ends once step ``at_step`` is applied (now if it has been, or is None); held pushes go
        through again, applied while the run is short of that step."""
        if at_step is not None and int(at_step) > run.step and not run.stopped:
            run.steps = min(run.steps, int(at_step))
        elif not run.stopped:
            run.stopped = True
            run.save(self.index)
            self._release_waiting()
            self._report(now=True)
        held, run.parked, run.park_at = run.parked, [], None
        for identity, push in held:
            self._serve(identity, push)

    def _check_park(self) -> None:
        run = self.run
        if run is not None and run.park_at is not None and time.monotonic() - run.parked_since > PARK_S:
            self._end_at(run, None)  # the second STOP never came: stop where this ps is

    def _checkpoint(self, identity, msg):
        """Write this ps's shard now (meta {"step": null} or the current step) or once step S is applied."""
        run = self._current(identity, msg)
        if run is None:
            return
        if not run.checkpoint_dir:
            raise ProtocolError("this run has no checkpoint directory")
        step = (msg.meta or {}).get("step")
        step = run.step if step is None else int(step)
        if step > run.steps:
            raise Refused(f"step {step} is beyond the run's {run.steps} steps")
        if step < run.step:
            raise Refused(f"step {step} {PASSED}: ps {self.index} is at step {run.step}")
        if step == run.step:
            if not run.save(self.index):
                raise Refused(f"ps {self.index} could not write its shard of step {step}")
        else:
            run.save_at.add(step)
        self._reply(identity, msg, Op.OK, value=step)

    def _membership(self, identity, msg):
        """Workers lost (meta {"lost": [...]}): stop waiting for them (sync aggregates fewer gradients, SSP
        ignores their clocks). Scaling (meta {"workers": n, "replicas": r}): the run has ``n`` workers now, of
        which sync aggregates ``r`` per step; added ones count from their first request."""
        run = self._current(identity, msg)
        if run is None:
            return
        meta = msg.meta or {}
        if "workers" in meta:
            n, replicas = int(meta["workers"]), int(meta.get("replicas", run.replicas))
            if not 1 <= n <= MAX_WORKERS:
                raise ProtocolError(f"a run has 1 to {MAX_WORKERS} workers, not {n}")
            run.lost = {w for w in run.lost if w < n} | set(range(run.num_workers, n))
            run.num_workers = n
            run.replicas = max(1, replicas)
        lost = [int(w) for w in meta.get("lost", []) if 0 <= int(w) < run.num_workers]
        for w in lost:
            self._sessions.fence(w)  # the lost worker may only hang: it must not come back beside its replacement
        run.lost.update(lost)
        run.policy.members_changed()
        self._reply(identity, msg, Op.OK)

    def _shutdown(self, identity, msg):
        self._reply(identity, msg, Op.OK)
        self._stop.set()

    # --- updates -------------------------------------------------------------------
    def _apply(self, run: RunState, grads: list, count: int, *, counts: bool = True) -> None:
        """One update with the mean of ``count`` summed gradients (see ``updates.apply``). ``counts``: the update
        is a global step (a user's loop with several optimizers: its first one's)."""
        try:
            updates.apply(run, grads, count)
        except NonFiniteUpdate as e:
            self.refuse_update(run, e)
            return
        run.applied += 1
        if not counts:
            return
        run.step += 1
        if run.step >= run.steps:
            run.stopped = True
            run.save(self.index)  # the final checkpoint
            self._report(now=True)
        elif run.step in run.save_at or any(every and run.step % every == 0
                                            for every in (run.checkpoint_every, run.eval_every)):
            run.save(self.index)
        else:
            run.keep_state_copy(self.index)

    def refuse_update(self, run: RunState, error: NonFiniteUpdate) -> None:
        """An update refused, nothing of it applied: the run fails at its current step. The held worker requests
        are answered with the cause now, every later one too (``_reply``); the values stay those of that step,
        which the final shard holds."""
        if run.refused_update is None:
            run.refused_update = (f"ps {self.index} refused the update from global step {run.step}: {error}, so "
                                  "nothing of it was applied (lower the learning rate, or clip with "
                                  "max_grad_norm=...)")
            self._report(now=True)
        self._release_waiting()

    def _release_waiting(self, ready=None) -> None:
        """Answer the held requests (those that ``ready(request)`` accepts), with the current parameters."""
        run = self.run
        if run is None:
            return
        held, run.waiting = run.waiting, []
        now = time.monotonic()
        for identity, req, since in held:
            if ready is None or run.stopped or ready(req):
                self._reply(identity, req, Op.PARAMS, with_params=True, value=req.value,
                            wait_us=int((now - since) * 1e6))
            else:
                run.waiting.append((identity, req, since))

    _HANDLERS = {Op.HELLO: _hello, Op.INIT: _init, Op.PULL: _pull, Op.PULL_ROWS: _pull_rows, Op.PUSH: _push,
                 Op.PUSH_PULL: _push, Op.STATS: _stats, Op.STOP: _stop_run, Op.SHUTDOWN: _shutdown,
                 Op.CHECKPOINT: _checkpoint, Op.MEMBERSHIP: _membership, Op.SHARE: _share}


@dataclass(frozen=True)
class OwnerLease:
    """Run ``run_id``'s owner (``owner``: who) holds it for ``seconds`` from ``renewed`` (this ps's clock)."""

    run_id: int
    owner: str
    seconds: float
    renewed: float

    @classmethod
    def renewed_by(cls, msg: Message) -> "OwnerLease":
        """The lease a STATS from the run's owner renews (meta {"lease": {"owner", "seconds"}})."""
        lease = msg.meta["lease"]
        if msg.task != protocol.NO_TASK or not isinstance(lease, dict) or not isinstance(lease.get("owner"), str) \
                or isinstance(lease.get("seconds"), bool) or not isinstance(lease.get("seconds"), (int, float)) \
                or not lease["seconds"] > 0:
            raise MalformedMessage(f"a lease is renewed by the run's owner, for some seconds: not {lease!r}")
        return cls(msg.run_id, lease["owner"], float(lease["seconds"]), time.monotonic())


def _held(msg: Message) -> Message:
    """A copy of a request that outlives its frames (released once the request is handled)."""
    return Message(op=msg.op, flags=msg.flags, task=msg.task, run_id=msg.run_id, request_id=msg.request_id,
                   nonce=msg.nonce, step=msg.step, ids=list(msg.ids), tensors=[t.clone() for t in msg.tensors],
                   meta=msg.meta)
