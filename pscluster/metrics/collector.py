"""The controller's end of the metrics pipeline: a ZeroMQ PULL socket and a thread.

Runtime tasks send JSON event batches (see ``pscluster.runtime.metrics``); the
collector decodes them and hands each batch (a list of event dicts) to a callback. JSON only: nothing
received is unpickled.
"""

from __future__ import annotations

import json
import threading

import zmq


class Collector:
    """Receives event batches on ``address`` and calls ``on_batch(events)`` for each."""

    def __init__(self, on_batch, host: str = "127.0.0.1", context: zmq.Context | None = None, port: int = 0):
        """``port``: listen there (the address the emitters of a run adopted from another kernel send to);
        0: a free port."""
        self._on_batch = on_batch
        self._sock = (context or zmq.Context.instance()).socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.bad_batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pscluster-collector", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(100):
                    self._dispatch(self._sock.recv())
            while self._sock.poll(0):  # what arrived before close
                self._dispatch(self._sock.recv())
        finally:
            self._sock.close(linger=0)

    def _dispatch(self, raw: bytes) -> None:
        try:
            batch = json.loads(raw)
        except ValueError:
            self.bad_batches += 1
            return
        events = [e for e in batch if isinstance(e, dict)] if isinstance(batch, list) else []
        if events:
            self._on_batch(events)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
