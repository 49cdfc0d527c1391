"""Metric events from the runtime to the controller's collector.

Events are small JSON objects, buffered and sent in batches every
``FLUSH_S`` seconds over a ZeroMQ PUSH socket without blocking: when the
collector is slow or absent, events are dropped and counted, and training never
waits for them.
"""

from __future__ import annotations

import json
import time

import zmq

FLUSH_S = 0.25


class MetricsEmitter:
    """Buffers events of one task and sends them in batches; never blocks."""

    def __init__(self, address: str | None, task: str, context: zmq.Context | None = None):
        self.task = task
        self.dropped = 0
        self._buffer: list[dict] = []
        self._last_flush = time.monotonic()
        self._sock = None
        if address:
            self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
            self._sock.setsockopt(zmq.SNDHWM, 100)
            self._sock.setsockopt(zmq.LINGER, 1000)
            self._sock.connect(address)

    def emit(self, kind: str, **fields) -> None:
        """Queue one event; sends the batch when it is due."""
        if self._sock is None:
            return
        self._buffer.append({"kind": kind, "task": self.task, "time": time.time(), **fields})
        if time.monotonic() - self._last_flush >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self._sock is None or not self._buffer:
            return
        batch, self._buffer = self._buffer, []
        self._last_flush = time.monotonic()
        try:
            self._sock.send(json.dumps(batch).encode(), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += len(batch)

    def close(self) -> None:
        self.flush()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
