"""One run's state on a ps: its variables, their optimizer, what its requests may hold, its counters, and the
shards it writes. Built from the chief's INIT (``RunState.from_init``), which for a restore carries optimizer state
and a starting step; what the run's mode does with pushes is its policy's (``policies``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import zmq

from ..errors import CheckpointError
from . import checkpoint, protocol, rescue
from .emitter import MetricsEmitter
from .optim import OptimizerSpec, PsOptimizer, build
from .plan import PsConfig
from .policies import Policy
from .protocol import Message
from .steps import PRECISIONS
from .streamed import ChunkSums

STATE_COPY_SHARE = 0.02  # the most of a ps's time its state copies take (see ``keep_state_copy``)
STATE_COPY_MIN_S = 0.1  # and the least time between two
SENT_WAIT_S = 0.01  # how long an update waits for ZeroMQ to let go of values it sends zero-copy (see release_sent)
RUN_JSON_BYTES = 64 << 10  # the JSON frame of a request during a run (INIT excepted)


@dataclass
class RunState:
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
    options: Mapping = field(default_factory=dict)  # the run's options as its INIT gave them (``PsConfig.options``)
    kinds: list[str] = field(default_factory=list)  # per variable: param, frozen or buffer (plan.KINDS)
    optimizer_of: list[int] = field(default_factory=list)  # per variable: which of a user's optimizers trains it
    buffer_rule: str = "chief"  # plan.BUFFER_RULES
    half: torch.dtype | None = None  # mixed precision: the dtype the gradients of fp32 variables arrive in
    buffer_values: dict = field(default_factory=dict)  # worker -> the buffer values of its latest applied push
    num_workers: int = 1
    emitter: MetricsEmitter | None = None
    policy: Policy | None = None  # what the run's mode does with pushes: set by the ps once the run is built
    step: int = 0
    stopped: bool = False
    finalized: bool = False  # its supervisor has closed it: a ps serving one run (a script's) may end
    chunk_sums: ChunkSums = field(default_factory=ChunkSums)  # sync: the variables summed chunk by chunk
    waiting: list[tuple[bytes, Message, float]] = field(default_factory=list)  # held answers (identity, header, since)
    snapshot: tuple[int, list[torch.Tensor], protocol.PayloadTags] | None = None  # updates, values, their tags
    sending: list = field(default_factory=list)  # zmq.MessageTrackers of replies sending dense values zero-copy
    pushes: int = 0
    pulls: int = 0
    pulled: set = field(default_factory=set)  # the workers that pulled the parameters (the chief's start barrier)
    applied: int = 0
    dropped_stale: int = 0
    late: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    eval_every: int = 0  # shards at its multiples too: the controller evaluates them
    metrics_address: str | None = None  # where the run's metric events go (told to workers that join by STATS)
    attempt: int = 0  # restarts of the run after a ps was lost
    save_at: set = field(default_factory=set)  # steps to write a shard at (CHECKPOINT)
    saved: set = field(default_factory=set)
    checkpoint_errors: int = 0
    state_copy_due: float = 0.0  # monotonic time of the next state copy (``keep_state_copy``)
    lost: set = field(default_factory=set)  # workers lost (or added by scaling) and not heard from yet
    park_at: int | None = None  # a stop in two phases: hold pushes from this step on
    parked: list = field(default_factory=list)  # (identity, push) held while parked
    parked_since: float = 0.0
    reported_rejected: dict = field(default_factory=dict)  # the counters last sent to the collector
    value_bound: float | None = None  # plain SGD: a bound of every |value| (see update_guard.sgd_step)
    refused_update: str | None = None  # why an update was refused: every later worker request is answered so

    def __post_init__(self):
        # fixed for the run: looked up on every request
        self.kinds = self.kinds or ["param"] * len(self.ids)
        self.optimizer_of = self.optimizer_of or [0] * len(self.ids)
        self.optimizer_sets = max(self.optimizer_of, default=0) + 1
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

    @classmethod
    def from_init(cls, msg: Message, cfg: PsConfig) -> "RunState":
        """The run an INIT (``msg``, its config ``cfg``) starts: its values first, then for a restore the optimizer
        state tensors (their slots in ``cfg.state``). KeyError, TypeError, ValueError or RuntimeError for one that
        does not fit."""
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
        run = cls(run_id=msg.run_id, mode=cfg.mode, steps=cfg.steps, replicas=cfg.replicas_to_aggregate,
                  ids=list(msg.ids[:n]), names=list(cfg.names), params=params, optimizer=optimizer,
                  sparse=list(cfg.sparse), options=cfg.options, num_workers=cfg.num_workers, step=cfg.step,
                  checkpoint_dir=cfg.checkpoint_dir, checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every,
                  attempt=cfg.attempt, kinds=list(cfg.kinds), buffer_rule=cfg.buffers,
                  optimizer_of=list(cfg.optimizer_of), half=half, metrics_address=cfg.metrics_address)
        run._restore_state(msg.ids[n:], msg.tensors[n:], cfg.state)
        run.optimizer.restore(run.step, cfg.schedule_state)  # the schedule at the starting step
        return run

    def _restore_state(self, ids, tensors, slots) -> None:
        """Optimizer state sent with INIT (a restore): tensor k is slot ``slots[k]`` of variable ``ids[k]``."""
        if len(slots) != len(tensors):
            raise ValueError(f"{len(tensors)} optimizer state tensors for {len(slots)} slot names")
        entries: dict[int, dict] = {}
        for vid, t, slot in zip(ids, tensors, slots):
            if vid not in self.position:
                raise ValueError(f"optimizer state of variable {vid}, which this ps does not hold")
            entries.setdefault(vid, {})[str(slot)] = t
        for vid, e in entries.items():
            self.optimizer.load_state(self.params[self.position[vid]], checkpoint.decode_state(e))

    def waiting_for(self) -> list[int]:
        """The workers the run waits for now (see the policy's ``waiting_for``)."""
        return [] if self.stopped else self.policy.waiting_for()

    def live(self) -> list[int]:
        return [w for w in range(self.num_workers) if w not in self.lost] or [0]

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

    def keep_state_copy(self, index: int) -> None:
        """Once the previous one is old enough, a copy of this ps's optimizer state at its step
        (``rescue.write_state_copy``): where this ps, if it is lost, gets its optimizer state back from. The copies
        take at most ``STATE_COPY_SHARE`` of the ps's time (one that took 2 ms is followed by the next 100 ms
        later); one that cannot be written fails the run as a shard would (``checkpoint_failed``). None on a ps that
        holds a sparse variable: a rescue rolls it back to its own shards (``rescue``), never reads its copy."""
        now = time.monotonic()
        if not self.checkpoint_dir or now < self.state_copy_due:
            return
        if any(self.sparse):
            self.state_copy_due = float("inf")  # never: not looked at again every step
            return
        state = {f"{self.names[i]}#{slot}": t for i in self.trained
                 for slot, t in checkpoint.encode_state(self.optimizer_state(i, join=checkpoint.Pieces)).items()}
        shapes = {name: list(p.shape) for name, p in zip(self.names, self.params)}
        try:
            rescue.write_state_copy(self.checkpoint_dir, index, self.step, state, shapes, run_id=self.run_id,
                                    attempt=self.attempt)
        except OSError as e:
            self.state_copy_due = float("inf")  # said once: the run ends on it
            self._write_failed(f"ps {index}'s state copy of step {self.step} was not written: "
                               f"{type(e).__name__}: {e}", e.errno)
            return
        self.state_copy_due = now + max(STATE_COPY_MIN_S, (time.monotonic() - now) / STATE_COPY_SHARE)

    def save(self, index: int) -> bool:
        """Write shard ``index`` of the current step (once); False when checkpointing is off or failed."""
        if not self.checkpoint_dir:
            return False
        if self.step in self.saved:
            return True
        self.saved.add(self.step)
        # the state of a variable stepped in chunks is written from its chunks', never put together in memory
        states = [self.optimizer_state(i, join=checkpoint.Pieces) for i in range(len(self.ids))]
        tensors = checkpoint.shard_tensors(self.names, self.params, states)
        try:
            checkpoint.write_shard(self.checkpoint_dir, self.step, index, tensors, run_id=self.run_id,
                                   attempt=self.attempt, schedule=self.optimizer.schedule_state())
        except CheckpointError as e:  # a full disk (``errno`` says which fault), a diverged state, never written
            self._write_failed(f"{type(e).__name__}: {e}", getattr(e.__cause__, "errno", None))
            return False
        return True

    def _write_failed(self, error: str, errno: int | None) -> None:
        """A shard or state copy not written: counted, and told to the supervisor (which ends the run on a file
        system's ``errno``)."""
        self.checkpoint_errors += 1
        if self.emitter is not None:
            self.emitter.emit("checkpoint_failed", step=self.step, error=error, errno=errno)


def _frame_numel(param: torch.Tensor, half: torch.dtype | None) -> int:
    """The elements of one payload frame of ``param``'s gradient (in ``half`` for a float32 variable of a mixed
    precision run): the chunks a large variable is stepped in as its gradient arrives (see ``streamed``)."""
    dtype = half if half is not None and param.dtype == torch.float32 else param.dtype
    return protocol.CHUNK_BYTES // torch.empty((), dtype=dtype).element_size()
