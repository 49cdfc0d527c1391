"""``ctx.shard``'s stream of batches, read ahead while an exchange is in flight.

A user's ``optimizer.step()`` sends its push and waits for the new values; the batches the loop will ask for next do
not depend on those values, so the stream reads them during that wait (``read_ahead``), as ``Cluster.train``'s own
loop reads its next batch while its push-pull is in flight. The loop gets the same batches in the same order.

Reading a batch may draw from the process's random generators (a dataset's random augmentation), and the loop may
draw between ``step()`` and its next batch (a GAN's noise): a batch read early would then take other numbers than a
plain loop's. So a stream reads ahead only while its last read drew nothing (``seeding.same_states`` before and
after each read): a stream whose reads draw is read when the loop asks, as a plain loop reads it. A read ahead that
draws after all (a dataset that begins to draw only later) puts the generators back as they were before it, and
moves them on to where the read left them when the loop takes that batch, unless the loop drew meanwhile.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterator

from ..errors import RunEnded
from . import seeding
from .steps import samples_in


class _Read:
    """A batch read ahead, or what reading it raised; ``states``: the generators' states before and after the
    read, where the read drew from them."""

    __slots__ = ("batch", "error", "states")

    def __init__(self, batch=None, error: BaseException | None = None, states: tuple | None = None):
        self.batch, self.error, self.states = batch, error, states


class Batches:
    """A worker's batches (``make()``: the iterator, made at the first batch asked for), each counted in
    ``counted(samples)``; ``begin()`` runs before each batch is handed out (the worker context's start). The
    iteration ends with the iterator's, or once ``ended()`` gives why the run is over: a loop that never asks
    ``should_stop()`` ends with its data. An iteration that would begin after the run's end raises ``RunEnded``
    instead, so that a loop that asks for epoch after epoch (``while True``) ends too."""

    def __init__(self, make: Callable[[], Iterator], begin: Callable[[], None], counted: Callable[[int], None],
                 ended: Callable[[], str | None], *, first_before_begin: bool = False, always_ahead: bool = False):
        """``first_before_begin``: the first batch is read before ``begin()`` (a worker joins the run with its
        data ready); ``always_ahead``: batches are read ahead even where reading them draws, the loop drawing
        nothing between a step and its next batch (``Cluster.train``'s), and no generator state is compared."""
        self._make, self._begin, self._counted, self._ended = make, begin, counted, ended
        self._first_before_begin, self._always_ahead = first_before_begin, always_ahead
        self._it: Iterator | None = None
        self._ahead: collections.deque[_Read] = collections.deque()
        self._taken = 0  # batches handed out since the last read ahead: how many the loop takes a step
        self._draws = True  # whether the last read drew from the random generators (none seen yet: assumed)
        self._closed = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._first_before_begin and self._it is None and not self._closed:
            self._ahead.append(self._first())
        try:
            self._begin()
        except StopIteration as e:  # a for loop would take it for the end of the data
            raise RuntimeError(f"the run's start raised StopIteration: {e}") from e
        reason = self._ended()
        if reason is not None and self._it is None:
            raise RunEnded(reason)
        if self._closed or reason is not None:
            self.close()
            raise StopIteration
        if self._ahead:
            read = self._ahead.popleft()
            if read.error is not None:
                raise read.error
            if read.states is not None:
                before, after = read.states
                if seeding.same_states(before, seeding.generator_states()):
                    seeding.set_generator_states(after)
            batch = read.batch
        else:
            batch = self._read()
        self._taken += 1
        self._counted(samples_in(batch))
        return batch

    def _first(self) -> _Read:
        """The first batch, read before the run began (what reading it raised, raised when it is handed out)."""
        try:
            return _Read(self._read())
        except (Exception, StopIteration) as e:
            return _Read(error=e)

    def _read(self):
        if self._it is None:
            self._it = self._make()
        if self._always_ahead:
            self._draws = False
            return next(self._it)
        before = seeding.generator_states()
        batch = next(self._it)
        self._draws = not seeding.same_states(before, seeding.generator_states())
        return batch

    def read_ahead(self) -> None:
        """Read as many batches as the loop took since the last call (its batches of a step), unless the last
        read drew from the random generators (see the module; with ``always_ahead``, whether it drew or not); what
        reading raises is raised when the loop asks for that batch."""
        wanted, self._taken = self._taken - len(self._ahead), 0
        for _ in range(wanted):
            if self._draws or self._closed:
                return
            before = None if self._always_ahead else seeding.generator_states()
            try:
                batch = next(self._it)
            except (Exception, StopIteration) as e:
                self._ahead.append(_Read(error=e))
                return
            if before is None or seeding.same_states(before, after := seeding.generator_states()):
                self._ahead.append(_Read(batch))
            else:
                self._draws = True
                seeding.set_generator_states(before)
                self._ahead.append(_Read(batch, states=(before, after)))

    def close(self) -> None:
        """End the iteration: a generator's ``close()``, a DataLoader iterator's loader processes shut down."""
        self._ahead.clear()
        if self._it is not None and not self._closed:
            close = getattr(self._it, "close", None) or getattr(self._it, "_shutdown_workers", None)
            if close is not None:
                close()
        self._closed = True
