"""The controller's end of the metrics pipeline: a ZeroMQ PULL socket and a thread.

Runtime tasks send signed JSON event batches (see ``pscluster.runtime.emitter``); the collector
checks each batch's signature and freshness, and hands the events of every accepted batch (a list
of event dicts) to a callback. A refused batch never reaches the callback: it is counted in
``rejected`` by reason (unsigned, bad_signature, replayed, malformed); one the callback fails on is
counted as ``unrecorded``, and the collector goes on. JSON only: nothing received is unpickled.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import zmq

from ..errors import ProtocolError
from ..runtime.emitter import BATCH_FRAMES, MAX_BATCH_BYTES, BatchReceiver
from ..runtime.protocol import receive

log = logging.getLogger("pscluster.metrics")


class Collector:
    """Receives event batches on ``address`` and calls ``on_batch(events)`` for each."""

    def __init__(self, on_batch, key: bytes, host: str = "127.0.0.1", context: zmq.Context | None = None,
                 port: int = 0, run_id: int | None = None, on_failure=None):
        """``key``: the cluster secret's bytes (``ClusterSpec.key``) the batches are signed with. ``port``: listen
        there (the address the emitters of a run adopted from another kernel send to); 0: a free port.
        ``run_id``: take only that run's batches (counted as ``other_run`` otherwise); None: any run's.
        ``on_failure(exception)``: called if the collector's thread ends on an exception (nothing is received
        after it); None: the exception is logged."""
        self._on_batch = on_batch
        self._on_failure = on_failure
        self._receiver = BatchReceiver(key, run_id)
        self._sock = (context or zmq.Context.instance()).socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.rejected: Counter = Counter()  # refused batches by reason
        self._said = False  # whether close() has told the count of unrecorded batches
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pscluster-collector", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(100):
                    self._dispatch(receive(self._sock, BATCH_FRAMES))
            while self._sock.poll(0):  # what arrived before close
                self._dispatch(receive(self._sock, BATCH_FRAMES))
        except Exception as e:  # never a silent end: whoever records the metrics learns they no longer arrive
            if self._on_failure is None:
                log.error("the metrics collector at %s stopped", self.address, exc_info=True)
            else:
                self._on_failure(e)
        finally:
            self._sock.close(linger=0)

    def _dispatch(self, frames) -> None:
        if frames is None:
            self.rejected["malformed"] += 1  # more frames than a batch has: not even kept
            return
        try:
            batch = self._receiver.open([f.bytes for f in frames])
        except ProtocolError as e:
            self.rejected[e.counter] += 1
            return
        events = [e for e in batch if isinstance(e, dict)]
        if not events:
            return
        try:
            self._on_batch(events)
        except Exception:  # a signed batch whose events could not be recorded: counted, and the loop goes on
            self.rejected["unrecorded"] += 1
            if self.rejected["unrecorded"] == 1:  # the first with its traceback; the others counted, said at close
                log.warning("a metrics batch of %d events could not be recorded (the next ones that cannot are "
                            "counted)", len(events), exc_info=True)

    def close(self, timeout: float = 2.0) -> None:
        """Stop receiving (what arrived is still handed on); say how many batches could not be recorded."""
        self._stop.set()
        self._thread.join(timeout)
        if self.rejected["unrecorded"] > 1 and not self._said:
            self._said = True
            log.warning("%d metrics batches in all could not be recorded", self.rejected["unrecorded"])
