"""``ctx.shard``'s stream (``streams.Batches``): batches read ahead during a step's exchange reach the loop in order,
with the random numbers a plain loop's reads and draws would get."""

import random

import numpy
import pytest
import torch

from pscluster.errors import ConfigError
from pscluster.runtime import seeding
from pscluster.runtime.streams import Batches


class Source:
    """Batches 0, 1, 2, ... as tensors; each read draws from ``draws`` (a generator's name) from batch
    ``draws_from`` on; ``reads``: the indices read so far."""

    def __init__(self, draws: str | None = None, draws_from: int = 0, ends_after: int | None = None):
        self.draws, self.draws_from, self.ends_after = draws, draws_from, ends_after
        self.reads: list[int] = []

    def __iter__(self):
        k = 0
        while self.ends_after is None or k < self.ends_after:
            self.reads.append(k)
            noise = 0.0
            if self.draws is not None and k >= self.draws_from:
                noise = {"torch": lambda: torch.rand(()).item(), "numpy": numpy.random.rand,
                         "random": random.random}[self.draws]()
            yield torch.tensor([float(k), noise])
            k += 1
        raise ConfigError("the dataset gave worker 0 no batch")


def stream_of(source: Source) -> tuple[Batches, list[int]]:
    counted: list[int] = []
    return Batches(lambda: iter(source), begin=lambda: None, counted=counted.append, ended=lambda: None), counted


def loop(batches, steps: int, read_ahead=None, draw_between: bool = False) -> list:
    """A loop's view: each step's batch (and, where ``draw_between``, the number it drew after its step)."""
    seen = []
    for _ in range(steps):
        batch = next(batches)
        if read_ahead is not None:
            read_ahead()  # optimizer.step()'s exchange
        seen.append((batch.tolist(), torch.rand(()).item() if draw_between else None))
    return seen


# (a dataset that begins to draw only later, with a loop that draws between its steps, is the one case left out:
# see the module)
@pytest.mark.parametrize("draws, draws_from, draw_between", [
    (draws, 0, between) for draws in (None, "torch", "numpy", "random") for between in (False, True)] + [
    ("torch", 3, False), ("numpy", 3, False), ("random", 3, False)])
def test_the_loop_gets_the_batches_and_numbers_of_a_plain_loop(draws, draws_from, draw_between):
    seeding.seed_worker(5, 0)
    plain = loop(iter(Source(draws, draws_from)), 8, draw_between=draw_between)
    seeding.seed_worker(5, 0)
    batches, counted = stream_of(Source(draws, draws_from))
    assert loop(batches, 8, batches.read_ahead, draw_between) == plain
    assert counted == [2] * 8
    after = seeding.generator_states()
    seeding.seed_worker(5, 0)
    loop(iter(Source(draws, draws_from)), 8, draw_between=draw_between)
    assert seeding.same_states(after, seeding.generator_states())  # and the generators end where a plain loop's do


def test_taking_the_normal_numpy_kept_from_its_last_pair_is_a_draw():
    """It changes no word of NumPy's generator, only the kept normal (a read that draws so is seen drawing), and
    putting the states back gives it back."""
    seeding.seed_worker(5, 0)
    numpy.random.randn()  # the pair's second normal is kept
    before = seeding.generator_states()
    numpy.random.randn()
    assert not seeding.same_states(before, seeding.generator_states())
    seeding.set_generator_states(before)
    assert seeding.same_states(before, seeding.generator_states())


def test_a_clean_stream_is_read_ahead_during_the_exchange_and_a_drawing_one_is_not():
    clean, drawing = Source(), Source("torch")
    for source, read_in_exchange in ((clean, [1, 2, 3]), (drawing, [])):
        batches, _ = stream_of(source)
        in_exchange = []
        for _ in range(3):
            next(batches)
            before = len(source.reads)
            batches.read_ahead()
            in_exchange += source.reads[before:]
        assert in_exchange == read_in_exchange


def test_as_many_batches_are_read_ahead_as_the_loop_takes_a_step():
    source = Source()
    batches, _ = stream_of(source)
    for step in range(3):
        micro = [next(batches).tolist()[0] for _ in range(2)]  # two micro-batches accumulated
        assert micro == [2 * step, 2 * step + 1]
        batches.read_ahead()
        assert len(source.reads) == 2 * step + 4
    batches.read_ahead()  # a second optimizer's step, no batch taken since: nothing more read
    assert len(source.reads) == 8


def test_an_error_of_a_read_ahead_is_raised_when_the_loop_asks_for_that_batch():
    batches, _ = stream_of(Source(ends_after=2))
    next(batches)
    batches.read_ahead()
    next(batches)
    batches.read_ahead()  # the source is exhausted here: the error waits for the loop
    with pytest.raises(ConfigError, match="no batch"):
        next(batches)
