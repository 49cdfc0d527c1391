"""PSClient: a worker's (or the controller's) connection to every ps task.

Requests to several ps tasks are all sent before any reply is awaited; each reply is matched by its session and
request id (see ``protocol``), and every wait has a timeout. A ps whose connection drops (its process died, or
ZeroMQ heartbeats went unanswered for ``HEARTBEAT_TIMEOUT_MS``), or that refuses the handshake (one side
encrypted and not the other), fails the requests waiting on it at once with PeerLost instead of at the timeout;
a send that ZeroMQ cannot queue (a connection the handshake ended) fails within the timeout. A worker on the same
host as a ps moves its dense values through a shared-memory lane (``share``, see ``lanes``), and its lane
requests and their replies through a bell beside it (``bells``: pipes, which wake the thread waiting on them). A
request may also leave in parts as its payloads become ready (``open``: a sync worker's push during backward, see
``overlap``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import ConfigError, PeerLost, ProtocolError, RunOver, RuntimeTimeout, StaleTask, TrainingError
from ..spec import ClusterSpec
from . import curve, host_copies, parts, protocol
from .bells import Bell, frame
from .lanes import Lane, LaneError, value_set
from .options import DEFAULTS
from .protocol import Flag, Message, Op

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# refused connection attempts (100 ms apart) before a ps counts as lost: a listening port never refuses, so one that
# does is of a ps that died (before this client connected: no connection to drop), and its run's recovery waits on it
CONNECT_RETRIES = 3
_LANE_OPS = (Op.PULL, Op.PUSH, Op.PUSH_PULL)
_HANDSHAKE_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


@dataclass
class Pending:
    """Requests sent and not answered yet: ps index -> (request id, session nonce)."""

    op: Op
    requests: dict[int, tuple[int, bytes]]


@dataclass
class Opened:
    """A request sent in parts as its payloads become ready (``PSClient.open``): ``part(payloads)`` sends the
    next payload frames (``protocol.payload_frames``, in the message's order); ``message``: what its head
    described."""

    part: Callable[[list], None]
    message: Message


@dataclass
class Reply:
    """What the ps tasks answered to one request, merged."""

    step: int          # ps 0's step: the global step
    flags: Flag        # union of every ps's flags
    value: int         # ps 0's value (staleness for pushes)
    wait_s: float      # the longest a ps held the request (sync: waiting for other replicas)
    messages: list[Message]


_NO_CONNECTION = ("it has no connection with this client (the handshake failed: is one of them encrypted "
                  "and not the other?), or it was lost")


def _lost(event: int, op: Op) -> str:
    """What monitor ``event`` of a ps's socket, seen during ``op``, says happened to the ps."""
    if event == zmq.EVENT_CONNECT_RETRIED:
        return f"refuses connections during {op.name}: it was lost"
    if event & _HANDSHAKE_REFUSED:
        return (f"refused this client's handshake during {op.name}: start both with the same encrypt setting "
                "and secret (PSCLUSTER_SECRET)")
    return f"disconnected during {op.name}: it was lost"


def _answers(reply: Message, request_id: int, nonce: bytes, *, hello: bool) -> bool:
    """Whether ``reply`` answers the request sent with ``request_id`` and ``nonce``: in the same session, or
    for a HELLO, to the same challenge (the ps adds its session tag)."""
    if reply.request_id != request_id:
        return False
    if hello:
        return reply.nonce[:protocol.NONCE_SIZE // 2] == nonce[:protocol.NONCE_SIZE // 2]
    return reply.nonce == nonce


class PSClient:
    """Request/reply to all ps tasks of ``spec`` over one DEALER socket per ps (CURVE-encrypted when
    ``spec.encrypt``); the constructor opens a session with each ps (HELLO)."""

    def __init__(self, spec: ClusterSpec, *, task: int = protocol.NO_TASK, run_id: int = 0,
                 timeout: float = DEFAULTS.request_timeout, context: zmq.Context | None = None,
                 only: list[int] | None = None, pinned: bool = False):
        """``only``: connect to these ps tasks alone (the survivors, when one was lost). ``pinned``: replies that
        arrive in parts are assembled in page-locked memory (a CUDA worker's: from there they go to the GPU
        without waiting, see ``host_copies``)."""
        self.spec = spec
        self.task = task
        self.timeout = timeout
        self.run_id = run_id  # the run every request is about
        self.bytes_sent = 0
        self.bytes_received = 0
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)  # request ids: increasing on every connection, as each session requires
        self._nonces: dict[int, bytes] = {}  # ps index -> the session it opened for us
        self._max_frame: dict[int, int] = {}  # ps index -> the largest frame it receives (its HELLO says)
        self._socks, self._monitors, self._index = {}, {}, {}  # ps index -> socket, socket -> ps index
        self._refused: dict[int, int] = {}  # ps index -> connection attempts refused
        self._lanes: dict[int, Lane] = {}  # ps index -> the shared-memory lane of its session
        self._bells: dict[int, Bell] = {}  # ps index -> the bell its lane's requests ring (see ``bells``)
        self._bell_of: dict[int, int] = {}  # a bell's pipe, polled -> its ps index
        self._assembling = parts.Assemblies(spec.key, pinned)  # by ps index: replies arriving in parts
        self._destination: Callable[[int], torch.Tensor | None] | None = None  # see receive_into
        self._poller = zmq.Poller()
        for ps in spec.ps if only is None else [spec.ps[i] for i in only]:
            s = protocol.configure(self._ctx.socket(zmq.DEALER))
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            s.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))  # a DEALER whose connection a failed handshake
            if spec.encrypt:                                  # ended blocks its sends until this
                curve.make_client(s, spec.key)
            monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | _HANDSHAKE_REFUSED)
            s.connect(ps.address)
            self._socks[ps.index] = s
            self._index[s] = ps.index
            self._monitors[monitor] = ps.index
            self._poller.register(s, zmq.POLLIN)
            self._poller.register(monitor, zmq.POLLIN)
        try:
            self.hello()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for s, monitor in zip(self._socks.values(), self._monitors):
            s.disable_monitor()
            monitor.close(linger=0)
            s.close(linger=0)
        self._socks, self._monitors, self._index = {}, {}, {}
        for lane in self._lanes.values():
            lane.unpin()
        self._lanes = {}
        for i in list(self._bells):
            self._drop_bell(i)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- one round trip to a set of ps tasks ------------------------------------------
    def request(self, op: Op, per_ps: dict[int, tuple[list[int], list[torch.Tensor]]] | None = None, *,
                step: int = 0, meta: dict | list | None = None, targets=None,
                timeout: float | None = None) -> list[Message]:
        """Send ``op`` to ``targets`` (default: every ps), then collect one reply from each.

        ``per_ps`` maps a ps index to the (ids, tensors) it receives; ``meta`` is a dict sent
        to all or a list with one dict per ps.
        """
        return self.collect(self.send(op, per_ps, step=step, meta=meta, targets=targets), timeout=timeout)

    def send(self, op: Op, per_ps: dict[int, tuple[list[int], list[torch.Tensor]]] | None = None, *,
             step: int = 0, meta: dict | list | None = None, targets=None,
             opened: dict[int, "Opened"] | None = None) -> "Pending":
        """The first half of ``request``: send, and return what ``collect`` waits for. In between, the caller
        may do other work (not with this client, nor with the tensors it sent). ``opened``: requests to some of
        the targets sent already, in parts (``open``), whose replies are awaited with the others'."""
        targets = list(self._socks) if targets is None else targets
        opened = opened or {}
        copies = host_copies.Copies()  # a CUDA worker's tensors, copied to the host all at once
        messages = {}
        for i in (i for i in targets if i not in opened):
            nonce = protocol.challenge() if op is Op.HELLO else self._nonces[i]
            ids, tensors = (per_ps or {}).get(i, ([], []))
            m = meta[i] if isinstance(meta, list) else meta
            flags, ids, tensors = self._into_lane(i, op, ids, tensors, m, copies)
            messages[i] = Message(op=op, flags=flags, task=self.task, run_id=self.run_id, request_id=next(self._ids),
                                  step=step, ids=ids, tensors=[copies.to_host(t) for t in tensors], meta=m,
                                  nonce=nonce)
        copies.wait()
        pending = {}
        for i, msg in messages.items():
            if not self._ring(i, msg):
                for frames in parts.messages(msg, self.spec.key):
                    self._send_frames(i, op, frames)
            pending[i] = (msg.request_id, msg.nonce)
        for i, request in opened.items():
            pending[i] = (request.message.request_id, request.message.nonce)
        return Pending(op, pending)

    def open(self, i: int, op: Op, ids: list[int], like: list[torch.Tensor], *, step: int = 0) -> "Opened":
        """A request to ps ``i`` whose payloads leave part by part as the caller has them (``Opened.part``): its
        head goes now, described by ``like`` (tensors with the payloads' shapes and dtypes: on the meta device
        will do). ``send(..., opened={i: it})`` awaits its reply once every payload has gone; until then, no other
        request to ps ``i``."""
        msg = Message(op=op, flags=Flag.NONE, task=self.task, run_id=self.run_id, request_id=next(self._ids),
                      step=step, ids=list(ids), tensors=list(like), meta=None, nonce=self._nonces[i])
        writer = parts.Writer(msg, self.spec.key)
        self._send_frames(i, op, writer.head)
        return Opened(lambda payloads: self._send_frames(i, op, writer.part(payloads)), msg)

    def receive_into(self, destination: Callable[[int], torch.Tensor | None] | None) -> None:
        """Where the values of a reply in parts are written as its parts arrive: ``destination(variable id)``
        gives a contiguous CPU tensor of the variable's shape and dtype (or None: memory of the reply's own), which
        becomes the reply's tensor. Only replies to the request awaited are written there, and only once their
        head is checked; a reply cut off midway leaves those tensors holding part of it. None: no destinations."""
        self._destination = destination

    def _destinations(self, head: Message, request: tuple[int, bytes] | None) -> dict[int, torch.Tensor] | None:
        """``receive_into``'s tensors for the payloads of ``head`` (a reply in parts), by position: none unless it
        answers ``request``, the one awaited from its ps."""
        if self._destination is None or request is None or not _answers(head, *request, hello=False):
            return None
        into = {}
        for k, (vid, like) in enumerate(zip(head.ids, head.tensors)):
            t = self._destination(vid)
            if (t is not None and t.shape == like.shape and t.dtype == like.dtype and t.device.type == "cpu"
                    and t.is_contiguous()):
                into[k] = t
        return into

    def has_lane(self, i: int) -> bool:
        """Whether this client's dense values to and from ps ``i`` go through a shared-memory lane."""
        return i in self._lanes

    def gradient_slots(self, i: int) -> dict[int, torch.Tensor]:
        """The slots of ps ``i``'s lane that a push's dense values go into, by variable id, page-locked for
        copies from a GPU ({} without a lane). A push may hand a slot itself as its tensor (nothing is copied):
        written only once the previous request's reply has come."""
        lane = self._lanes.get(i)
        if lane is None:
            return {}
        lane.pin()
        return dict(zip(lane.ids, lane.grads))

    def _send_frames(self, i: int, op: Op, frames: list) -> None:
        sizes = [memoryview(f).nbytes for f in frames]
        if max(sizes) > self._max_frame.get(i, max(sizes)):
            raise ConfigError(f"a frame of {max(sizes)} bytes for ps {i}, which receives at most "
                              f"{self._max_frame[i]}: start it with max_frame_bytes of at least "
                              f"{protocol.MAX_FRAME_BYTES} (the largest frame the protocol sends)")
        self.bytes_sent += sum(sizes)
        try:
            self._socks[i].send_multipart(frames, copy=False)
        except zmq.Again:
            raise PeerLost(f"ps {i} at {self.spec.ps[i].address} took no {op.name} within {self.timeout:.0f}s: "
                           f"{_NO_CONNECTION}") from None

    def collect(self, sent: "Pending", timeout: float | None = None) -> list[Message]:
        """The second half of ``request``: one reply from each ps ``sent`` went to, in ps order."""
        op, pending = sent.op, sent.requests
        replies: dict[int, Message] = {}
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while len(replies) < len(pending):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(pending) - set(replies))
                raise RuntimeTimeout(f"no reply to {op.name} from ps {missing} within "
                                     f"{self.timeout if timeout is None else timeout:.0f}s: "
                                     "check that the ps tasks are alive")
            for sock, _ in self._poller.poll(int(left * 1000) + 1):
                if sock in self._monitors:
                    i = self._monitors[sock]
                    event = recv_monitor_message(sock)["event"]
                    if event == zmq.EVENT_CONNECT_RETRIED:  # a ps that died before we connected
                        self._refused[i] = self._refused.get(i, 0) + 1
                        if self._refused[i] < CONNECT_RETRIES:
                            continue
                    if i in pending and i not in replies:
                        raise PeerLost(f"ps {i} at {self.spec.ps[i].address} {_lost(event, op)}")
                    continue
                if sock in self._bell_of:
                    i = self._bell_of[sock]
                    arrived = self._bells[i].receive()
                    if self._bells[i].closed:
                        self._drop_bell(i)  # the ps closed it (or ended: its socket's monitor tells)
                else:
                    i = self._index[sock]
                    arrived = [sock.recv_multipart(copy=False)]
                for frames in arrived:
                    msg = self._receive(i, frames, pending.get(i))
                    if msg is None:
                        continue  # a head, or a part, of a message in parts not yet whole
                    if i not in pending or not _answers(msg, *pending[i], hello=op is Op.HELLO):
                        continue  # a late reply to a request that timed out earlier
                    replies[i] = self._answer(i, op, msg)
        return [replies[i] for i in sorted(replies)]

    def _answer(self, i: int, op: Op, msg: Message) -> Message:
        """Ps ``i``'s answer ``msg`` to ``op``, its lane's values in front; raises what an ERROR answer says."""
        if msg.flags & Flag.SHARED:
            self._from_lane(i, msg)
        if op is Op.HELLO and msg.op is Op.OK:
            self._nonces[i] = msg.nonce
            self._max_frame[i] = int((msg.meta or {}).get("max_frame_bytes", 0)) or 2**63
        if msg.op is Op.ERROR:
            meta = msg.meta or {}
            error = StaleTask if meta.get("fenced") else RunOver if meta.get("over") else TrainingError
            raise error(f"ps {i}: {meta.get('error', 'error')}")
        return msg

    def _receive(self, i: int, frames: list, request: tuple[int, bytes] | None) -> Message | None:
        """The message of ``frames`` from ps ``i``, or None while a message in parts is not yet whole (its head, or
        one of its parts, came). ``request``: the one awaited from ps ``i`` (see ``receive_into``)."""
        self.bytes_received += sum(len(f) for f in frames)
        if parts.is_part(frames):  # none open: the rest of a message whose head was refused (that raised)
            return self._assembling.take(i, frames) if i in self._assembling else None
        msg = protocol.decode(frames, self.spec.key, release=True)
        if msg.flags & Flag.PARTS:
            self._assembling.open(i, msg, frames[0], into=self._destinations(msg, request))
            return None
        return msg

    def _into_lane(self, i: int, op: Op, ids: list[int], tensors: list[torch.Tensor], meta,
                   copies: host_copies.Copies):
        """The flags, ids and tensors of a request to ps ``i``: with its lane, the dense values (the first
        ones, in the lane's order) are copied into the lane (by ``copies``; the lane page-locked first when they
        come from a GPU), the rest go in frames."""
        lane = self._lanes.get(i)
        if lane is None or op not in _LANE_OPS or (meta or {}).get("all") or (meta or {}).get("frozen"):
            return Flag.NONE, ids, tensors
        if lane.pinned:
            copies.fence()  # the ps writes the lane's values, which the GPU may still be reading
        flags = lane.flags()
        if op is Op.PULL:
            return flags, ids, tensors
        n = len(lane.ids)
        if ids[:n] != lane.ids:
            return Flag.NONE, ids, tensors
        if any(t.is_cuda for t in tensors[:n]):
            lane.pin()
        with torch.no_grad():
            for slot, t in zip(lane.grads, tensors[:n]):
                if t is not slot:
                    copies.into(slot, t)
        self.bytes_sent += lane.nbytes
        return flags, ids[n:], tensors[n:]

    def _from_lane(self, i: int, msg: Message) -> None:
        """Put the dense values a reply left in the lane (the set it names) in front of its other tensors."""
        lane = self._lanes.get(i)
        if lane is None:
            raise ProtocolError(f"ps {i} answered through a shared-memory lane this client does not have")
        slot = value_set(msg.flags)
        if slot == lane.held:
            raise ProtocolError(f"ps {i} wrote its values into the lane's set that the model holds")
        msg.ids = lane.ids + msg.ids
        msg.tensors = lane.values[slot] + msg.tensors
        self.bytes_received += lane.nbytes

    def hold(self, held: dict[int, int]) -> None:
        """The model has taken the values of these lanes' sets as its memory (ps index -> 0 or 1: the set of
        ``Flag.SECOND``, see ``lanes``): later requests to those ps tasks ask for their values in the other set."""
        for i, slot in held.items():
            if i in self._lanes:
                self._lanes[i].held = slot

    @staticmethod
    def merge(messages: list[Message]) -> Reply:
        flags = Flag.NONE
        for m in messages:
            flags |= m.flags
        return Reply(step=messages[0].step, flags=flags, value=messages[0].value,
                     wait_s=max(m.wait_us for m in messages) / 1e6, messages=messages)

    # --- the operations -------------------------------------------------------------------
    def hello(self) -> None:
        """Open a session with every ps (see ``protocol``); a ps of another protocol version, or one that holds
        another secret, does not answer."""
        try:
            self.request(Op.HELLO, timeout=min(self.timeout, 30.0))
        except ProtocolError as e:
            raise ProtocolError(f"ps handshake failed: {e}") from None

    def init(self, run_id: int, per_ps: dict, configs: list[dict]) -> None:
        """The chief's INIT: variables with their initial values and the run's config, per ps."""
        self.run_id = run_id
        self.request(Op.INIT, per_ps, meta=configs)

    def share(self, reply: Reply, note: Callable[[str], None] | None = None) -> list[int]:
        """Open a shared-memory lane (see ``lanes``) with every ps on this host, laid out as the dense values
        of ``reply`` (a pull's), and a bell beside it (see ``bells``): later pushes and pulls move those values
        through the lane and ring the bell. Returns the ps indices with a lane; the others (on other hosts, or
        where there is no shared memory) go on over the socket. ``note(line)``: told why, when this process could
        make no lane (no room in shared memory...)."""
        lanes, bells = {}, {}
        for i, msg in zip(sorted(self._socks), reply.messages):
            if msg.tensors and i not in self._lanes:
                try:
                    lanes[i] = Lane.for_tensors(msg.ids, msg.tensors)
                except LaneError as e:
                    if note is not None:
                        note(f"the values go over the socket: {e}")
                    break  # no shared memory for this process: none for the others either
                try:
                    bells[i] = Bell.make()
                except LaneError:
                    pass  # the lane without a bell: its requests go over the socket
        if lanes:
            meta = [None] * (max(lanes) + 1)
            for i, lane in lanes.items():
                meta[i] = lane.request() | ({"bell": bells[i].request()} if i in bells else {})
            try:
                answers = self.request(Op.SHARE, targets=sorted(lanes), meta=meta)
            finally:
                for lane in lanes.values():
                    lane.unlink()
                for bell in bells.values():
                    bell.unlink()
            for i, answer in zip(sorted(lanes), answers):
                if answer.value == 1:
                    self._lanes[i] = lanes[i]
                    if i in bells and (answer.meta or {}).get("bell"):
                        self._add_bell(i, bells.pop(i))
        for bell in bells.values():
            bell.close()
        return sorted(self._lanes)

    def _add_bell(self, i: int, bell: Bell) -> None:
        if i in self._bells:
            self._drop_bell(i)
        self._bells[i] = bell
        self._bell_of[bell.fileno()] = i
        self._poller.register(bell.fileno(), zmq.POLLIN)

    def _drop_bell(self, i: int) -> None:
        bell = self._bells.pop(i)
        self._poller.unregister(bell.fileno())
        del self._bell_of[bell.fileno()]
        bell.close()

    def _ring(self, i: int, msg: Message) -> bool:
        """Send ``msg`` (a whole lane request) to ps ``i`` by its bell; False when it goes over the socket (no bell,
        another op, too large, the pipe full)."""
        bell = self._bells.get(i)
        if bell is None or msg.op not in _LANE_OPS or msg.nbytes() > parts.PART_BYTES:
            return False
        framed = frame(protocol.encode(msg, self.spec.key))
        if framed is None or not bell.send(framed):
            if bell.closed:  # the ps closed it
                self._drop_bell(i)
            return False
        self.bytes_sent += len(framed)
        return True

    def pull(self, attempt: int | None = None) -> Reply | None:
        """Current parameters, or None while the chief has not initialized the run (its ``attempt``); a reply
        flagged STOPPED with no values when the run was stopped before its chief initialized it."""
        msgs = self.request(Op.PULL, meta=None if attempt is None else {"attempt": attempt})
        if any(m.op is Op.NOT_READY for m in msgs):
            if any((m.meta or {}).get("stopped") for m in msgs):
                return Reply(step=0, flags=Flag.STOPPED, value=0, wait_s=0.0, messages=[])
            return None
        return self.merge(msgs)

    def pull_all(self) -> Reply | None:
        """Every variable, sparse ones whole (the controller's pull of the trained parameters)."""
        msgs = self.request(Op.PULL, meta={"all": True})
        if any(m.op is Op.NOT_READY for m in msgs):
            return None
        return self.merge(msgs)

    def pull_frozen(self) -> Reply:
        """The frozen parameters (a worker's, once: they never change)."""
        return self.merge(self.request(Op.PULL, meta={"frozen": True}))

    def pull_rows(self, per_ps: dict) -> Reply:
        """Rows of sparse variables: ``per_ps`` maps a ps index to (variable ids, row index tensors)."""
        return self.merge(self.request(Op.PULL_ROWS, per_ps, targets=sorted(per_ps)))

    def push(self, step: int, per_ps: dict) -> Reply:
        return self.merge(self.request(Op.PUSH, per_ps, step=step))

    def push_pull(self, step: int, per_ps: dict, *, meta: dict | None = None) -> Reply:
        """Push gradients computed on ``step`` and get the parameters after they were applied. ``meta``: what goes
        with the gradients (``{"groups": [options of each group]}``: the update's optimizer options, see ps)."""
        return self.start_push_pull(step, per_ps, meta=meta)()

    def start_push_pull(self, step: int, per_ps: dict, opened: dict[int, Opened] | None = None, *,
                        meta: dict | None = None):
        """``push_pull`` in two halves: sends now, and returns a function that waits for the reply. ``opened``:
        the pushes to some ps tasks, sent already in parts (``open``)."""
        sent = self.send(Op.PUSH_PULL, per_ps, step=step, opened=opened, meta=meta)
        return lambda: self.merge(self.collect(sent))

    def stats(self) -> list[dict]:
        return [m.meta or {} for m in self.request(Op.STATS)]

    def stop(self, at_step: int | None = None, *, attempt: int | None = None) -> int:
        """End the run now, or once every ps has applied step ``at_step``; returns the (highest) step a ps
        ends on. ``attempt``: end only that attempt of the run (a failed one), not the next."""
        meta = {k: v for k, v in (("at_step", at_step), ("attempt", attempt)) if v is not None}
        return max(m.value for m in self.request(Op.STOP, meta=meta or None))

    def close_run(self) -> None:
        """Tell every ps the run is over for good (its supervisor has finalized it): a ps serving one run, a
        script's, ends."""
        self.request(Op.STOP, meta={"closed": True})

    def park(self) -> int:
        """Every ps holds pushes from its current step on (the first half of a clean stop); returns the
        highest step a ps parked at: ``stop(at_step=that)`` ends every ps on it."""
        return max(m.value for m in self.request(Op.STOP, meta={"hold": True}))

    def checkpoint(self, step: int | None = None) -> bool:
        """Every ps writes its shard of ``step`` when it gets there (None: now, at its current step); False when
        a ps does not hold the run (yet): it was asked nothing."""
        return not any(m.op is Op.NOT_READY for m in self.request(Op.CHECKPOINT, meta={"step": step}))

    def lost_workers(self, workers: list[int]) -> None:
        """Tell every ps that ``workers`` are lost: sync and SSP stop waiting for them."""
        self.request(Op.MEMBERSHIP, meta={"lost": list(workers)})

    def resize(self, workers: int, replicas: int) -> None:
        """Tell every ps that the run has ``workers`` workers now (added ones count from their first request,
        removed ones are told to stop), and that sync aggregates ``replicas`` gradients per step."""
        self.request(Op.MEMBERSHIP, meta={"workers": workers, "replicas": replicas})

    def shutdown(self, timeout: float = 5.0) -> None:
        self.request(Op.SHUTDOWN, timeout=timeout)
