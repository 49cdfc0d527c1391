"""A CUDA worker's gradients copied to the host during backward (``staging``), against the same run copying them
after backward and against plain torch on the same GPU; where it applies (every machine)."""

from dataclasses import replace

import pytest
import torch

from pscluster.runtime.plan import assemble
from pscluster.runtime.staging import MIN_BYTES, GradientStaging
from pscluster.runtime.worker import run_worker

from .test_overlap import Wide, plain_wide, plan_for
from .test_worker_inprocess import RUN_ID, dataset  # noqa: F401 - a fixture

CUDA = torch.device("cuda")


@pytest.mark.parametrize("settings", [{"max_grad_norm": 1.0}, {"precision": "fp16"},
                                      {"pipeline": True, "mode": "async"}, {"overlap": False}],
                         ids=lambda s: next(iter(s)))
def test_no_staging_where_a_gradient_changes_after_backward_or_its_memory_is_still_being_read(local_ps, settings):
    spec = local_ps.start(num_ps=1, num_workers=1)
    assert GradientStaging.applies(plan_for(spec, steps=3), CUDA)
    assert GradientStaging.applies(plan_for(spec, steps=3, mode="async"), CUDA)
    assert not GradientStaging.applies(plan_for(spec, steps=3), torch.device("cpu"))
    assert not GradientStaging.applies(plan_for(spec, steps=3, **settings), CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("shared_memory,precision,num_ps,staged", [(True, "fp32", 1, True), (False, "fp32", 2, True),
                                                                   (True, "bf16", 1, True), (False, "bf16", 2, False)],
                         ids=["lane", "socket-2ps", "lane-bf16", "socket-bf16-2ps"])
def test_a_gpu_worker_copying_its_gradients_during_backward_trains_as_copying_them_after(local_ps, dataset,
                                                                                          shared_memory, precision,
                                                                                          num_ps, staged):
    """Adam on the 8.4 MB MLP whose 8 MB middle layer is split across the ps tasks where there are 2 (row shards):
    the same parameters to 1e-6 with and without staging; fp32 also against plain torch on the GPU. Staged: the
    middle layer's gradient (or each shard's) where it is at least MIN_BYTES on the wire (not 2 MB shards in
    bf16); the small ones are copied after backward either way."""
    assert 2048 * 1024 * 4 // 2 >= MIN_BYTES > 2048 * 1024 * 2 // 2
    steps = 30
    results = {}
    for overlap in (True, False):
        spec = local_ps.start(num_ps=num_ps, num_workers=1)
        spec = replace(spec, workers=tuple(replace(w, device="cuda:0") for w in spec.workers))
        plan = plan_for(spec, steps=steps, overlap=overlap, shared_memory=shared_memory, precision=precision,
                        partition={"hidden.weight": 2} if num_ps == 2 else None)
        summary = run_worker(spec, 0, plan, Wide, dataset, torch.nn.CrossEntropyLoss())
        assert summary["global_step"] == steps and summary["staged_steps"] == (steps if overlap and staged else 0)
        results[overlap] = assemble(plan.variables, local_ps.client(spec, run_id=RUN_ID).pull_all().messages)
    for name, value in results[False].items():
        assert (results[True][name] - value).abs().max() <= 1e-6, name
    if precision == "fp32":
        for name, value in plain_wide(dataset, steps, device="cuda").items():
            assert (results[True][name].to(value.dtype) - value.cpu()).abs().max() <= 1e-4, name
