"""Lifecycle: stop() leaves nothing behind; a cluster dies with the process that owns it."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pscluster.cluster.reaper import alive

pytestmark = pytest.mark.integration

OWNER = textwrap.dedent("""
    import json, os, sys, time, pscluster
    cluster = pscluster.Cluster(ps=1, workers=1).start()
    print(json.dumps([cluster.pids, cluster._engines._ipp.cluster_file]), flush=True)
    time.sleep(300)
""")


def wait_dead(pids, timeout) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_cluster_dies_with_its_owner_process():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pids, cluster_file = json.loads(owner.stdout.readline())
        assert os.path.exists(cluster_file)
        assert len(pids) >= 3 and all(alive(p) for p in pids)  # engines, nannies, controller and its schedulers
        os.kill(owner.pid, signal.SIGKILL)  # a kernel that dies without cleaning up
        owner.wait(10)
        assert wait_dead(pids, timeout=20) == []
        deadline = time.monotonic() + 5
        while os.path.exists(cluster_file) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(cluster_file)  # no stale cluster left for ipyparallel to list
    finally:
        owner.kill()
        owner.wait(10)


def test_stop_leaves_no_process(start_cluster):
    cluster = start_cluster(ps=1, workers=1, threads=1)
    pids = cluster.pids
    engine_ids = [t.engine_id for t in (*cluster.spec.ps, *cluster.spec.workers)]
    # every task runs torch with the threads it was given (more would spin against the other tasks)
    assert [cluster._engines.view(e).apply_sync(torch.get_num_threads) for e in engine_ids] == [1, 1]
    assert all(alive(p) for p in pids)
    cluster.stop()
    assert [p for p in pids if alive(p)] == []
    cluster.stop()  # stopping twice is harmless
