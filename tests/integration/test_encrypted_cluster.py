"""Cluster(encrypt=True) / %pscluster start --encrypt: the data plane runs over ZeroMQ CURVE, and a client without
it gets no answer from the ps."""

from dataclasses import replace

import pytest
import torch

from pscluster.errors import PSClusterError
from pscluster.runtime.client import PSClient

from .conftest import mlp

pytestmark = pytest.mark.integration


def test_an_encrypted_cluster_trains_and_a_plain_client_is_not_answered(own_cluster, digits_train):
    cluster = own_cluster(ps=1, workers=1, encrypt=True, threads=1)
    assert cluster.spec.encrypt
    run = cluster.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), lr=0.1, steps=20, batch_size=32,
                        checkpoint_secs=None).wait(verbose=False)
    assert run.global_step == 20
    with PSClient(cluster.spec, timeout=10.0) as client:  # CURVE with the cluster's keys: answered
        assert client.stats()[0]["step"] == 20
    with pytest.raises(PSClusterError):
        PSClient(replace(cluster.spec, encrypt=False), timeout=3.0).close()
