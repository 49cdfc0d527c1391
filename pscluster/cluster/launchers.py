"""How a cluster's engines start: one of ipyparallel's launchers, chosen by name, and its options.

    Launcher()                                              # local engines (the default)
    Launcher("ssh", hosts=("node1", "node2=3"), ps_hosts=("node1",), ports=(20000,20100))
    Launcher("slurm", partition="gpu", account="proj", time_limit="01:00:00")
    Launcher("mpi", mpi_args=("--hostfile", "hosts.txt"), interface="10.0.0.1")

A ``Launcher`` is plain frozen data, validated on construction. ``EngineSet`` turns it into the
ipyparallel options (``controller_options``, ``engine_options``); the engines themselves are always
started by ipyparallel's launcher of that name (``LocalEngineSetLauncher``, ``SSHEngineSetLauncher``,
``MPIEngineSetLauncher``, ``SlurmEngineSetLauncher``); local ones as one process that forks into them
(``engine_main``).

Addresses: a local cluster (and an MPI one without ``interface``) binds its controller, data plane and
metrics collector to 127.0.0.1 only. Any other binds the controller and the collector to ``interface``
(default: this machine's address on the route to the first host, or to the default gateway), and
each ps to its own engine's address on the route to the controller. ``ports=(lo, hi)``: the ps and
collector ports are picked free in that range.
"""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..runtime.network import route_address

KINDS = ("local", "ssh", "mpi", "slurm")
LOOPBACK = "127.0.0.1"
# An engine that misses its heartbeats for HEARTBEAT_DEADLINE_S is lost, as a dead one is: a hung process
# (SIGSTOP, a long pause) or a cut link is replaced like a killed one. (Remote engines end themselves when the
# controller goes away through runtime.remote.watch_controller: ipyparallel 9's own
# IPEngine.max_heartbeat_misses check never runs under ipykernel 7.)
HEARTBEAT_DEADLINE_S = 4.0
HB_PERIOD_MS = 1000
CONTROLLER_HB_MISSES = round(HEARTBEAT_DEADLINE_S * 1000 / HB_PERIOD_MS)
# The controller counts an engine registered one heartbeat after the first one it answers: ipyparallel's
# default period (3 s) makes every start wait 3 to 6 s for nothing. A local engine that dies is seen at once by
# its pid; one that hangs misses the same deadline.
LOCAL_HB_PERIOD_MS = 200
LOCAL_HB_MISSES = round(HEARTBEAT_DEADLINE_S * 1000 / LOCAL_HB_PERIOD_MS)
_IPP_CLASS = {"local": "local", "ssh": "ssh", "mpi": "mpi", "slurm": "slurm"}


def _slurm_template() -> str:
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    return SlurmEngineSetLauncher.class_traits()["default_template"].default_value


def parse_hosts(hosts) -> dict[str, int | None]:
    """``["a", "b=2"]`` or ``"a,b=2"`` or ``{"a": 1, "b": 2}`` -> ``{"a": None, "b": 2}`` (None: as many engines
    as the role rule puts there). A host is ``[user@]name[:ssh port]``."""
    if isinstance(hosts, dict):
        items = [(str(h), n) for h, n in hosts.items()]
    else:
        words = hosts.split(",") if isinstance(hosts, str) else list(hosts)
        items = []
        for word in (str(w).strip() for w in words):
            name, sep, count = word.partition("=")
            if sep and not count.strip().isdigit():
                raise ConfigError(f"host {word!r}: write HOST or HOST=ENGINES, e.g. node1=2")
            items.append((name.strip(), int(count) if sep else None))
    parsed: dict[str, int | None] = {}
    for name, n in items:
        if not name or name in parsed:
            raise ConfigError(f"host {name!r} is empty or listed twice: list each host once, e.g. node1,node2=2")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"host {name}={n!r}: the engine count must be an integer >= 1")
        parsed[name] = n
    return parsed


def parse_ports(ports) -> tuple[int, int] | None:
    """``"20000-20100"`` or ``(20000, 20100)`` -> ``(20000, 20100)``; None stays None (any free port)."""
    if ports is None:
        return None
    try:
        lo, hi = (int(p) for p in (ports.split("-") if isinstance(ports, str) else ports))
    except (ValueError, TypeError):
        raise ConfigError(f"ports {ports!r}: give a range LO-HI, e.g. 20000-20100") from None
    if not 1024 <= lo <= hi <= 65535:
        raise ConfigError(f"ports {lo}-{hi}: use 1024 <= LO <= HI <= 65535")
    return lo, hi


def host_name(host: str) -> str:
    """``user@node1:2222`` -> ``node1``: the machine, without the ssh user and port."""
    return host.rpartition("@")[2].partition(":")[0]


@dataclass(frozen=True)
class Launcher:
    """Which ipyparallel launcher starts the engines, and its options.

    ``kind``: ``local``, ``ssh``, ``mpi`` or ``slurm``. ``hosts`` (ssh: required): ``[user@]host[:port][=N]``,
    N engines there (default: as the role rule places the tasks). ``ps_hosts``: the hosts whose engines
    serve the ps tasks (default: the first host); the workers go to the other hosts (all hosts when every
    one holds a ps). ``interface``: the address the controller and the metrics collector listen on.
    ``ports``: ``(lo, hi)`` range for the data-plane and metrics ports. ssh: ``ssh_args`` (e.g. ``-i KEY``),
    ``remote_python`` (default: this interpreter's path), ``remote_profile_dir``. slurm: ``partition``,
    ``account``, ``time_limit``, ``qos``, ``sbatch_args`` (more ``#SBATCH`` lines, e.g. ``--nodes=2``). mpi:
    ``mpi_args`` (e.g. ``--hostfile FILE``).
    """

    kind: str = "local"
    hosts: dict = field(default_factory=dict)
    ps_hosts: tuple[str, ...] = ()
    interface: str | None = None
    ports: tuple[int, int] | None = None
    ssh_args: tuple[str, ...] = ()
    remote_python: str | None = None
    remote_profile_dir: str | None = None
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    qos: str | None = None
    sbatch_args: tuple[str, ...] = ()
    mpi_args: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"launcher {self.kind!r}: use one of {', '.join(KINDS)}")
        object.__setattr__(self, "hosts", parse_hosts(self.hosts))
        object.__setattr__(self, "ports", parse_ports(self.ports))
        for name in ("ps_hosts", "ssh_args", "sbatch_args", "mpi_args"):
            value = getattr(self, name)
            object.__setattr__(self, name, tuple(value.split(",") if name == "ps_hosts" and isinstance(value, str)
                                                 else value))
        if self.kind == "ssh" and not self.hosts:
            raise ConfigError("the ssh launcher needs hosts: pass hosts=['node1', 'node2'] (--hosts node1,node2)")
        if self.kind in ("local", "slurm", "mpi") and self.hosts:
            where = {"local": "use launcher='ssh' to start engines on other hosts",
                     "slurm": "Slurm places the engines: ask for nodes with sbatch_args, e.g. --nodes=2",
                     "mpi": "name them in mpi_args, e.g. --host a,b or --hostfile FILE"}[self.kind]
            raise ConfigError(f"hosts are for the ssh launcher, not {self.kind}: {where}")
        ssh_only = [n for n in ("ssh_args", "remote_python", "remote_profile_dir") if getattr(self, n)]
        slurm_only = [n for n in ("partition", "account", "time_limit", "qos", "sbatch_args") if getattr(self, n)]
        for kind, names in (("ssh", ssh_only), ("slurm", slurm_only), ("mpi", ["mpi_args"] * bool(self.mpi_args))):
            if names and self.kind != kind:
                raise ConfigError(f"{', '.join(names)} are {kind} launcher options, and this cluster uses "
                                  f"{self.kind}: drop them or use launcher={kind!r}")
        known = {host_name(h) for h in self.hosts} | set(self.hosts)
        unknown = [h for h in self.ps_hosts if h not in known] if self.kind == "ssh" else []
        if unknown:
            raise ConfigError(f"ps host {unknown[0]!r} is not one of the hosts ({', '.join(self.hosts)}): "
                              "list it in hosts too")
        if self.interface is not None:
            try:
                ipaddress.ip_address(self.interface)
            except ValueError:
                raise ConfigError(f"interface {self.interface!r}: give an IP address of this machine, "
                                  "e.g. 10.0.0.1") from None
            if self.kind == "local" and self.interface != LOOPBACK:
                raise ConfigError(f"interface {self.interface}: a local cluster listens on {LOOPBACK} only; "
                                  "pick another launcher for engines on other hosts")

    @property
    def local(self) -> bool:
        """Engines are processes of this machine that this process may signal and watch by pid."""
        return self.kind == "local"

    # --- placement of the tasks on the hosts -------------------------------------------------
    def task_hosts(self, num_ps: int, num_workers: int) -> tuple[list[str], list[str]]:
        """The host of each ps and each worker task (ssh). ps tasks go round-robin to ``ps_hosts`` (default:
        the first host), workers round-robin to the other hosts (to every host when all of them hold a ps).
        With engine counts (``node1=2``, on every host then) the ps take the first engines of the ps hosts
        and the workers the rest, in host order; the counts must add up to the tasks."""
        hosts = list(self.hosts)
        ps_hosts = [h for h in hosts if h in self.ps_hosts or host_name(h) in self.ps_hosts] or hosts[:1]
        counts = [n for n in self.hosts.values() if n is not None]
        if not counts:
            worker_hosts = [h for h in hosts if h not in ps_hosts] or hosts
            return ([ps_hosts[i % len(ps_hosts)] for i in range(num_ps)],
                    [worker_hosts[i % len(worker_hosts)] for i in range(num_workers)])
        if len(counts) != len(hosts) or sum(counts) != num_ps + num_workers:
            listed = ", ".join(f"{h}={n or '?'}" for h, n in self.hosts.items())
            raise ConfigError(f"engine counts {listed} do not hold {num_ps} ps + {num_workers} workers: give "
                              f"every host a count, adding up to {num_ps + num_workers}")
        slots = [h for h in hosts for _ in range(self.hosts[h])]
        ps_slots = [h for h in slots if h in ps_hosts][:num_ps]
        if len(ps_slots) < num_ps:
            raise ConfigError(f"the ps hosts ({', '.join(ps_hosts)}) have {len(ps_slots)} engines for {num_ps} ps "
                              "tasks: give them more engines or name more ps hosts")
        workers = list(slots)
        for h in ps_slots:
            workers.remove(h)
        return ps_slots, workers

    def engine_counts(self, num_ps: int, num_workers: int) -> dict[str, int]:
        """Engines to start on each ssh host."""
        ps, workers = self.task_hosts(num_ps, num_workers)
        return {h: (ps + workers).count(h) for h in self.hosts if (ps + workers).count(h)}

    # --- ipyparallel options -----------------------------------------------------------------
    def controller_ip(self) -> str:
        """The address the controller (and the metrics collector) listens on."""
        if self.interface is not None:
            return self.interface
        if self.kind in ("local", "mpi"):
            return LOOPBACK
        target = host_name(next(iter(self.hosts))) if self.hosts else "192.0.2.1"  # TEST-NET: the default route
        address = route_address(target)
        if address is None:
            raise ConfigError(f"no route from this machine to {target}: pass interface=<this machine's address "
                              "the engines reach> (--interface IP)")
        return address

    def cluster_options(self) -> dict:
        """Keyword arguments of ``ipyparallel.Cluster`` for this launcher."""
        options = {"engine_launcher_class": _IPP_CLASS[self.kind], "controller_ip": self.controller_ip()}
        period, misses = (LOCAL_HB_PERIOD_MS, LOCAL_HB_MISSES) if self.local else (HB_PERIOD_MS, CONTROLLER_HB_MISSES)
        options["controller_args"] = [f"--HeartMonitor.period={period}",
                                      f"--HeartMonitor.max_heartmonitor_misses={misses}"]
        if self.local:  # the engines read the controller's connection file themselves (see engine_main)
            options["send_engines_connection_env"] = False
        return options

    def engine_options(self, counts: dict[str, int] | None = None) -> dict:
        """Keyword arguments of the engine launcher (``start_engines``); ``counts``: engines per ssh host."""
        options: dict = {}
        if self.kind == "ssh":
            options["engines"] = dict(counts or {})
            options["ssh_args"] = list(self.ssh_args)
            options["scp_args"] = ["-P" if a == "-p" else a for a in self.ssh_args]
            options["remote_python"] = self.remote_python or sys.executable
            if self.remote_profile_dir:
                options["remote_profile_dir"] = self.remote_profile_dir
        elif self.kind == "mpi":
            options["mpi_args"] = list(self.mpi_args)
        elif self.kind == "slurm":
            options.update({k: v for k, v in (("queue", self.partition), ("account", self.account),
                                              ("timelimit", self.time_limit), ("qos", self.qos)) if v})
            if self.sbatch_args:  # ipyparallel's own engine job script, with these lines after its first; the
                # task count stated too (ipyparallel would take a --nodes line for one and leave it out)
                shebang, rest = _slurm_template().split("\n", 1)
                lines = ["#SBATCH --ntasks={n}", *(f"#SBATCH {a}" for a in self.sbatch_args)]
                options["default_template"] = "\n".join([shebang, *lines, rest])
        return options

    def bind_host(self, engine_address: str | None) -> str:
        """Where a ps on an engine (that reported ``engine_address``, its address towards the controller)
        listens."""
        if self.controller_ip() == LOOPBACK:
            return LOOPBACK
        return engine_address or LOOPBACK


