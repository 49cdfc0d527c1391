"""Shared-memory lanes: a worker and a ps on the same host exchange dense values through memory both
map, instead of through the socket.

A lane belongs to one session (see ``protocol``) and holds two segments, one slot per dense variable of the
ps in its order: ``grads`` (the worker writes the gradients of a push there) and ``values``, twice over (the ps
writes the parameters of its reply into the first or the second set of slots, as the request says with
``Flag.SECOND``). Requests and replies still go by the socket or the bell (``bells``), signed as always; a
message with ``Flag.SHARED`` has its dense values in the lane instead of in payload frames (sparse rows stay in
frames). The worker waits for each reply before it writes the gradients again, and the ps reads a push's
gradients before it answers: no slot is written by both at once.

Why two sets of values: the worker's model may take a reply's values as its own memory instead of copying them
(``Shards.load``); it then ``holds`` that set, and its next requests name the other, so that the ps never writes
what the model computes with (with ``pipeline``, while the model computes the next step).

Attaching (op SHARE): the client creates both segments under random names in ``SHM_DIR``, writes a
random token at the start of ``grads``, and sends the names and the token in a signed SHARE request. The
ps maps them only if they exist with the sizes its own variables give and hold the token (a ps on another
host finds no such file), and answers whether it did; both sides then unlink the names, so nothing is
left behind when either process dies.

Why a lane's values are not signed: a segment is a file that only the cluster's user may open (mode
0600) and whose name is gone once both sides mapped it; whoever could write it runs as that user and can
read the cluster's secret anyway.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

import torch

from . import host_copies
from .protocol import Flag

SHM_DIR = "/dev/shm"
ALIGN = 64  # each slot starts on a cache line
TOKEN_BYTES = 16
_NAME = re.compile(r"pscluster-[0-9a-f]{32}")


class LaneError(OSError):
    """A lane could not be created or attached (no shared memory here, another host, sizes that differ)."""


def value_set(flags: Flag) -> int | None:
    """The set of a lane's values a message's ``flags`` name (0, or 1 with ``Flag.SECOND``); None when its values
    are not in a lane (no ``Flag.SHARED``)."""
    return (1 if flags & Flag.SECOND else 0) if flags & Flag.SHARED else None


def slots(layout: list[tuple[torch.Size, torch.dtype]], start: int = 0) -> tuple[list[int], int]:
    """Byte offsets of tensors of these shapes and dtypes placed one after the other from ``start``, each
    aligned to ``ALIGN``, and the size of the whole."""
    offsets, end = [], start
    for shape, dtype in layout:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += torch.Size(shape).numel() * dtype.itemsize
    return offsets, max(end, 1)


class Segment:
    """A named shared-memory file mapped into this process."""

    def __init__(self, name: str, size: int, *, create: bool):
        if not _NAME.fullmatch(name):
            raise LaneError(f"{name!r} is not a lane segment name")
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as e:
            raise LaneError(f"shared memory {self.path}: {e.strerror}") from None
        try:
            if create:
                self._reserve(fd, size)
            elif os.fstat(fd).st_size != size:
                raise LaneError(f"shared memory {self.path} holds {os.fstat(fd).st_size} bytes, {size} expected")
            self.map = mmap.mmap(fd, size)
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)

    def _reserve(self, fd: int, size: int) -> None:
        """Give the new file ``size`` bytes of memory now: a file only sized would take its pages as they are first
        written, and a full ``SHM_DIR`` would then end the process that writes (SIGBUS) instead of refusing the
        lane here."""
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise LaneError(f"shared memory {self.path}: no room for {size:,} bytes ({e.strerror}): the worker "
                            f"goes on over the socket; give {SHM_DIR} more room (docker: --shm-size)") from None

    def tensors(self, layout, offsets) -> list[torch.Tensor]:
        """Views of the segment at ``offsets`` with the shapes and dtypes of ``layout``."""
        return [torch.frombuffer(self.map, dtype=dtype, count=torch.Size(shape).numel(), offset=offset).view(shape)
                if torch.Size(shape).numel() else torch.empty(shape, dtype=dtype)
                for (shape, dtype), offset in zip(layout, offsets)]

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @property
    def address(self) -> int:
        """Where the segment is mapped in this process."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()


class Lane:
    """The two segments of one session, as tensor views: ``grads`` and the two sets of ``values``, one slot per
    variable id of ``ids`` in each. ``create``: make new segments (the client); otherwise map the named ones (the
    ps)."""

    def __init__(self, ids: list[int], layout: list[tuple[torch.Size, torch.dtype]], *, names=None,
                 token: bytes | None = None):
        self.ids = list(ids)
        grad_offsets, grad_size = slots(layout, TOKEN_BYTES)
        value_offsets, value_size = slots(layout * 2)
        create = names is None
        if create:
            names = [f"pscluster-{secrets.token_hex(16)}" for _ in range(2)]
            token = secrets.token_bytes(TOKEN_BYTES)
        grads = Segment(names[0], grad_size, create=create)
        try:
            values = Segment(names[1], value_size, create=create)
        except LaneError:
            if create:
                grads.unlink()
            raise
        self.segments = (grads, values)
        if create:
            grads.map[:TOKEN_BYTES] = token
        elif grads.map[:TOKEN_BYTES] != token:
            raise LaneError("shared memory holds another token: not the client's segment")
        self.token = token
        self.grads = grads.tensors(layout, grad_offsets)
        n = len(layout)
        self.values = (values.tensors(layout, value_offsets[:n]), values.tensors(layout, value_offsets[n:]))
        self.nbytes = sum(t.numel() * t.element_size() for t in self.grads)  # one way, one step
        self.pinned: list[int] | None = None  # segments page-locked for a CUDA worker's copies (None: not tried)
        self.held: int | None = None  # the worker's side: the set of values its model holds (``PSClient.hold``)

    def flags(self) -> Flag:
        """The flags of a request through this lane: its values in the lane, in the set the worker's model does not
        hold (``value_set``)."""
        return Flag.SHARED | Flag.SECOND if self.held == 0 else Flag.SHARED

    @classmethod
    def for_tensors(cls, ids: list[int], tensors: list[torch.Tensor]) -> "Lane":
        """A new lane (the client's side) for variables with these ids, shaped like ``tensors``."""
        return cls(ids, [(t.shape, t.dtype) for t in tensors])

    def request(self) -> dict:
        """What a SHARE request carries: the segments' names and the token."""
        return {"grads": self.segments[0].name, "values": self.segments[1].name, "token": self.token.hex()}

    @classmethod
    def attach(cls, ids: list[int], params: list[torch.Tensor], request: dict) -> "Lane":
        """The ps's side: map the segments a SHARE request names, laid out for ``params``; LaneError when
        they are not there as described."""
        try:
            names, token = [str(request["grads"]), str(request["values"])], bytes.fromhex(str(request["token"]))
        except (KeyError, ValueError):
            raise LaneError("a SHARE request names two segments and a token") from None
        return cls(ids, [(p.shape, p.dtype) for p in params], names=names, token=token)

    def unlink(self) -> None:
        """Remove the segments' names (the mapped memory stays until both sides let go of it)."""
        for segment in self.segments:
            segment.unlink()

    def pin(self) -> None:
        """Page-lock both segments (the client's side, when it copies to and from a GPU): tried once."""
        if self.pinned is None:
            self.pinned = [s.address for s in self.segments if host_copies.pin(s.address, len(s.map))]

    def unpin(self) -> None:
        """Undo ``pin``, once the GPU's copies from and to the segments are done."""
        if self.pinned:
            torch.cuda.synchronize()
        for address in self.pinned or ():
            host_copies.unpin(address)
        self.pinned = None
