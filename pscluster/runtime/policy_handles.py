"""The ps's side of the policy interface (``policies``): ``RunHandle``, the ps as a run's policy sees it
(``policies.Server``), and ``PushRequest``, one push given to the policy (``policies.Push``). Both work on the
run's state and on the few callables the ps gives them; neither holds the ps."""

from __future__ import annotations

import time

from . import updates
from .protocol import Flag, Message, Op


class RunHandle:
    """``policies.Server`` over ``run`` (a ``run_state.RunState``): ``apply(run, grads, count, counts=...)`` is the
    ps's update (``ParameterServer._apply``), ``release(ready)`` answers the held requests that ``ready(request)``
    accepts (``ParameterServer._release_waiting``)."""

    __slots__ = ("_run", "_apply", "_release")

    def __init__(self, run, apply, release):
        self._run, self._apply, self._release = run, apply, release

    step = property(lambda self: self._run.step)
    stopped = property(lambda self: self._run.stopped)
    replicas = property(lambda self: self._run.replicas)
    num_workers = property(lambda self: self._run.num_workers)
    lost = property(lambda self: self._run.lost)
    holding = property(lambda self: bool(self._run.waiting))

    def live(self) -> list[int]:
        return self._run.live()

    def join(self, worker: int) -> None:
        self._run.lost.discard(worker)

    def apply(self, grads: list, count: int = 1, *, counts: bool = True) -> None:
        if self._run.chunk_sums:  # the step's sums of the variables pushes in parts streamed
            self._run.chunk_sums.fold(self._run, grads)
        self._apply(self._run, grads, count, counts=counts)

    def release(self, ready=None) -> None:
        self._release(None if ready is None else lambda req: ready(req.task))


class PushRequest:
    """``policies.Push``: push ``msg`` of connection ``identity`` to ``run``, its ``grads`` and ``buffers`` read
    (``gradients.read_push``), answered through ``reply`` (``ParameterServer._reply``)."""

    __slots__ = ("_run", "_reply", "_identity", "_msg", "_grads", "_buffers", "worker", "step", "optimizer",
                 "wants_values")

    def __init__(self, run, reply, identity: bytes, msg: Message, grads: list, buffers: list, optimizer: int):
        self._run, self._reply, self._identity, self._msg = run, reply, identity, msg
        self._grads, self._buffers = grads, buffers
        self.worker, self.step, self.optimizer = msg.task, msg.step, optimizer
        self.wants_values = msg.op is Op.PUSH_PULL

    def take(self) -> list:
        updates.note_buffers(self._run, self.worker, self._buffers)
        self._run.chunk_sums.take(self._run, self._grads)
        return self._grads

    def reply(self, staleness: int = 0) -> None:
        self._reply(self._identity, self._msg, Op.PARAMS if self.wants_values else Op.OK, value=staleness,
                    with_params=self.wants_values)

    def drop(self, staleness: int) -> None:
        self._run.dropped_stale += 1
        self._reply(self._identity, self._msg, Op.PARAMS if self.wants_values else Op.OK, flags=Flag.DROPPED,
                    value=staleness, with_params=self.wants_values)

    def hold(self, staleness: int = 0) -> None:
        """Held in the run's ``waiting``, with what answering it takes of the request (its frames are released once
        it is handled): its header, and ``staleness`` as the answer's value."""
        msg = self._msg
        header = Message(op=msg.op, flags=msg.flags, task=msg.task, run_id=msg.run_id, request_id=msg.request_id,
                         nonce=msg.nonce, value=staleness)
        self._run.waiting.append((self._identity, header, time.monotonic()))
