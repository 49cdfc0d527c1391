"""A model's whole state on the ps: buffers kept by the run's rule, frozen parameters that never move."""

import pytest
import torch

from pscluster.errors import TrainingError
from pscluster.runtime.protocol import Flag, Op

from ..conftest import RUN_ID, ps_config

LR, MOMENTUM, DECAY = 0.1, 0.9, 0.1
KINDS = ["param", "buffer", "buffer", "frozen"]  # w, running mean, a step count, a frozen weight


def start(local_ps, *, mode="sync", rule="chief", workers=2):
    """One ps holding w (trained with SGD momentum + weight decay), two buffers and a frozen weight."""
    spec = local_ps.start(1, workers)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(3, 4, generator=g), torch.zeros(4), torch.tensor(0), torch.randn(4, generator=g)]
    config = ps_config(["w", "bn.running_mean", "bn.num_batches_tracked", "stem.weight"], mode=mode,
                       replicas=workers, workers=workers, lr=LR, momentum=MOMENTUM, weight_decay=DECAY,
                       kinds=tuple(KINDS), buffers=rule)
    local_ps.client(spec).init(RUN_ID, {0: ([0, 1, 2, 3], values)}, [config])
    workers = [local_ps.client(spec, task=i, run_id=RUN_ID) for i in range(workers)]
    return values, workers


def push(client, step, grad, mean, count):
    return client.push_pull(step, {0: ([0, 1, 2], [grad, mean, torch.tensor(count)])})


def by_id(reply):
    return {i: t.clone() for m in reply.messages for i, t in zip(m.ids, m.tensors)}


def test_sync_keeps_the_chiefs_buffers_and_replies_with_them(local_ps):
    (w, _, _, frozen), (w0, w1) = start(local_ps, rule="chief")
    g0, g1 = torch.ones(3, 4), 3 * torch.ones(3, 4)
    first = w0.send(Op.PUSH_PULL, {0: ([0, 1, 2], [g0, torch.full((4,), 1.0), torch.tensor(1)])}, step=0)
    reply = push(w1, 0, g1, torch.full((4,), 5.0), 7)  # the second replica: the step is applied
    assert by_id(w0.merge(w0.collect(first))).keys() == {0, 1, 2}
    got = by_id(reply)
    assert sorted(got) == [0, 1, 2]  # the frozen weight is not sent with every step
    expected_w = w - LR * ((g0 + g1) / 2 + DECAY * w)  # first step of SGD: momentum buffer = the gradient
    assert torch.allclose(got[0], expected_w, atol=1e-6)
    assert torch.equal(got[1], torch.full((4,), 1.0)) and got[2].item() == 1  # worker 0's, as DDP broadcasts
    assert torch.equal(by_id(w0.pull_frozen())[3], frozen)


def test_average_keeps_the_mean_of_every_workers_latest_buffers(local_ps):
    _, (w0, w1) = start(local_ps, rule="average", mode="async")
    push(w0, 0, torch.zeros(3, 4), torch.full((4,), 1.0), 1)
    got = by_id(push(w1, 0, torch.zeros(3, 4), torch.full((4,), 4.0), 4))
    assert torch.equal(got[1], torch.full((4,), 2.5)) and got[2].item() == 2  # integers rounded (2.5 -> 2)
    got = by_id(push(w0, 1, torch.zeros(3, 4), torch.full((4,), 2.0), 2))  # worker 0's latest replaces its first
    assert torch.equal(got[1], torch.full((4,), 3.0)) and got[2].item() == 3


def test_async_buffers_follow_the_chief_once_it_has_pushed(local_ps):
    _, (w0, w1) = start(local_ps, rule="chief", mode="async")
    got = by_id(push(w1, 0, torch.zeros(3, 4), torch.full((4,), 9.0), 9))
    assert torch.equal(got[1], torch.full((4,), 9.0))  # the lowest worker that pushed any: worker 1, for now
    got = by_id(push(w0, 1, torch.zeros(3, 4), torch.full((4,), 2.0), 2))
    assert torch.equal(got[1], torch.full((4,), 2.0)) and got[2].item() == 2
    got = by_id(push(w1, 2, torch.zeros(3, 4), torch.full((4,), 9.0), 9))
    assert torch.equal(got[1], torch.full((4,), 2.0))


def test_frozen_parameters_never_move_and_are_never_pushed(local_ps):
    (_, _, _, frozen), (w0,) = start(local_ps, workers=1, mode="async")
    for step in range(5):
        push(w0, step, torch.randn(3, 4), torch.randn(4), step)
    assert torch.equal(by_id(w0.pull_frozen())[3], frozen)  # momentum and weight decay left it alone
    with pytest.raises(TrainingError, match=r"push holds variables \[0, 1, 2, 3\]"):
        w0.push_pull(5, {0: ([0, 1, 2, 3], [torch.zeros(3, 4), torch.zeros(4), torch.tensor(0), torch.zeros(4)])})
    assert not w0.pull().flags & Flag.STOPPED
