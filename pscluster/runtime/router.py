"""A ZeroMQ ROUTER socket that serves signed requests in one thread: the ps's transport (``ps.ParameterServer``
serves the requests).

Hostile input: every message is checked before it is served (``protocol``: limits, HMAC-SHA256 signature, wire
format, session freshness); one that fails is dropped and counted in ``rejected`` by reason (unsigned,
bad_signature, replayed, malformed), and never reaches a handler. A signed, fresh request of a task the sessions
have fenced off (``protocol.Sessions.fence``) is refused with an ERROR reply that ends it (counted as fenced).
Nothing is unpickled, and nothing is allocated from a size field before it is bounded: ZeroMQ refuses frames over
``max_frame_bytes`` at the transport (``MAXMSGSIZE``, fixed when the socket binds: the protocol's largest frame, a
few MB, whatever the model, as tensors travel in chunks), and a subclass holds each message to the limits it gives
(``_limits``). A message may arrive in parts (``parts``), put together (or streamed, ``_streamed``) before it is
served.

Same host: a worker with a lane may ring a bell (``bells``: two pipes, polled beside the socket) with its lane
requests; each is checked and served as the socket's are, and answered through the bell while the answer fits one
pipe write (else over the socket, to the connection that opened the bell).

A subclass gives ``_HANDLERS`` (op -> method), ``_reply`` (how a request is answered), and may override
``_limits``, ``_streamed``, ``_tick`` (run every ``TICK_S``) and ``_closing`` (before the socket closes).
A handler that raises ProtocolError, KeyError, TypeError or ValueError refuses its request with an ERROR reply
(counted as malformed; ``Refused``, a fair request at the wrong moment, is answered the same way uncounted); any
other exception is counted in ``failed_requests`` and answered the same way: a bad request never takes the server
down.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import Counter

import zmq

from ..errors import FencedOff, MalformedMessage, ProtocolError, Refused
from . import curve, parts, protocol
from .bells import Bells, frame
from .protocol import Flag, Message, Op

POLL_MS = 100
TICK_S = 0.5  # how often ``_tick`` runs
ASSEMBLY_S = 300.0  # a message in parts not whole this long after its head is dropped
REJECTED = ("unsigned", "bad_signature", "replayed", "malformed", "fenced")


class Router(ABC):
    """Serves on ``tcp://host:port`` (port 0: a free port, see ``.port``), its messages signed with ``key``;
    ``encrypt``: as a ZeroMQ CURVE server (see ``curve``). ``max_frame_bytes``: the largest frame it receives."""

    _HANDLERS: dict = {}

    def __init__(self, key: bytes, *, host: str, port: int, context: zmq.Context | None, encrypt: bool,
                 max_frame_bytes: int, name: str):
        self.key = key
        self.max_frame_bytes = max_frame_bytes
        self._name = name
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
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self.bells = Bells(lambda fd: self._poller.register(fd, zmq.POLLIN), self._poller.unregister)
        self.assembling = parts.Assemblies(key)  # by connection identity: messages arriving in parts
        self.rejected: Counter = Counter(dict.fromkeys(REJECTED, 0))  # messages dropped or refused, by reason
        self.failed_requests = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.bell_requests = 0  # messages that came by a bell (``bells``), not the socket
        self.last_request = time.monotonic()  # when the last authenticated request arrived
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------
    def start(self):
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, name=self._name, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        last_tick = 0.0
        try:
            while not self._stop.is_set():
                for ready, _ in self._poller.poll(POLL_MS):
                    if ready is self._sock:
                        self._handle(protocol.receive(self._sock, protocol.DEFAULT_LIMITS.max_frames + 1))
                    else:
                        self._ring(ready)
                if time.monotonic() - last_tick >= TICK_S:
                    last_tick = time.monotonic()
                    self._tick()
        finally:
            self._closing()
            self.bells.close_all()
            self._sock.close(linger=0)

    def _tick(self) -> None:
        self.rejected["malformed"] += self.assembling.drop_older_than(ASSEMBLY_S)

    def _closing(self) -> None:  # noqa: B027 - a subclass may have nothing to close
        pass

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- receiving -----------------------------------------------------------------
    def _handle(self, frames) -> None:
        """Check one received message (identity frame first) and serve it, or drop and count it."""
        if frames is None:
            self.rejected["malformed"] += 1  # more frames than any message has: not even kept
            return
        identity, body = frames[0].bytes, frames[1:]
        frames.clear()  # body alone holds the payload frames, which decode lets go of as it copies them
        self._take(identity, body)

    def _ring(self, fd: int) -> None:
        """Serve the messages a bell (``bells``) brought: each a whole message, checked as the socket's are."""
        found = self.bells.at(fd)
        if found is None:
            return
        identity, bell = found
        try:
            messages = bell.receive()
        except MalformedMessage:
            self.rejected["malformed"] += 1
            messages = []
        if bell.closed:  # its worker ended, or it broke the framing
            self.bells.close(bell)
        self.bell_requests += len(messages)
        for body in messages:
            self._take(identity, body, whole=True)

    def _take(self, identity: bytes, body: list, *, whole: bool = False) -> None:
        """Check one received message (its frames ``body``, from ``identity``) and serve it, or drop and count
        it. ``whole``: a message in parts, or a part, is refused (a bell's: see ``bells``)."""
        self.bytes_in += sum(len(f) for f in body)
        if parts.is_part(body):
            if whole:
                self.rejected["malformed"] += 1
            else:
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
        if msg.flags & Flag.PARTS and whole:
            self.rejected["malformed"] += 1
            return
        if msg.flags & Flag.PARTS:  # served once its parts are in (one message in parts per connection)
            self.assembling.open(identity, msg, body[0], self._streamed(msg))
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
        """What a message (its frames ``body``) may hold."""
        return protocol.DEFAULT_LIMITS

    def _streamed(self, head: Message):
        """What takes the payloads of a message in parts as they arrive (see ``parts.Assemblies.open``), or None."""
        return None

    def _serve(self, identity: bytes, msg: Message) -> None:
        self.last_request = time.monotonic()
        handler = self._HANDLERS.get(msg.op)
        try:
            if handler is None:
                raise MalformedMessage(f"op {msg.op.name} is not a request")
            handler(self, identity, msg)
        except Refused as e:  # a fair request at the wrong moment: answered, not counted
            self._error(identity, msg, str(e))
        except (ProtocolError, KeyError, TypeError, ValueError) as e:  # the request does not fit: refused
            self.rejected["malformed"] += 1
            self._error(identity, msg, f"{msg.op.name} refused: {e}" if not isinstance(e, ProtocolError) else str(e))
        except Exception as e:  # a bad request must never take the server down
            self.failed_requests += 1
            self._error(identity, msg, f"{msg.op.name} failed: {type(e).__name__}: {e}")

    # --- sending -------------------------------------------------------------------
    def _send(self, identity: bytes, msg: Message, tags: protocol.PayloadTags | None = None, *,
              track: bool = False):
        """Send ``msg``; with ``track``, a zmq.MessageTracker that is done once ZeroMQ is done with every frame
        sent without a copy (pyzmq's ``send_multipart`` tracks its last frame only)."""
        bell, identity = self.bells.route(identity)
        if bell is not None and not track and msg.nbytes() <= parts.PART_BYTES:
            frames = protocol.encode(msg, self.key, tags)
            framed = frame(frames)
            if framed is not None and bell.send(framed):
                self.bytes_out += len(framed)
                return None
            if bell.closed:  # its worker is gone
                self.bells.close(bell)
        trackers = []
        for frames in parts.messages(msg, self.key, tags):
            self.bytes_out += sum(memoryview(f).nbytes for f in frames)
            if not track:
                self._sock.send_multipart([identity, *frames], copy=False)
                continue
            trackers += [self._sock.send(f, zmq.SNDMORE, copy=False, track=True) for f in [identity, *frames[:-1]]]
            trackers.append(self._sock.send(frames[-1], copy=False, track=True))
        return zmq.MessageTracker(*trackers) if track else None

    @abstractmethod
    def _reply(self, identity: bytes, req: Message, op: Op, *, meta: dict | None = None) -> None:
        """Answer ``req`` with ``op`` (a subclass adds what its answers carry)."""

    def _error(self, identity: bytes, req: Message, text: str) -> None:
        self._reply(identity, req, Op.ERROR, meta={"error": text})
