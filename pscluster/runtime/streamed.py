"""Large variables updated chunk by chunk as their gradients arrive. A push of more than 8 MiB comes in parts (see
``parts``); the ps takes each chunk of a large variable's gradient as soon as its part is checked, instead of
putting the gradient together first, so the transfer, the checks and the update overlap, and the ps never holds
such a gradient whole: with Adam it holds the variables, the optimizer's state and the chunks in flight.

What is taken in chunks: each dense trained variable of a push whose gradient travels in more than one payload
frame (``protocol.CHUNK_BYTES``) and whose optimizer steps it in chunks of one frame's elements
(``optim.ELEMENTWISE`` optimizers, see ``optim.build``; plain SGD adds ``-lr * chunk`` itself). Everything else in
the push (buffers, sparse rows, smaller variables) is put together and applied once the push is whole, with what
every push does then: the global step, checkpoints, the reply. A streamed variable's gradient stays on the meta
device in the whole message: ``ParameterServer._apply`` skips it, it has been taken.

Async and SSP apply each chunk as it arrives (``StreamedPush``): lock-free, as TensorFlow's async ps without
use_locking, a pull or another worker's push served while a push's parts arrive sees the variables with the
chunks applied so far, and the global step counts the push once it is whole.

Sync sums each chunk of the step's gradients as they arrive (``ChunkSums``, for pushes in parts and whole ones
alike) and applies the chunk's mean as soon as it has the step's ``replicas_now()`` gradients: the last
replica's parts are applied as they arrive. The step is one averaged update of every variable, as before; the
replies wait for the whole step. A push of a step that has moved on stops being taken.

A chunk is taken only while its run goes on (not stopped, not replaced by another INIT), so a stopped run's final
checkpoint holds its final values. A push whose sender is lost midway stays taken in part (async: applied in
part; sync: its chunks so far in the step's means); each chunk's optimizer state counts its own steps, and a
checkpoint keeps the first chunk's count.
"""

from __future__ import annotations

import torch

from . import protocol
from .protocol import Flag, Message, Op


def chunk_bounds(run, i: int, k: int) -> tuple[int, int]:
    """The elements of chunk ``k`` of variable ``i`` of ``run`` (one stepped in chunks)."""
    numel = run.optimizer.chunk_numel(run.params[i])
    return k * numel, min((k + 1) * numel, run.params[i].numel())


def apply_chunk(run, i: int, k: int, grad: torch.Tensor) -> None:
    """Update chunk ``k`` of variable ``i`` of ``run`` with ``grad`` (its 1-D gradient, which the optimizer may
    change), with the learning rate of the run's current step."""
    run.release_sent()  # the replies that send the variables without a copy are done before they change
    run.snapshot = None  # and the next reply tags the values anew
    param = run.params[i]
    lr = run.optimizer.plain_sgd_rate(run.step)
    with torch.no_grad():
        if lr is None:
            run.optimizer.step_chunk(run.step, param, k, grad)
        else:
            start, end = chunk_bounds(run, i, k)
            param.detach().view(-1)[start:end].add_(grad, alpha=-lr)


class ChunkSums:
    """Sync: the current step's gradients of each variable stepped in chunks, summed chunk by chunk, and how many
    each chunk has; a chunk is applied once it has the step's ``replicas_now()`` (``finish`` applies those with
    fewer, when the step ends short of its gradients: workers lost)."""

    def __init__(self):
        self._sums: dict[int, torch.Tensor] = {}  # variable -> its chunks' sums (flat), kept for the next steps
        self._counts: dict[int, list[int]] = {}  # variable -> per chunk, the gradients summed; APPLIED once applied

    APPLIED = -1

    def add(self, run, i: int, k: int, grad: torch.Tensor) -> None:
        """Sum ``grad`` (1-D, alive during this call only) into chunk ``k`` of variable ``i``; apply the chunk
        once it has the step's gradients. A gradient of a chunk already applied this step is dropped."""
        param = run.params[i]
        counts = self._counts.setdefault(i, [0] * -(-param.numel() // run.optimizer.chunk_numel(param)))
        if counts[k] == self.APPLIED:
            return
        if counts[k] == 0 and run.replicas_now() == 1:  # nothing to sum: applied from where it arrived
            counts[k] = self.APPLIED
            apply_chunk(run, i, k, grad if grad.dtype == param.dtype else grad.float())
            return
        start, end = chunk_bounds(run, i, k)
        chunk = self._sums.setdefault(i, torch.empty(param.numel(), dtype=param.dtype))[start:end]
        if counts[k] == 0:
            chunk.copy_(grad)
        else:
            chunk.add_(grad)
        counts[k] += 1
        if counts[k] >= run.replicas_now():
            self._apply(run, i, k, chunk, counts)

    def finish(self, run) -> None:
        """The step ends: apply each chunk that has gradients and was not applied, and start the next step."""
        for i, counts in self._counts.items():
            for k, count in enumerate(counts):
                if count > 0:
                    start, end = chunk_bounds(run, i, k)
                    self._apply(run, i, k, self._sums[i][start:end], counts)
        self._counts = {}

    def _apply(self, run, i: int, k: int, chunk: torch.Tensor, counts: list[int]) -> None:
        if counts[k] > 1:
            chunk.div_(counts[k])
        counts[k] = self.APPLIED
        apply_chunk(run, i, k, chunk)


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
        if self._server.run is not run or run.stopped:
            return
        i = self.positions[position]
        if run.mode == "sync":
            if run.step == self._step:
                run.chunk_sums.add(run, i, chunk, values)
            return
        apply_chunk(run, i, chunk, values if values.dtype == run.params[i].dtype else values.float())


def streamed_push(server, run, head: Message) -> StreamedPush | None:
    """What takes the large variables of ``head`` (a push whose payloads follow in parts) as they arrive, or None
    where the push is put together first: not a push of the running run, a push the ps would refuse, hold or
    drop as stale (sync), or nothing in it to stream."""
    if (head.op not in (Op.PUSH, Op.PUSH_PULL) or run is None or run.run_id != head.run_id or run.stopped
            or head.flags & Flag.SHARED or head.task == protocol.NO_TASK or head.task >= run.num_workers
            or not 0 <= head.step <= run.steps or run.park_at is not None and run.step >= run.park_at
            or run.mode == "sync" and head.step != run.step):
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
