import gzip
import hashlib
import pickle
import struct
import subprocess
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from pscluster import datasets
from pscluster.datasets import Digits, IdxDataset, digits, idx, read_idx, write_idx
from pscluster.errors import ConfigError


@pytest.fixture(scope="module")
def train_split():
    return digits("train")


@pytest.fixture(scope="module")
def test_split():
    return digits("test")


def _row_hashes(X):
    return {hashlib.sha1(row.numpy().tobytes()).hexdigest() for row in X}


# --- digits -----------------------------------------------------------------


def test_digits_split_sizes(train_split, test_split):
    assert len(train_split) == 1437
    assert len(test_split) == 360
    assert train_split.tensors()[0].shape == (1437, 64)
    assert test_split.tensors()[0].shape == (360, 64)


def test_digits_splits_are_disjoint_and_cover_the_data(train_split, test_split):
    from sklearn.datasets import load_digits

    train_rows = _row_hashes(train_split.tensors()[0])
    test_rows = _row_hashes(test_split.tensors()[0])
    assert not train_rows & test_rows
    all_rows = _row_hashes(torch.from_numpy(load_digits().data / 16.0).to(torch.float32))
    assert train_rows | test_rows == all_rows


def test_digits_are_scikit_learns_split_as_before_read_without_importing_it(train_split, test_split):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    order = np.random.default_rng(0).permutation(len(bunch.target))
    for split, rows in ((train_split, order[:1437]), (test_split, order[1437:])):
        X, y = split.tensors()
        assert torch.equal(X, torch.from_numpy(bunch.data[rows] / 16.0).to(torch.float32))
        assert torch.equal(y, torch.from_numpy(bunch.target[rows]).to(torch.int64))
    # a worker process that loads the digits does not pay for importing scikit-learn (a second of CPU)
    code = ("import sys\nfrom pscluster.datasets import digits\ndigits('train').tensors()\n"
            "print('sklearn' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_digits_values_and_dtypes(train_split):
    x, y = train_split[0]
    assert x.dtype == torch.float32 and x.shape == (64,)
    assert y.dtype == torch.int64 and y.shape == ()
    X, Y = train_split.tensors()
    assert X.min() == 0.0 and X.max() == 1.0
    # pixels are integers 0..16 before scaling
    assert torch.equal(X * 16, (X * 16).round())
    assert set(Y.tolist()) == set(range(10))


def test_digits_is_deterministic(train_split):
    X1, y1 = train_split.tensors()
    X2, y2 = digits("train").tensors()
    assert torch.equal(X1, X2) and torch.equal(y1, y2)


def test_digits_batched_indexing(train_split):
    X, y = train_split.tensors()
    for index in ([3, 0, 7], torch.tensor([3, 0, 7])):
        xb, yb = train_split[index]
        assert xb.shape == (3, 64) and yb.shape == (3,)
        assert torch.equal(xb, X[[3, 0, 7]]) and torch.equal(yb, y[[3, 0, 7]])
    assert torch.equal(train_split[5][0], X[5]) and train_split[5][1] == y[5]


def test_digits_out_of_range_index_raises_index_error(test_split):
    with pytest.raises(IndexError):
        test_split[360]


def test_digits_loads_lazily_and_pickles_small():
    ds = Digits("test")
    assert ds._data is None
    blob = pickle.dumps(ds)
    assert len(blob) < 200
    ds[0]
    loaded_blob = pickle.dumps(ds)
    assert len(loaded_blob) < 200
    copy = pickle.loads(loaded_blob)
    assert copy._data is None
    assert len(copy) == 360
    for i in (0, 17, 359):
        assert torch.equal(copy[i][0], ds[i][0]) and copy[i][1] == ds[i][1]
    assert len(cloudpickle.dumps(ds)) < 200


def test_digits_are_read_from_their_file_once_a_process(monkeypatch):
    # a worker's next attempt after a lost ps unpickles the dataset anew: it read the file again, on a loaded engine
    datasets._digits_table()
    monkeypatch.setattr(datasets.np, "loadtxt", lambda *a, **k: pytest.fail("the digits' file read again"))
    ds = pickle.loads(pickle.dumps(Digits("train")))
    assert len(ds) == 1437 and ds[0][0].shape == (64,)
    with pytest.raises(ValueError):  # one table shared by every split and copy: none may change it
        datasets._digits_table()[0, 0] = 1.0


def test_digits_repr(test_split):
    assert repr(test_split) == "Digits(split='test', n=360)"


def test_digits_bad_split():
    with pytest.raises(ConfigError, match=r"""unknown split 'val': use "train" or "test"$"""):
        digits("val")


# --- IDX reader and writer ----------------------------------------------------

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.float32, torch.float64]


def _sample(dtype):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(3, 4, 5, generator=g, dtype=dtype) * 1e3
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, (3, 4, 5), generator=g, dtype=torch.int64).to(dtype)
    t[0, 0, 0], t[0, 0, 1] = info.min, info.max  # extremes catch byte-order mistakes
    return t


@pytest.mark.parametrize("name", ["t.idx", "t.idx.gz"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_idx_round_trip(tmp_path, dtype, name):
    path = tmp_path / name
    tensor = _sample(dtype)
    write_idx(path, tensor)
    back = read_idx(path)
    assert back.dtype == dtype
    assert torch.equal(back, tensor)
    assert path.read_bytes()[:2] == (b"\x1f\x8b" if name.endswith(".gz") else b"\x00\x00")


def test_idx_header_is_big_endian(tmp_path):
    path = tmp_path / "t.idx"
    write_idx(path, torch.tensor([[1, 258]], dtype=torch.int16))
    assert path.read_bytes() == b"\x00\x00\x0b\x02" + struct.pack(">II", 1, 2) + b"\x00\x01\x01\x02"


def test_idx_compression_is_detected_by_content(tmp_path):
    tensor = torch.arange(10, dtype=torch.uint8)
    write_idx(tmp_path / "x.idx", tensor)
    raw = (tmp_path / "x.idx").read_bytes()
    plain, packed = tmp_path / "plain.gz", tmp_path / "packed.idx"  # names that lie
    plain.write_bytes(raw)
    packed.write_bytes(gzip.compress(raw))
    assert torch.equal(read_idx(plain), tensor)
    assert torch.equal(read_idx(packed), tensor)


def test_idx_non_contiguous_tensor(tmp_path):
    tensor = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    write_idx(tmp_path / "t.idx", tensor)
    assert torch.equal(read_idx(tmp_path / "t.idx"), tensor)


def _header(code, *shape):
    return bytes([0, 0, code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"\x00\x00", "shorter than the 4-byte IDX header"),
        (b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"\x00", "not an IDX file"),
        (_header(0x0A, 2) + b"\x00\x00", "unknown IDX type code 0x0A"),
        (_header(0x08, 2, 3)[:9], "ends inside the header"),
        (_header(0x08, 2, 3) + bytes(5), "needs 6 data bytes but the file has 5"),
        (_header(0x0C, 2) + bytes(12), "needs 8 data bytes but the file has 12"),
        (gzip.compress(_header(0x08, 4) + bytes(4))[:-6], "broken gzip data"),
    ],
    ids=["short", "magic", "type", "header", "truncated", "too-long", "gzip"],
)
def test_read_idx_rejects_bad_files(tmp_path, content, problem):
    path = tmp_path / "bad.idx"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=problem) as info:
        read_idx(path)
    message = str(info.value)
    assert message.startswith(str(path)) and "\n" not in message


def test_read_idx_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such IDX file"):
        read_idx(tmp_path / "nope.idx")


def test_write_idx_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(ConfigError, match="cannot store torch.int64: convert"):
        write_idx(tmp_path / "t.idx", torch.zeros(3, dtype=torch.int64))


# --- IdxDataset -----------------------------------------------------------------


@pytest.fixture
def mnist_like(tmp_path):
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (10, 28, 28), generator=g, dtype=torch.int64).to(torch.uint8)
    labels = torch.randint(0, 10, (10,), generator=g, dtype=torch.int64).to(torch.uint8)
    write_idx(tmp_path / "images.idx.gz", images)
    write_idx(tmp_path / "labels.idx", labels)
    return tmp_path / "images.idx.gz", tmp_path / "labels.idx", images, labels


def test_idx_dataset_items(mnist_like):
    images_path, labels_path, images, labels = mnist_like
    ds = idx(images_path, labels_path)
    assert isinstance(ds, IdxDataset)
    assert len(ds) == 10
    x, y = ds[3]
    assert x.dtype == torch.float32 and x.shape == (784,)
    assert y.dtype == torch.int64 and y.shape == () and y == labels[3]
    assert torch.allclose(x, images[3].flatten().float() / 255)
    assert 0.0 <= ds.tensors()[0].min() and ds.tensors()[0].max() <= 1.0
    xb, yb = ds[torch.tensor([0, 9])]
    assert xb.shape == (2, 784) and torch.equal(yb, labels[[0, 9]].long())
    assert repr(ds) == f"IdxDataset({str(images_path)!r}, n=10)"


def test_idx_dataset_scale_and_flatten(mnist_like):
    images_path, labels_path, images, _ = mnist_like
    ds = IdxDataset(images_path, labels_path, scale=1.0, flatten=False)
    X, _ = ds.tensors()
    assert X.shape == (10, 28, 28)
    assert torch.equal(X, images.float())


def test_idx_dataset_count_mismatch(mnist_like, tmp_path):
    images_path, _, _, labels = mnist_like
    write_idx(tmp_path / "short.idx", labels[:9])
    with pytest.raises(ConfigError, match="10 images but .* 9 labels: pass matching"):
        IdxDataset(images_path, tmp_path / "short.idx")
