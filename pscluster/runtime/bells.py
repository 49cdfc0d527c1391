"""Doorbells: a worker with a shared-memory lane (``lanes``) sends its lane requests, and gets their replies,
through a pair of named pipes instead of ZeroMQ, which hands every message to an I/O thread on each side (two
thread wake-ups a message, the largest part of a same-host round trip on a busy host). A pipe wakes the one thread
blocked on it.

A bell carries whole protocol messages, each signed and checked as on the socket: ``frame`` puts a message's frames
into one pipe write of at most ``PIPE_BUF`` bytes (the kernel hands such a write to the reader whole, never mixed
with another); a message that does not fit goes over ZeroMQ as before. Only lane requests ring (PULL, PUSH,
PUSH_PULL: the hot path, a few hundred bytes each); control stays on the socket.

Opening one: the client makes both pipes under random names in ``lanes.SHM_DIR`` (mode 0600), opens its ends
(without waiting for the other side: every end is opened non-blocking), and names them in its SHARE request
beside the lane's segments. The ps opens its ends only if they are pipes of this user, and answers whether it did;
both sides then unlink the names. A ps reads a request pipe until its writer is gone (the worker ended): then the
bell closes. A client whose reply pipe ends (the ps ended, or closed the bell) goes on over the socket; a lost ps
is still the socket's to tell (its monitor). The reader of a pipe checks its framing: bytes that are not whole
frames end the bell, counted as malformed, and never its reader's loop.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import select
import stat
import struct
from collections import OrderedDict

from ..errors import MalformedMessage
from .lanes import SHM_DIR, LaneError

PIPE_BUF = select.PIPE_BUF  # a pipe write of this many bytes or fewer reaches the reader whole
_LENGTH = struct.Struct("<I")  # a message's bytes, this length included; then each frame as length + bytes
_MAX_FRAMES = 8
_NAME = re.compile(r"pscluster-[0-9a-f]{32}-bell")
MAX_BELLS = 128  # a ps's open bells (two pipes each): the least recently opened goes first


def frame(frames: list) -> bytearray | None:
    """``frames`` as one pipe message, or None when it takes more than ``PIPE_BUF`` bytes (or frames)."""
    views = [memoryview(f) for f in frames]
    size = _LENGTH.size * (1 + len(views)) + sum(v.nbytes for v in views)
    if size > PIPE_BUF or len(views) > _MAX_FRAMES:
        return None
    out = bytearray(_LENGTH.pack(size))
    for v in views:
        out += _LENGTH.pack(v.nbytes)
        out += v
    return out


def _open(name: str, flags: int) -> int:
    """One of a bell's pipes, opened with ``flags``: LaneError unless it is a pipe of this user's."""
    if not _NAME.fullmatch(name):
        raise LaneError(f"{name!r} is not a bell's pipe name")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise LaneError(f"pipe {name}: {e.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISFIFO(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise LaneError(f"{name} is not a pipe of this user's")
    return fd


def _unlink(names) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


class Bell:
    """One side of a doorbell: ``send`` writes a message into the pipe to the other side, ``receive`` reads the
    messages that came from it (``fileno``: the pipe to poll). ``Bell.make()``: the client's side (new pipes);
    ``Bell.attach(request)``: the ps's side of the pipes a SHARE request names."""

    def __init__(self, read_fd: int, write_fd: int, names: tuple[str, str]):
        self._read, self._write = read_fd, write_fd
        self.names = names  # (requests, replies)
        self._pending = bytearray()  # bytes read of a message not yet whole (only a writer that breaks framing)
        self.closed = False

    @classmethod
    def make(cls) -> "Bell":
        names = tuple(f"pscluster-{secrets.token_hex(16)}-bell" for _ in range(2))
        try:
            for name in names:
                os.mkfifo(os.path.join(SHM_DIR, name), 0o600)
            reader = _open(names[0], os.O_RDONLY)  # held while opening for writing, which needs a reader
            try:
                requests = _open(names[0], os.O_WRONLY)
            finally:
                os.close(reader)  # the ps is the reader: once it is gone, a write fails (the pipe is broken)
            try:
                replies = _open(names[1], os.O_RDONLY)
            except LaneError:
                os.close(requests)
                raise
        except OSError as e:
            _unlink(names)
            raise LaneError(f"no bell: {e}") from None
        return cls(replies, requests, names)

    def request(self) -> dict:
        """What a SHARE request carries of the bell: its pipes' names."""
        return {"requests": self.names[0], "replies": self.names[1]}

    @classmethod
    def attach(cls, request) -> "Bell":
        """The ps's side of the pipes ``request`` (``Bell.request``) names; LaneError when they are not there."""
        if not isinstance(request, dict) or not all(isinstance(request.get(k), str) for k in ("requests", "replies")):
            raise LaneError("a bell is named by its requests and replies pipes")
        names = (request["requests"], request["replies"])
        requests = _open(names[0], os.O_RDONLY)
        try:
            replies = _open(names[1], os.O_WRONLY)  # the client holds its read end open: this does not wait
        except LaneError:
            os.close(requests)
            raise
        return cls(requests, replies, names)

    def unlink(self) -> None:
        """Remove the pipes' names (both ends stay open)."""
        _unlink(self.names)

    def fileno(self) -> int:
        return self._read

    def send(self, message) -> bool:
        """Write one ``frame``d message; False when it must go another way: the pipe is full, or its reader is
        gone (the bell is then closed)."""
        try:
            return os.write(self._write, message) == len(message)
        except BlockingIOError:
            return False
        except BrokenPipeError:
            self.close()
            return False

    def receive(self) -> list[list[memoryview]]:
        """The messages (each a list of frames) in the pipe now; [] and ``closed`` once the other side is gone.
        MalformedMessage (the bell is then closed) on bytes that are not whole frames."""
        try:
            chunk = os.read(self._read, 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            self.close()
            return []
        data = memoryview(bytes(self._pending) + chunk) if self._pending else memoryview(chunk)
        messages, at = [], 0
        while len(data) - at >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(data, at)
            if not _LENGTH.size <= size <= PIPE_BUF:
                self.close()
                raise MalformedMessage(f"a bell's message of {size} bytes: at most {PIPE_BUF}")
            if len(data) - at < size:
                break
            messages.append(self._frames(data[at + _LENGTH.size:at + size]))
            at += size
        self._pending = bytearray(data[at:])
        return messages

    def _frames(self, body: memoryview) -> list[memoryview]:
        frames, at = [], 0
        while at < len(body):
            if len(body) - at < _LENGTH.size or len(frames) == _MAX_FRAMES:
                self.close()
                raise MalformedMessage("a bell's message that is not whole frames")
            (n,) = _LENGTH.unpack_from(body, at)
            at += _LENGTH.size
            if n > len(body) - at:
                self.close()
                raise MalformedMessage("a bell's frame longer than its message")
            frames.append(body[at:at + n])
            at += n
        return frames

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._read)
            os.close(self._write)


class Bells:
    """A ps's bells, one per session at most: each answers to an identity of its own (what the server's
    handlers pass to its replies, as a socket's identity), routed back through its bell, or through the socket
    to the session's connection (``route``) when a reply does not fit or the bell is gone. ``register`` and
    ``unregister``: what the server polls."""

    def __init__(self, register, unregister):
        self._register, self._unregister = register, unregister
        self._ids = itertools.count()
        self._by_session: OrderedDict[bytes, Bell] = OrderedDict()  # session nonce -> its bell
        self._by_fd: dict[int, tuple[bytes, Bell]] = {}  # pipe polled -> (its identity, the bell)
        self._routes: OrderedDict[bytes, tuple[Bell, bytes]] = OrderedDict()  # identity -> (bell, socket identity)

    def __len__(self) -> int:
        return len(self._by_session)

    def open(self, nonce: bytes, identity: bytes, request) -> bool:
        """Attach the bell a SHARE request of session ``nonce``, from socket ``identity``, names (replacing the
        session's last one); False when it is not there as named."""
        try:
            bell = Bell.attach(request)
        except LaneError:
            return False  # the client removes its pipes' names whatever the answer
        bell.unlink()
        if nonce in self._by_session:
            self.close(self._by_session.pop(nonce))
        while len(self._by_session) >= MAX_BELLS:
            self.close(self._by_session.popitem(last=False)[1])
        ring = b"\xffbell" + next(self._ids).to_bytes(8, "big")  # never a socket's identity (those start 0x00)
        self._by_session[nonce] = bell
        self._by_fd[bell.fileno()] = (ring, bell)
        self._routes[ring] = (bell, identity)
        while len(self._routes) > 4 * MAX_BELLS:  # a closed bell's route outlives it a while: held replies
            self._routes.popitem(last=False)
        self._register(bell.fileno())
        return True

    def at(self, fd: int) -> tuple[bytes, Bell] | None:
        """The identity and bell of a polled pipe."""
        return self._by_fd.get(fd)

    def route(self, identity: bytes) -> tuple[Bell | None, bytes]:
        """Where a reply to ``identity`` goes: (its open bell or None, the socket identity to use otherwise)."""
        bell, socket_identity = self._routes.get(identity, (None, identity))
        return (None if bell is None or bell.closed else bell), socket_identity

    def close(self, bell: Bell) -> None:
        """Stop polling ``bell`` and close it (its route stays, to the socket)."""
        if self._by_fd.pop(bell.fileno(), None) is not None:
            self._unregister(bell.fileno())
        bell.close()
        for nonce in [n for n, b in self._by_session.items() if b is bell]:
            del self._by_session[nonce]

    def close_all(self) -> None:
        for bell in list(self._by_session.values()):
            self.close(bell)
