"""A cluster over ipyparallel's SSH launcher on namespace hosts: the ps on one host, the workers on others,
trains like the same cluster on local engines; a host cut off during a run is detected by the controller's
heartbeats, named, and recovered from (or the run ends with its name) within a bounded time."""

import faulthandler
import time

import psutil
import pytest
import torch

import pscluster
from pscluster.cluster.reaper import alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
SEED, STEPS, BATCH, LR = 3, 40, 32, 0.1


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


@pytest.fixture(scope="module")
def ssh_cluster(hosts):
    """1 ps on the first namespace host, a worker on each of two others, over the real ssh launcher; shared by
    the tests of this module (starting engines over ssh takes a while), in their order: train, then cut."""
    h = hosts(3)
    cluster = pscluster.Cluster(ps=1, workers=2, hosts=h.addresses, ps_hosts=[h.addresses[0]], ports="42000-42099",
                                **h.launcher_options())
    try:
        yield cluster.start()
    finally:
        pids = cluster.pids
        cluster.stop()
        assert not [p for p in pids if alive(p)], "controller processes left running after stop()"
        sshd = {p.pid for p in h.sshd}
        deadline = time.monotonic() + 30  # the engines on the hosts end too (one cut off ends on its own)
        while (left := set(h.processes()) - sshd) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"processes left on the hosts after stop(): {described(left)}"


def described(pids) -> list[str]:
    """``pid: command line (status)`` of each process, for a failure's message."""
    lines = []
    for pid in sorted(pids):
        try:
            p = psutil.Process(pid)
            lines.append(f"{pid}: {' '.join(p.cmdline())[:200]} ({p.status()})")
        except psutil.Error:
            lines.append(f"{pid}: gone")
    return lines


def train(cluster, dataset, **kwargs):
    return cluster.train(mlp, dataset, torch.nn.CrossEntropyLoss(), optimizer="sgd", lr=LR, mode="sync",
                         steps=STEPS, batch_size=BATCH, seed=SEED, checkpoint_secs=None, **kwargs)


def test_ps_and_workers_on_separate_hosts_train_like_local_engines(ssh_cluster, hosts):
    digits = pscluster.datasets.digits("train")
    cluster, h = ssh_cluster, hosts(3)
    roles = {r["role"]: r for r in cluster.roles()}
    # the ps serves on its own host's address only, on a port of the range; each worker is on another host
    ps = cluster.spec.ps[0]
    assert ps.host == h.addresses[0] and 42000 <= ps.port <= 42099
    assert roles["ps"]["address"] == f"tcp://{h.addresses[0]}:{ps.port}"
    assert sorted(t.host for t in cluster.spec.workers) == h.addresses[1:3]
    # the controller listens on the bridge address (its schedulers talk among themselves on loopback), never
    # on every interface
    controller = psutil.Process(cluster._engines.controller_pid)
    listening = {c.laddr.ip for p in [controller, *controller.children(recursive=True)]
                 for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert h.controller_ip in listening and listening <= {h.controller_ip, "127.0.0.1"}
    remote = train(cluster, digits)
    assert remote.plan.metrics_address.startswith(f"tcp://{h.controller_ip}:")
    assert 42000 <= int(remote.plan.metrics_address.rsplit(":", 1)[1]) <= 42099
    remote.wait(verbose=False)

    with pscluster.Cluster(ps=1, workers=2) as local_cluster:
        local = train(local_cluster, digits).wait(verbose=False)
    assert remote.global_step == local.global_step == STEPS
    got, expected = remote.state_dict(), local.state_dict()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6)
    test = pscluster.datasets.digits("test")
    assert remote.evaluate(test)["accuracy"] == pytest.approx(local.evaluate(test)["accuracy"], abs=1e-9)


def test_a_host_cut_off_mid_run_is_named_and_the_run_recovers_or_ends_in_bounded_time(ssh_cluster, hosts):
    cluster, h = ssh_cluster, hosts(3)
    run = cluster.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), lr=LR, mode="sync",
                        steps=100_000, batch_size=BATCH, checkpoint_every=20, checkpoint_secs=None)
    deadline = time.monotonic() + 60
    while run.global_step < 30:
        assert not run.done and time.monotonic() < deadline, f"no progress: {run.error}"
        time.sleep(0.1)
    h.cut(0)  # the ps host loses its link
    cut_at, step_at_cut = time.monotonic(), run.global_step
    try:
        deadline = cut_at + 120
        while not (lost := _events(run, "lost")) and not run.done and time.monotonic() < deadline:
            time.sleep(0.2)
        if not lost:  # where each thread of this process is, and what the controller still counts, for the report
            faulthandler.dump_traceback(all_threads=True)
            print(f"engines registered: {sorted(cluster._engines.registered())}; {cluster.spec}; "
                  f"step {run.global_step}; events:\n{run.events().tail(20).to_string()}")
        assert lost, f"the lost ps was not detected within 120s ({run.error})"
        assert (lost[0]["task"], lost[0]["host"]) == ("ps:0", h.addresses[0])
        # recovered (the ps replaced on a live host, training past the step of the cut) or ended naming the host
        while not run.done and time.monotonic() < deadline:
            if _events(run, "replaced") and run.global_step > step_at_cut + 10:
                break
            time.sleep(0.2)
        assert time.monotonic() < deadline, "neither recovered nor ended within 120s of the cut"
        if run.done:
            print(f"the run ended after the cut: {run.error}")
            assert run.error and h.addresses[0] in run.error
        else:
            print(f"recovered: {_events(run, 'replaced')}, step {run.global_step}, {time.monotonic() - cut_at:.0f}s")
            assert _events(run, "replaced")[0]["host"] in h.addresses[1:]
            assert cluster.spec.ps[0].host in h.addresses[1:]
    finally:
        run.stop()
        h.restore(0)


def _events(run, kind) -> list[dict]:
    e = run.events()
    return [{"task": r.task, **r.detail} for r in e[e["kind"] == kind].itertuples()]
