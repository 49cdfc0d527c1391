"""Large messages in parts: the payload of a message of more than ``PART_BYTES`` travels in messages of its own
after the message itself (its head), so that a sender tags each part while ZeroMQ sends the one before it, and a
receiver checks and copies each part while the next one arrives. (ZeroMQ sends a multipart message only once
its last frame is queued, and delivers it only whole: in one message, the tags of every payload run before the
transfer on one side and after it on the other.)

Wire format (see ``protocol`` for the rest):

- The head is a protocol message with ``Flag.PARTS`` and no payload frames: its tensor table describes every
  tensor, its signature covers header, table and json, and its header's salt is the payloads' salt.
- Each part is ``[part header, payload frames..., tags]``: the part header packs ``PART_MAGIC``, the protocol
  version, the head's salt and the index of the part's first payload frame (payload frames are numbered over
  the whole message, as ``protocol.message_payloads`` orders them: the tensors' frames, then the pack);
  ``tags`` holds the 16-byte AES-GMAC tag of each of its payload frames (``protocol.payload_tag``).

A part is checked by its tags: each tag's nonce is made of the head's salt and the frame's index, so a part
verifies only in its own place in its own message, and nobody without the cluster's secret can make a tag that
verifies. A part that arrives without its head, out of order, of the wrong size, or with a tag that does not
verify is refused (``MalformedMessage``, ``BadSignature``) and the message it belonged to is dropped.

Call order: a sender sends every frame list ``messages(msg, key)`` yields, in order, on one socket. A receiver
decodes each message that is not a part (``is_part``) with ``protocol.decode``; a decoded head (``Flag.PARTS``)
opens an ``Assembly`` of the sender's next messages (``Assemblies.open``), and ``Assemblies.take`` feeds it each
part and gives the message once it is whole, its tensors filled in; or, for the tensors a stream takes (a ps's
large variables, see ``streamed``), handed to it payload by payload as they arrive, never put together.
"""

from __future__ import annotations

import hmac
import struct
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from ..errors import BadSignature, MalformedMessage, ProtocolError
from . import protocol
from .protocol import Flag, Message

PART_BYTES = protocol.CHUNK_BYTES  # a message of a larger payload goes in parts of about this size
PART_MAGIC = b"PSCP"
TAG_SIZE = 16
_PART = struct.Struct(f"!4sH{protocol.SALT_SIZE}sI")


def messages(msg: Message, key: bytes, tags: protocol.PayloadTags | None = None) -> Iterator[list]:
    """The frame lists that carry ``msg``, to send in order on one socket: the message itself when its payload is
    ``PART_BYTES`` or less, else its head and then its parts, each part's tags computed as it is yielded.
    ``tags``: those the sender keeps for these payloads (see ``protocol.encode``)."""
    if msg.nbytes() <= PART_BYTES:
        yield protocol.encode(msg, key, tags)
        return
    writer = Writer(msg, key, tags)
    yield writer.head
    for group in _groups(protocol.message_payloads(msg.tensors)):
        yield writer.part(group)


class Writer:
    """The head and then the parts of one message, each part made when its payloads are there: a sender may
    send the head before it has the payloads (the head needs only the tensors' shapes and dtypes: tensors on
    the meta device will do) and each part as soon as it has the payload frames that come next."""

    def __init__(self, msg: Message, key: bytes, tags: protocol.PayloadTags | None = None):
        self._key = key
        self._tags = protocol.PayloadTags() if tags is None else tags
        self._first = 0  # the index of the next part's first payload frame
        self.head = protocol.encode(replace(msg, flags=msg.flags | Flag.PARTS), key,
                                    protocol.PayloadTags(self._tags.salt))

    def part(self, payloads: list) -> list:
        """The frames of the next part, carrying ``payloads``: the payload frames (``protocol.payload_frames``)
        that follow those of the parts before it, in the message's order."""
        tags = b"".join(self._tags.tag(self._key, self._first + k, f) for k, f in enumerate(payloads))
        frames = [_PART.pack(PART_MAGIC, protocol.PROTOCOL_VERSION, self._tags.salt, self._first), *payloads, tags]
        self._first += len(payloads)
        return frames


def _groups(payloads: list) -> Iterator[list]:
    """Consecutive payload frames in groups of ``PART_BYTES`` or less (a frame is never larger)."""
    group, size = [], 0
    for frame in payloads:
        nbytes = memoryview(frame).nbytes
        if group and size + nbytes > PART_BYTES:
            yield group
            group, size = [], 0
        group.append(frame)
        size += nbytes
    if group:
        yield group


def is_part(frames) -> bool:
    """Whether received ``frames`` (``zmq.Frame`` or bytes-like) are a part rather than a protocol message."""
    if not frames:
        return False
    header = frames[0].buffer if hasattr(frames[0], "buffer") else memoryview(frames[0])
    return header.nbytes == _PART.size and bytes(header[:4]) == PART_MAGIC


class Assembly:
    """A message whose head arrived and whose parts are arriving: ``feed`` each part in the order it came."""

    def __init__(self, head: Message, header, key: bytes, stream=None, pinned: bool = False,
                 into: dict[int, torch.Tensor] | None = None):
        """``head``: the decoded head (its tensors described on the meta device); ``header``: its header frame
        (the salt is its last bytes). ``stream``: what takes some tensors' payloads as they arrive instead of
        memory of their own: ``stream.positions``, the positions of those tensors in the message (they stay on
        the meta device in it), and ``stream.take(position, chunk, values)``, called with each of their payload
        frames checked, in order, as a 1-D tensor of the tensor's dtype that lives only during the call.
        ``into``: the caller's memory for some tensors (position -> a contiguous CPU tensor of that tensor's
        shape and dtype), which become the message's tensors and are written as their parts arrive. The other
        tensors get memory here (page-locked with ``pinned``)."""
        self.message = head
        self.started = time.monotonic()
        self._key = key
        self._salt = bytes(memoryview(header.buffer if hasattr(header, "buffer") else header)[-protocol.SALT_SIZE:])
        self._stream = stream
        streamed = stream.positions if stream is not None else ()
        into = into or {}
        offsets, size = protocol.pack_layout(head.tensors)
        pack = torch.empty(size, dtype=torch.uint8, pin_memory=pinned and size > 0)
        in_pack = protocol.Pack(pack)

        def memory(k: int, t: torch.Tensor) -> torch.Tensor:
            if k in streamed:
                return t
            if offsets[k] is not None:
                return in_pack.tensor(offsets[k], t.dtype, t.shape)
            return into[k] if k in into else torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        head.tensors = [memory(k, t) for k, t in enumerate(head.tensors)]
        # per payload frame: (tensor position, chunk of that tensor, the bytes it fills or None when streamed); the
        # pack last, when there is one
        self._slots = [(k, j, slot) for k, t in enumerate(head.tensors) if offsets[k] is None
                       for j, slot in enumerate(_chunk_views(t) if k not in streamed else
                                                [None] * protocol.chunk_count(t.numel() * t.element_size()))]
        if any(offset is not None for offset in offsets):
            self._slots.append((None, 0, pack))
        self._next = 0  # the index of the next payload frame expected

    def feed(self, frames) -> bool:
        """Check part ``frames`` and copy its payloads into the message's tensors (or give them to the stream);
        True once the message is whole. Raises MalformedMessage or BadSignature on a part that does not belong
        here (the payloads before the bad one have been taken)."""
        bufs = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
        if len(bufs) < 3 or bufs[0].nbytes != _PART.size:
            raise MalformedMessage(f"part of {len(bufs)} frames: a header, payloads and their tags expected")
        magic, version, salt, first = _PART.unpack(bufs[0])
        payloads, tags = bufs[1:-1], bytes(bufs[-1])
        if (magic, version) != (PART_MAGIC, protocol.PROTOCOL_VERSION) or salt != self._salt:
            raise MalformedMessage("part of another message or protocol version")
        if first != self._next or first + len(payloads) > len(self._slots):
            raise MalformedMessage(f"part of payloads {first}.. where {self._next} of {len(self._slots)} is next")
        if len(tags) != TAG_SIZE * len(payloads):
            raise MalformedMessage("part whose tags do not match its payloads")
        for k, (frame, (position, chunk, slot)) in enumerate(zip(payloads, self._slots[first:])):
            tensor = self.message.tensors[position] if slot is None else None
            expected = slot.numel() if slot is not None else _chunk_bytes(tensor, chunk)
            if frame.nbytes != expected:
                raise MalformedMessage(f"payload {first + k} of {frame.nbytes} bytes where {expected} belong")
            tag = protocol.payload_tag(self._key, self._salt, first + k, frame)
            if not hmac.compare_digest(tag, tags[k * TAG_SIZE:(k + 1) * TAG_SIZE]):
                raise BadSignature("part with a bad tag: the sender does not hold this cluster's secret")
            if slot is None:
                self._stream.take(position, chunk, torch.frombuffer(frame, dtype=tensor.dtype))
            elif frame.nbytes:
                slot.copy_(torch.frombuffer(frame, dtype=torch.uint8))
        self._next += len(payloads)
        if self._next < len(self._slots):
            return False
        self.message.flags &= ~Flag.PARTS  # whole now: as if it had come in one message
        return True


def _chunk_bytes(t: torch.Tensor, chunk: int) -> int:
    """The size of payload frame ``chunk`` of ``t``."""
    return min(protocol.CHUNK_BYTES, t.numel() * t.element_size() - chunk * protocol.CHUNK_BYTES)


def _chunk_views(t: torch.Tensor) -> list[torch.Tensor]:
    """Byte views of ``t`` (contiguous, allocated by the ``Assembly``) in the payload frames it travels in."""
    data = t.reshape(-1).view(torch.uint8)
    chunk = protocol.CHUNK_BYTES
    return [data[i * chunk:(i + 1) * chunk] for i in range(protocol.chunk_count(data.numel()))]


class Assemblies:
    """The messages arriving in parts, at most one per sender (a ps: per connection; a client: per ps)."""

    def __init__(self, key: bytes, pinned: bool = False):
        """``pinned``: the messages' tensors in page-locked memory (see ``Assembly``)."""
        self._key, self._pinned = key, pinned
        self._open: dict = {}  # sender -> its Assembly

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, sender) -> bool:
        return sender in self._open

    def open(self, sender, head: Message, header, stream=None, into: dict[int, torch.Tensor] | None = None) -> None:
        """Expect the parts of ``head`` (decoded, with ``Flag.PARTS``; ``header``: its header frame) from
        ``sender``, instead of any message of it still unfinished; ``stream``, ``into``: see ``Assembly``."""
        self._open[sender] = Assembly(head, header, self._key, stream, self._pinned, into)

    def take(self, sender, frames) -> Message | None:
        """Part ``frames`` from ``sender`` fed to its message: the message once whole, else None. Raises
        MalformedMessage (no message of ``sender`` open) or what ``Assembly.feed`` raises, and then drops it."""
        assembly = self._open.get(sender)
        try:
            if assembly is None:
                raise MalformedMessage("a part without its message's head on this connection")
            if not assembly.feed(frames):
                return None
        except ProtocolError:
            self._open.pop(sender, None)
            raise
        del self._open[sender]
        return assembly.message

    def drop_older_than(self, seconds: float) -> int:
        """Forget the messages opened more than ``seconds`` ago (a sender that died on the way); how many."""
        now = time.monotonic()
        stale = [sender for sender, a in self._open.items() if now - a.started > seconds]
        for sender in stale:
            del self._open[sender]
        return len(stale)
