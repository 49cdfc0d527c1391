"""The seed of a run: the model's initial values (``build_model``), and each worker's own random streams: torch's,
NumPy's and Python's ``random`` generators seeded from the run's seed, the worker's index and the attempt it trains
in (a run restarted after a lost ps draws new numbers).

``worker_seed(seed, 0, 0) == seed``: the chief of a run's first attempt draws what a plain single-process loop seeded
with ``seed`` draws, so a one-worker run is that loop's equal. Every other (worker, attempt) gets a stream of its own.
"""

from __future__ import annotations

import copy
import ctypes
import random

import numpy
import torch

from ..errors import ConfigError

_WORKER_STRIDE = 1_000_003  # primes: distinct (worker, attempt) pairs give distinct seeds for any run seed
_ATTEMPT_STRIDE = 7_919
_SEED_SPAN = 2**63


def worker_seed(seed: int, worker: int, attempt: int = 0) -> int:
    """The seed of worker ``worker``'s generators in attempt ``attempt`` of a run seeded with ``seed``."""
    return (seed + _WORKER_STRIDE * worker + _ATTEMPT_STRIDE * attempt) % _SEED_SPAN


def seed_worker(seed: int, worker: int, attempt: int = 0) -> int:
    """Seed this process's torch (CPU and CUDA), NumPy and ``random`` generators with ``worker_seed(...)``;
    returns that seed."""
    mine = worker_seed(seed, worker, attempt)
    torch.manual_seed(mine)
    random.seed(mine)
    numpy.random.seed(mine % 2**32)
    return mine


def generator_states() -> tuple:
    """The states of the generators ``seed_worker`` seeds (and CUDA's, once initialized): what ``same_states``
    compares and ``set_generator_states`` puts back."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
    return torch.get_rng_state(), _numpy_state(), random.getstate(), cuda


def same_states(a: tuple, b: tuple) -> bool:
    """Whether two ``generator_states()`` are the same: nothing drew from those generators in between."""
    (torch_a, numpy_a, random_a, cuda_a), (torch_b, numpy_b, random_b, cuda_b) = a, b
    return (random_a == random_b and torch.equal(torch_a, torch_b) and (numpy_a is numpy_b or (
            numpy_a["state"]["pos"] == numpy_b["state"]["pos"] and numpy_a["has_gauss"] == numpy_b["has_gauss"]
            and numpy.array_equal(numpy_a["state"]["key"], numpy_b["state"]["key"])))
            and len(cuda_a) == len(cuda_b) and all(torch.equal(x, y) for x, y in zip(cuda_a, cuda_b)))


def set_generator_states(states: tuple) -> None:
    """Put back what ``generator_states()`` returned."""
    global _numpy_kept
    torch_state, numpy_state, random_state, cuda = states
    torch.set_rng_state(torch_state)
    numpy.random.set_state(numpy_state)
    _numpy_kept = (*_numpy_words(), numpy_state)
    random.setstate(random_state)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


# numpy.random.get_state() copies the 624 words of the generator's key one by one, slower than the rest of a
# ``generator_states()`` together, which a stream takes twice for each batch it reads ahead: the state last taken is
# kept with the generator's words as they were (one copy of their bytes, through its ctypes interface) and given
# again while they are the same. Every draw changes them but one that takes only the normal variate the legacy
# generator keeps from its last pair: a state that keeps one is taken afresh.
_MT19937_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos
_numpy_kept: tuple = (None, b"", None)  # (the bit generator, its words, numpy.random.get_state(legacy=False))


def _numpy_words() -> tuple:
    """NumPy's global bit generator and its state's bytes (b"" for one other than MT19937)."""
    generator = numpy.random.get_bit_generator()
    if type(generator) is not numpy.random.MT19937:
        return generator, b""
    return generator, ctypes.string_at(generator.ctypes.state_address, _MT19937_BYTES)


def _numpy_state() -> dict:
    """``numpy.random.get_state(legacy=False)``, the one kept while the generator's words are unchanged."""
    global _numpy_kept
    generator, words = _numpy_words()
    kept_generator, kept_words, kept = _numpy_kept
    if words and generator is kept_generator and words == kept_words and not kept["has_gauss"]:
        return kept
    state = numpy.random.get_state(legacy=False)
    _numpy_kept = (generator, words, state)
    return state


def build_model(model_fn, seed: int) -> torch.nn.Module:
    """A fresh model: a copy of ``model_fn`` if it is a module, else ``model_fn()`` under ``seed``."""
    torch.manual_seed(seed)
    if isinstance(model_fn, torch.nn.Module):
        return copy.deepcopy(model_fn)
    model = model_fn()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model_fn returned {type(model).__name__}: it must build a torch.nn.Module")
    return model
