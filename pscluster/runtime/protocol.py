"""The data-plane wire format and its authentication: one module, no pickle.

A message is a list of ZeroMQ frames::

    [header, table, json, payload frames..., mac]

``header`` is a fixed struct (magic, protocol version, op, flags, task, run id, session nonce,
request id, step, value, wait in microseconds, tensor count, payload salt); ``table`` describes each tensor
(variable id, dtype code, whether it is packed, shape); ``json`` is a UTF-8 JSON object for the few control
messages that carry structured data (empty otherwise). The payload frames follow (``message_payloads``): each
tensor's raw bytes in ``CHUNK_BYTES`` frames (the last one shorter; one empty frame for an empty tensor), sent
without a copy from ``COPY_LIMIT`` bytes up (smaller ones are copied into ZeroMQ's message as they are sent: see
``configure``), but for the tensors the table marks packed; then, when there are any, the pack, which holds the
raw bytes of every packed tensor in table order, each from a multiple of ``PACK_ALIGN`` bytes. Which tensors
are packed follows from their sizes alone (``pack_layout``: those of at most ``PACK_LIMIT`` bytes, while the
pack stays within ``CHUNK_BYTES``), so a message in parts can be described before its payloads exist: a model's
many small tensors (biases, norms, their buffers) cost one frame and one tag, not one each, and a receiver
reads each as a view of the pack. No frame is larger than
``MAX_FRAME_BYTES``, whatever the model, so a receiver refuses larger ones at the transport (ZeroMQ's
``MAXMSGSIZE``) before holding any of their bytes. ``mac`` is HMAC-SHA256 with the per-cluster secret as
key over the header, table and json frames and, for each payload frame, its tag, each of these items
preceded by the length of its frame (so frame boundaries are signed too). A payload's tag is AES-GMAC (AES-GCM
authenticating the frame, encrypting nothing) under a key derived from the secret, with a nonce made of the
header's random 96-bit salt and the payload's index (salt XOR index: unique per payload while salts do not
collide, about 2**-96 per pair of messages). GMAC, not a hash such as BLAKE3 or SHA-256: it is a MAC, so a
secret key is all it needs to be unforgeable, and AES-NI and carry-less multiplication run it at 3 times
BLAKE3's speed on one core (5.1 against 1.65 GB/s measured here), without holding the GIL. Tags run over
memory views of the frames: payloads are never copied to be signed. Signing a payload by its tag lets a
sender tag the same values once for several messages (a ps answers every worker of a sync step with the
same parameters, with the same salt: see ``encode``'s ``tags``).

Sessions and replay protection. A signature proves who sent a message, not that it is fresh: a
frame captured on the wire would still verify when sent again. So every request also carries a
16-byte session nonce and a request id, both inside the signed header:

1. HELLO: the client picks a random 8-byte challenge ``C`` per ps connection and sends HELLO with
   nonce ``C`` + 8 zero bytes. The ps refuses a challenge it has seen before (a replayed HELLO),
   otherwise opens a session: it draws a random 8-byte ``S`` and answers with nonce ``C + S``.
   The client accepts only a reply whose nonce starts with its own ``C``: an old HELLO reply
   cannot be passed off as the answer to a new one.
2. Every later request carries nonce ``C + S`` and a request id greater than the last one the ps
   accepted in that session (a client counts its request ids up from 1). The ps drops a request
   whose nonce names no session it opened (a frame of another ps process, such as the one an
   earlier run or a replaced ps served) or whose request id is not greater than the session's
   last: a frame sent again, on the same connection or another one.
3. Every reply carries the request's nonce and request id; the client takes a reply only for the
   request it is waiting on, in the session it opened. A reply sent back to a ps is a replay too
   (its nonce and request id were used), and reply ops (OK, PARAMS...) are no requests anyway.

A ps keeps the last ``MAX_SESSIONS`` sessions (least recently used first out; a forgotten session's
requests are dropped as replays) and the last ``MAX_SESSIONS`` HELLO challenges: a HELLO captured and
sent to a ps process that never saw its challenge opens a session, which nobody without the key can use.

Limits (``Limits``): a message's frame count and total size are checked before its signature is
computed; its tensor count, each shape's elements and its JSON frame's size before anything is
allocated from them.

Same host: a worker and a ps that share a host move dense values through a shared-memory lane instead
of payload frames (``Flag.SHARED``); the messages themselves are signed and checked as above (see
``lanes``).

What a ps does with a message that fails a check (see ``ps.py``): it drops it and counts it under
the name of the error class's ``counter`` (unsigned, bad_signature, replayed, malformed), and
answers a signed request it cannot serve with an ERROR reply.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import math
import secrets
import struct
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import torch
import zmq

from ..errors import BadSignature, FencedOff, MalformedMessage, ProtocolError, ReplayedMessage, UnsignedMessage

PROTOCOL_VERSION = 10
MAGIC = b"PSCL"
MAX_DIMS = 8
NO_TASK = 0xFFFF  # the `task` of a message that comes from the controller, not a worker
NONCE_SIZE = 16  # client challenge (8 bytes) + session tag the ps drew (8 bytes)
MAC_SIZE = 32
SALT_SIZE = 12  # a message's random salt, from which its payload tags' nonces derive
MAX_SESSIONS = 65536
MAX_ELEMENTS = 2**48  # of one tensor, counting a zero dimension as one: bounds what a view's shape can say
COPY_LIMIT = 4 << 20  # frames from this size up are sent without a copy (see ``configure``)
CHUNK_BYTES = 8 << 20  # a tensor's bytes travel in frames of this size (the last one shorter)
PACK_LIMIT = 64 << 10  # a tensor of at most this many bytes travels in the message's pack
PACK_ALIGN = 16  # each packed tensor's bytes start at a multiple of this in the pack

_HEADER = struct.Struct(f"!4sHBBHI{NONCE_SIZE}sQqqII{SALT_SIZE}s")  # the salt last: see ``mac``
_TENSOR = struct.Struct("!IBBB1x" + "Q" * MAX_DIMS)  # id, dtype code, dims, packed (0 or 1), shape
_LENGTH = struct.Struct("!Q")
_NO_SESSION = bytes(NONCE_SIZE // 2)

# torch.frombuffer warns on read-only buffers; received frames are only read.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class Op(IntEnum):
    HELLO = 1
    INIT = 2
    PULL = 3
    PUSH = 4
    PUSH_PULL = 5
    STATS = 6
    STOP = 7
    SHUTDOWN = 8
    PULL_ROWS = 9  # rows of sparse variables: one int64 tensor of row indices per variable
    CHECKPOINT = 10  # write this ps's shard at a step (meta {"step": S}, or now)
    MEMBERSHIP = 11  # workers lost (meta {"lost": [i, ...]}): sync and SSP stop waiting for them
    SHARE = 12  # map a shared-memory lane for this session (see ``lanes``); value 1 in the OK: mapped
    # replies
    OK = 64
    PARAMS = 65
    NOT_READY = 66
    ERROR = 67


class Flag(IntFlag):
    NONE = 0
    STOPPED = 1  # the run has reached its target or was stopped: finish now
    DROPPED = 2  # the pushed gradient was stale (sync) or late (after stop) and was not applied
    SHARED = 4  # the dense values are in the session's shared-memory lane, not in payload frames
    PARTS = 8  # the payload frames follow in messages of their own (see ``parts``)
    SECOND = 16  # with SHARED: the values go into (a request), are in (a reply), the lane's second set (``lanes``)


_OP_BY_CODE = {int(op): op for op in Op}
_FLAGS = int(Flag.STOPPED | Flag.DROPPED | Flag.SHARED | Flag.PARTS | Flag.SECOND)
_FLAG_BY_CODE = {code: Flag(code) for code in range(_FLAGS + 1) if not code & ~_FLAGS}  # enum calls cost microseconds

_DTYPES = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4,
    torch.int64: 5, torch.int32: 6, torch.int8: 7, torch.uint8: 8, torch.bool: 9,
}
_DTYPE_BY_CODE = {code: dtype for dtype, code in _DTYPES.items()}
_ITEMSIZE = {code: torch.empty((), dtype=dtype).element_size() for dtype, code in _DTYPES.items()}


@dataclass
class Message:
    """One decoded (or to-be-encoded) data-plane message."""

    op: Op
    flags: Flag = Flag.NONE
    task: int = NO_TASK
    run_id: int = 0
    request_id: int = 0
    step: int = 0
    value: int = 0
    wait_us: int = 0  # replies: how long the ps held the request (sync: waiting for the other replicas)
    ids: list[int] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    meta: dict | None = None
    nonce: bytes = bytes(NONCE_SIZE)  # the session (see the module docstring)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True)
class Limits:
    """The most one message may hold (see the module docstring for when each is checked); a ps holds the
    requests of an initialized run to the sizes of its variables."""

    max_tensors: int = 1 << 18
    max_json_bytes: int = 4 << 20
    max_message_bytes: int = 1 << 40

    @property
    def max_frames(self) -> int:
        """Header, table, json and mac, each tensor's last (or only) frame, and the full chunks of its bytes."""
        return 4 + self.max_tensors + self.max_message_bytes // CHUNK_BYTES


DEFAULT_LIMITS = Limits()
# the largest frame of any message: a chunk, or the table or json frame of one within the default limits
MAX_FRAME_BYTES = max(CHUNK_BYTES, DEFAULT_LIMITS.max_tensors * _TENSOR.size, DEFAULT_LIMITS.max_json_bytes)


def configure(sock: zmq.Socket) -> zmq.Socket:
    """Set how ``sock`` sends frames: those under ``COPY_LIMIT`` bytes are copied into ZeroMQ's message while
    ``send`` runs, so the tensor they come from may change as soon as it returns; larger ones go without a
    copy. A zero-copy frame is released through pyzmq's garbage-collector thread once ZeroMQ is done with
    it; measured on a busy 2-core host, a ps's reply of 0.8 MB of parameters took about 1.4 ms to send as
    zero-copy frames and 0.2 ms as copied ones."""
    sock.copy_threshold = COPY_LIMIT
    return sock


def tensor_bytes(t: torch.Tensor):
    """A zero-copy byte view of a CPU tensor's data (made contiguous first if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def chunk_count(nbytes: int) -> int:
    """How many payload frames carry a tensor of ``nbytes`` bytes (one, empty, for an empty tensor)."""
    return max(1, -(-nbytes // CHUNK_BYTES))


def payload_frames(t: torch.Tensor) -> list:
    """The payload frames of tensor ``t``: zero-copy views of its bytes, ``CHUNK_BYTES`` each (the last shorter)."""
    data = tensor_bytes(t)
    if data.nbytes <= CHUNK_BYTES:  # nearly every tensor: no slicing on the training step's path
        return [data]
    return [data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES] for i in range(chunk_count(data.nbytes))]


_KEYED: dict = {}  # key -> keyed HMAC state
_GMAC: dict = {}  # key -> AES-GCM under the payload key derived from it


@dataclass
class PayloadTags:
    """The tags of a message's payload frames under one salt, each computed when it is first needed and kept:
    a sender that sends the same payloads again (a ps, its parameters to every worker of a step) reuses them
    with the same salt."""

    salt: bytes = field(default_factory=lambda: secrets.token_bytes(SALT_SIZE))
    tags: list[bytes] = field(default_factory=list)  # of payloads 0, 1, ... so far

    def tag(self, key: bytes, index: int, payload) -> bytes:
        """The tag of payload frame ``index`` (tags are computed in payload order)."""
        if index == len(self.tags):
            self.tags.append(payload_tag(key, self.salt, index, payload))
        return self.tags[index]


def _cached(cache: dict, key: bytes, make):
    value = cache.get(key)
    if value is None:  # the key schedule once per key
        if len(cache) >= 64:
            cache.clear()
        value = cache.setdefault(key, make(key))
    return value


def _gmac_cipher(key: bytes) -> AESGCM:
    return AESGCM(hmac.new(key, b"pscluster payload GMAC key", hashlib.sha256).digest())


def payload_tag(key: bytes, salt: bytes, index: int, payload) -> bytes:
    """AES-GMAC of payload frame ``index`` (bytes-like) of a message with ``salt``, as ``mac`` signs it."""
    nonce = salt[:8] + (int.from_bytes(salt[8:], "big") ^ index).to_bytes(4, "big")
    return _cached(_GMAC, key, _gmac_cipher).encrypt(nonce, b"", memoryview(payload))


def mac(key: bytes, frames, tags: list[bytes] | None = None) -> bytes:
    """HMAC-SHA256 of ``frames``: the first three (header, table, json) as they are, each later one (a
    payload) by its ``payload_tag`` (``tags``, when given, are those of the payloads, already computed; else
    they are computed with the salt that ends the header frame), every item preceded by its frame's length."""
    h = _cached(_KEYED, key, lambda k: hmac.new(k, digestmod=hashlib.sha256)).copy()
    salt = b""
    if tags is None and len(frames) > 3:  # a header too short for a salt is refused later: no raising here
        salt = bytes(memoryview(frames[0])[-SALT_SIZE:]).rjust(SALT_SIZE, b"\0")
    for i, f in enumerate(frames):
        mv = memoryview(f)
        h.update(_LENGTH.pack(mv.nbytes))
        if i < 3:
            h.update(mv)
        else:
            h.update(tags[i - 3] if tags is not None else payload_tag(key, salt, i - 3, mv))
    return h.digest()


def encode(msg: Message, key: bytes, tags: PayloadTags | None = None) -> list:
    """Frames for ``msg``, signed with ``key``; tensor payloads are not copied. ``tags``: those of its payload
    frames (``payload_frames``) under their salt, when the sender keeps them (else fresh ones)."""
    if len(msg.ids) != len(msg.tensors):
        raise ValueError("one variable id per tensor")
    tags = PayloadTags() if tags is None else tags
    header = _HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg.op), int(msg.flags), msg.task, msg.run_id, msg.nonce,
                          msg.request_id, msg.step, msg.value, min(msg.wait_us, 0xFFFFFFFF), len(msg.tensors),
                          tags.salt)
    table = bytearray()
    layout = pack_layout(msg.tensors)
    for var_id, t, offset in zip(msg.ids, msg.tensors, layout[0]):
        if t.dim() > MAX_DIMS:
            raise ProtocolError(f"tensor of {t.dim()} dims: at most {MAX_DIMS} go on the wire")
        try:
            code = _DTYPES[t.dtype]
        except KeyError:
            raise ProtocolError(f"dtype {t.dtype} cannot go on the wire: use one of "
                                f"{', '.join(str(d) for d in _DTYPES)}") from None
        shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        table += _TENSOR.pack(var_id, code, t.dim(), offset is not None, *shape)
    payloads = [] if msg.flags & Flag.PARTS else message_payloads(msg.tensors, layout)
    body = b"" if msg.meta is None else json.dumps(msg.meta).encode()
    frames = [header, bytes(table), body, *payloads]
    frames.append(mac(key, frames, [tags.tag(key, i, p) for i, p in enumerate(payloads)]))
    return frames


def _aligned(nbytes: int) -> int:
    """The room a tensor of ``nbytes`` bytes takes in a pack."""
    return -(-nbytes // PACK_ALIGN) * PACK_ALIGN


def pack_layout(tensors) -> tuple[list[int | None], int]:
    """Where each of a message's ``tensors`` travels: its offset in the message's pack, or None for a tensor in
    frames of its own (more than ``PACK_LIMIT`` bytes, or the pack full at ``CHUNK_BYTES``); and the pack's size.
    From shapes and dtypes alone: tensors on the meta device will do."""
    offsets, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes <= PACK_LIMIT and size + nbytes <= CHUNK_BYTES:
            offsets.append(size)
            size += _aligned(nbytes)
        else:
            offsets.append(None)
    return offsets, size


def message_payloads(tensors, layout: tuple[list[int | None], int] | None = None) -> list:
    """The payload frames of a message of ``tensors``, in order: the frames of each tensor not packed
    (``payload_frames``), then the pack, when ``pack_layout`` packs any (``layout``: its result, when the caller
    has it already)."""
    offsets, size = pack_layout(tensors) if layout is None else layout
    frames = [f for t, offset in zip(tensors, offsets) if offset is None for f in payload_frames(t)]
    if any(offset is not None for offset in offsets):
        frames.append(pack_frame([(offset, t) for t, offset in zip(tensors, offsets) if offset is not None], size))
    return frames


def pack_frame(placed: list[tuple[int, torch.Tensor]], size: int) -> bytes | bytearray:
    """A pack of ``size`` bytes holding each tensor's bytes at its offset (zeros between them)."""
    if not size:
        return b""
    pack = bytearray(size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(pack))
    for offset, t in placed:
        if not t.is_cpu:
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        ctypes.memmove(base + offset, t.data_ptr(), t.numel() * t.element_size())
    return pack


def decode(frames, key: bytes, limits: Limits = DEFAULT_LIMITS, *, release: bool = False) -> Message:
    """Check and decode received frames (``zmq.Frame`` or bytes-like).

    Raises a ProtocolError subclass naming what failed: MalformedMessage (beyond ``limits``, or not the
    wire format), UnsignedMessage, BadSignature. Freshness (replays) is the receiver's check: see
    ``Sessions``. Tensors in the result are read-only views of the received buffers (a tensor of several
    chunks is put together in a tensor of its own): copy them before the frames go away if they must outlive
    the message. With ``release`` (``frames`` a list that holds the only references to its frames), each chunk
    of a tensor of several is dropped from ``frames`` once copied: decoding a message of N bytes then holds
    about N plus one chunk, not 2N.
    """
    bufs = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
    if len(bufs) > limits.max_frames:
        raise MalformedMessage(f"message of {len(bufs)} frames: at most {limits.max_frames} accepted")
    size = sum(b.nbytes for b in bufs)
    if size > limits.max_message_bytes:
        raise MalformedMessage(f"message of {size} bytes: at most {limits.max_message_bytes} accepted")
    if len(bufs) > 1 and bufs[1].nbytes > limits.max_tensors * _TENSOR.size:
        raise MalformedMessage(f"message of {bufs[1].nbytes // _TENSOR.size} tensors: at most {limits.max_tensors} "
                               "accepted")
    if len(bufs) < 4 or bufs[-1].nbytes != MAC_SIZE:
        raise UnsignedMessage(f"message of {len(bufs)} frames without a signature: at least 4 expected, "
                              f"the last a {MAC_SIZE}-byte signature")
    if not hmac.compare_digest(bytes(bufs[-1]), mac(key, bufs[:-1])):
        raise BadSignature("bad signature: the sender does not hold this cluster's secret")
    if bufs[0].nbytes != _HEADER.size:
        raise MalformedMessage("malformed header")
    (magic, version, op, flags, task, run_id, nonce, request_id, step, value, wait_us,
     count, _salt) = _HEADER.unpack(bufs[0])
    if magic != MAGIC:
        raise MalformedMessage("not a pscluster message")
    if version != PROTOCOL_VERSION:
        raise MalformedMessage(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}: "
                               "install the same pscluster version everywhere")
    if bufs[1].nbytes != count * _TENSOR.size:
        raise MalformedMessage("tensor table does not match the frames")
    if bufs[2].nbytes > limits.max_json_bytes:
        raise MalformedMessage(f"JSON frame of {bufs[2].nbytes} bytes: at most {limits.max_json_bytes} accepted")
    if op not in _OP_BY_CODE or flags not in _FLAG_BY_CODE:
        raise MalformedMessage(f"unknown op {op} or flags {flags}")
    op, flags = _OP_BY_CODE[op], _FLAG_BY_CODE[flags]
    msg = Message(op=op, flags=flags, task=task, run_id=run_id, request_id=request_id, step=step,
                  value=value, wait_us=wait_us, nonce=nonce)
    described = [_described(fields) for fields in _TENSOR.iter_unpack(bufs[1])]
    if flags & Flag.PARTS:
        _allocate(msg, described, len(bufs), limits)
    else:
        _read(msg, described, bufs, frames if release else None)
    if bufs[2].nbytes:
        try:
            msg.meta = json.loads(bytes(bufs[2]))
        except (ValueError, RecursionError):
            raise MalformedMessage("bad JSON frame") from None
        if not isinstance(msg.meta, dict):
            raise MalformedMessage(f"JSON frame holds a {type(msg.meta).__name__}: an object expected")
    return msg


def _read(msg: Message, described: list, bufs: list, frames=None) -> None:
    """The tensors of ``msg`` from its payload frames (``bufs[3:-1]``; ``frames``: see ``_tensor``)."""
    pack_bytes, has_pack, unpacked_frames = _payloads(described)
    if len(bufs) != 4 + has_pack + unpacked_frames:
        raise MalformedMessage("tensor table does not match the frames")
    if has_pack and bufs[-2].nbytes != pack_bytes:
        raise MalformedMessage(f"a pack of {bufs[-2].nbytes} bytes for packed tensors of {pack_bytes}")
    pack = Pack(torch.frombuffer(bufs[-2], dtype=torch.uint8) if pack_bytes else torch.empty(0, dtype=torch.uint8))
    frame, offset = 3, 0
    for var_id, dtype, shape, numel, nbytes, packed in described:
        msg.ids.append(var_id)
        if packed:
            msg.tensors.append(pack.tensor(offset, dtype, shape))
            offset += _aligned(nbytes)
            continue
        first, count = frame, chunk_count(nbytes)
        frame += count
        sizes = [b.nbytes for b in bufs[first:frame]]
        if sum(sizes) != nbytes or any(size != CHUNK_BYTES for size in sizes[:-1]):
            raise MalformedMessage(f"tensor {var_id}: {sum(sizes)} bytes for shape {tuple(shape)}")
        msg.tensors.append(_tensor(bufs, first, count, dtype, numel, frames).view(tuple(shape)))


def _allocate(head: Message, described: list, frames: int, limits: Limits) -> None:
    """The tensors of ``head``, a message whose payloads follow in parts (``Flag.PARTS``), described (on the meta
    device: shape and dtype, no memory) once what the table declares is within ``limits``; ``parts.Assembly``
    gives them memory as it fills them in."""
    declared = sum(nbytes for *_, nbytes, _ in described)
    _, has_pack, unpacked_frames = _payloads(described)
    payloads = unpacked_frames + has_pack
    if frames != 4:
        raise MalformedMessage(f"a message whose payloads follow in parts, with {frames - 4} payload frames")
    if declared > limits.max_message_bytes or 4 + payloads > limits.max_frames:
        raise MalformedMessage(f"a message of {declared} bytes in {payloads} payloads: at most "
                               f"{limits.max_message_bytes} bytes and {limits.max_frames - 4} payloads accepted")
    for var_id, dtype, shape, *_ in described:
        head.ids.append(var_id)
        head.tensors.append(torch.empty(shape, dtype=dtype, device="meta"))
    offsets, _ = pack_layout(head.tensors)  # the receiver lays its pack out by the same rule
    if [offset is not None for offset in offsets] != [packed for *_, packed in described]:
        raise MalformedMessage("a message whose payloads follow in parts, packed otherwise than its tensors say")


def _payloads(described: list) -> tuple[int, bool, int]:
    """Of a message's described tensors: the size of its pack, whether it has one, its other payload frames."""
    return (sum(_aligned(nbytes) for *_, nbytes, packed in described if packed),
            any(packed for *_, packed in described),
            sum(chunk_count(nbytes) for *_, nbytes, packed in described if not packed))


def _described(fields) -> tuple[int, torch.dtype, tuple, int, int, bool]:
    """A tensor table entry checked: (variable id, dtype, shape, elements, bytes, packed)."""
    var_id, code, ndim, packed = fields[:4]
    dtype = _DTYPE_BY_CODE.get(code)
    if dtype is None or ndim > MAX_DIMS or packed > 1 or any(fields[4 + ndim:]):
        raise MalformedMessage("bad tensor descriptor")
    shape = fields[4:4 + ndim]
    numel, extent = 1, 1
    for d in shape:
        numel *= d
        extent *= max(d, 1)
    if extent > MAX_ELEMENTS:
        raise MalformedMessage(f"tensor {var_id}: shape {tuple(shape)} is beyond {MAX_ELEMENTS} elements")
    return var_id, dtype, tuple(shape), numel, numel * _ITEMSIZE[code], bool(packed)


class Pack:
    """The bytes of a pack (a uint8 tensor: a received frame, or memory a message in parts fills in), whose
    tensors are views of it (one view of the whole pack per dtype)."""

    def __init__(self, data: torch.Tensor):
        self._bytes = data
        self._as: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` whose bytes start at ``offset`` (an empty one: of its own)."""
        if not math.prod(shape):
            return torch.empty(shape, dtype=dtype)
        whole = self._as.get(dtype)
        if whole is None:
            whole = self._as[dtype] = self._bytes.view(dtype)
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= max(d, 1)
        return torch.as_strided(whole, shape, strides[::-1], offset // whole.element_size())


def _tensor(bufs: list, first: int, count: int, dtype: torch.dtype, numel: int, frames=None) -> torch.Tensor:
    """The flat tensor of ``numel`` elements whose bytes ``bufs[first:first + count]`` hold: a read-only view of
    a single frame, or the chunks copied into a tensor of its own; given ``frames`` (the list ``bufs`` views),
    each chunk is dropped from both once copied."""
    if not numel:
        return torch.empty(0, dtype=dtype)
    if count == 1:
        return torch.frombuffer(bufs[first], dtype=dtype, count=numel)
    t = torch.empty(numel, dtype=dtype)
    data, offset = t.view(torch.uint8), 0
    for k in range(first, first + count):
        size = bufs[k].nbytes
        data[offset:offset + size].copy_(torch.frombuffer(bufs[k], dtype=torch.uint8))
        offset += size
        if frames is not None:
            bufs[k] = frames[k] = None
    return t


def remember(entries: OrderedDict, key, value, capacity: int) -> None:
    """``entries[key] = value`` as the most recent entry, forgetting the oldest beyond ``capacity``: what a
    receiver keeps of its senders' last sequence numbers."""
    entries[key] = value
    entries.move_to_end(key)
    if len(entries) > capacity:
        entries.popitem(last=False)


class Sessions:
    """A ps's sessions: which requests are fresh (see the module docstring), and which are fenced off: the
    sessions a lost worker opened, whose requests are refused once it is declared lost (``fence``)."""

    def __init__(self, capacity: int = MAX_SESSIONS):
        self.capacity = capacity
        self._last: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # nonce -> (last request id, task)
        self._challenges: OrderedDict[bytes, None] = OrderedDict()
        self._fenced: OrderedDict[bytes, int] = OrderedDict()  # nonce -> the task it belonged to

    def open(self, hello: Message) -> bytes:
        """A new session for ``hello``: its nonce, the client's challenge followed by a fresh tag.
        ReplayedMessage when the challenge was seen before."""
        challenge, tag = hello.nonce[:NONCE_SIZE // 2], hello.nonce[NONCE_SIZE // 2:]
        if tag != _NO_SESSION:
            raise MalformedMessage("HELLO with a session tag: a HELLO carries the client's challenge only")
        if challenge in self._challenges:
            raise ReplayedMessage("HELLO with a challenge seen before: a replayed HELLO")
        remember(self._challenges, challenge, None, self.capacity)
        nonce = challenge + secrets.token_bytes(NONCE_SIZE // 2)
        remember(self._last, nonce, (hello.request_id, hello.task), self.capacity)
        return nonce

    def admit(self, msg: Message) -> None:
        """Accept ``msg`` as the next request of its session, or raise ReplayedMessage (or FencedOff)."""
        last, task = self._last.get(msg.nonce, (None, None))
        if last is None:
            raise ReplayedMessage("request of a session this ps did not open: a frame from another connection, "
                                  "ps process or run")
        if msg.request_id <= last:
            raise ReplayedMessage(f"request id {msg.request_id} not after {last}: a frame sent before")
        remember(self._last, msg.nonce, (msg.request_id, task), self.capacity)
        if msg.nonce in self._fenced:
            raise FencedOff(f"worker {task} was declared lost and replaced while it did not answer: "
                            "this process is fenced off and must end")

    def fence(self, task: int) -> int:
        """Refuse every request of the sessions ``task`` opened so far; how many there were."""
        nonces = [nonce for nonce, (_, t) in self._last.items() if t == task]
        for nonce in nonces:
            remember(self._fenced, nonce, task, self.capacity)
        return len(nonces)


def challenge() -> bytes:
    """A client's HELLO nonce: a fresh random challenge and no session tag."""
    return secrets.token_bytes(NONCE_SIZE // 2) + _NO_SESSION


def peek_op(header) -> int | None:
    """The op a (not yet verified) header frame names, None when it is no header: a receiver picks the
    limits to check a message against by it; ``decode`` still verifies everything."""
    mv = memoryview(header)
    return mv[6] if mv.nbytes == _HEADER.size else None


def receive(sock, max_frames: int) -> list | None:
    """One multipart message from ``sock`` as ``zmq.Frame`` parts, or None when it has more than
    ``max_frames`` parts: those past the limit are read and let go, never kept. (Each frame's own ``more``, not
    the socket's RCVMORE option: asking the socket took two thirds of the time of a message of many frames.)"""
    part = sock.recv(copy=False)
    frames = [part]
    while part.more:
        part = sock.recv(copy=False)
        if frames is not None:
            frames.append(part)
            if len(frames) > max_frames:
                frames = None
    return frames
