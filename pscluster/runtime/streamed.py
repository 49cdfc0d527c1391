"""Large variables updated chunk by chunk as their gradients arrive. A push of more than 8 MiB comes in parts (see
``parts``); the ps takes each chunk of a large variable's gradient as soon as its part is checked, instead of
putting the gradient together first, so the transfer, the checks and the update overlap, and the ps never holds
such a gradient whole: with Adam it holds the variables, the optimizer's state and the chunks in flight.

What is taken in chunks: each dense trained variable of a push whose gradient travels in more than one payload
frame (``protocol.CHUNK_BYTES``) and whose optimizer steps it in chunks of one frame's elements
(``optim.ELEMENTWISE`` optimizers, see ``optim.build``; plain SGD adds ``-lr * chunk`` itself). Everything else in
the push (buffers, sparse rows, smaller variables) is put together and applied once the push is whole, with what
every push does then: the global step, checkpoints, the reply. A streamed variable's gradient stays on the meta
device in the whole message: ``updates.apply`` skips it, it has been taken.

Async and SSP apply each chunk as it arrives (``StreamedPush``): lock-free, as TensorFlow's async ps without
use_locking, a pull or another worker's push served while a push's parts arrive sees the variables with the
chunks applied so far, and the global step counts the push once it is whole.

Sync sums each chunk of a push in parts into the step's sum as it arrives (``ChunkSums``; a whole push of the
same step adds into the same sum) and applies the step once it has its gradients, as for any push: one averaged
update of every variable, never a part of one. A push of a step that has moved on stops being taken.

A chunk is taken only while its run goes on (not stopped, not replaced by another INIT), so a stopped run's final
checkpoint holds its final values. A push whose sender is lost midway stays taken in part (async: applied in
part; sync: its chunks so far in the step's sum); each chunk's optimizer state counts its own steps, and a
checkpoint keeps the first chunk's count.
"""

from __future__ import annotations

import torch

from ..errors import NonFiniteUpdate
from . import protocol, update_guard
from .protocol import Flag, Message, Op


def apply_chunk(run, i: int, k: int, grad: torch.Tensor) -> None:
    """Update chunk ``k`` of variable ``i`` of ``run`` with ``grad`` (its 1-D gradient, which the optimizer may
    change), with the learning rate of the run's current step; NonFiniteUpdate, the chunk as it was, when it would
    make a value or a slot NaN or infinite (the chunks of the push taken before it stay: async is lock-free)."""
    run.release_sent()  # the replies that send the variables without a copy are done before they change
    run.snapshot = None  # and the next reply tags the values anew
    param = run.params[i]
    lr = run.optimizer.plain_sgd_rate(run.step)
    run.value_bound = None  # the ps's bound of its values (``update_guard.sgd_step``) is measured again
    with torch.no_grad():
        if lr is None:
            run.optimizer.step_chunk(run.step, param, k, grad)
        else:
            start, end = run.optimizer.chunk_bounds(param)[k]
            update_guard.sgd_step([param.detach().view(-1)[start:end]], [grad], lr, None)


class ChunkSums:
    """Sync: the current step's gradients of the variables pushes in parts streamed, summed chunk by chunk as they
    arrive, with how many each chunk has. The step's update stays whole: ``fold`` hands the sums to it once the
    step has its gradients, so no variable changes before the step does (a checkpoint or a stop in the middle of a
    step sees the values of the step before)."""

    def __init__(self):
        self._sums: dict[int, torch.Tensor] = {}  # variable -> its chunks' sums (flat), kept for the next steps
        self._counts: dict[int, list[int]] = {}  # variable -> per chunk, the gradients summed this step

    def __len__(self) -> int:
        """How many variables have gradients summed here this step."""
        return len(self._counts)

    def __contains__(self, i: int) -> bool:
        """Whether variable ``i`` has gradients summed here this step."""
        return i in self._counts

    def add(self, run, i: int, k: int, grad: torch.Tensor) -> None:
        """Sum ``grad`` (1-D, alive during this call only) into chunk ``k`` of variable ``i``."""
        param = run.params[i]
        bounds = run.optimizer.chunk_bounds(param)
        counts = self._counts.setdefault(i, [0] * len(bounds))
        start, end = bounds[k]
        chunk = self._sums.setdefault(i, torch.empty(param.numel(), dtype=param.dtype))[start:end]
        if counts[k] == 0:
            chunk.copy_(grad)
        else:
            chunk.add_(grad)
        counts[k] += 1

    def take(self, run, grads: list) -> None:
        """Of a whole push of the current step (``grads``: its gradient of each trained variable), the gradients of
        the variables summed here this step: added here, and left in ``grads`` on the meta device."""
        if not self:  # no push in parts this step: nearly every sync step
            return
        for j, i in enumerate(run.trained):
            grad = grads[j]
            if isinstance(grad, torch.Tensor) and not grad.is_meta and i in self:
                flat = grad.reshape(-1)
                for k, (start, end) in enumerate(run.optimizer.chunk_bounds(run.params[i])):
                    self.add(run, i, k, flat[start:end])
                grads[j] = torch.empty(grad.shape, dtype=grad.dtype, device="meta")

    def fold(self, run, accum: list) -> None:
        """Add the sums into ``accum`` (the step's summed gradient of each trained variable, on the meta device
        where every gradient so far was summed here), and start the next step. A push cut short (its sender lost)
        reached a variable's first chunks only: each chunk's sum is scaled to the pushes that reached every chunk
        (the step's count), as the mean of what reached it; with none, the variable's sum here is zero."""
        for i, counts in self._counts.items():
            total, complete = self._sums[i], min(counts)
            for count, (start, end) in zip(counts, run.optimizer.chunk_bounds(run.params[i])):
                if not complete:
                    total[start:end].zero_()
                elif count != complete:
                    total[start:end].mul_(complete / count)
            j = run.trained.index(i)
            total = total.view(run.params[i].shape)
            if accum[j].is_meta:
                accum[j] = total
            else:
                accum[j].add_(total)
        self._counts = {}


class StreamedPush:
    """The streamed variables of one push (``positions``: tensor position in the push -> variable index in the
    run) and what takes their chunks (``take``, called by ``parts.Assembly``)."""

    def __init__(self, server, run, head: Message, positions: dict[int, int]):
        self._server, self._run, self._step = server, run, head.step
        self.positions = positions

    def take(self, position: int, chunk: int, values: torch.Tensor) -> None:
        """Take chunk ``chunk`` (1-D ``values``, alive during this call only) of the gradient at ``position`` in the
        push: async, applied; sync, summed into its step's (see ``ChunkSums``)."""
        run = self._run
        if self._server.run is not run or run.stopped or run.refused_update:
            return
        i = self.positions[position]
        if run.policy.aggregates_steps:
            if run.step == self._step:
                run.chunk_sums.add(run, i, chunk, values)
            return
        try:
            apply_chunk(run, i, chunk, values if values.dtype == run.params[i].dtype else values.float())
        except NonFiniteUpdate as e:
            self._server.refuse_update(run, e)


def streamed_push(server, run, head: Message) -> StreamedPush | None:
    """What takes the large variables of ``head`` (a push whose payloads follow in parts) as they arrive, or None
    where the push is put together first: not a push of the running run, a push the ps would refuse, hold or
    drop as stale (sync), or nothing in it to stream."""
    if (head.op not in (Op.PUSH, Op.PUSH_PULL) or run is None or run.run_id != head.run_id or run.stopped
            or head.flags & Flag.SHARED or head.task == protocol.NO_TASK or head.task >= run.num_workers
            or not 0 <= head.step <= run.steps or run.park_at is not None and run.step >= run.park_at
            or run.policy.aggregates_steps and head.step != run.step):
        return None
    try:
        server._gradients(run, head)  # what can be checked of it before its payloads arrive
    except protocol.ProtocolError:
        return None
    positions = {}
    for k, (vid, grad) in enumerate(zip(head.ids, head.tensors)):
        i = run.position[vid]
        if run.kinds[i] != "param" or run.sparse[i]:
            continue
        frame_numel = protocol.CHUNK_BYTES // grad.element_size()
        if grad.numel() > frame_numel and run.optimizer.chunk_numel(run.params[i]) == frame_numel:
            positions[k] = i
    return StreamedPush(server, run, head, positions) if positions else None
