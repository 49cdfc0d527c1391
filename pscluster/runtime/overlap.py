"""Sync overlap: a worker's push leaves while backward still runs, as DDP's buckets do.

A large push travels in parts (``parts``): a head that describes every tensor, then parts that carry their bytes
in order. ``EarlyPush`` sends a ps's head before backward and each part as soon as backward has produced the
gradients it carries (``register_post_accumulate_grad_hook``), so the transfer, the payload tags on both sides
and the ps's first work on them (a large variable's chunks summed, see ``streamed``) run while backward computes
the earlier layers' gradients. The ps needs nothing new: the push is the same message, its parts only leave
sooner, and the ps applies the step once it has every worker's gradients, as always.

Order: buffers first (their values are final after forward), then the gradients in the order backward produced
them the step before (the first step: the reverse of the model's order, as backward mostly goes). A part leaves
once ``BUCKET_BYTES`` are ready in that order, the small payloads held back for the pack (``protocol``), which
goes last; the rest, and a gradient backward never produced (a layer the
batch did not use: zeros, as without overlap), leave at the end of backward.

Where it applies (``EarlyPush.applies``): sync runs on CPU workers, to each ps whose dense push is at least
``MIN_BYTES`` and holds no sparse variable, over the socket (a ps on the worker's host with a shared-memory lane
reads the values from memory: nothing to overlap), and only where a push, once begun, is never withdrawn or
changed after backward: not with ``max_grad_norm`` (clipping needs every gradient first), nor with
``on_nonfinite="skip"`` or fp16 loss scaling (a batch left out after backward). A non-finite gradient never
leaves: each gradient is checked before it goes, every push of the step stops at the first non-finite one, and
the step fails as it does without overlap. The parts sent before it make messages the ps never completes, so
the step is not applied (a large variable's chunks already in a sync step's sum, see ``streamed``, would count
only as those of any push cut short do: if the worker were declared lost instead of failing the run).
"""

from __future__ import annotations

import torch

from .client import Opened, PSClient
from .plan import TrainPlan, VariableSpec
from .policies import policy_for
from . import protocol
from .protocol import Op
from .update_guard import all_finite

BUCKET_BYTES = 2 << 20  # a part leaves once this much of the push is ready, in order
MIN_BYTES = 2 * BUCKET_BYTES  # a smaller push goes whole after backward: one message costs less than parts


class EarlyPush:
    """The pushes of one worker that leave during backward (see the module): ``begin(step)`` after forward,
    the hooks during backward, ``finish()`` after it, whose requests ``PSClient.send(..., opened=...)`` awaits.
    A push stopped at a non-finite gradient is left out of ``finish()``'s requests (the step's own check fails
    the step)."""

    def __init__(self, shards, client: PSClient, plan: TrainPlan, device: torch.device,
                 wire_dtype: torch.dtype | None):
        """``shards``: the worker's ``member.Shards`` (what each ps holds and what goes on the wire for it)."""
        self._shards, self._client, self._wire_dtype = shards, client, wire_dtype
        self.ps: dict[int, list[VariableSpec]] = {}
        if self.applies(plan, device):
            sparse_ps = {v.ps for v in plan.variables if v.sparse}
            for i, vs in shards.dense.items():
                nbytes = sum(self._like(v).nbytes for v in vs)
                if i not in sparse_ps and not client.has_lane(i) and nbytes >= MIN_BYTES:
                    self.ps[i] = _first_order(vs)
        # id of a parameter -> its trained variables here
        self._of_param = shards.hook_gradients([v for vs in self.ps.values() for v in vs if v.kind == "param"],
                                               self._produced)
        # a parameter whose every part goes in these pushes -> those parts' ids
        self._parts = {pid: {v.id for v in vs} for pid, vs in self._of_param.items()
                       if len(vs) == sum(v.parameter == vs[0].parameter for v in shards.by_id.values())}
        self._open: dict[int, _Push] = {}
        self._seen: list[int] = []  # the variables in the order backward produced their gradients this step
        self._checked_ids: set[int] = set()  # the variables whose gradients were found finite this step
        self.pushes = 0  # pushes that left during backward

    @staticmethod
    def applies(plan: TrainPlan, device: torch.device) -> bool:
        """Whether a run of ``plan`` on a worker of ``device`` may push during backward (see the module)."""
        return (plan.overlap and policy_for(plan).aggregates_steps and device.type == "cpu"
                and plan.max_grad_norm is None and plan.on_nonfinite == "fail" and plan.precision != "fp16"
                and not plan.pipeline)

    def begin(self, step: int) -> None:
        """Send the heads of this step's pushes (gradients computed on global ``step``); call after forward, before
        backward."""
        self._open = {}
        for i, vs in self.ps.items():
            likes = [self._like(v) for v in vs]
            self._open[i] = _Push(self._client.open(i, Op.PUSH_PULL, [v.id for v in vs], likes, step=step), vs,
                                  protocol.pack_layout(likes))
        self._seen, self._checked_ids = [], set()
        for i in self._open:
            self._advance(i)

    def checked(self) -> set[int]:
        """The ids of the parameters whose gradients this step's pushes found finite (the step's own check need
        not look at them again); call after backward."""
        return {pid for pid, parts in self._parts.items() if parts <= self._checked_ids}

    def finish(self) -> dict[int, Opened]:
        """The rest of this step's pushes, sent: what backward did not produce goes now (zeros). Returns the
        requests, for ``PSClient.send(..., opened=...)``."""
        opened = {}
        for i, push in self._open.items():
            push.all_ready()
            self._advance(i, last=True)
            opened[i] = push.request
        if self._open:
            self.pushes += 1
            self._learn_order()
        self._open = {}
        return opened

    def _produced(self, param: torch.Tensor) -> None:
        if not self._open:
            return  # a backward outside the training step, or a step without early pushes
        for v in self._of_param.get(id(param), ()):
            self._seen.append(v.id)
            push = self._open.get(v.ps)
            if push is not None:
                push.ready.add(v.id)
                self._advance(v.ps)

    def _advance(self, i: int, last: bool = False) -> None:
        """Send what ps ``i``'s push has ready, in order, once it makes ``BUCKET_BYTES`` (with ``last``: all)."""
        push = self._open[i]
        while push.next < len(push.order) and push.order[push.next].id in push.ready:
            v = push.order[push.next]
            tensor = self._shards.exchanged(v, self._wire_dtype)
            if v.kind == "param":
                if not all_finite(tensor):
                    self._open, self._checked_ids = {}, set()  # every push of this step stops here; the step's
                    return                                # own check fails the step after backward
                self._checked_ids.add(v.id)
            if push.offsets[push.next] is None:
                push.bucket += protocol.payload_frames(tensor)
                push.bucket_bytes += tensor.numel() * tensor.element_size()
            else:  # a small one: in the pack, the push's last payload
                push.packed.append((push.offsets[push.next], tensor))
            push.next += 1
        if last and push.packed:
            push.bucket.append(protocol.pack_frame(push.packed, push.pack_bytes))
        if push.bucket and (last or push.bucket_bytes >= BUCKET_BYTES):
            push.request.part(push.bucket)
            push.bucket, push.bucket_bytes = [], 0

    def _learn_order(self) -> None:
        """Next step's order for each push: buffers, then the gradients as backward produced them this step,
        then those it did not produce."""
        rank = {vid: k for k, vid in enumerate(dict.fromkeys(self._seen))}
        for i, vs in self.ps.items():
            self.ps[i] = sorted(vs, key=lambda v: (v.kind == "param", rank.get(v.id, len(rank))))

    def _like(self, v: VariableSpec) -> torch.Tensor:
        """``v``'s payload as it travels, on the meta device: its shape and dtype only."""
        return torch.empty(v.shape, dtype=self._shards.on_wire(v, self._wire_dtype), device="meta")


class _Push:
    """One ps's push of the current step: its request, its variables in the order their payloads go, which ones
    backward has produced, the payload frames ready but not sent yet, and the small payloads that go last, in
    the pack (``layout``: ``protocol.pack_layout`` of the payloads)."""

    def __init__(self, request: Opened, order: list[VariableSpec], layout: tuple[list[int | None], int]):
        self.request, self.order = request, order
        self.offsets, self.pack_bytes = layout
        self.packed: list = []  # (offset in the pack, payload)
        self.ready = {v.id for v in order if v.kind != "param"}
        self.next = 0
        self.bucket: list = []
        self.bucket_bytes = 0

    def all_ready(self) -> None:
        self.ready.update(v.id for v in self.order)


def _first_order(vs: list[VariableSpec]) -> list[VariableSpec]:
    """Buffers, then the trained variables in the reverse of the model's order."""
    return [v for v in vs if v.kind != "param"] + [v for v in reversed(vs) if v.kind == "param"]

