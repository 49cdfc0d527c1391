"""Gradients applied as they arrive: the parts of an async (or SSP) push of a large variable (see ``parts``) are
applied by the ps chunk by chunk, each as soon as its part is checked, instead of put together first. The
transfer, the check of each part and the update overlap, and the ps never holds the gradient whole: with Adam it
holds the variables, the optimizer's state and the chunks in flight.

What is streamed: each dense trained variable of the push whose gradient travels in more than one payload frame
(``protocol.CHUNK_BYTES``) and whose optimizer steps it in chunks of one frame's elements (``optim.ELEMENTWISE``
optimizers, see ``optim.build``; plain SGD adds ``-lr * chunk`` itself). Everything else in the push (buffers,
sparse rows, smaller variables) is put together and applied once the push is whole, with what every push does
then: the global step, checkpoints, the reply. A streamed variable's gradient stays on the meta device in the
whole message: ``ParameterServer._apply`` skips it, it has been applied.

Semantics: async without locking, as TensorFlow's async ps: a pull or another worker's push served while a push's
parts arrive sees the variables with the chunks applied so far, and the global step counts the push once it is
whole. A chunk is applied only while its run goes on (not stopped, not replaced by another INIT), so a stopped
run's final checkpoint holds its final values. A push whose sender is lost midway stays applied in part; each
chunk's optimizer state counts its own steps, and a checkpoint keeps the first chunk's count.
"""

from __future__ import annotations

import torch

from . import protocol
from .protocol import Flag, Message, Op


class StreamedPush:
    """The streamed variables of one push (``positions``: tensor position in the push -> variable index in the
    run) and what applies their chunks (``take``, called by ``parts.Assembly``)."""

    def __init__(self, server, run, positions: dict[int, int]):
        self._server, self._run = server, run
        self.positions = positions

    def take(self, position: int, chunk: int, values: torch.Tensor) -> None:
        """Apply chunk ``chunk`` (1-D ``values``, read-only and alive during this call only) of the gradient at
        ``position`` in the push, with the learning rate of the run's current step."""
        run = self._run
        if self._server.run is not run or run.stopped:
            return
        param = run.params[self.positions[position]]
        grad = values if values.dtype == param.dtype else values.float()  # mixed precision
        run.release_sent()  # the replies that send the variables without a copy are done before they change
        run.snapshot = None  # and the next reply tags the values anew
        lr = run.optimizer.plain_sgd_rate(run.step)
        with torch.no_grad():
            if lr is None:
                run.optimizer.step_chunk(run.step, param, chunk, grad)
            else:
                start = chunk * run.optimizer.chunk_numel(param)
                param.detach().view(-1)[start:start + grad.numel()].add_(grad, alpha=-lr)


def streamed_push(server, run, head: Message) -> StreamedPush | None:
    """The stream that applies the large variables of ``head`` (a push whose payloads follow in parts) as they
    arrive, or None where the push is put together first: not an async or SSP push of the running run, a push
    the ps would refuse or hold, or nothing in it to stream."""
    if (head.op not in (Op.PUSH, Op.PUSH_PULL) or run is None or run.run_id != head.run_id or run.stopped
            or run.mode == "sync" or head.flags & Flag.SHARED or head.task == protocol.NO_TASK
            or head.task >= run.num_workers or not 0 <= head.step <= run.steps
            or run.park_at is not None and run.step >= run.park_at):
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
    return StreamedPush(server, run, positions) if positions else None
