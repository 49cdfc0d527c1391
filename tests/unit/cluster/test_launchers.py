"""Launcher options: validation with one-line errors, placement of the tasks on hosts, the ipyparallel options
they become, role assignment by machine with per-host GPUs, and picking ports in a range; launchers found by
name (pscluster's, registered ones, any of ipyparallel's) or class, and no launcher name tested outside
``pscluster/cluster/launchers``."""

import ast
import dataclasses
import errno
import socket
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import zmq

import pscluster
from pscluster.cluster import launchers
from pscluster.cluster.launchers import (LOCAL_HB_PERIOD_MS, BatchLauncher, IPyParallelLauncher, Launcher,
                                         SlurmLauncher, parse_hosts)
from pscluster.cluster.launchers import base as launcher_base
from pscluster.cluster.roles import EngineInfo, assign_roles, host_gpus
from pscluster.errors import ConfigError
from pscluster.magics.parsers import launcher_options, parsers
from pscluster.runtime.network import bind_in_range, ephemeral_ports, free_port, route_address

from ...ports import quiet_port_range


@pytest.mark.parametrize("kwargs, fix", [
    ({"kind": "ssh"}, "needs hosts"),
    ({"kind": "nfs"}, "use one of local, ssh, mpi, slurm"),
    ({"kind": "local", "hosts": ["a"]}, "use launcher='ssh'"),
    ({"kind": "slurm", "hosts": ["a"]}, "--nodes=2"),
    ({"kind": "pbs", "slurm_partition": "gpu"}, "slurm_partition are slurm launcher options"),
    ({"kind": "pbs", "queeu": "long"}, "nor a trait of ipyparallel's PBSEngineSetLauncher"),
    ({"kind": "local", "workres": 2}, "'workres' is not an option of a cluster or of the local launcher"),
    ({"kind": "no_such_module.Launcher"}, "does not import"),
    ({"kind": "ssh", "hosts": ["a"], "slurm_partition": "gpu"}, "slurm_partition are slurm launcher options"),
    ({"kind": "local", "mpi_args": ["-n"]}, "mpi_args are mpi launcher options"),
    ({"kind": "ssh", "hosts": ["a", "b"], "ps_hosts": ["c"]}, "ps host 'c' is not one of the hosts"),
    ({"kind": "ssh", "hosts": ["a"], "interface": "eth0"}, "give an IP address"),
    ({"kind": "local", "interface": "10.0.0.1"}, "listens on 127.0.0.1 only"),
    ({"ports": "9-8"}, "1024 <= LO <= HI"),
    ({"ports": "abc"}, "give a range LO-HI"),
    ({"kind": "ssh", "hosts": "a=x"}, "HOST=ENGINES"),
    ({"kind": "ssh", "hosts": "a,a"}, "listed twice"),
])
def test_bad_options_are_refused_in_one_line_naming_the_fix(kwargs, fix):
    with pytest.raises(ConfigError) as e:
        Launcher(**kwargs)
    assert fix in str(e.value) and "\n" not in str(e.value)


def test_hosts_parse_from_text_lists_and_dicts():
    assert parse_hosts("root@a:2222, b=2") == {"root@a:2222": None, "b": 2}
    assert parse_hosts(["a", "b=3"]) == {"a": None, "b": 3}
    assert parse_hosts({"a": 1}) == {"a": 1}


def test_ps_go_to_the_ps_hosts_and_workers_to_the_others():
    launcher = Launcher("ssh", hosts=["a", "b", "c"], ps_hosts=["a"])
    assert launcher.task_hosts(1, 4) == (["a"], ["b", "c", "b", "c"])
    assert launcher.engine_counts(1, 4) == {"a": 1, "b": 2, "c": 2}
    # default: the first host holds the ps tasks; a single host holds everything
    assert Launcher("ssh", hosts=["x", "y"]).task_hosts(2, 1) == (["x", "x"], ["y"])
    assert Launcher("ssh", hosts=["x"]).task_hosts(1, 2) == (["x"], ["x", "x"])
    # ps hosts named by machine also match user@host:port entries
    assert Launcher("ssh", hosts=["u@a:22", "b"], ps_hosts=["a"]).task_hosts(1, 1) == (["u@a:22"], ["b"])


def test_engine_counts_must_hold_the_tasks_exactly():
    launcher = Launcher("ssh", hosts="a=2,b=2", ps_hosts="a")
    assert launcher.task_hosts(1, 3) == (["a"], ["a", "b", "b"])
    with pytest.raises(ConfigError, match="adding up to 5"):
        launcher.task_hosts(1, 4)
    with pytest.raises(ConfigError, match="give every host a count"):
        Launcher("ssh", hosts="a=2,b").task_hosts(1, 2)
    with pytest.raises(ConfigError, match="have 1 engines for 2 ps"):
        Launcher("ssh", hosts="a=1,b=3", ps_hosts="a").task_hosts(2, 2)


def test_ipyparallel_options_of_each_launcher():
    local = Launcher()
    options = local.cluster_options()
    assert options["engine_launcher_class"] == "local" and options["controller_ip"] == "127.0.0.1"
    assert options["send_engines_connection_env"] is False  # engine_main reads the connection file
    assert f"--HeartMonitor.period={LOCAL_HB_PERIOD_MS}" in options["controller_args"]
    assert local.engine_options() == {} and local.bind_host("10.0.0.5") == "127.0.0.1"
    ssh = Launcher("ssh", hosts=["127.0.0.1"], ssh_args=["-p", "2222", "-i", "k"], remote_python="/opt/py")
    options = ssh.engine_options({"127.0.0.1": 3})
    assert options["engines"] == {"127.0.0.1": 3} and options["remote_python"] == "/opt/py"
    assert options["scp_args"] == ["-P", "2222", "-i", "k"]  # scp names the port -P
    cluster = ssh.cluster_options()
    assert cluster["engine_launcher_class"] == "ssh" and cluster["controller_ip"] == "127.0.0.1"
    assert any(a.startswith("--HeartMonitor.max_heartmonitor_misses=") for a in cluster["controller_args"])
    assert Launcher("mpi", mpi_args=["--hostfile", "h"]).engine_options()["mpi_args"] == ["--hostfile", "h"]
    assert Launcher("mpi", interface="127.0.0.1").controller_ip() == "127.0.0.1"
    slurm = Launcher("slurm", slurm_partition="p", account="a", time_limit="10", interface="10.1.2.3").engine_options()
    assert slurm == {"queue": "p", "account": "a", "timelimit": "10"}
    assert Launcher("slurm", interface="10.1.2.3").bind_host("10.1.2.9") == "10.1.2.9"


def test_roles_by_machine_with_gpus_per_host():
    engines = [EngineInfo(0, "n1", 10, "10.0.0.1", gpus=0), EngineInfo(1, "n2", 11, "10.0.0.2", gpus=2),
               EngineInfo(2, "n2", 12, "10.0.0.2", gpus=2), EngineInfo(3, "n2", 13, "10.0.0.2", gpus=2),
               EngineInfo(4, "n1", 14, "10.0.0.1", gpus=0)]
    gpus = host_gpus(engines, None)
    spec = assign_roles(engines, 1, 4, gpus=gpus, ps_machines=["10.0.0.2"], bind_host=lambda e: e.address)
    assert [(t.engine_id, t.host) for t in spec.ps] == [(1, "10.0.0.2")]
    assert [(t.engine_id, t.device) for t in spec.workers] == [(0, "cpu"), (2, "cuda:0"), (3, "cuda:1"),
                                                              (4, "cpu")]
    with pytest.raises(ConfigError, match="host 10.0.0.1 has 0"):
        host_gpus(engines, 1)
    with pytest.raises(ConfigError, match="no engine registered from 10.9.9.9"):
        assign_roles(engines, 1, 1, ps_machines=["10.9.9.9"])


def test_ports_are_picked_free_in_the_range():
    ctx = zmq.Context.instance()

    def bind(p):
        s = ctx.socket(zmq.ROUTER)
        try:
            s.bind(f"tcp://127.0.0.1:{p}")
        except zmq.ZMQError:
            s.close()
            raise
        return s, p

    port, _ = quiet_port_range(2)
    taken, _ = bind(port)
    sockets = [taken]
    try:
        sock, got = bind_in_range(bind, (port, port + 1))
        sockets.append(sock)
        assert got == port + 1  # the taken one skipped
        with pytest.raises(OSError, match="wider --ports range$"):
            bind_in_range(bind, (port, port + 1))
    finally:
        for s in sockets:
            s.close()


def test_a_full_range_that_outgoing_connections_share_is_named_in_the_error():
    def taken(port):
        raise zmq.ZMQError(errno.EADDRINUSE)

    low, high = ephemeral_ports()
    with pytest.raises(OSError, match=f"wider --ports range outside {low}-{high}, the ports outgoing"):
        bind_in_range(taken, (high - 1, high + 1))


def test_a_free_port_for_a_later_server_is_outside_the_ports_outgoing_connections_take_and_never_handed_out_twice():
    low, _ = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free when handed out: a later server binds it


def test_route_address_is_this_machines_address_towards_a_target():
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert route_address("host.invalid") is None
    assert socket.inet_aton(route_address("127.0.0.1"))


def test_start_magic_takes_the_launcher_options():
    args = parsers()["start"].parse_args(
        ["--launcher", "slurm", "--slurm-partition", "gpu", "--account", "a", "--time-limit", "01:00:00",
         "--sbatch-arg=--nodes=2", "--ports", "40000-40100", "--interface", "10.0.0.1", "--encrypt"])
    assert (args.launcher, args.slurm_partition, args.time_limit, args.sbatch_args) == ("slurm", "gpu", "01:00:00",
                                                                                  ["--nodes=2"])
    assert args.encrypt and not parsers()["start"].parse_args([]).encrypt
    with pytest.raises(ConfigError, match="launcher 'nfs': use one of local, ssh, mpi, slurm, .*pbs"):
        parsers()["start"].parse_args(["--launcher", "nfs"])
    args = parsers()["start"].parse_args(["--launcher", "pbs", "--launcher-opt", "queue=long"])
    assert (args.launcher, args.launcher_opts) == ("pbs", [("queue", "long")])


@dataclasses.dataclass(frozen=True)
class KubeLauncher(launchers.SSHLauncher):
    """A new kind with options of its own: nothing else is written for its flags."""

    kind: str = "kube"
    namespace: str | None = launchers.option(None, help="the namespace of the engines' pods")
    pod_args: tuple[str, ...] = launchers.option((), metavar="ARG", repeat=True, help="a pod option (repeatable)")


def test_a_registered_launcher_s_options_are_start_flags_with_no_other_file_changed(monkeypatch):
    monkeypatch.setitem(launcher_base._REGISTERED, "kube", KubeLauncher)
    start = parsers()["start"]
    assert "kube: the namespace of the engines' pods" in start.format_help()
    args = start.parse_args(["--launcher", "kube", "--hosts", "a,b", "--namespace", "ml", "--pod-arg=--cpu=2",
                             "--pod-arg=--mem=4G", "--launcher-opt", "remote_profile_dir='/p'"])
    given = launcher_options(args)
    assert given == {"hosts": "a,b", "namespace": "ml", "pod_args": ["--cpu=2", "--mem=4G"],
                     "remote_profile_dir": "/p"}
    made = Launcher(args.launcher, **given)
    assert isinstance(made, KubeLauncher) and (made.namespace, made.pod_args) == ("ml", ["--cpu=2", "--mem=4G"])
    # a flag of a launcher the cluster does not use is refused in one line naming its owner
    with pytest.raises(ConfigError, match="namespace are kube launcher options"):
        Launcher("mpi", **launcher_options(start.parse_args(["--launcher", "mpi", "--namespace", "ml"])))
    # every flag is one option's: the launchers' and the cluster's own flags never share a name
    flags = [f.flag for f in launchers.flags()]
    assert len(flags) == len(set(flags)) and "--namespace" in flags
    assert not set(flags) & {"--ps", "--workers", "--gpus", "--name", "--threads", "--spares", "--launcher"}
    for command in ("train", "run"):  # nor with a run's (--partition was a Slurm partition and a variable's split)
        assert not set(flags) & {s for action in parsers()[command]._actions for s in action.option_strings}


def test_any_ipyparallel_engine_launcher_by_name_or_class():
    from ipyparallel.cluster import launcher as ipp

    pbs = Launcher("pbs", queue="long", interface="10.1.2.3")
    assert isinstance(pbs, BatchLauncher) and pbs.kind == "pbs" and pbs.traits == {"queue": "long"}
    assert pbs.cluster_options()["engine_launcher_class"] is ipp.PBSEngineSetLauncher
    assert pbs.engine_options() == {"queue": "long"} and pbs.job_variable() == "PBS_JOBID"
    assert Launcher("sge", traits={"queue": "q"}).job_variable() == "JOB_ID"  # SGE's own, not PBS's
    proxy = Launcher("sshproxy", interface="10.1.2.3")  # no batch system: all engines in one launch
    assert type(proxy).__mro__[1] is IPyParallelLauncher and not isinstance(proxy, BatchLauncher)
    by_path = Launcher("ipyparallel.cluster.launcher.LSFEngineSetLauncher", interface="10.1.2.3")
    by_class = pscluster.Cluster(launcher=ipp.LSFEngineSetLauncher, interface="10.1.2.3").launcher
    assert type(by_path) is type(by_class) and by_class.job_variable() == "LSB_JOBID"
    assert {"local", "ssh", "mpi", "slurm", "pbs", "sge", "lsf", "htcondor"} <= set(launchers.names())
    assert launchers.names()[:4] == ["local", "ssh", "mpi", "slurm"]
    slurm = Launcher("slurm", slurm_partition="p", namespace={"x": 1})  # a trait of ipyparallel's Slurm launcher too
    assert isinstance(slurm, SlurmLauncher) and slurm.engine_options() == {"queue": "p", "namespace": {"x": 1}}


def test_slurm_submits_a_job_per_engine_unless_its_options_size_one_job():
    each = Launcher("slurm", sbatch_args=["--gres=gpu:1"])
    assert not each.together() and "--gres=gpu:1" in each.engine_options()["default_template"]
    for size in ("--nodes=2", "-N2", "--ntasks-per-node=4", "-n 4"):
        launcher = Launcher("slurm", sbatch_args=[size, "--mem=8G"])
        assert launcher.together(), size  # the first engines one job of that size, as before
        assert f"#SBATCH {size}\n" in launcher.engine_options()["default_template"]
        replacement = launcher.replacement_options()["default_template"]  # a job of one engine, of the same kind
        assert size not in replacement and "#SBATCH --mem=8G\n" in replacement, replacement


@dataclasses.dataclass(frozen=True)
class FakeKubernetes(Launcher):
    """A third party's launcher: its own options, the whole interface (nothing started here)."""

    kind: str = "k8s"
    namespace: str = "default"
    image: str | None = None

    def start(self, engines, n, num_ps, num_workers):
        raise NotImplementedError

    def add(self, engines, task, live):
        raise NotImplementedError


def test_a_third_party_launcher_by_registration_or_entry_point(monkeypatch):
    monkeypatch.setitem(launcher_base._REGISTERED, "k8s", FakeKubernetes)
    made = Launcher("k8s", namespace="ml", interface="10.0.0.9")
    assert isinstance(made, FakeKubernetes) and made.namespace == "ml" and made.controller_ip() == "10.0.0.9"
    assert pscluster.Cluster(launcher="k8s", image="me/engine:1", ps=1, workers=1).launcher.image == "me/engine:1"
    with pytest.raises(ConfigError, match="namespace are k8s launcher options, and this cluster uses mpi"):
        Launcher("mpi", namespace="ml")
    assert "k8s" in launchers.names()
    args = parsers()["start"].parse_args(["--launcher", "k8s", "--launcher-opt", "namespace=ml"])
    assert args.launcher_opts == [("namespace", "ml")]
    monkeypatch.delitem(launcher_base._REGISTERED, "k8s")
    point = EntryPoint(name="k8s", value=f"{__name__}:FakeKubernetes", group=launcher_base.ENTRY_POINTS)
    real = launcher_base.entry_points
    monkeypatch.setattr(launcher_base, "entry_points",
                        lambda group: [point] if group == launcher_base.ENTRY_POINTS else real(group=group))
    assert isinstance(Launcher("K8s", namespace="ml"), FakeKubernetes)


# what may decide by a launcher's name: its own modules
LAUNCHERS = Path(launchers.__file__).parent


def _names_in(node, names) -> list[str]:
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]


def test_no_launcher_name_is_tested_outside_the_launchers():
    """No ``kind == "ssh"``, ``kind in ("local", "mpi")`` or ``{"local": ..., "ssh": ...}[kind]`` anywhere else in
    pscluster: what differs between launchers is a method of theirs."""
    found, names = [], set(launchers.names())
    for path in Path(pscluster.__file__).parent.rglob("*.py"):
        if LAUNCHERS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                hits = [n for side in (node.left, *node.comparators) for n in _names_in(side, names)]
            elif isinstance(node, ast.Dict):
                hits = [n for k in node.keys if k is not None for n in _names_in(k, names)]
                hits = hits if len(hits) > 1 else []
            else:
                continue
            found += [f"{path.relative_to(LAUNCHERS.parents[2])}:{node.lineno} {h!r}" for h in hits]
    assert not found, found


def test_ipyparallel_client_notes_go_to_the_log_not_the_notebook(capsys, caplog):
    """After a recovery, the client's thread reports the replies of engines declared lost ("got stale result" and
    the whole message): into the pscluster log, not into whatever notebook cell runs."""
    import ipyparallel.client.client as ipp_client

    import pscluster.cluster.engines  # noqa: F401  (routes them)

    with caplog.at_level("INFO", logger="pscluster.engines"):
        ipp_client.print("got stale result: 3f2a")  # as the client calls it
    assert capsys.readouterr().out == ""
    assert [r.getMessage() for r in caplog.records] == ["got stale result: 3f2a"]


class _Submitted:
    """An engine set of ipyparallel's batch launchers, as far as the launcher reads it: its job."""

    def __init__(self, job_id):
        self.job_id, self.batch_file = job_id, None


class _Cluster:
    """ipyparallel's cluster with two engine sets, one job each."""

    def __init__(self):
        self.engines = {"s1": _Submitted("4711"), "s2": _Submitted("4712.server")}
        self.stopped = []

    def stop_engines_sync(self, set_id):
        self.stopped.append(set_id)
        del self.engines[set_id]


class _Engines:
    """A cluster's engines as a launcher sees them (``launchers.base.Engines``)."""

    def __init__(self):
        self.cluster = _Cluster()
        self.info = {0: EngineInfo(0, "n1", 10, "10.0.0.1", job="4711"),
                     1: EngineInfo(1, "n2", 11, "10.0.0.2", job="4712.server")}
        self.engines = {0: 10, 1: 11}


def test_a_batch_launcher_kills_releases_and_stops_engines_by_their_jobs(monkeypatch):
    engines = _Engines()
    slurm = Launcher("slurm", interface="10.0.0.1")
    assert slurm.where(engines, 1) == {"host": "n2", "pid": 11, "address": "10.0.0.2", "job": "4712.server"}
    slurm.kill(engines, 0)  # its job cancelled, the other left
    assert engines.cluster.stopped == ["s1"] and list(engines.cluster.engines) == ["s2"]
    drained = []
    monkeypatch.setattr(SlurmLauncher, "drain", lambda self, jobs: drained.append(jobs))
    slurm.stop(engines)  # every job left deleted, then waited for until the queue no longer lists them
    assert engines.cluster.stopped == ["s1", "s2"] and drained == [["4712.server"]]
