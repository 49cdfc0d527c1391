"""The raw pyzmq request/reply that the exchange benchmark measures pscluster against.

    python -m benchmarks.raw_zmq PORT     a REP server: answers each request with as many bytes
"""

from __future__ import annotations

import sys

import numpy as np
import zmq


def serve(port: int) -> None:
    """Answer each request with a preallocated buffer of its size (requests received without a copy); an
    empty request ends it."""
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(f"tcp://127.0.0.1:{port}")
    reply = np.ones(0, dtype=np.uint8)
    while (n := len(sock.recv(copy=False))) > 0:
        if n > len(reply):
            reply = np.ones(n, dtype=np.uint8)
        sock.send(memoryview(reply)[:n], copy=False)
    sock.send(b"")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
