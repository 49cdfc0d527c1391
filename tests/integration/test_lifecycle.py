"""Lifecycle: stop() leaves nothing behind; a cluster dies with the process that owns it, unless detached: then
a later process attaches to it and takes over its run."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import ipyparallel as ipp
import psutil
import pytest
import torch

import pscluster
from pscluster import Cluster
from pscluster.cluster import forkserver, registry
from pscluster.cluster.engines import EngineSet
from pscluster.cluster.reaper import alive
from pscluster.errors import ClusterStateError, TrainingError
from pscluster.metrics.store import LEASE_S

from ..ports import quiet_port_range
from .conftest import mlp, wait_for_step

pytestmark = pytest.mark.integration

OWNER = textwrap.dedent("""
    import json, os, sys, time, pscluster
    cluster = pscluster.Cluster(ps=1, workers=1).start()
    print(json.dumps([cluster.pids, cluster._engines._ipp.cluster_file]), flush=True)
    time.sleep(300)
""")


OWNER_KILLED_WHILE_STARTING = textwrap.dedent("""
    import json, os, time, pscluster
    from pscluster.cluster.engines import EngineSet

    def registered_then_stuck(self, n):  # the owner dies after the engines registered, before start() returns
        self.client.wait_for_engines(n, timeout=60)
        print(json.dumps(os.getpid()), flush=True)
        time.sleep(300)

    EngineSet._wait_for_engines = registered_then_stuck
    pscluster.Cluster(ps=1, workers=2).start()
""")


DETACHED_OWNER = textwrap.dedent("""
    import json, os, sys, time, torch, pscluster
    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    cluster = pscluster.Cluster(ps=1, workers=2, name=sys.argv[1], detached=True).start()
    run = cluster.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), lr=0.1,
                        steps=int(sys.argv[2]), batch_size=32, checkpoint_secs=None)
    while run.global_step < 50:
        time.sleep(0.05)
    print(json.dumps([cluster.pids, run.id]), flush=True)
    time.sleep(300)
""")


TRAINING_OWNER = textwrap.dedent("""
    import json, sys, time, torch, pscluster
    cluster = pscluster.Cluster(ps=1, workers=1, name=sys.argv[1]).start()
    run = cluster.train(lambda: torch.nn.Linear(64, 10), pscluster.datasets.digits("train"),
                        torch.nn.CrossEntropyLoss(), lr=0.1, steps=10**6, batch_size=32, checkpoint_secs=None)
    while run.global_step < 20:
        time.sleep(0.05)
    print(json.dumps([run.id, cluster._engines._connection_files()]), flush=True)
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
        assert len(pids) >= 3 and all(alive(p) for p in pids)  # engines, controller and its schedulers
        # the process the owner's local engines are forked from serves no cluster of another owner
        forking = [p.pid for p in psutil.Process(owner.pid).children() if forkserver.__name__ in p.cmdline()]
        assert len(forking) == 1
        os.kill(owner.pid, signal.SIGKILL)  # a kernel that dies without cleaning up
        owner.wait(10)
        assert wait_dead(pids + forking, timeout=20) == []
        deadline = time.monotonic() + 5
        while os.path.exists(cluster_file) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(cluster_file)  # no stale cluster left for ipyparallel to list
    finally:
        owner.kill()
        owner.wait(10)


def test_a_kernel_killed_mid_run_leaves_its_run_failed_owner_lost_and_no_file_of_its_cluster():
    name = f"killed-{os.getpid()}"
    owner = subprocess.Popen([sys.executable, "-c", TRAINING_OWNER, name], stdout=subprocess.PIPE, text=True)
    try:
        run_id, connection_files = json.loads(owner.stdout.readline())
        entry = registry.entry_path(name)
        assert os.path.exists(entry) and connection_files and all(map(os.path.exists, connection_files))
        assert pscluster.open_run(run_id).status == "training"
        os.kill(owner.pid, signal.SIGKILL)  # no stop(), no end of the run written by anyone
        killed = time.time()
        owner.wait(10)
        run = pscluster.open_run(run_id)
        deadline = time.monotonic() + LEASE_S + 30
        while run.status == "training" and time.monotonic() < deadline:
            time.sleep(0.2)
        record = run.record
        assert record["status"] == "failed", record
        assert record["owner_lost"].startswith(f"owner lost: pid {owner.pid} on ")
        assert record["ended"] <= killed + LEASE_S  # when its lease ran out: at most LEASE_S after the kill
        runs = pscluster.runs().set_index("id")
        assert runs.loc[run_id, "status"] == "failed" and runs.loc[run_id, "owner_lost"] == record["owner_lost"]
        deadline = time.monotonic() + 20  # the watchdog deletes the files once the engines are dead
        while any(map(os.path.exists, [entry, *connection_files])) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [f for f in [entry, *connection_files] if os.path.exists(f)]
        assert name not in [c["name"] for c in pscluster.clusters()]
    finally:
        owner.kill()
        owner.wait(10)


def test_a_cluster_dies_with_its_owner_killed_while_it_starts():
    owner = subprocess.Popen([sys.executable, "-c", OWNER_KILLED_WHILE_STARTING], stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(owner.stdout.readline()) == owner.pid
        started = [p.pid for p in psutil.Process(owner.pid).children(recursive=True)]
        assert len(started) >= 5  # the controller and its schedulers, the forkserver and its engines, the reaper
        server = next(p for p in psutil.Process(owner.pid).children() if forkserver.__name__ in p.cmdline())
        firsts = server.children()  # the first engine of each set: it forked the others
        assert sum(len(f.children()) for f in firsts) >= 1
        # the reaper's SIGTERM (through fork_request) ends the first engines before the forkserver sees the owner
        # gone: the engines they forked must not be left to init
        server.suspend()
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        assert wait_dead([f.pid for f in firsts], timeout=20) == []
        server.resume()
        assert wait_dead(started, timeout=20) == []
    finally:
        owner.kill()
        owner.wait(10)


def test_removing_the_engine_the_others_were_forked_from_stops_that_one_alone():
    # local engines fork from one of them (engine_main), so the others are its children: removing that
    # engine (a worker scaled away) must not take the ps and the chief down with it
    engines = EngineSet(3, f"pscluster-forked-{os.getpid()}")
    pids = {e.engine_id: e.pid for e in engines.start()}
    try:
        parents = {psutil.Process(pid).ppid() for pid in pids.values()}
        [forker] = [e for e, pid in pids.items() if pid in parents]
        rest = sorted(set(pids) - {forker})
        # an engine that shuts down signals every process of its process group (ipykernel does): wait for it,
        # as a removal may, before the kill that follows. Its process's end, not its reply, is waited for: an
        # engine may exit before its reply leaves, and ipyparallel's blocking shutdown then waits forever
        engines.client.shutdown(targets=[forker], block=False)
        deadline = time.monotonic() + 60
        while alive(pids[forker]):
            assert time.monotonic() < deadline, "the engine asked to shut down is still running"
            time.sleep(0.05)
        engines.remove_engines([forker])
        assert not alive(pids[forker])
        assert engines.client[rest].apply_sync(os.getpid) == [pids[e] for e in rest]
    finally:
        engines.stop()
    assert not [p for p in pids.values() if alive(p)]


def test_a_start_counts_an_engine_whose_registration_its_client_missed(monkeypatch):
    # the client hears of engines from the hub's list when it connects, then from notifications: one that
    # registers between the two (local engines start while it connects) is never announced to it
    missed = []
    announce = ipp.Client._register_engine

    def miss_the_first(client, msg):
        if not missed:
            missed.append(msg)
        else:
            announce(client, msg)

    monkeypatch.setattr(ipp.Client, "_register_engine", miss_the_first)
    engines = EngineSet(2, f"pscluster-missed-{os.getpid()}")
    try:
        assert len(engines.start()) == 2 and missed
        assert sorted(engines.client.ids) == sorted(engines.engines)
    finally:
        engines.stop()


def test_stop_leaves_no_process(start_cluster):
    cluster = start_cluster(ps=1, workers=1, threads=1)
    pids = cluster.pids
    engine_ids = [t.engine_id for t in (*cluster.spec.ps, *cluster.spec.workers)]
    # every task runs torch with the threads it was given (more would spin against the other tasks)
    assert [cluster._engines.view(e).apply_sync(torch.get_num_threads) for e in engine_ids] == [1, 1]
    assert all(alive(p) for p in pids)
    # a local engine is watched by its pid: no nanny process beside it
    commands = [" ".join(psutil.Process(p).cmdline()) for p in pids]
    assert not [c for c in commands if "nanny" in c], commands
    connection_files = cluster._engines._connection_files()
    assert connection_files and all(map(os.path.exists, connection_files))
    cluster.stop()
    assert [p for p in pids if alive(p)] == []
    assert not [f for f in connection_files if os.path.exists(f)]  # ipcontroller's files go with it
    cluster.stop()  # stopping twice is harmless


def test_a_detached_cluster_outlives_its_owner_and_a_later_process_takes_over_its_run():
    name, steps = f"detached-{os.getpid()}", 4000
    owner = subprocess.Popen([sys.executable, "-c", DETACHED_OWNER, name, str(steps)], stdout=subprocess.PIPE,
                             text=True)
    cluster = None
    try:
        pids, run_id = json.loads(owner.stdout.readline())
        os.kill(owner.pid, signal.SIGKILL)  # the kernel goes away; the cluster and its run go on
        owner.wait(10)
        time.sleep(2)
        assert all(alive(p) for p in pids)
        assert {"name": name, "state": "detached"}.items() <= next(
            c for c in pscluster.clusters() if c["name"] == name).items()
        with pytest.raises(ClusterStateError, match="no detached cluster named 'nope'"):
            Cluster.attach("nope")
        attached_at = time.time()
        cluster = Cluster.attach(name)
        run = cluster.runs[-1]
        assert run.id == run_id and cluster.spec.chief.pid in pids
        run.wait(timeout=240, verbose=False)
        assert run.status == "finished" and run.global_step == steps
        metrics = run.metrics()
        assert (metrics["time"] > attached_at).any()  # its metrics are recorded again
        assert "adopted" in set(run.events()["kind"])
        assert set(run.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        with pytest.raises(TrainingError, match="load run.state_dict"):
            run.model()
        assert cluster.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), lr=0.1,
                             steps=20, checkpoint_secs=None).wait(timeout=120, verbose=False).global_step == 20
    finally:
        owner.kill()
        owner.wait(10)
        if cluster is not None:
            every = cluster.pids
            cluster.stop()
            assert wait_dead(every, timeout=10) == []
        assert wait_dead(pids, timeout=10) == []
    assert name not in [c["name"] for c in pscluster.clusters()]


def test_two_clusters_with_one_port_range_bind_loopback_ports_apart_and_a_rerun_finds_free_ones(start_cluster):
    ports = quiet_port_range(5)  # 2 ps + 1 collector, then 1 ps + 1 collector, at once: the range is nearly full
    first = start_cluster(ps=2, workers=1, ports=ports, threads=1)
    second = start_cluster(ps=1, workers=1, ports=ports, threads=1)
    # runs long enough to be training at once (a 20-step run could end, and free its collector's port for the
    # other run's, before the other started: seen once in three suites beside two CPU hogs)
    runs = [c.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), lr=0.1, steps=10**6,
                    batch_size=32, checkpoint_secs=None) for c in (first, second)]
    assert not any(run.done for run in runs)
    addresses = [t.address for c in (first, second) for t in c.spec.ps] + [r.plan.metrics_address for r in runs]
    assert len(set(addresses)) == len(addresses) == 5
    for address in addresses:  # the data plane and the metrics listen on loopback only, in the range
        host, port = address[len("tcp://"):].rsplit(":", 1)
        assert host == "127.0.0.1" and ports[0] <= int(port) <= ports[1]
    for run in runs:
        wait_for_step(run, 10)
        assert run.stop().status == "stopped" and run.global_step >= 10
    rerun = first.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), lr=0.1, steps=10,
                        batch_size=32, checkpoint_secs=None)
    assert ports[0] <= int(rerun.plan.metrics_address.rsplit(":", 1)[1]) <= ports[1]
    assert rerun.wait(verbose=False).global_step == 10
