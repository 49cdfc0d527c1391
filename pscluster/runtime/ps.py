"""The ps server: holds variables and their optimizer state, applies updates.

One thread, one ROUTER socket. Each run is set up by the chief's INIT message
(variables, initial values, optimizer, mode), so a ps needs nothing but its
address and the cluster secret to start.

Sync mode (SyncReplicasOptimizer): gradients computed on the current step are
summed until ``replicas_to_aggregate`` have arrived, then one averaged update is
applied and the step advances; a gradient computed on an older step is dropped
and counted. A PUSH_PULL in sync mode is answered when its step's update has been
applied (the token-queue wait of TF, in one round trip). When a step aggregates more
gradients than there are live workers, each gives several (TF's tokens: one worker
with ``replicas_to_aggregate=2`` makes one global step of every two of its own):
worker i's quota is an even share, the lower-numbered workers taking the remainder,
and a push short of its quota is answered at once, on the same step.

Async mode: each gradient is applied on arrival and its staleness (current step
minus the step it was computed on) is recorded.

SSP mode (bounded staleness): as async, but the reply to a worker's push is held
while that worker has pushed more than ``staleness_bound`` times more than the
slowest worker, so no worker runs more than the bound ahead.

Sparse variables (embedding tables) are never sent whole after INIT: workers pull
the rows their batch touches (PULL_ROWS) and push (row indices, row gradients)
pairs; the ps applies them with a sparse-aware optimizer (SGD, Adagrad, or Adam as
the lazy SparseAdam, which touches only the rows present).

Once the step target is reached (or STOP arrives), replies carry Flag.STOPPED and
later gradients are not applied. A clean stop of several ps tasks takes two STOPs: the first (meta
{"hold": true}) parks each ps at its current step, holding the pushes that arrive; its replies say where
each parked. The second (meta {"at_step": T}, T the highest of those) lets a ps behind apply held and
arriving pushes up to T: every ps ends on step T, which the final checkpoint holds. A ps parked for
``PARK_S`` without the second STOP stops where it is.

Checkpoints: when the run has a checkpoint directory, the ps writes its shard (variables and optimizer
state, see ``checkpoint.py``) every ``checkpoint_every`` steps and every ``eval_every`` steps (the controller
evaluates those), at steps asked for by CHECKPOINT, and at the end; the controller commits a checkpoint once every
ps has written its shard of one step. INIT can carry optimizer state and a starting step: a restore.

Membership (MEMBERSHIP): lost workers are left out (sync aggregates the gradients of the live workers
only, SSP measures the slowest among them) and count as live again from their next request (sync: from their
first gradient of the current step). The worker count can change during a run (scaling): added workers count
the same way; a removed worker's next push or pull is answered STOPPED, so it ends.

Hostile input: every message is checked before it is served (``protocol``: limits, HMAC-SHA256 signature, wire
format, session freshness); one that fails is dropped and counted in ``rejected`` by reason (unsigned,
bad_signature, replayed, malformed), and never reaches the optimizer. A signed, fresh request of a worker the
run declared lost (MEMBERSHIP "lost": it hung, and has a replacement) is refused with an ERROR reply that ends
it (counted as fenced): a worker that wakes up never trains beside its replacement. A signed request that does
not fit the run (variables, shapes, dtypes, rows, steps, worker counts out of range) is refused with an ERROR
reply and counted as malformed. Nothing is unpickled, and nothing is allocated from a size field before it is bounded:
ZeroMQ refuses frames over ``max_frame_bytes`` at the transport (``MAXMSGSIZE``, fixed when the socket binds:
the protocol's largest frame, a few MB, whatever the model, as tensors travel in chunks), and once a run is
initialized its requests are held to the sizes of its own variables (``protocol.Limits``). The counters reach the run
store as "rejected" events (see ``_report``) and are in the STATS reply.

Same host: a worker may map a shared-memory lane for its session (SHARE, see ``lanes``); its pushes then
leave their dense gradients in the lane and the parameters of its replies are written there. A run keeps
at most ``MAX_LANES`` lanes (least recently mapped first out); a new run's INIT drops them all.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch
import zmq

from ..errors import FencedOff, MalformedMessage, ProtocolError
from . import checkpoint, curve, parts, protocol
from .emitter import MetricsEmitter
from .lanes import Lane, LaneError
from .optim import OptimizerSpec, PsOptimizer, build
from .plan import PsConfig
from .steps import PRECISIONS
from .streamed import ChunkSums, streamed_push
from .protocol import Flag, Message, Op

# torch's sparse optimizers build sparse tensors without stating whether to check them; ours are checked
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled", category=UserWarning)

POLL_MS = 100
REPORT_S = 0.5  # how often a ps sends its counters to the collector
PARK_S = 30.0  # how long a ps parked by a first STOP waits for the second
SENT_WAIT_S = 0.01  # how long an update waits for ZeroMQ to let go of values it sends zero-copy (see release_sent)
ASSEMBLY_S = 300.0  # a message in parts not whole this long after its head is dropped
RUN_JSON_BYTES = 64 << 10  # the JSON frame of a request during a run (INIT excepted)
MAX_WORKERS = protocol.NO_TASK  # worker task ids are 16 bits, NO_TASK excepted
MAX_LANES = 1024
REJECTED = ("unsigned", "bad_signature", "replayed", "malformed", "fenced")
PASSED = "has passed"  # in the refusal of a CHECKPOINT at a step the ps is past: the controller asks again


@dataclass
class _RunState:
    """One run's variables, optimizer and counters on this ps."""

    run_id: int
    mode: str
    steps: int
    replicas: int
    ids: list[int]
    names: list[str]
    params: list[torch.Tensor]  # parameters (trained or frozen) and buffers, in the order of ids
    optimizer: PsOptimizer  # of the trained variables, with the run's schedule (see ``optim``)
    sparse: list[bool]
    kinds: list[str] = field(default_factory=list)  # per variable: param, frozen or buffer (plan.KINDS)
    optimizer_of: list[int] = field(default_factory=list)  # per variable: which of a user's optimizers trains it
    buffer_rule: str = "chief"  # plan.BUFFER_RULES
    half: torch.dtype | None = None  # mixed precision: the dtype the gradients of fp32 variables arrive in
    buffer_values: dict = field(default_factory=dict)  # worker -> the buffer values of its latest applied push
    num_workers: int = 1
    staleness_bound: int = 0
    emitter: MetricsEmitter | None = None
    step: int = 0
    stopped: bool = False
    finalized: bool = False  # its supervisor has closed it: a ps serving one run (a script's) may end
    accum: list | None = None  # sync: per variable, a summed dense gradient or a list of (rows, values)
    chunk_sums: ChunkSums = field(default_factory=ChunkSums)  # sync: the variables summed chunk by chunk
    accum_count: int = 0
    accum_optimizer: int = 0  # sync: which of a user's optimizers the step's gradients are for
    contributors: list[int] = field(default_factory=list)
    waiting: list[tuple[bytes, Message, float]] = field(default_factory=list)  # (identity, header, since)
    snapshot: tuple[int, list[torch.Tensor], protocol.PayloadTags] | None = None  # updates, values, their tags
    sending: list = field(default_factory=list)  # zmq.MessageTrackers of replies sending dense values zero-copy
    clocks: Counter = field(default_factory=Counter)  # ssp: pushes per worker
    pushes: int = 0
    pulls: int = 0
    pulled: set = field(default_factory=set)  # the workers that pulled the parameters (the chief's start barrier)
    applied: int = 0
    dropped_stale: int = 0
    late: int = 0
    staleness: Counter = field(default_factory=Counter)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    eval_every: int = 0  # shards at its multiples too: the controller evaluates them
    metrics_address: str | None = None  # where the run's metric events go (told to workers that join by STATS)
    attempt: int = 0  # restarts of the run after a ps was lost
    save_at: set = field(default_factory=set)  # steps to write a shard at (CHECKPOINT)
    saved: set = field(default_factory=set)
    checkpoint_errors: int = 0
    lost: set = field(default_factory=set)  # workers lost (or added by scaling) and not heard from yet
    park_at: int | None = None  # a stop in two phases: hold pushes from this step on
    parked: list = field(default_factory=list)  # (identity, push) held while parked
    parked_since: float = 0.0
    reported_rejected: dict = field(default_factory=dict)  # the counters last sent to the collector

    def __post_init__(self):
        # fixed for the run: looked up on every request
        self.kinds = self.kinds or ["param"] * len(self.ids)
        self.optimizer_of = self.optimizer_of or [0] * len(self.ids)
        self.optimizer_sets = max(self.optimizer_of, default=0) + 1
        self.rules = AGGREGATION[self.mode]  # what the mode does with a push, chosen once
        self.position = {vid: i for i, vid in enumerate(self.ids)}
        # exchanged with every push and reply: trained dense variables (gradients in, values out) and buffers
        exchanged = [not sparse and kind != "frozen" for sparse, kind in zip(self.sparse, self.kinds)]
        self.dense_ids = [vid for vid, x in zip(self.ids, exchanged) if x]
        self.dense_params = [p for p, x in zip(self.params, exchanged) if x]
        self.zero_copy = [p for p in self.dense_params if p.numel() * p.element_size() >= protocol.COPY_LIMIT]
        self.trained = [i for i, kind in enumerate(self.kinds) if kind == "param"]
        self.trained_params = [self.params[i] for i in self.trained]
        self.buffers = [self.params[i] for i, kind in enumerate(self.kinds) if kind == "buffer"]
        # the most one legitimate request can hold: each variable once (a sparse one as int64 row
        # indices, each row at most once, and the rows' values)
        frame = [p.numel() * p.element_size() + (8 * p.shape[0] if sparse and p.dim() else 0)
                 for p, sparse in zip(self.params, self.sparse)]
        self.limits = protocol.Limits(max_tensors=max(1, 2 * len(self.ids)), max_json_bytes=RUN_JSON_BYTES,
                                      max_message_bytes=sum(frame) + RUN_JSON_BYTES + 4096 * (len(self.ids) + 1))

    def waiting_for(self) -> list[int]:
        """The workers the run waits for now (see the mode's ``waiting_for``)."""
        return [] if self.stopped else self.rules.waiting_for(self)

    def live(self) -> list[int]:
        return [w for w in range(self.num_workers) if w not in self.lost] or [0]

    def replicas_now(self) -> int:
        """Sync: gradients to aggregate per step, at most one per live worker."""
        if not self.lost:
            return self.replicas
        return max(1, min(self.replicas, self.num_workers - len(self.lost)))

    def ahead(self, worker: int) -> int:
        """SSP: how many pushes ``worker`` is ahead of the slowest live worker."""
        return self.clocks[worker] - min(self.clocks[w] for w in self.live())

    def release_sent(self) -> None:
        """Before the dense values change in place: wait up to ``SENT_WAIT_S`` for ZeroMQ to be done with the
        replies that send them without a copy (a worker reads its reply before it sends its next gradient, so
        it nearly always is); a reply still in flight then (a slow or stopped reader) keeps the memory it sends,
        and each value sent without a copy moves to a copy of it: a variable's bytes are held twice only
        while a reply of them is stuck."""
        if not self.sending:  # nothing sent zero-copy since the last update: most runs, every step
            return
        pending, self.sending = self.sending, []
        deadline = time.monotonic() + SENT_WAIT_S
        try:
            for tracker in pending:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            return
        except zmq.NotDone:
            pass
        with torch.no_grad():
            for p in self.zero_copy:
                p.data = p.detach().clone()
                self.optimizer.moved(p)
        self.snapshot = None

    def optimizer_state(self, i: int, join=None) -> dict:
        """The optimizer state of variable ``i`` (none for a frozen parameter or a buffer); ``join``: see
        ``PsOptimizer.state``."""
        return self.optimizer.state(self.params[i], join) if self.kinds[i] == "param" else {}

    def params_snapshot(self) -> tuple[list[torch.Tensor], protocol.PayloadTags]:
        """The current dense values to reply with and the tags of their payload frames, kept until the next update
        (every reply of a sync step, and every pull, sends the same values, tagged once, as the first reply is
        sent: see ``parts``). The values are the
        variables themselves: one of ``protocol.COPY_LIMIT`` bytes or more goes without a copy, so the reply is
        tracked (``sending``) and the next update leaves its memory alone until ZeroMQ is done with it
        (``release_sent``); a smaller one is copied as it is sent."""
        if self.snapshot is None or self.snapshot[0] != self.applied:  # an update (of any optimizer) since
            values = [p.detach() for p in self.dense_params]
            self.snapshot = (self.applied, values, protocol.PayloadTags())
        return self.snapshot[1], self.snapshot[2]


def _sparse_grad(param: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], count: int) -> torch.Tensor:
    """The mean of ``count`` sparse gradients given as (row indices, row values) parts."""
    rows = torch.cat([r for r, _ in parts])
    values = torch.cat([v for _, v in parts])
    if count > 1:
        values = values / count
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, param.shape, check_invariants=False).coalesce()


class ParameterServer:
    """Serves one ps task on ``tcp://host:port`` (port 0: a free port, see ``.port``), its messages signed
    with ``key``; ``encrypt``: as a ZeroMQ CURVE server (see ``curve``). ``max_frame_bytes``: the largest
    frame it receives (default: the largest the protocol sends, whatever the model)."""

    def __init__(self, key: bytes, *, index: int = 0, host: str = "127.0.0.1", port: int = 0,
                 context: zmq.Context | None = None, encrypt: bool = False,
                 max_frame_bytes: int = protocol.MAX_FRAME_BYTES):
        self.key = key
        self.index = index
        self.max_frame_bytes = max_frame_bytes
        self._ctx = context or zmq.Context.instance()
        self._sock = protocol.configure(self._ctx.socket(zmq.ROUTER))
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
            # one message queued per connection: the parts of a push wait in the kernel's socket buffers, not
            # in this process, while it applies the part before (see ``streamed``: the ps's peak memory)
            self._sock.setsockopt(zmq.RCVHWM, 1)
            if encrypt:
                curve.make_server(self._sock, key)
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        except BaseException:
            self._sock.close(linger=0)
            raise
        self._sessions = protocol.Sessions()
        self.run: _RunState | None = None
        # (run id, attempt or None for every attempt): STOP can arrive before the chief's INIT
        self._stop_requested: set[tuple[int, int | None]] = set()
        self._past_runs: set[int] = set()
        self._lanes: OrderedDict[bytes, Lane] = OrderedDict()  # session nonce -> its shared-memory lane
        self.assembling = parts.Assemblies(key)  # by connection identity: messages arriving in parts
        self.rejected: Counter = Counter(dict.fromkeys(REJECTED, 0))  # messages dropped or refused, by reason
        self.failed_requests = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_request = time.monotonic()  # when the last authenticated request arrived
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------
    def start(self) -> "ParameterServer":
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, name=f"ps-{self.index}", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last_report = 0.0
        try:
            while not self._stop.is_set():
                if poller.poll(POLL_MS):
                    self._handle(protocol.receive(self._sock, protocol.DEFAULT_LIMITS.max_frames + 1))
                if time.monotonic() - last_report >= REPORT_S:
                    last_report = time.monotonic()
                    self._report()
                    self._check_park()
                    self.rejected["malformed"] += self.assembling.drop_older_than(ASSEMBLY_S)
        finally:
            self._close_run()
            self._sock.close(linger=0)

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

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def done_serving(self, quiet_s: float) -> bool:
        """Whether the run this server holds is over: its supervisor closed it, or it ended and no request
        came for ``quiet_s`` seconds (a supervisor that died before closing it)."""
        run = self.run
        return run is not None and (run.finalized or run.stopped and time.monotonic() - self.last_request > quiet_s)

    # --- dispatch ------------------------------------------------------------------
    def _handle(self, frames) -> None:
        """Check one received message (identity frame first) and serve it, or drop and count it."""
        if frames is None:
            self.rejected["malformed"] += 1  # more frames than any message has: not even kept
            return
        identity, body = frames[0].bytes, frames[1:]
        frames.clear()  # body alone holds the payload frames, which decode lets go of as it copies them
        self.bytes_in += sum(len(f) for f in body)
        if parts.is_part(body):
            self._take_part(identity, body)
            return
        try:
            msg = protocol.decode(body, self.key, self._limits(body), release=True)
            if msg.op is Op.HELLO:
                msg.nonce = self._sessions.open(msg)
            else:
                self._sessions.admit(msg)
        except FencedOff as e:  # signed and fresh, from a worker replaced while it hung: told to end
            self.rejected[e.counter] += 1
            self._reply(identity, msg, Op.ERROR, meta={"error": str(e), "fenced": True})
            return
        except ProtocolError as e:
            self.rejected[e.counter] += 1
            return
        if msg.flags & Flag.PARTS:  # served once its parts are in (one message in parts per connection)
            self.assembling.open(identity, msg, body[0], streamed_push(self, self.run, msg))
            return
        self._serve(identity, msg)

    def _take_part(self, identity: bytes, body) -> None:
        """One part of the message arriving in parts from ``identity``: serve the message once it is whole;
        drop it, counting why, at a part that does not belong."""
        try:
            msg = self.assembling.take(identity, body)
        except ProtocolError as e:
            self.rejected[e.counter] += 1
            return
        if msg is not None:
            self._serve(identity, msg)

    def _limits(self, body) -> protocol.Limits:
        """What a message may hold: a running run's requests are held to the sizes of its variables; INIT
        (of the next run, or a restart) and anything before a run to the server's limits."""
        run = self.run
        if run is None or run.stopped or not body or protocol.peek_op(body[0]) == Op.INIT:
            return protocol.DEFAULT_LIMITS
        return run.limits

    def _serve(self, identity: bytes, msg: Message) -> None:
        self.last_request = time.monotonic()
        handler = self._HANDLERS.get(msg.op)
        try:
            if handler is None:
                raise MalformedMessage(f"op {msg.op.name} is not a request")
            handler(self, identity, msg)
        except (ProtocolError, KeyError, TypeError, ValueError) as e:  # the request does not fit: refused
            self.rejected["malformed"] += 1
            self._error(identity, msg, f"{msg.op.name} refused: {e}" if not isinstance(e, ProtocolError) else str(e))
        except Exception as e:  # a bad request must never take the server down
            self.failed_requests += 1
            self._error(identity, msg, f"{msg.op.name} failed: {type(e).__name__}: {e}")

    def _send(self, identity: bytes, msg: Message, tags: protocol.PayloadTags | None = None, *,
              track: bool = False):
        """Send ``msg``; with ``track``, a zmq.MessageTracker that is done once ZeroMQ is done with every frame
        sent without a copy (pyzmq's ``send_multipart`` tracks its last frame only)."""
        trackers = []
        for frames in parts.messages(msg, self.key, tags):
            self.bytes_out += sum(memoryview(f).nbytes for f in frames)
            if not track:
                self._sock.send_multipart([identity, *frames], copy=False)
                continue
            trackers += [self._sock.send(f, zmq.SNDMORE, copy=False, track=True) for f in [identity, *frames[:-1]]]
            trackers.append(self._sock.send(frames[-1], copy=False, track=True))
        return zmq.MessageTracker(*trackers) if track else None

    def _reply(self, identity: bytes, req: Message, op: Op, *, flags=Flag.NONE, value: int = 0,
               wait_us: int = 0, with_params: bool = False, meta: dict | None = None) -> None:
        run = self.run
        reply = Message(op=op, flags=flags, run_id=req.run_id, request_id=req.request_id, nonce=req.nonce,
                        step=run.step if run else 0, value=value, wait_us=wait_us, meta=meta)
        if run is not None and run.stopped:
            reply.flags |= Flag.STOPPED
        tags = None
        lane = self._lanes.get(req.nonce) if with_params and req.flags & Flag.SHARED else None
        if lane is not None:
            with torch.no_grad():
                for slot, p in zip(lane.params, run.dense_params):
                    slot.copy_(p)
            reply.flags |= Flag.SHARED
            self.bytes_out += lane.nbytes
        elif with_params:
            reply.ids = run.dense_ids
            reply.tensors, tags = run.params_snapshot()
            if run.zero_copy:
                run.sending.append(self._send(identity, reply, tags, track=True))
                return
        self._send(identity, reply, tags)

    def _error(self, identity: bytes, req: Message, text: str) -> None:
        self._reply(identity, req, Op.ERROR, meta={"error": text})

    def _current(self, identity: bytes, msg: Message) -> _RunState | None:
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
        if msg.task in run.lost and run.rules.joins_on_request:  # a replacement: live again, level with the others
            run.lost.discard(msg.task)
            run.clocks[msg.task] = min((run.clocks[w] for w in run.live() if w != msg.task), default=0)
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
        """Map the shared-memory lane a worker on this host created for its session; value 1: mapped, 0: not
        (another host, or no such segments: the worker goes on over the socket)."""
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
        self._reply(identity, msg, Op.OK, value=1)

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
            n = len(cfg.names)
            if n > len(msg.tensors) or len(set(msg.ids[:n])) != n:
                raise ValueError(f"{len(msg.tensors)} values with ids {msg.ids[:n]} for {n} distinct variables")
            # buffers (integer ones too) are plain tensors, frozen parameters take no gradient
            params = [torch.nn.Parameter(t.clone(), requires_grad=kind == "param") if kind != "buffer" else t.clone()
                      for t, kind in zip(msg.tensors[:n], cfg.kinds)]
            half = PRECISIONS[cfg.precision]
            parts = []
            for k, spec in enumerate((cfg.optimizer, *cfg.more_optimizers)):  # each over the variables it trains
                trained = [i for i, kind in enumerate(cfg.kinds) if kind == "param" and cfg.optimizer_of[i] == k]
                parts.append(build([(cfg.names[i], params[i]) for i in trained], OptimizerSpec.from_dict(spec),
                                   sparse=[cfg.sparse[i] for i in trained],
                                   chunk_numel=[_frame_numel(params[i], half) for i in trained]))
            optimizer = parts[0] if len(parts) == 1 else PsOptimizer.merged(parts)
            run = _RunState(run_id=msg.run_id, mode=cfg.mode, steps=cfg.steps, replicas=cfg.replicas_to_aggregate,
                            ids=list(msg.ids[:n]), names=list(cfg.names), params=params, optimizer=optimizer,
                            sparse=list(cfg.sparse), num_workers=cfg.num_workers, staleness_bound=cfg.staleness_bound,
                            step=cfg.step, checkpoint_dir=cfg.checkpoint_dir, checkpoint_every=cfg.checkpoint_every,
                            eval_every=cfg.eval_every, attempt=cfg.attempt, kinds=list(cfg.kinds),
                            buffer_rule=cfg.buffers,
                            optimizer_of=list(cfg.optimizer_of),
                            half=half, metrics_address=cfg.metrics_address)
            self._restore_state(run, msg.ids[n:], msg.tensors[n:], cfg.state)
            run.optimizer.restore(run.step, cfg.schedule_state)  # the schedule at the starting step
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise MalformedMessage(f"bad INIT: {e}") from None
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

    @staticmethod
    def _restore_state(run: _RunState, ids, tensors, slots) -> None:
        """Optimizer state sent with INIT (a restore): tensor k is slot ``slots[k]`` of variable ``ids[k]``."""
        if len(slots) != len(tensors):
            raise ValueError(f"{len(tensors)} optimizer state tensors for {len(slots)} slot names")
        entries: dict[int, dict] = {}
        for vid, t, slot in zip(ids, tensors, slots):
            if vid not in run.position:
                raise ValueError(f"optimizer state of variable {vid}, which this ps does not hold")
            entries.setdefault(vid, {})[str(slot)] = t
        for vid, e in entries.items():
            run.optimizer.load_state(run.params[run.position[vid]], checkpoint.decode_state(e))

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
        rows = []
        for vid, index in zip(msg.ids, msg.tensors):
            param = run.params[self._sparse_position(run, vid)]
            rows.append(param.detach()[_checked_rows(index, param.shape[0], vid)])
        run.pulls += 1
        self._send(identity, Message(op=Op.PARAMS, flags=Flag.STOPPED if run.stopped else Flag.NONE,
                                     run_id=msg.run_id, request_id=msg.request_id, nonce=msg.nonce,
                                     step=run.step, ids=list(msg.ids), tensors=rows))

    @staticmethod
    def _sparse_position(run: _RunState, vid: int) -> int:
        i = run.position.get(vid)
        if i is None or not run.sparse[i]:
            raise ProtocolError(f"variable {vid} is not a sparse variable of this ps")
        return i

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
        reply_op = Op.PARAMS if with_params else Op.OK
        if run.stopped:
            run.late += 1
            self._reply(identity, msg, reply_op, flags=Flag.DROPPED, with_params=with_params)
            return
        run.rules.push(self, run, identity, msg, grads, buffers, with_params, optimizer_set)

    def _gradients(self, run: _RunState, msg: Message, optimizer_set: int = 0) -> tuple[list, list[torch.Tensor]]:
        """(per trained variable of this ps, in its order: a dense gradient, or for a sparse variable a list of
        one (row indices, row values) pair, None for one of another of a user's optimizers; per buffer: its value on
        the worker). A push holds each buffer and each trained variable of ``optimizer_set`` (with one optimizer:
        all of them) once, a sparse one as two tensors in a row (rows, then values); with ``Flag.SHARED`` the dense
        ones are in the session's lane. Raises ProtocolError on anything that does not fit."""
        ids, tensors = msg.ids, msg.tensors
        if msg.flags & Flag.SHARED:
            lane = self._lanes.get(msg.nonce)
            if lane is None:
                raise ProtocolError("a push through a shared-memory lane this session did not map (SHARE first)")
            ids, tensors = lane.ids + ids, lane.grads + tensors
            self.bytes_in += lane.nbytes
        grads: list = [None] * len(run.ids)
        k = 0
        while k < len(ids):
            i = run.position.get(ids[k])
            if i is None or grads[i] is not None or run.kinds[i] == "frozen" or \
                    (run.kinds[i] == "param" and run.optimizer_of[i] != optimizer_set):
                raise ProtocolError(f"push holds variables {ids}: ps {self.index} takes {run.dense_ids} and its "
                                    "sparse ones, each once")
            param = run.params[i]
            if not run.sparse[i]:
                grad = tensors[k]
                if grad.shape != param.shape or not (grad.dtype == param.dtype or run.kinds[i] == "param" and
                                                     param.dtype == torch.float32 and grad.dtype == run.half):
                    raise ProtocolError(f"gradients of variable {ids[k]} have the wrong shape or dtype: "
                                        "the worker's model differs from the chief's")
                grads[i], k = (grad if grad.dtype == param.dtype else grad.float()), k + 1  # mixed precision
                continue
            if k + 1 >= len(ids) or ids[k + 1] != ids[k]:
                raise ProtocolError(f"sparse variable {ids[k]}: rows and values expected")
            rows, values = _checked_rows(tensors[k], param.shape[0], ids[k]), tensors[k + 1]
            if values.shape != (len(rows), *param.shape[1:]) or values.dtype != param.dtype:
                raise ProtocolError(f"sparse gradient of variable {ids[k]}: {tuple(values.shape)} values "
                                    f"for {len(rows)} rows of shape {tuple(param.shape[1:])}")
            grads[i], k = [(rows, values)], k + 2
        if any(g is None for g, kind, k in zip(grads, run.kinds, run.optimizer_of)
               if kind == "buffer" or kind == "param" and k == optimizer_set):
            raise ProtocolError(f"push holds variables {ids}: ps {self.index} takes {run.dense_ids} and its "
                                "sparse ones, each once")
        return [grads[i] for i in run.trained], [g for g, kind in zip(grads, run.kinds) if kind == "buffer"]

    def _stats(self, identity, msg):
        run = self.run
        meta = {"ps": self.index, "rejected": dict(self.rejected), "failed_requests": self.failed_requests,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}
        if run is not None:
            meta.update(run_id=run.run_id, attempt=run.attempt, metrics_address=run.metrics_address,
                        checkpoint_dir=run.checkpoint_dir, mode=run.mode, step=run.step, stopped=run.stopped,
                        finalized=run.finalized,
                        pushes=run.pushes, pulls=run.pulls, pulled=sorted(run.pulled), applied=run.applied,
                        dropped_stale=run.dropped_stale, late=run.late,
                        staleness={str(k): v for k, v in sorted(run.staleness.items())},
                        waiting_on=sorted(set(run.contributors)),
                        variables=run.names, lanes=len(self._lanes))
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

    def _end_at(self, run: _RunState, at_step) -> None:
        """The run ends once step ``at_step`` is applied (now if it has been, or is None); held pushes go
        through again, applied while the run is short of that step."""
        if at_step is not None and int(at_step) > run.step and not run.stopped:
            run.steps = min(run.steps, int(at_step))
        elif not run.stopped:
            run.stopped = True
            self._save(run)
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
            raise ProtocolError(f"step {step} is beyond the run's {run.steps} steps")
        if step < run.step:
            raise ProtocolError(f"step {step} {PASSED}: ps {self.index} is at step {run.step}")
        if step == run.step:
            if not self._save(run):
                raise ProtocolError(f"ps {self.index} could not write its shard of step {step}")
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
            for w in range(n, run.num_workers):
                run.clocks.pop(w, None)
            run.num_workers = n
            run.replicas = max(1, replicas)
        lost = [int(w) for w in meta.get("lost", []) if 0 <= int(w) < run.num_workers]
        for w in lost:
            self._sessions.fence(w)  # the lost worker may only hang: it must not come back beside its replacement
        run.lost.update(lost)
        run.rules.members_changed(self, run)
        self._reply(identity, msg, Op.OK)

    def _shutdown(self, identity, msg):
        self._reply(identity, msg, Op.OK)
        self._stop.set()

    # --- updates -------------------------------------------------------------------
    def _apply(self, run: _RunState, grads: list, count: int, *, counts: bool = True) -> None:
        """One optimizer step with the mean of ``count`` summed gradients (of the variables this ps owns;
        sparse ones as lists of (rows, values) parts; a dense one on the meta device was applied as it arrived,
        see ``streamed``; None: a variable of another of a user's optimizers, left as it is). ``counts``: the update
        is a global step (a user's loop with several optimizers: its first one's)."""
        run.release_sent()
        kept = [(p, g) for p, g in zip(run.trained_params, grads)
                if g is not None and not (isinstance(g, torch.Tensor) and g.is_meta)]
        params, grads = [p for p, _ in kept], [g for _, g in kept]
        lr = run.optimizer.plain_sgd_rate(run.step)
        if lr is not None and grads:  # what SGD's step does without momentum or decay, less its per-call overhead
            with torch.no_grad():
                if count > 1:
                    torch._foreach_div_(grads, count)
                torch._foreach_add_(params, grads, alpha=-lr)
        elif lr is not None:  # this ps holds no trained variable: buffers or frozen ones only
            pass
        else:
            for p, g in zip(params, grads):
                if isinstance(g, torch.Tensor):
                    p.grad = g.div_(count) if count > 1 else g
                else:
                    p.grad = _sparse_grad(p, g, count)
            run.optimizer.step(run.step)
            for p in run.trained_params:
                p.grad = None
        _keep_buffers(run)
        run.applied += 1
        if not counts:
            return
        run.step += 1
        if run.step >= run.steps:
            run.stopped = True
            self._save(run)  # the final checkpoint
            self._report(now=True)
        elif run.step in run.save_at or any(every and run.step % every == 0
                                            for every in (run.checkpoint_every, run.eval_every)):
            self._save(run)

    def _save(self, run: _RunState) -> bool:
        """Write this ps's shard of the current step (once); False when checkpointing is off or failed."""
        if not run.checkpoint_dir:
            return False
        if run.step in run.saved:
            return True
        run.saved.add(run.step)
        # the state of a variable stepped in chunks is written from its chunks', never put together in memory
        states = [run.optimizer_state(i, join=checkpoint.Pieces) for i in range(len(run.ids))]
        tensors = checkpoint.shard_tensors(run.names, run.params, states)
        try:
            checkpoint.write_shard(run.checkpoint_dir, run.step, self.index, tensors, run_id=run.run_id,
                                   attempt=run.attempt, schedule=run.optimizer.schedule_state())
        except OSError as e:
            run.checkpoint_errors += 1
            if run.emitter is not None:
                run.emitter.emit("checkpoint_failed", step=run.step, error=f"{type(e).__name__}: {e}")
            return False
        return True

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


class _Sync:
    """SyncReplicasOptimizer: a gradient of the current step is summed until ``replicas_now()`` have arrived, then
    one averaged update is applied and the held replies are answered; a gradient of an older step is dropped.
    A worker that joins (a replacement, or one added) is waited for from the first step it sends a gradient of:
    counted from its first pull, a ps a step ahead of another when it pulled would wait for its gradient of a step
    it never computes (it pushes the step of ps 0's reply), and hold every worker."""

    joins_on_request = False

    @staticmethod
    def push(server: ParameterServer, run: _RunState, identity, msg: Message, grads, buffers, with_params,
             optimizer_set: int = 0) -> None:
        staleness = run.step - msg.step
        if staleness != 0:
            run.dropped_stale += 1
            server._reply(identity, msg, Op.PARAMS if with_params else Op.OK, flags=Flag.DROPPED, value=staleness,
                          with_params=with_params)
            return
        run.lost.discard(msg.task)  # a gradient of this step: a member from now on
        _note_buffers(run, msg.task, buffers)
        _sum_in_chunks(run, grads)
        if run.accum is None:
            # one replica per step: applied below, before this request's frames are let go, so not copied
            run.accum = grads if run.replicas_now() == 1 else [_owned(g) for g in grads]
            run.accum_optimizer = optimizer_set
        else:
            for a, g in zip(run.accum, grads):
                if g is None:
                    continue
                if isinstance(g, torch.Tensor):
                    if not g.is_meta:  # on the meta device: summed in chunks (see streamed)
                        a.add_(g)
                else:
                    a.extend(_owned(g))
        run.accum_count += 1
        run.contributors.append(msg.task)
        if with_params and run.contributors.count(msg.task) < _Sync.quota(run, msg.task):
            # not its last gradient of this step (a quota sums to the step's count: the step cannot be complete)
            server._reply(identity, msg, Op.PARAMS, with_params=True)
        elif with_params:
            run.waiting.append((identity, _header(msg), time.monotonic()))
        _Sync.members_changed(server, run)
        if not with_params:
            server._reply(identity, msg, Op.OK)

    @staticmethod
    def members_changed(server: ParameterServer, run: _RunState) -> None:
        """Apply the step once it has its gradients (fewer are needed when workers are lost)."""
        if run.accum is not None and run.accum_count >= run.replicas_now():
            run.chunk_sums.fold(run, run.accum)
            server._apply(run, run.accum, run.accum_count, counts=run.accum_optimizer == 0)
            run.accum, run.accum_count, run.contributors = None, 0, []
            server._release_waiting()

    @staticmethod
    def quota(run: _RunState, worker: int) -> int:
        """The gradients ``worker`` gives each step: one, or when the step aggregates more than there are live
        workers an even share of them, the lower-numbered workers taking one more each for the remainder.
        Every ps computes the same quotas, so each answers a worker's pushes alike."""
        if run.replicas <= run.num_workers - len(run.lost):  # the usual case, on every push: one each
            return 1
        live, needed = run.live(), run.replicas_now()
        if needed <= len(live) or worker not in live:
            return 1
        return needed // len(live) + (live.index(worker) < needed % len(live))

    @staticmethod
    def waiting_for(run: _RunState) -> list[int]:
        """The workers whose gradients for the current step have not all arrived yet."""
        return [w for w in run.live() if run.contributors.count(w) < _Sync.quota(run, w)]


class _Async:
    """Each gradient is applied on arrival; its staleness is counted."""

    joins_on_request = True  # no step waits for a worker

    def push(self, server: ParameterServer, run: _RunState, identity, msg: Message, grads, buffers,
             with_params, optimizer_set: int = 0) -> None:
        staleness = run.step - msg.step
        run.staleness[staleness] += 1
        _note_buffers(run, msg.task, buffers)
        # applied before this request's frames are let go: no copy (they are writable memory of this message
        # alone, so an optimizer that changes a gradient in place changes nothing else)
        server._apply(run, grads, 1, counts=optimizer_set == 0)
        self.answer(server, run, identity, msg, staleness, with_params)

    @staticmethod
    def answer(server: ParameterServer, run: _RunState, identity, msg: Message, staleness: int, with_params) -> None:
        server._reply(identity, msg, Op.PARAMS if with_params else Op.OK, value=staleness, with_params=with_params)

    @staticmethod
    def members_changed(server: ParameterServer, run: _RunState) -> None:
        pass

    @staticmethod
    def waiting_for(run: _RunState) -> list[int]:
        return []


class _SSP(_Async):
    """Bounded staleness: as async, but the answer to a push is held while its worker has pushed more than
    ``staleness_bound`` times more than the slowest live worker."""

    @staticmethod
    def answer(server: ParameterServer, run: _RunState, identity, msg: Message, staleness: int, with_params) -> None:
        run.clocks[msg.task] += 1
        if run.ahead(msg.task) > run.staleness_bound and not run.stopped:
            run.waiting.append((identity, _header(msg, value=staleness), time.monotonic()))
        else:
            _Async.answer(server, run, identity, msg, staleness, with_params)
        _SSP.members_changed(server, run)

    @staticmethod
    def members_changed(server: ParameterServer, run: _RunState) -> None:
        server._release_waiting(lambda req: run.ahead(req.task) <= run.staleness_bound)

    @staticmethod
    def waiting_for(run: _RunState) -> list[int]:
        """The slowest workers, while some worker is held for them."""
        if not run.waiting:
            return []
        slowest = min(run.clocks[w] for w in run.live())
        return [w for w in run.live() if run.clocks[w] == slowest]


AGGREGATION = {"sync": _Sync(), "async": _Async(), "ssp": _SSP()}
_WORKER_OPS = (Op.PULL, Op.PUSH, Op.PUSH_PULL)


def _sum_in_chunks(run: _RunState, grads: list) -> None:
    """Sync: the gradients in ``grads`` (per trained variable) of the variables whose step's sum is kept in chunks
    (a push in parts of this step streamed them: ``ChunkSums``), added there and left in ``grads`` on the meta
    device."""
    if not run.chunk_sums:  # no push in parts this step: nearly every sync step
        return
    for j, i in enumerate(run.trained):
        grad = grads[j]
        if isinstance(grad, torch.Tensor) and not grad.is_meta and i in run.chunk_sums:
            flat = grad.reshape(-1)
            for k, (start, end) in enumerate(run.optimizer.chunk_bounds(run.params[i])):
                run.chunk_sums.add(run, i, k, flat[start:end])
            grads[j] = torch.empty(grad.shape, dtype=grad.dtype, device="meta")


def _header(msg: Message, value: int = 0) -> Message:
    """What answering ``msg`` later takes of it (its frames are released once it is handled): its header,
    with the ``value`` the answer carries."""
    return Message(op=msg.op, flags=msg.flags, task=msg.task, run_id=msg.run_id, request_id=msg.request_id,
                   nonce=msg.nonce, value=value)


def _held(msg: Message) -> Message:
    """A copy of a request that outlives its frames (released once the request is handled)."""
    return Message(op=msg.op, flags=msg.flags, task=msg.task, run_id=msg.run_id, request_id=msg.request_id,
                   nonce=msg.nonce, step=msg.step, ids=list(msg.ids), tensors=[t.clone() for t in msg.tensors],
                   meta=msg.meta)


def _note_buffers(run: _RunState, worker: int, values: list[torch.Tensor]) -> None:
    """Keep the buffer values of a push that is applied (copies: its frames are released after the request);
    ``_keep_buffers`` sets the buffers from them at the update."""
    if values:
        run.buffer_values[worker] = [v.clone() for v in values]


def _keep_buffers(run: _RunState) -> None:
    """Set the buffers by the run's rule from the latest pushed values: ``chief``, those of the lowest-numbered
    live worker that pushed any (worker 0 while it lives, as DDP's broadcast_buffers takes rank 0's);
    ``average``, the mean of every live worker's latest (integer buffers rounded)."""
    if not run.buffers or not run.buffer_values:
        return
    live = [w for w in run.live() if w in run.buffer_values] or sorted(run.buffer_values)
    with torch.no_grad():
        if run.buffer_rule == "chief":
            for b, v in zip(run.buffers, run.buffer_values[live[0]]):
                b.copy_(v)
            return
        for k, b in enumerate(run.buffers):
            mean = torch.stack([run.buffer_values[w][k].double() for w in live]).mean(0)
            b.copy_(mean.round() if not b.is_floating_point() else mean)


def _frame_numel(param: torch.Tensor, half: torch.dtype | None) -> int:
    """The elements of one payload frame of ``param``'s gradient (in ``half`` for a float32 variable of a mixed
    precision run): the chunks a large variable is stepped in as its gradient arrives (see ``streamed``)."""
    dtype = half if half is not None and param.dtype == torch.float32 else param.dtype
    return protocol.CHUNK_BYTES // torch.empty((), dtype=dtype).element_size()


def _owned(grad):
    """A copy of a received gradient (dense, or a list of (rows, values) parts): received tensors are
    read-only views of frames that are released after the request."""
    if grad is None:  # a variable of another of a user's optimizers
        return None
    if isinstance(grad, torch.Tensor):
        return grad.clone()
    return [(rows.clone(), values.clone()) for rows, values in grad]


def _checked_rows(rows: torch.Tensor, num_rows: int, vid: int) -> torch.Tensor:
    """``rows`` as row indices of a variable of ``num_rows`` rows, or ProtocolError (rows on the meta device
    have not arrived yet: their range is checked once they have)."""
    if rows.dtype != torch.int64 or rows.dim() != 1 or len(rows) > num_rows:
        raise ProtocolError(f"rows of variable {vid}: a 1-D int64 tensor of at most {num_rows} rows expected")
    if len(rows) and not rows.is_meta and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        raise ProtocolError(f"rows of variable {vid} out of range 0..{num_rows - 1}")
    return rows


def wait_until(predicate, timeout: float, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
