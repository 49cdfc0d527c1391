"""A data-plane peer that speaks the wire format frame by frame: what the hostile-input tests send with.

It holds the cluster key (or another one), opens a session like PSClient does, and can send anything: signed
requests of its choosing, frames it captured earlier, or raw bytes.
"""

from __future__ import annotations

import itertools

import zmq

from pscluster.runtime import parts, protocol
from pscluster.runtime.protocol import Flag, Message, Op


class RawPeer:
    """One DEALER connection to a ps at ``address``, signing with ``key``."""

    def __init__(self, address: str, key: bytes, *, context: zmq.Context | None = None):
        self.key = key
        self.sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.nonce = bytes(protocol.NONCE_SIZE)
        self.ids = itertools.count(1)

    def close(self) -> None:
        self.sock.close(linger=0)

    def hello(self, timeout_ms: int = 5000) -> list:
        """Open a session; returns the HELLO frames it sent (to replay them later)."""
        frames = protocol.encode(Message(op=Op.HELLO, request_id=next(self.ids), nonce=protocol.challenge()),
                                 self.key)
        self.sock.send_multipart(frames)
        reply = self.reply(timeout_ms)
        assert reply is not None and reply.op is Op.OK, reply
        self.nonce = reply.nonce
        return frames

    def signed(self, msg: Message) -> list:
        """``msg`` as the next request of this peer's session, signed."""
        msg.nonce, msg.request_id = self.nonce, next(self.ids)
        return protocol.encode(msg, self.key)

    def send(self, frames) -> None:
        self.sock.send_multipart(frames, copy=False)

    def request(self, msg: Message, timeout_ms: int = 5000) -> Message | None:
        """Send ``msg`` in this session and wait for its reply (None: no reply)."""
        self.send(self.signed(msg))
        return self.reply(timeout_ms)

    def reply(self, timeout_ms: int) -> Message | None:
        """The next message from the ps, put back together when it comes in parts (None: none came)."""
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        msg = protocol.decode(frames, self.key)
        if not msg.flags & Flag.PARTS:
            return msg
        assemblies = parts.Assemblies(self.key)
        assemblies.open(None, msg, frames[0])
        while self.sock.poll(timeout_ms):
            if (whole := assemblies.take(None, self.sock.recv_multipart(copy=False))) is not None:
                return whole
        return None

    def drain(self) -> int:
        """Read and count the replies waiting."""
        n = 0
        while self.sock.poll(0):
            self.sock.recv_multipart(copy=False)
            n += 1
        return n
