"""A 1 ps + 1 worker sync SGD run equals a plain single-process torch loop."""

import copy

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from .conftest import mlp

pytestmark = pytest.mark.integration
SEED, STEPS, BATCH, LR = 7, 50, 32, 0.1


def plain_loop(dataset) -> dict:
    torch.manual_seed(SEED)
    model = mlp()
    train_plainly(model, torch.optim.SGD(model.parameters(), lr=LR), dataset, STEPS)
    return model.state_dict()


def train_plainly(model, optimizer, dataset, steps: int) -> None:
    """``steps`` steps of a plain loop over a fresh DataLoader (as a process started again makes one)."""
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == steps:
                break
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
        epoch += 1


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


def test_a_run_resumed_by_name_goes_on_as_a_plain_loop_resumed_from_its_saved_state(start_cluster, digits_train):
    """``resume="latest"``: the second run of a name starts from the first's latest checkpoint, Adam's moments
    included, as a torch user resumes: ``torch.save`` of model and optimizer, ``load_state_dict``, a new
    DataLoader."""
    cluster = start_cluster(ps=1, workers=1)
    options = dict(optimizer="adam", lr=0.01, mode="sync", batch_size=BATCH, seed=SEED, name="digits-adam",
                   checkpoint_every=30)
    first = cluster.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), steps=30, resume="latest",
                          **options).wait(verbose=False)
    assert first.events().query("kind == 'resuming'")["detail"].tolist() == [
        {"run": None, "from": "scratch: no earlier run of this name"}]
    second = cluster.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), steps=50, resume="latest",
                           **options).wait(verbose=False)
    assert second.global_step == 50 and second.local_steps == [20]
    assert second.plan.checkpoint_dir == first.plan.checkpoint_dir
    assert (f'[controller] resuming run {first.id} "digits-adam" (sync, 1 worker) from its checkpoint at global step '
            f"30 in {first.plan.checkpoint_dir}") in second.logs
    assert [d["step"] for d in second.events().query("kind == 'restored'")["detail"]] == [30]
    assert second.metrics()["global_step"].min() == 31

    torch.manual_seed(SEED)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_plainly(model, optimizer, digits_train, 30)
    saved = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict())}
    model, optimizer = mlp(), None
    model.load_state_dict(saved["model"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    optimizer.load_state_dict(saved["optimizer"])
    train_plainly(model, optimizer, digits_train, 20)
    got, expected = second.state_dict(), model.state_dict()
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5
