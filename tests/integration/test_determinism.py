"""A 1 ps + 1 worker sync SGD run equals a plain single-process torch loop."""

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from .conftest import mlp

pytestmark = pytest.mark.integration
SEED, STEPS, BATCH, LR = 7, 50, 32, 0.1


def plain_loop(dataset) -> dict:
    torch.manual_seed(SEED)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == STEPS:
                break
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
        epoch += 1
    return model.state_dict()


def test_one_worker_sync_sgd_matches_plain_torch(start_cluster, digits_train):
    cluster = start_cluster(ps=1, workers=1)
    run = cluster.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), optimizer="sgd", lr=LR, mode="sync",
                        steps=STEPS, batch_size=BATCH, seed=SEED).wait(verbose=False)
    assert run.local_steps == [STEPS] and run.global_step == STEPS
    expected = plain_loop(digits_train)
    got = run.state_dict()
    assert got.keys() == expected.keys()
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert diff <= 1e-6
    moved = max((got[k] - mlp_init()[k]).abs().max().item() for k in expected)
    assert moved > 1e-3  # training did change the parameters


def mlp_init() -> dict:
    torch.manual_seed(SEED)
    return mlp().state_dict()
