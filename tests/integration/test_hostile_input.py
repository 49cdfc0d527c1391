"""Hostile frames against a ps of a real cluster: dropped, counted, reported in the run, training unharmed."""

import pytest
import torch
import zmq

from pscluster.runtime import protocol
from pscluster.runtime.protocol import Message, Op

from .conftest import events, mlp, wait_for_step

pytestmark = pytest.mark.integration
STEPS = 400


def test_rejected_frames_reach_the_run_and_training_goes_on(cluster_1ps_2w, digits_train):
    cluster = cluster_1ps_2w
    run = cluster.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), optimizer="sgd", lr=0.1, mode="sync",
                        steps=STEPS, batch_size=32, seed=3)
    wait_for_step(run, 5)
    other_cluster = bytes(16)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(cluster.spec.ps[0].address)
        for _ in range(3):
            dealer.send_multipart([b"not a pscluster message"])
        dealer.send_multipart(protocol.encode(Message(op=Op.STOP, run_id=run.id, nonce=protocol.challenge()),
                                              other_cluster))
        run.wait(timeout=300, verbose=False)
    finally:
        dealer.close(linger=0)
    assert run.status == "finished" and run.global_step == STEPS  # the forged STOP stopped nothing
    assert run.ps_stats[0]["rejected"] == {"unsigned": 3, "bad_signature": 1, "replayed": 0, "malformed": 0}
    reported = events(run, "rejected")
    assert len(reported) and reported["task"].iloc[-1] == "ps:0"
    assert reported["detail"].iloc[-1] == run.ps_stats[0]["rejected"]
