"""The data-plane wire format: one module, no pickle.

A message is a list of ZeroMQ frames::

    [header, table, json, payload_0, ..., payload_n-1, mac]

``header`` is a fixed struct (magic, protocol version, op, flags, task, run id,
request id, step, value, wait in microseconds, tensor count); ``table`` describes each tensor (variable
id, dtype code, shape); ``json`` is UTF-8 JSON for the few control messages that
carry structured data (empty otherwise); each payload is a tensor's raw bytes,
sent without a copy; ``mac`` is a keyed BLAKE2b over every other frame, with the
per-cluster secret as key. A message that fails any check raises ProtocolError,
and servers drop it (counted) instead of crashing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import warnings
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag

import torch

from ..errors import ProtocolError

PROTOCOL_VERSION = 3
MAGIC = b"PSCL"
MAX_DIMS = 8
NO_TASK = 0xFFFF  # the `task` of a message that comes from the controller, not a worker

_HEADER = struct.Struct("!4sHBBHIIqqII")
_TENSOR = struct.Struct("!IBB2x" + "Q" * MAX_DIMS)
_MAC_SIZE = 16

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
    # replies
    OK = 64
    PARAMS = 65
    NOT_READY = 66
    ERROR = 67


class Flag(IntFlag):
    NONE = 0
    STOPPED = 1  # the run has reached its target or was stopped: finish now
    DROPPED = 2  # the pushed gradient was stale (sync) or late (after stop) and was not applied


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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def tensor_bytes(t: torch.Tensor):
    """A zero-copy byte view of a CPU tensor's data (made contiguous first if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _mac(key: bytes, frames) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=_MAC_SIZE)
    for f in frames:
        mv = memoryview(f)
        h.update(struct.pack("!Q", mv.nbytes))
        h.update(mv)
    return h.digest()


def encode(msg: Message, key: bytes) -> list:
    """Frames for ``msg``, signed with ``key``; tensor payloads are not copied."""
    if len(msg.ids) != len(msg.tensors):
        raise ValueError("one variable id per tensor")
    header = _HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg.op), int(msg.flags), msg.task,
                          msg.run_id, msg.request_id, msg.step, msg.value, min(msg.wait_us, 0xFFFFFFFF),
                          len(msg.tensors))
    table = bytearray()
    payloads = []
    for var_id, t in zip(msg.ids, msg.tensors):
        if t.dim() > MAX_DIMS:
            raise ProtocolError(f"tensor of {t.dim()} dims: at most {MAX_DIMS} go on the wire")
        try:
            code = _DTYPES[t.dtype]
        except KeyError:
            raise ProtocolError(f"dtype {t.dtype} cannot go on the wire: use one of "
                                f"{', '.join(str(d) for d in _DTYPES)}") from None
        shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        table += _TENSOR.pack(var_id, code, t.dim(), *shape)
        payloads.append(tensor_bytes(t))
    body = b"" if msg.meta is None else json.dumps(msg.meta).encode()
    frames = [header, bytes(table), body, *payloads]
    frames.append(_mac(key, frames))
    return frames


def decode(frames, key: bytes) -> Message:
    """Check and decode received frames (``zmq.Frame`` or bytes-like).

    Tensors in the result are read-only views of the received buffers: copy them
    before the frames go away if they must outlive the message.
    """
    bufs = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
    if len(bufs) < 4:
        raise ProtocolError(f"message of {len(bufs)} frames: at least 4 expected")
    if not hmac.compare_digest(bytes(bufs[-1]), _mac(key, bufs[:-1])):
        raise ProtocolError("bad signature: the sender does not hold this cluster's secret")
    if bufs[0].nbytes != _HEADER.size:
        raise ProtocolError("malformed header")
    magic, version, op, flags, task, run_id, request_id, step, value, wait_us, count = _HEADER.unpack(bufs[0])
    if magic != MAGIC:
        raise ProtocolError("not a pscluster message")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}: "
                            "install the same pscluster version everywhere")
    if bufs[1].nbytes != count * _TENSOR.size or len(bufs) != 4 + count:
        raise ProtocolError("tensor table does not match the frames")
    try:
        op = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    msg = Message(op=op, flags=Flag(flags), task=task, run_id=run_id,
                  request_id=request_id, step=step, value=value, wait_us=wait_us)
    for i, fields in enumerate(_TENSOR.iter_unpack(bufs[1])):
        var_id, code, ndim = fields[:3]
        shape = fields[3:3 + ndim]
        dtype = _DTYPE_BY_CODE.get(code)
        if dtype is None or ndim > MAX_DIMS:
            raise ProtocolError("bad tensor descriptor")
        payload = bufs[3 + i]
        numel = 1
        for d in shape:
            numel *= d
        if payload.nbytes != numel * _ITEMSIZE[code]:
            raise ProtocolError(f"tensor {var_id}: {payload.nbytes} bytes for shape {tuple(shape)}")
        t = (torch.frombuffer(payload, dtype=dtype, count=numel) if numel
             else torch.empty(0, dtype=dtype))
        msg.ids.append(var_id)
        msg.tensors.append(t.view(tuple(shape)))
    if bufs[2].nbytes:
        try:
            msg.meta = json.loads(bytes(bufs[2]))
        except ValueError:
            raise ProtocolError("bad JSON frame") from None
    return msg
