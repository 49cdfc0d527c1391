"""Shared-memory lanes: a worker and a ps on the same host exchange dense values through memory both
map, instead of through the socket.

A lane belongs to one session (see ``protocol``) and holds two segments laid out the same way, one slot
per dense variable of the ps in its order: ``grads`` (the worker writes the gradients of a push there) and
``params`` (the ps writes the parameters of its reply there). Requests and replies still go over the
socket, signed as always; a message with ``Flag.SHARED`` has its dense values in the lane instead of in
payload frames (sparse rows stay in frames). The worker waits for each reply before it touches the lane
again, and the ps reads a push's gradients before it answers: a lane is never written by both at once.

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

SHM_DIR = "/dev/shm"
ALIGN = 64  # each slot starts on a cache line
TOKEN_BYTES = 16
_NAME = re.compile(r"pscluster-[0-9a-f]{32}")


class LaneError(OSError):
    """A lane could not be created or attached (no shared memory here, another host, sizes that differ)."""


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
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise LaneError(f"shared memory {self.path} holds {os.fstat(fd).st_size} bytes, {size} expected")
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

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
    """The two segments of one session, as tensor views: ``grads`` and ``params``, one per variable id
    of ``ids``. ``create``: make new segments (the client); otherwise map the named ones (the ps)."""

    def __init__(self, ids: list[int], layout: list[tuple[torch.Size, torch.dtype]], *, names=None,
                 token: bytes | None = None):
        self.ids = list(ids)
        grad_offsets, grad_size = slots(layout, TOKEN_BYTES)
        param_offsets, param_size = slots(layout)
        create = names is None
        if create:
            names = [f"pscluster-{secrets.token_hex(16)}" for _ in range(2)]
            token = secrets.token_bytes(TOKEN_BYTES)
        grads = Segment(names[0], grad_size, create=create)
        try:
            params = Segment(names[1], param_size, create=create)
        except LaneError:
            if create:
                grads.unlink()
            raise
        self.segments = (grads, params)
        if create:
            grads.map[:TOKEN_BYTES] = token
        elif grads.map[:TOKEN_BYTES] != token:
            raise LaneError("shared memory holds another token: not the client's segment")
        self.token = token
        self.grads = grads.tensors(layout, grad_offsets)
        self.params = params.tensors(layout, param_offsets)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.params)
        self.pinned: list[int] | None = None  # segments page-locked for a CUDA worker's copies (None: not tried)

    @classmethod
    def for_tensors(cls, ids: list[int], tensors: list[torch.Tensor]) -> "Lane":
        """A new lane (the client's side) for variables with these ids, shaped like ``tensors``."""
        return cls(ids, [(t.shape, t.dtype) for t in tensors])

    def request(self) -> dict:
        """What a SHARE request carries: the segments' names and the token."""
        return {"grads": self.segments[0].name, "params": self.segments[1].name, "token": self.token.hex()}

    @classmethod
    def attach(cls, ids: list[int], params: list[torch.Tensor], request: dict) -> "Lane":
        """The ps's side: map the segments a SHARE request names, laid out for ``params``; LaneError when
        they are not there as described."""
        try:
            names, token = [str(request["grads"]), str(request["params"])], bytes.fromhex(str(request["token"]))
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
