"""A synthetic click-through-rate (CTR) dataset of any size, generated lazily from a seed.

The generative model
--------------------
Each row has ``num_fields`` categorical fields. Field ``f`` takes a value ``v_f`` in
``0..cardinality-1`` with probability proportional to ``(v_f + 1) ** -1.1`` (Zipf-like, as in
ad logs: value 0 is the most common, most values are rare). Each ``(f, v_f)`` pair is hashed
into one id space of ``num_buckets`` buckets, and the item ``x`` is the row's ``num_fields``
bucket ids: a bag of ids for ``nn.EmbeddingBag(num_buckets, dim, mode="sum")`` or
``nn.Embedding``. Collisions are part of the hashing trick.

The label ``y`` is 1.0 (a click) with probability ``sigmoid(logit)``, and the ground-truth
logit is a factorization machine::

    logit = bias + sum_f w[f, v_f] + sum_{f < g} <u[f, v_f], u[g, v_g]>

with Gaussian weights ``w`` and 4-dimensional factors ``u`` drawn once from the seed. The
pairwise term carries more signal than the linear one, so a model with interactions (an FM,
embeddings + MLP) clearly beats logistic regression on the ids, which still beats chance.
The bias centres the logit so that about 30% of the rows are clicks.
``CtrDataset.true_logits`` gives the ground truth, hence the best achievable AUC.

Determinism
-----------
Every random number is a splitmix64 hash of counters: the weights hash ``(seed, position)``,
a row's values and label noise hash ``(seed, row, field)``. So ``dataset[i]`` is the same in
any order or batch, in any process and on any machine, and nothing is stored per row. The
test split reads rows ``2**62`` onwards of the same stream: disjoint from train, equally
distributed, same ground truth.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from pscluster.errors import ConfigError

__all__ = ["CtrDataset", "ctr"]

ZIPF_EXPONENT = 1.1
FACTOR_DIM = 4
LINEAR_STD = 1.2  # std of the linear term (its sum over the fields)
PAIRWISE_STD = 2.0  # std of the pairwise term (its sum over the field pairs)
MEAN_LOGIT = -1.3  # the bias centres the logit here: about 30% clicks

_SPLITS = ("train", "test")
_TEST_ROW_OFFSET = 2**62
_MAX_WEIGHTS = 2**24  # num_fields * cardinality: 5 float32 weights each, ~350 MB in all

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# Separate hash streams for the rows, the bucket ids and the two weight arrays.
_ROWS, _BUCKETS, _LINEAR, _FACTORS = 1, 2, 3, 4


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, elementwise on a uint64 array (wrapping arithmetic)."""
    z = x + _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def _stream_key(seed: int, stream: int) -> np.ndarray:
    """A well-mixed 64-bit key for one hash stream of one seed, as a uint64 array of one element.

    An array, not a numpy scalar: scalar arithmetic would warn about the intended wrap-around.
    """
    return _splitmix64(_splitmix64(np.array([seed], dtype=np.uint64)) ^ np.uint64(stream))


def _uniforms(hashes: np.ndarray) -> np.ndarray:
    """Floats in [0, 1) from the top 53 bits of uint64 hashes."""
    return (hashes >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _normals(key: np.ndarray, count: int) -> np.ndarray:
    """``count`` standard normal floats from the hash stream ``key`` (Box-Muller)."""
    pairs = (count + 1) // 2
    u = _uniforms(_splitmix64(key ^ np.arange(2 * pairs, dtype=np.uint64)))
    radius = np.sqrt(-2.0 * np.log1p(-u[:pairs]))  # log1p(-u): u may be 0, 1 - u may not
    angle = 2.0 * math.pi * u[pairs:]
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]


def _zipf_cdf(cardinality: int) -> np.ndarray:
    """Cumulative probabilities of values ``0..cardinality-1``, ``P(v) ~ (v + 1) ** -ZIPF_EXPONENT``."""
    cdf = np.cumsum(np.arange(1, cardinality + 1, dtype=np.float64) ** -ZIPF_EXPONENT)
    cdf /= cdf[-1]
    cdf[-1] = 1.0  # exactly: searchsorted then never passes the last value
    return cdf


def _pairwise(factors: np.ndarray) -> np.ndarray:
    """Sum over field pairs f < g of <factors[..., f, :], factors[..., g, :]>, by the FM identity."""
    total = factors.sum(axis=-2)
    return 0.5 * ((total * total).sum(axis=-1) - (factors * factors).sum(axis=(-2, -1)))


class _GroundTruth(NamedTuple):
    cdf: np.ndarray  # [cardinality] float64: the value distribution of every field
    linear: np.ndarray  # [num_fields, cardinality] float32: w
    factors: np.ndarray  # [num_fields, cardinality, FACTOR_DIM] float32: u
    bias: float


def _ground_truth(seed: int, num_fields: int, cardinality: int) -> _GroundTruth:
    cdf = _zipf_cdf(cardinality)
    num_pairs = max(num_fields * (num_fields - 1) // 2, 1)
    linear_std = LINEAR_STD / math.sqrt(num_fields)
    factor_std = (PAIRWISE_STD**2 / (num_pairs * FACTOR_DIM)) ** 0.25  # a dot product of FACTOR_DIM terms
    linear = _normals(_stream_key(seed, _LINEAR), num_fields * cardinality) * linear_std
    factors = _normals(_stream_key(seed, _FACTORS), num_fields * cardinality * FACTOR_DIM) * factor_std
    linear = linear.reshape(num_fields, cardinality).astype(np.float32)
    factors = factors.reshape(num_fields, cardinality, FACTOR_DIM).astype(np.float32)

    # Centre the expected logit on MEAN_LOGIT: the frequent values' weights would otherwise move
    # the click rate a lot from seed to seed. The fields are independent, so E[pairwise] is the
    # pairwise term of the expected factors.
    probabilities = np.diff(cdf, prepend=0.0)
    mean_linear = (linear * probabilities).sum()
    mean_factors = (factors * probabilities[:, None]).sum(axis=1)
    bias = MEAN_LOGIT - float(mean_linear) - float(_pairwise(mean_factors))
    return _GroundTruth(cdf, linear, factors, bias)


def _check_int(name: str, value, low: int, high: int, fix: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an int, got {type(value).__name__}: {fix}") from None
    if not low <= number <= high or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is out of range: {fix}")
    return number


class CtrDataset(Dataset):
    """Rows of the synthetic CTR dataset: ``x`` is int64 ``[num_fields]`` bucket ids, ``y`` a float32 0/1 label.

    Nothing is stored per row: items are generated on access (see the module docstring for
    the model), and pickling keeps only the parameters; the ground-truth weights are rebuilt
    from the seed on first use, so the dataset ships to another process in a few hundred bytes.
    """

    supports_batch_index = True  # dataset[list_of_indices] gives a whole batch at once

    def __init__(self, rows: int = 1_000_000, seed: int = 0, *, num_fields: int = 8, cardinality: int = 100_000,
                 num_buckets: int = 2**21, split: str = "train"):
        self.rows = _check_int("rows", rows, 1, _TEST_ROW_OFFSET, "pass rows=1 or more, at most 2**62")
        self.seed = _check_int("seed", seed, 0, 2**64 - 1, "pass a seed in [0, 2**64)")
        self.num_fields = _check_int("num_fields", num_fields, 1, 2**16, "pass num_fields=1 or more")
        self.cardinality = _check_int("cardinality", cardinality, 1, 2**32, "pass cardinality=1 or more")
        self.num_buckets = _check_int("num_buckets", num_buckets, 1, 2**62, "pass num_buckets=1 or more")
        if split not in _SPLITS:
            raise ConfigError(f'unknown split {split!r}: use "train" or "test"')
        if self.num_fields * self.cardinality > _MAX_WEIGHTS:
            raise ConfigError(f"num_fields * cardinality = {self.num_fields * self.cardinality:,} values would need "
                              f"too many ground-truth weights: keep it at most {_MAX_WEIGHTS:,}")
        self.split = split
        self._row_offset = np.uint64(_TEST_ROW_OFFSET if split == "test" else 0)
        self._row_key = _stream_key(self.seed, _ROWS)
        self._bucket_key = _stream_key(0, _BUCKETS)  # the same hash of (field, value) for every seed
        self._field_bits = np.arange(self.num_fields, dtype=np.uint64) << np.uint64(32)
        self._truth: _GroundTruth | None = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index):
        """``(ids, label)`` of one row for an int; ``(ids [n, num_fields], labels [n])`` for a slice,
        a list or a 1-D tensor of indices."""
        single, positions = self._positions(index)
        values, label_noise = self._draw(positions)
        clicks = label_noise < 1.0 / (1.0 + np.exp(-self._logits(values, pairwise=True)))
        ids = torch.from_numpy(self._bucket_ids(values))
        labels = torch.from_numpy(clicks.astype(np.float32))
        return (ids[0], labels[0]) if single else (ids, labels)

    def true_logits(self, indices, *, pairwise: bool = True) -> torch.Tensor:
        """The ground-truth logits (float32) of the rows at ``indices`` (an int, a slice, a list or a 1-D tensor).

        Their AUC against the labels is the best any model can reach. With ``pairwise=False``
        the field-pair interaction term is left out: the linear part of the model only.
        """
        single, positions = self._positions(indices)
        logits = torch.from_numpy(self._logits(self._draw(positions)[0], pairwise).astype(np.float32))
        return logits[0] if single else logits

    def __getstate__(self) -> dict:
        return {"rows": self.rows, "seed": self.seed, "num_fields": self.num_fields,
                "cardinality": self.cardinality, "num_buckets": self.num_buckets, "split": self.split}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return (f"CtrDataset(rows={self.rows:_}, seed={self.seed}, split={self.split!r}, "
                f"num_fields={self.num_fields}, num_buckets={self.num_buckets:_})")

    def _ground_truth(self) -> _GroundTruth:
        if self._truth is None:
            self._truth = _ground_truth(self.seed, self.num_fields, self.cardinality)
        return self._truth

    def _positions(self, index) -> tuple[bool, np.ndarray]:
        """(whether ``index`` names one row, the int64 row numbers it names), range-checked."""
        if isinstance(index, slice):
            return False, np.arange(*index.indices(self.rows), dtype=np.int64)
        array = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index)
        if array.ndim > 1 or (array.size and array.dtype.kind not in "iu"):
            raise TypeError(f"index CtrDataset with an int, a slice or a 1-D sequence of ints, not {index!r:.80}")
        positions = array.reshape(-1).astype(np.int64)
        positions = np.where(positions < 0, positions + self.rows, positions)
        if positions.size and (positions.min() < 0 or positions.max() >= self.rows):
            bad = array.reshape(-1)[(positions < 0) | (positions >= self.rows)][0]
            raise IndexError(f"row {bad} is out of range for a CtrDataset of {self.rows} rows")
        return array.ndim == 0, positions

    def _draw(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The field values [n, num_fields] and the label noise [n] in [0, 1) of rows ``positions``."""
        row_keys = _splitmix64(self._row_key ^ (positions.astype(np.uint64) + self._row_offset))
        slots = np.arange(self.num_fields + 1, dtype=np.uint64)  # one per field, then the label
        uniforms = _uniforms(_splitmix64(row_keys[:, None] + slots))
        values = np.searchsorted(self._ground_truth().cdf, uniforms[:, :-1], side="right")
        return values, uniforms[:, -1]

    def _bucket_ids(self, values: np.ndarray) -> np.ndarray:
        hashes = _splitmix64(self._bucket_key ^ (self._field_bits | values.astype(np.uint64)))
        return (hashes % np.uint64(self.num_buckets)).astype(np.int64)

    def _logits(self, values: np.ndarray, pairwise: bool) -> np.ndarray:
        truth = self._ground_truth()
        fields = np.arange(self.num_fields)
        logits = truth.bias + truth.linear[fields, values].astype(np.float64).sum(axis=1)
        if pairwise:
            logits += _pairwise(truth.factors[fields, values].astype(np.float64))
        return logits


def ctr(rows: int = 1_000_000, seed: int = 0, *, num_fields: int = 8, cardinality: int = 100_000,
        num_buckets: int = 2**21, split: str = "train") -> CtrDataset:
    """A synthetic click-through dataset of ``rows`` rows: hashed categorical ids and 0/1 click labels.

    ``num_fields`` categorical fields of ``cardinality`` Zipf-distributed values each are hashed
    into ``num_buckets`` ids (the size of the embedding table to train); the labels follow a
    factorization machine drawn from ``seed`` (see ``pscluster.ctr``). Rows are generated on
    access, so any ``rows`` costs nothing up front. ``split="test"`` gives rows disjoint from
    ``"train"`` with the same ground truth.
    """
    return CtrDataset(rows, seed, num_fields=num_fields, cardinality=cardinality, num_buckets=num_buckets,
                      split=split)
