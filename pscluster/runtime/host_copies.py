"""A CUDA worker's tensors on their way between its GPU and the host, moved as the GPU's copy engines move
them fastest: to and from page-locked (pinned) host memory, queued on the device's current stream without
waiting (``non_blocking``), with one wait for all the copies of a request. A worker process sees one GPU.

- ``Copies``: the copies of one request. ``to_host`` puts a CUDA tensor in a new pinned host tensor (torch's
  caching host allocator gives the same memory back step after step; a block stays taken while a frame that
  ZeroMQ sends zero-copy still refers to it); ``into`` copies into a given host tensor (a shared-memory lane's
  slot); ``wait`` returns once every queued copy is done, before anything is sent (and, after ``fence``,
  once the GPU is done reading a pinned lane a request hands back to its ps).
- ``pin`` / ``unpin``: page-lock memory this process mapped itself (a lane's segments) so that copies to and
  from it are DMA too; where CUDA refuses, the copies still happen, staged by the driver.

Copies to the GPU are queued without waiting too: a large reply is assembled in pinned memory (``PSClient``'s
``pinned``), a pinned lane's values change only after the worker's next request through the lane, which waits
for the GPU first (``fence``), and from a small reply's pageable frames ``copy_(host, non_blocking=True)``
returns once the driver has the bytes.
"""

from __future__ import annotations

import ctypes

import torch


class Copies:
    """Device-to-host copies queued for one request; ``wait`` before the host tensors are read."""

    def __init__(self):
        self._queued = False

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself if it is on the CPU, else a pinned host tensor its values are on their way into."""
        if t.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return self.into(host, t)

    def into(self, host: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Copy ``t`` (any device, any dtype) into ``host``; returns ``host``."""
        host.copy_(t, non_blocking=t.is_cuda)
        self._queued |= t.is_cuda
        return host

    def fence(self) -> None:
        """Make ``wait`` wait for this process's GPU work even with no copy queued: pinned memory the GPU may
        still be reading (a lane's values) is about to be handed to a ps that writes it."""
        self._queued = True

    def wait(self) -> None:
        if self._queued:
            torch.cuda.synchronize()
        self._queued = False


def pin(address: int, size: int) -> bool:
    """Page-lock ``size`` bytes at ``address`` for CUDA's copies; False where CUDA refuses (nothing changes)."""
    if int(torch.cuda.cudart().cudaHostRegister(address, size, 0)) == 0:
        return True
    _reset_last_error()
    return False


def _reset_last_error() -> None:
    """A refused cudaHostRegister stays the CUDA runtime's last error, which torch's check after its next kernel
    launch would raise as that kernel's: reset it (cudaGetLastError of each CUDA runtime this process loaded)."""
    with open("/proc/self/maps") as maps:
        runtimes = {line.split(maxsplit=5)[-1].strip() for line in maps if "/libcudart" in line}
    for path in runtimes:
        ctypes.CDLL(path).cudaGetLastError()


def unpin(address: int) -> None:
    """Undo ``pin`` (before the memory is unmapped)."""
    torch.cuda.cudart().cudaHostUnregister(address)
