"""The training contract on CUDA workers: the models of ``test_models`` with GPU workers, in bf16 and in fp16 with
loss scaling, against a plain torch loop on the same GPU. Skipped where there is no GPU; run wherever one is."""

import pytest
import torch
from torch import nn

import pscluster

from .test_models import BATCH, SEED, BNNet, Corpus, TiedLM, accuracy, assert_loads_strictly, frozen_stem, lm_loss, \
    plain_loop

pytestmark = [pytest.mark.integration, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")]


@pytest.fixture(scope="module")
def gpu_cluster(start_cluster):
    cluster = start_cluster(ps=2, workers=1, gpus=1)
    assert cluster.spec.workers[0].device.startswith("cuda")
    return cluster


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_batchnorm_cnn_on_a_gpu_worker(gpu_cluster, digits_train, tmp_path, precision):
    steps, options = 200, dict(lr=0.02, momentum=0.9)
    test = pscluster.datasets.digits("test")
    run = gpu_cluster.train(BNNet, digits_train, nn.CrossEntropyLoss(), mode="sync", steps=steps, batch_size=BATCH,
                            seed=SEED, precision=precision, checkpoint_secs=None, **options).wait(verbose=False)
    reference = plain_loop(BNNet, digits_train, steps, loss_fn=nn.CrossEntropyLoss(), device="cuda",
                           precision=precision, **options)
    model = assert_loads_strictly(BNNet, run, tmp_path)
    assert abs(accuracy(model, test) - accuracy(reference, test)) <= 0.02
    assert run.state_dict()["features.2.num_batches_tracked"].item() == steps


def test_frozen_parameters_and_a_tied_lm_on_a_gpu_worker(gpu_cluster, digits_train):
    run = gpu_cluster.train(frozen_stem, digits_train, nn.CrossEntropyLoss(), optimizer="adamw", lr=3e-3,
                            steps=100, batch_size=BATCH, seed=SEED, checkpoint_secs=None).wait(verbose=False)
    torch.manual_seed(SEED)
    initial = frozen_stem().state_dict()
    assert torch.equal(run.state_dict()["0.weight"], initial["0.weight"])
    lm = gpu_cluster.train(TiedLM, Corpus("train"), lm_loss, steps=80, batch_size=16, seed=SEED, lr=1.0,
                           max_grad_norm=0.25, precision="bf16", checkpoint_secs=None).wait(verbose=False)
    state = lm.state_dict()
    assert state["decoder.weight"] is state["encoder.weight"]
    assert lm.evaluate(Corpus("test", windows=100))["loss"] < 3.4
