"""Metric events from the runtime to the controller's collector: the emitter a task sends them with, and the
format and checks of its signed batches (``BatchReceiver``, which the collector opens them with).

Events are small JSON objects, buffered and sent in batches every
``FLUSH_S`` seconds over a ZeroMQ PUSH socket without blocking: when the
collector is slow or absent, events are dropped and counted, and training never
waits for them. A worker's "done" (its summary) goes at once, with what is buffered: the run's end waits for it,
and a script's chief ends its loop, then waits for the run's end, before it closes its emitter.

A batch is signed like a data-plane message (HMAC-SHA256 with the cluster secret, see ``protocol``)::

    [header, json, mac]

``header`` holds a magic, the version, the emitter's random 8-byte id, its run's id and the batch's sequence
number, which grows by one per batch: ``BatchReceiver.open`` refuses an unsigned, wrongly signed, malformed
or replayed batch (a sequence number not after the last one of its emitter), and one of another run than
the receiver's.
"""

from __future__ import annotations

import json
import secrets
import struct
import time
from collections import OrderedDict

import zmq

from ..errors import BadSignature, MalformedMessage, OtherRun, ReplayedMessage, UnsignedMessage
from .protocol import MAC_SIZE, mac, remember

FLUSH_S = 0.25
AT_ONCE = frozenset({"done"})  # the kinds of event sent without waiting for the batch to be due
MAX_BATCH_BYTES = 16 << 20
BATCH_FRAMES = 3  # header, JSON, signature
MAX_EMITTERS = 4096  # emitters whose last sequence number a collector keeps
_MAGIC, _VERSION = b"PSCM", 2
_HEADER = struct.Struct("!4sH8sIQ")


def sign_batch(events: list[dict], key: bytes, emitter: bytes, sequence: int, run_id: int = 0) -> list[bytes]:
    """The frames of one batch of ``events`` of run ``run_id`` from ``emitter`` (8 bytes), number ``sequence``."""
    frames = [_HEADER.pack(_MAGIC, _VERSION, emitter, run_id, sequence), json.dumps(events).encode()]
    return [*frames, mac(key, frames)]


class BatchReceiver:
    """The collector's checks of signed batches; remembers each emitter's last sequence number. ``run_id``:
    the run whose batches it takes (None: any run's)."""

    def __init__(self, key: bytes, run_id: int | None = None):
        self._key = key
        self._run_id = run_id
        self._last: OrderedDict[bytes, int] = OrderedDict()

    def open(self, frames: list[bytes]) -> list:
        """The events of a batch, or a ProtocolError subclass saying why it is refused."""
        if len(frames) != BATCH_FRAMES or len(frames[-1]) != MAC_SIZE:
            raise UnsignedMessage(f"metrics batch of {len(frames)} frames without a signature")
        if not secrets.compare_digest(frames[-1], mac(self._key, frames[:-1])):
            raise BadSignature("metrics batch with a bad signature")
        if len(frames[0]) != _HEADER.size:
            raise MalformedMessage("metrics batch with a malformed header")
        magic, version, emitter, run_id, sequence = _HEADER.unpack(frames[0])
        if (magic, version) != (_MAGIC, _VERSION):
            raise MalformedMessage(f"metrics batch of version {version}: install the same pscluster everywhere")
        if self._run_id is not None and run_id != self._run_id:
            raise OtherRun(f"metrics batch of run {run_id}, not of run {self._run_id}")
        if sequence <= self._last.get(emitter, -1):
            raise ReplayedMessage(f"metrics batch {sequence} of an emitter past it: sent before")
        try:
            events = json.loads(frames[1])
        except (ValueError, RecursionError):
            raise MalformedMessage("metrics batch that is not JSON") from None
        remember(self._last, emitter, sequence, MAX_EMITTERS)
        return events if isinstance(events, list) else []


class MetricsEmitter:
    """Buffers events of one task and sends them in signed batches; never blocks."""

    def __init__(self, address: str | None, task: str, key: bytes, context: zmq.Context | None = None, *,
                 run_id: int = 0):
        """``key``: the cluster secret's bytes (``ClusterSpec.key``), which the collector checks batches with;
        ``run_id``: the run the events are of (its collector takes no other run's)."""
        self.task = task
        self.run_id = run_id
        self.dropped = 0
        self._key = key
        self._id = secrets.token_bytes(8)
        self._sequence = 0
        self._buffer: list[dict] = []
        self._last_flush = time.monotonic()
        self._sock = None
        if address:
            self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
            self._sock.setsockopt(zmq.SNDHWM, 100)
            self._sock.setsockopt(zmq.LINGER, 1000)
            self._sock.connect(address)

    def emit(self, kind: str, **fields) -> None:
        """Queue one event; sends the batch when it is due, or at once for a kind in ``AT_ONCE``."""
        if self._sock is None:
            return
        self._buffer.append({"kind": kind, "task": self.task, "time": time.time(), **fields})
        if kind in AT_ONCE or time.monotonic() - self._last_flush >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self._sock is None or not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        self._last_flush = time.monotonic()
        self._sequence += 1
        try:
            self._sock.send_multipart(sign_batch(batch, self._key, self._id, self._sequence, self.run_id), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += len(batch)

    def close(self) -> None:
        self.flush()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
