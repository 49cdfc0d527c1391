"""Small datasets for training examples and tests.

``digits`` wraps scikit-learn's bundled 8x8 digits (no download) with a fixed
train/test split. ``read_idx``/``write_idx`` handle the IDX format of MNIST
and its relatives, and ``idx`` turns an images/labels file pair into a dataset.
``ctr`` (from ``pscluster.ctr``) generates click-through rows of hashed ids lazily, from a seed.

Every other dataset yields ``(float32 features, int64 label)`` pairs, exposes the
whole split as ``tensors()``, and accepts a list or 1-D tensor of indices in
``__getitem__`` to return a whole batch at once.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from pscluster.ctr import CtrDataset, ctr
from pscluster.errors import ConfigError

__all__ = ["CtrDataset", "Digits", "IdxDataset", "ctr", "digits", "idx", "read_idx", "write_idx"]

_SPLITS = ("train", "test")
_TRAIN_FRACTION = 0.8
_GZIP_MAGIC = b"\x1f\x8b"

# IDX type code -> big-endian numpy dtype, as the format defines them.
_IDX_TYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {
    torch.uint8: 0x08,
    torch.int8: 0x09,
    torch.int16: 0x0B,
    torch.int32: 0x0C,
    torch.float32: 0x0D,
    torch.float64: 0x0E,
}


class _TensorPairs(Dataset):
    """Indexing shared by the datasets: subclasses provide ``tensors()``."""

    supports_batch_index = True  # dataset[list_of_indices] gives a whole batch at once

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.tensors()[1])

    def __getitem__(self, index):
        # An int gives one (x, y) pair; a list or 1-D tensor gives a batch.
        X, y = self.tensors()
        return X[index], y[index]


class Digits(_TensorPairs):
    """One split of scikit-learn's 8x8 digits: x is float32 [64] in [0, 1], y is int64.

    The data loads on first use, and pickling keeps only the split name, so
    the dataset ships to another process in a few bytes and reloads there.
    """

    def __init__(self, split: str = "train"):
        if split not in _SPLITS:
            raise ConfigError(f'unknown split {split!r}: use "train" or "test"')
        self.split = split
        self._data: tuple[torch.Tensor, torch.Tensor] | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the whole split as ``(X, y)``: float32 [n, 64] and int64 [n]."""
        if self._data is None:
            self._data = _load_digits(self.split)
        return self._data

    def __getstate__(self) -> str:
        return self.split

    def __setstate__(self, split: str) -> None:
        self.__init__(split)

    def __repr__(self) -> str:
        return f"Digits(split={self.split!r}, n={len(self)})"


def digits(split: str = "train") -> Digits:
    """Return the ``"train"`` (1437 images) or ``"test"`` (360 images) split of the digits.

    The split is fixed: a permutation from ``numpy.random.default_rng(0)``
    whose first 80% is train and the rest test.
    """
    return Digits(split)


@functools.cache
def _digits_table() -> np.ndarray:
    """scikit-learn's digits as one table, a row per image: its 64 pixels (0-16), then its label; read-only, read
    once a process (a worker's next attempt after a lost ps read it again: 0.1 s on a loaded engine). Read from
    the file scikit-learn bundles, without importing scikit-learn: that import costs a second of CPU in every
    process that loads the digits (a worker that replaces a lost one waited on it)."""
    found = importlib.util.find_spec("sklearn")
    table = None
    for folder in (found.submodule_search_locations or []) if found else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.exists():
            table = np.loadtxt(path, delimiter=",")
            break
    if table is None:
        from sklearn.datasets import load_digits  # a scikit-learn that keeps the file elsewhere

        bunch = load_digits()
        table = np.column_stack([bunch.data, bunch.target])
    table.setflags(write=False)
    return table


def _load_digits(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    table = _digits_table()
    order = np.random.default_rng(0).permutation(len(table))
    n_train = int(_TRAIN_FRACTION * len(order))
    rows = table[order[:n_train] if split == "train" else order[n_train:]]
    X = torch.from_numpy(rows[:, :-1] / 16.0).to(torch.float32)
    y = torch.from_numpy(rows[:, -1]).to(torch.int64)
    return X, y


def read_idx(path: str | os.PathLike) -> torch.Tensor:
    """Read an IDX file (plain or gzip-compressed) into a tensor of its stored type and shape.

    Compression is detected from the content, not the file name. Raises
    ConfigError when the file is missing, malformed or truncated.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such IDX file: check the path") from None
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise ConfigError(f"{path}: broken gzip data ({exc}): fetch the file again") from None

    if len(data) < 4:
        raise ConfigError(f"{path}: {len(data)} bytes is shorter than the 4-byte IDX header: fetch the file again")
    if data[:2] != b"\x00\x00":
        raise ConfigError(f"{path}: not an IDX file (magic starts with {data[:2].hex()}, not 0000): pass an IDX file")
    code, ndim = data[2], data[3]
    if code not in _IDX_TYPES:
        known = ", ".join(f"0x{c:02X}" for c in _IDX_TYPES)
        raise ConfigError(f"{path}: unknown IDX type code 0x{code:02X}: the file must use one of {known}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ConfigError(f"{path}: file ends inside the header of {ndim} dimensions: fetch the file again")

    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = _IDX_TYPES[code]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise ConfigError(
            f"{path}: shape {list(shape)} needs {expected} data bytes but the file has "
            f"{len(data) - header}: the file is truncated or corrupt, fetch it again"
        )
    array = np.frombuffer(data, dtype, offset=header).reshape(shape)
    return torch.from_numpy(array.astype(dtype.newbyteorder("=")))


def write_idx(path: str | os.PathLike, tensor: torch.Tensor) -> None:
    """Write a uint8, int8, int16, int32, float32 or float64 tensor as an IDX file.

    The file is gzip-compressed when ``path`` ends in ``.gz``.
    """
    if tensor.dtype not in _IDX_CODES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _IDX_CODES)
        raise ConfigError(f"write_idx cannot store {tensor.dtype}: convert the tensor to one of {names}")
    code = _IDX_CODES[tensor.dtype]
    array = tensor.detach().cpu().numpy()
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(_IDX_TYPES[code]).tobytes()
    if os.fspath(path).endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    with open(path, "wb") as f:
        f.write(payload)


class IdxDataset(_TensorPairs):
    """Images and labels from a pair of IDX files, as ``(float32 image, int64 label)`` pairs.

    Images are multiplied by ``scale`` (1/255 maps bytes to [0, 1]) and, with
    ``flatten``, reshaped to one row per image.
    """

    def __init__(
        self,
        images_path: str | os.PathLike,
        labels_path: str | os.PathLike,
        *,
        scale: float = 1 / 255,
        flatten: bool = True,
    ):
        images, labels = read_idx(images_path), read_idx(labels_path)
        if len(images) != len(labels):
            raise ConfigError(
                f"{images_path} holds {len(images)} images but {labels_path} holds "
                f"{len(labels)} labels: pass matching images and labels files"
            )
        X = images.to(torch.float32) * scale
        self._X = X.reshape(len(X), -1) if flatten else X
        self._y = labels.to(torch.int64)
        self.images_path = images_path

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return all images and labels as ``(X, y)``."""
        return self._X, self._y

    def __repr__(self) -> str:
        return f"IdxDataset({os.fspath(self.images_path)!r}, n={len(self)})"


def idx(images_path: str | os.PathLike, labels_path: str | os.PathLike, **kw) -> IdxDataset:
    """Return an ``IdxDataset`` over an images/labels IDX file pair; ``kw`` goes to it."""
    return IdxDataset(images_path, labels_path, **kw)
