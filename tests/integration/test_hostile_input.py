"""Hostile frames against a ps of a real cluster: dropped, counted, reported in the run, training unharmed."""

import logging
import os
import random
import socket
import time

import psutil
import pytest
import torch
import zmq

import pscluster
from pscluster.cluster.reaper import alive

from pscluster.runtime import protocol
from pscluster.runtime.protocol import Message, Op

from .conftest import events, mlp, wait_for_step

pytestmark = pytest.mark.integration
STEPS = 400
FUZZ_STEPS = 3_000  # the fuzzing takes a few hundred steps of it (about a second)


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
    assert run.ps_stats[0]["rejected"] == {"unsigned": 3, "bad_signature": 1, "replayed": 0, "malformed": 0,
                                             "fenced": 0}
    reported = events(run, "rejected")
    assert len(reported) and reported["task"].iloc[-1] == "ps:0"
    assert reported["detail"].iloc[-1] == run.ps_stats[0]["rejected"]


def listening_ports(pids: set[int]) -> set[int]:
    """The TCP ports the processes ``pids`` listen on (on 127.0.0.1 or every address)."""
    return {c.laddr.port for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids and c.laddr.ip in ("127.0.0.1", "0.0.0.0")}


def test_random_bytes_to_every_port_of_the_cluster_leave_the_run_to_finish(digits_train, caplog):
    # what a port scanner or a confused client does: connections that send garbage, to the ps tasks, the
    # engines, ipyparallel's controller and hub, the kernel's metrics collector and control socket
    c = pscluster.Cluster(ps=2, workers=2).start()
    try:
        fuzz_every_port_mid_run(c, digits_train)
    finally:
        pids = c.pids
        began = time.monotonic()
        c.stop()
        stopped_s = time.monotonic() - began
    assert pids and not [p for p in pids if alive(p)], "cluster processes left running after stop()"
    assert stopped_s < 10
    # what a notebook would show under its cell: errors with tracebacks, from the event loop of ipyparallel's client
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info]
    assert not shown, shown


def fuzz_every_port_mid_run(c, digits_train) -> None:
    run = c.train(mlp, digits_train, torch.nn.CrossEntropyLoss(), lr=0.1, mode="async", steps=FUZZ_STEPS,
                  batch_size=32, checkpoint_secs=None)
    wait_for_step(run, 200)
    ports = listening_ports(set(c.pids) | {os.getpid()})
    assert len(ports) >= 10
    rng = random.Random(0)
    for port in sorted(ports):
        for _ in range(15):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(rng.randbytes(rng.choice([1, 10, 64, 1000, 100_000])))
            except OSError:  # dropped by the peer: what it may do
                pass
    run.wait(timeout=180, verbose=False)
    assert run.status == "finished" and run.global_step == FUZZ_STEPS and run.error is None
    assert sum(run.local_steps) >= FUZZ_STEPS
