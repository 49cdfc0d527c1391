"""A CUDA worker's gradients copied to the host as backward produces them (the GPU's counterpart of ``overlap``).

Without this, a CUDA worker copies every gradient to the host once backward is over, and the GPU's copy engine
idles during backward while the push waits for all of them. ``GradientStaging`` hooks each trained parameter
(``register_post_accumulate_grad_hook``): as soon as backward has queued a gradient, its copy to page-locked
host memory is queued on a side stream, behind that gradient's kernels (the side stream waits for the compute
stream at that point) and alongside the rest of backward. The push then only waits for the side stream
(``take``), and the host memory it sends is already there:

- to a ps with a shared-memory lane: the lane's own gradient slot, page-locked (``PSClient.gradient_slots``),
  so the ps reads what the copy engine wrote, with no copy on the host;
- to a ps over the socket: a page-locked buffer of this worker's per variable, in the gradient's wire dtype.

Only gradients of at least ``MIN_BYTES`` on the wire are staged; the smaller ones are copied after backward with
the buffers. Each hook costs the autograd thread a turn of Python and a few CUDA calls, which a small copy
does not repay (``benchmarks/README.md``, "gpu": a conv net whose 8 gradients all went this way lost 22%).

Each copy writes memory that the previous request read: where it applies (``applies``) the previous reply has
come before the next backward starts, so the ps has read the lane and ZeroMQ has sent the buffers. That rules
out pipelining (the next backward runs while the push is in flight). A gradient that changes after backward
rules it out too: ``max_grad_norm`` (clipped in place) and fp16 (unscaled in place). A gradient backward produced
more than once in a step (a step_fn that calls backward twice) is copied again, on the same stream, so the last
copy wins; one it did not produce this step is left to the push's own copy (zeros, as without staging).
"""

from __future__ import annotations

import math

import torch

from .plan import TrainPlan

MIN_BYTES = 4 << 20  # a smaller gradient is copied after backward (see the module)


class GradientStaging:
    """The host copies of one CUDA worker's dense gradients, made during backward (see the module): ``begin()``
    before each backward, ``take()`` after it."""

    def __init__(self, shards, destinations: dict[int, torch.Tensor], wire_dtype: torch.dtype | None):
        """``shards``: the worker's ``member.Shards``; ``destinations``: host tensors some variables' gradients go into
        (a lane's slots) by variable id; the other staged variables get page-locked buffers here."""
        self._shards = shards
        self._stream = torch.cuda.Stream()
        self._host: dict[int, torch.Tensor] = {}
        self._wire: dict[int, torch.dtype] = {}  # by variable id: the dtype its gradient travels in
        for vs in shards.dense.values():
            for v in vs:
                dtype = shards.on_wire(v, wire_dtype)
                if v.kind != "param" or math.prod(v.shape) * dtype.itemsize < MIN_BYTES:
                    continue
                self._wire[v.id] = dtype
                self._host[v.id] = destinations.get(v.id)
                if self._host[v.id] is None:
                    self._host[v.id] = torch.empty(v.shape, dtype=dtype, pin_memory=True)
        self._copied: set[int] = set()
        self.steps = 0  # steps whose gradients were staged during backward
        # id of a parameter -> its staged variables
        self._of_param = shards.hook_gradients([shards.by_id[vid] for vid in self._host], self._produced)

    @staticmethod
    def applies(plan: TrainPlan, device: torch.device) -> bool:
        """Whether a run of ``plan`` on a worker of ``device`` stages its gradients during backward."""
        return (plan.overlap and device.type == "cuda" and not plan.pipeline and plan.max_grad_norm is None
                and plan.precision != "fp16")

    def begin(self) -> None:
        """Forget the copies of an earlier backward (a batch left out, say); call before each backward."""
        self._copied = set()

    def _produced(self, param: torch.Tensor) -> None:
        compute = torch.cuda.current_stream()
        self._stream.wait_stream(compute)  # behind the kernels that produced this gradient
        with torch.cuda.stream(self._stream), torch.no_grad():
            for v in self._of_param[id(param)]:
                gradient = self._shards.view(v, param.grad)
                gradient.record_stream(self._stream)  # its memory is not reused before the copy has read it
                host = self._host[v.id]
                host.copy_(gradient.to(self._wire[v.id]).to(host.dtype), non_blocking=True)
                self._copied.add(v.id)

    def take(self) -> dict[int, torch.Tensor]:
        """The host tensors this backward's gradients were copied into, by variable id, once every copy is
        done; call after backward."""
        if not self._copied:
            return {}  # nothing handed out: nothing to wait for
        self._stream.synchronize()
        copied, self._copied = {vid: self._host[vid] for vid in self._copied}, set()
        self.steps += 1
        return copied
