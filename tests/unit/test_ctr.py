import pickle
import tracemalloc

import cloudpickle
import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from torch.utils.data import default_collate

import pscluster.datasets
from pscluster.ctr import CtrDataset, ctr
from pscluster.errors import ConfigError
from pscluster.evaluate import auc
from pscluster.runtime.data import fetch_batch

SMALL = {"cardinality": 10_000, "num_buckets": 2**16}  # a small table: the model tests train in seconds


@pytest.fixture(scope="module")
def train():
    return ctr(100_000, seed=3, **SMALL)


@pytest.fixture(scope="module")
def holdout():  # the test split; a fixture named "test" would read as a test
    return ctr(20_000, seed=3, split="test", **SMALL)


def _expected_auc(logits: torch.Tensor) -> float:
    """The mean AUC of ``logits`` over labels drawn as Bernoulli(sigmoid(logits)): each row counts
    as a positive with weight p and as a negative with weight 1 - p."""
    p = torch.sigmoid(logits.double()).numpy()
    labels = np.concatenate([np.ones_like(p), np.zeros_like(p)])
    return roc_auc_score(labels, np.concatenate([logits, logits]), sample_weight=np.concatenate([p, 1 - p]))


# --- items and batches ------------------------------------------------------


def test_items_and_batches_have_the_documented_shapes_and_dtypes(train):
    x, y = train[0]
    assert x.dtype == torch.int64 and x.shape == (8,)
    assert y.dtype == torch.float32 and y.shape == () and y.item() in (0.0, 1.0)
    X, Y = train[torch.tensor([5, 1, 7])]
    assert X.dtype == torch.int64 and X.shape == (3, 8)
    assert Y.dtype == torch.float32 and Y.shape == (3,)
    assert train.supports_batch_index and train.num_fields == 8 and train.num_buckets == 2**16


def test_batches_equal_collated_items_in_any_order(train):
    indices = [99_999, 0, 17, 5_000, 17]
    X, Y = fetch_batch(train, indices)  # the path the workers take
    Xi, Yi = default_collate([train[i] for i in indices])
    assert torch.equal(X, Xi) and torch.equal(Y, Yi)
    Xl, Yl = train[indices[::-1]]
    assert torch.equal(Xl, X.flip(0)) and torch.equal(Yl, Y.flip(0))
    Xs, Ys = train[10:20]
    assert torch.equal(Xs, train[list(range(10, 20))][0]) and torch.equal(Ys, train[np.arange(10, 20)][1])


def test_same_seed_gives_the_same_rows_and_another_seed_other_rows(train):
    X, Y = train[:2000]
    again = ctr(100_000, seed=3, **SMALL)
    X2, Y2 = again[torch.arange(1999, -1, -1)]
    assert torch.equal(X, X2.flip(0)) and torch.equal(Y, Y2.flip(0))
    X3, Y3 = ctr(100_000, seed=4, **SMALL)[:2000]
    assert (X3 != X).any(dim=1).float().mean() > 0.9
    assert not torch.equal(Y3, Y)


def test_rows_are_pinned_across_versions_and_machines():
    # Changing these numbers changes every published result on this dataset: only on purpose.
    train, holdout = ctr(1000), ctr(1000, split="test")
    assert train[0][0].tolist() == [214216, 369125, 1282738, 1530987, 1837955, 67156, 225320, 1492067]
    assert holdout[0][0].tolist() == [1523068, 814556, 1936577, 982231, 1132758, 1155749, 690984, 1340280]
    assert int(train[:][1].sum()) == 288 and int(holdout[:][1].sum()) == 317


def test_ids_lie_in_the_table_and_spread_over_it():
    X, _ = ctr(20_000, num_buckets=1000, cardinality=10_000)[:]
    assert X.min() >= 0 and X.max() < 1000
    assert len(X.unique()) > 900
    assert ctr(10, num_buckets=1)[:][0].eq(0).all()


def test_field_values_are_skewed_like_click_logs():
    X, _ = ctr(20_000, **SMALL)[:]
    counts = torch.bincount(X[:, 0]).sort(descending=True).values
    assert 0.08 < counts[0] / len(X) < 0.25  # the most common value of a field
    assert counts[:10].sum() / len(X) < 0.6  # but a long tail
    assert len(counts.nonzero()) > 1000


def test_train_and_test_differ_with_similar_click_rates(train, holdout):
    X, Y = train[:20_000]
    Xt, Yt = holdout[:]
    assert (X != Xt).any(dim=1).float().mean() > 0.9
    assert 0.2 < Y.mean() < 0.35 and 0.2 < Yt.mean() < 0.35
    assert abs(Y.mean() - Yt.mean()) < 0.02


def test_click_rate_is_about_30_percent_for_every_seed():
    for seed in range(8):
        expected_rate = torch.sigmoid(ctr(10_000, seed, **SMALL).true_logits(slice(None))).mean()
        assert 0.28 < expected_rate < 0.32, seed


def test_large_datasets_cost_nothing_up_front():
    tracemalloc.start()
    try:
        huge = ctr(10**9, **SMALL)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100_000
    assert len(huge) == 10**9
    x, y = huge[10**9 - 1]
    assert torch.equal(x, huge[-1][0]) and torch.equal(y, huge[-1][1])
    assert huge[[10**9 - 2, 10**9 - 1]][0].shape == (2, 8)


def test_out_of_range_and_bad_indices_raise(train):
    with pytest.raises(IndexError, match="100000"):
        train[100_000]
    with pytest.raises(IndexError):
        train[[0, -100_001]]
    with pytest.raises(TypeError):
        train[1.5]


# --- the ground truth -------------------------------------------------------


def test_labels_follow_the_true_logits(holdout):
    logits = holdout.true_logits(slice(None))
    _, Y = holdout[:]
    assert logits.dtype == torch.float32 and logits.shape == (20_000,)
    assert torch.equal(holdout.true_logits(7), logits[7])
    true_auc = auc(logits, Y)
    assert true_auc > 0.8
    assert abs(true_auc - _expected_auc(logits)) < 0.015  # labels are Bernoulli(sigmoid(logit))
    assert abs(Y.mean() - torch.sigmoid(logits).mean()) < 0.015


def test_pairwise_term_carries_much_of_the_signal(holdout):
    _, Y = holdout[:]
    full = auc(holdout.true_logits(slice(None)), Y)
    linear_only = auc(holdout.true_logits(slice(None), pairwise=False), Y)
    assert linear_only > 0.6
    assert full > linear_only + 0.1


def _fit_and_score(train, holdout, factor_dim: int) -> float:
    """Holdout AUC after two epochs of Adagrad on the train rows of an FM with ``factor_dim`` factors
    per id; with ``factor_dim=0`` the FM is logistic regression on the ids."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(train.num_buckets, 1 + factor_dim, sparse=True)  # per id: a weight, then factors
    torch.nn.init.normal_(table.weight, std=0.01)
    bias = torch.zeros(1, requires_grad=True)

    def logits(x):
        rows = table(x)
        factors = rows[..., 1:]
        pairwise = 0.5 * (factors.sum(1).pow(2).sum(1) - factors.pow(2).sum((1, 2)))
        return bias + rows[..., 0].sum(1) + pairwise

    optimizers = [torch.optim.Adagrad(table.parameters(), lr=0.05), torch.optim.Adagrad([bias], lr=0.05)]
    X, Y = train[:]
    for _ in range(2):
        for batch in torch.randperm(len(X)).split(1000):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(X[batch]), Y[batch])
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
    Xt, Yt = holdout[:]
    with torch.no_grad():
        return auc(logits(Xt), Yt)


def test_logistic_regression_beats_chance_and_an_fm_beats_it(train, holdout):
    linear = _fit_and_score(train, holdout, factor_dim=0)
    assert linear > 0.6
    assert _fit_and_score(train, holdout, factor_dim=4) > linear + 0.03


# --- shipping and validation ------------------------------------------------


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_pickles_are_small_and_give_equal_rows(train, dumps):
    train[0]  # the ground truth is built: pickling must still leave it out
    blob = dumps(train)
    assert len(blob) < 10_000
    copy = pickle.loads(blob)
    assert isinstance(copy, CtrDataset) and len(copy) == len(train) and copy.split == "train"
    for a, b in zip(copy[[3, 99_000]], train[[3, 99_000]]):
        assert torch.equal(a, b)
    assert torch.equal(copy.true_logits([3, 4]), train.true_logits([3, 4]))


@pytest.mark.parametrize("kwargs, fix", [
    ({"rows": 0}, "pass rows=1 or more"),
    ({"rows": 2.5}, "must be an int"),
    ({"rows": True}, "pass rows=1 or more"),
    ({"seed": -1}, "pass a seed in"),
    ({"num_buckets": 0}, "pass num_buckets=1 or more"),
    ({"num_fields": 0}, "pass num_fields=1 or more"),
    ({"cardinality": 0}, "pass cardinality=1 or more"),
    ({"cardinality": 10**8}, "keep it at most"),
    ({"split": "valid"}, 'use "train" or "test"'),
])
def test_bad_arguments_raise_one_line_config_errors(kwargs, fix):
    with pytest.raises(ConfigError, match=fix) as info:
        ctr(**kwargs)
    assert "\n" not in str(info.value)


def test_is_exported_from_datasets_with_a_short_repr():
    assert pscluster.datasets.ctr is ctr and pscluster.datasets.CtrDataset is CtrDataset
    text = repr(ctr(50_000_000, seed=7, split="test"))
    assert "50_000_000" in text and "seed=7" in text and "'test'" in text and len(text) < 120


# --- auc --------------------------------------------------------------------


def test_auc_matches_a_hand_count():
    # positives 0.35 and 0.8 against negatives 0.1 and 0.4: 3 of the 4 pairs ordered right
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == pytest.approx(0.75)
    assert auc(np.array([0.5, 0.5, 0.9]), np.array([0, 1, 1])) == pytest.approx(0.75)  # a tie counts half
    assert auc(torch.tensor([[2.0], [1.0]], requires_grad=True), [1, 0]) == 1.0


def test_auc_rejects_single_class_and_mismatched_inputs():
    with pytest.raises(ConfigError, match="both classes") as info:
        auc(torch.tensor([0.2, 0.7]), torch.tensor([1.0, 1.0]))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="one score per label"):
        auc([0.1, 0.2, 0.3], [0, 1])
