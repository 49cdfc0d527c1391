"""Partitioned sparse embeddings and bounded staleness on real engines."""

import os
import time

import pytest
import torch
from torch.utils.data import TensorDataset

pytestmark = pytest.mark.integration

ROWS, DIM, BAG, BATCH = 50_000, 16, 6, 32
SLOW_ENV = "PSCLUSTER_TEST_SLOW_S"


class BagModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.out = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.out(self.embedding(ids)).squeeze(1)


def loss_fn(output, target):
    """BCE with logits; sleeps on an engine where SLOW_ENV is set (a straggler made on purpose)."""
    delay = float(os.environ.get(SLOW_ENV, 0))
    if delay:
        time.sleep(delay)
    return torch.nn.functional.binary_cross_entropy_with_logits(output, target)


@pytest.fixture(scope="module")
def bags():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ROWS, (2000, BAG), generator=g)
    return TensorDataset(ids, (ids.remainder(7) < 3).float().mean(1).gt(0.45).float())


@pytest.fixture(scope="module")
def cluster(start_cluster):
    return start_cluster(ps=2, workers=2)


def test_sparse_steps_move_only_the_touched_rows_and_partitioning_changes_no_result(cluster, bags):
    common = dict(lr=0.2, mode="sync", steps=30, batch_size=BATCH, replicas_to_aggregate=2)
    whole = cluster.train(BagModel, bags, loss_fn, placement={"embedding.weight": 0, "out.weight": 0,
                                                              "out.bias": 0}, name="one ps", **common)
    whole.wait(verbose=False)
    split = cluster.train(BagModel, bags, loss_fn, partition={"embedding": 2}, name="two ps", **common)
    split.wait(verbose=False)
    assert [v.name for v in split.plan.variables][:2] == ["embedding.weight/part_0", "embedding.weight/part_1"]
    assert {v.ps for v in split.plan.variables if v.sparse} == {0, 1}

    a, b = whole.state_dict(), split.state_dict()
    assert a.keys() == b.keys() and a["embedding.weight"].shape == (ROWS, DIM)
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5, name

    metrics = split.metrics()
    assert len(metrics) == 60
    touched_bound = BATCH * BAG * DIM * 4  # at most this many distinct rows' values per step
    moved = metrics["bytes_sent"] + metrics["bytes_received"]
    # values pulled and pushed once, plus 8-byte row indices (half a row of 16 floats) both ways, plus headers
    assert moved.max() <= 3 * touched_bound + 4096
    assert moved.max() < ROWS * DIM * 4 / 50  # nowhere near the table


def test_ssp_keeps_the_fast_worker_within_the_bound(cluster, bags):
    slow = next(t for t in cluster.spec.workers if t.index == 1)
    view = cluster._engines.view(slow.engine_id)
    view.execute(f"import os; os.environ[{SLOW_ENV!r}] = '0.05'", block=True)
    try:
        run = cluster.train(BagModel, bags, loss_fn, lr=0.1, mode="ssp", staleness_bound=2, steps=80,
                            batch_size=BATCH, name="ssp").wait(verbose=False)
    finally:
        view.execute(f"import os; os.environ.pop({SLOW_ENV!r})", block=True)
    m = run.metrics().sort_values("time")
    fast, slow_rows = m[m["worker"] == 0], m[m["worker"] == 1]
    assert fast["local_step"].max() > slow_rows["local_step"].max()  # it ran ahead when it could...
    last_slow = slow_rows["local_step"].max()
    for t, step in zip(fast["time"], fast["local_step"]):
        # ...but by at most 2 steps. The fast worker records its step s once the ps, holding the straggler's push of
        # step s - 2, has answered it; the straggler records each step before it pushes the next, so by then it has
        # recorded step s - 3 at least. (Its record of step s - 2 itself may come any time later on a loaded
        # machine: no slack of time bounds it.)
        done = slow_rows[slow_rows["time"] <= t]["local_step"].max()
        done = 0 if done != done else done  # NaN: nothing recorded yet
        if done < last_slow:
            assert step - done <= 2 + 1, (t, step, done)
