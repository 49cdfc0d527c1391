"""The launcher interface: how a cluster's engines start, are killed, replaced, listed and stopped.

A ``Launcher`` is a small frozen dataclass (its options, validated on construction) that also carries the
behaviour of its kind: ``Launcher("ssh", hosts=[...])`` builds an ``SSHLauncher``. ``EngineSet``
(``cluster/engines.py``) owns the ipyparallel controller, the client and the reaper, and calls the launcher
for everything that depends on how and where the engines run, in this order:

1. ``cluster_options()``: the keyword arguments of ``ipyparallel.Cluster`` (its engine launcher class, the
   controller's address and heartbeats);
2. ``start(engines, n, num_ps, num_workers)``: launch the cluster's first ``n`` engines;
3. ``job_variable()``: read on each engine once it registered, where it lives beyond host and pid (a job id);
4. ``ps_machines(...)``, ``bind_host(address)``: where the ps tasks go and listen;
5. during the cluster's life: ``kill(engines, engine_id)`` (a task on purpose, or a lost one that may still
   run), ``add(engines, task, live)`` (one more engine: a replacement, or a new worker), ``release(engines,
   engine_ids)`` (engines removed for good), ``where(engines, engine_id)`` (listing);
6. ``stop(engines)``: after the client asked every engine to exit: end whatever the launcher started.

Which class a kind names: ``local``, ``ssh``, ``mpi`` and ``slurm`` are pscluster's own; ``register`` and the
entry point group ``pscluster.launchers`` add others (a ``Launcher`` subclass, e.g. for Kubernetes); any other
name is one of ipyparallel's engine set launchers (its entry point group ``ipyparallel.engine_launchers``:
``pbs``, ``sge``, ``lsf``, ``htcondor``... and third-party ones), or an importable ``package.module.Class``
of either kind, run through ``IPyParallelLauncher`` (batch systems: one job per engine, ``BatchLauncher``).

Addresses: a local cluster (and an MPI one without ``interface``) binds its controller, data plane and
metrics collector to 127.0.0.1 only. Any other binds the controller and the collector to ``interface``
(default: this machine's address on the route to the first host, or to the default gateway), and
each ps to its own engine's address on the route to the controller. ``ports=(lo, hi)``: the ps and
collector ports are picked free in that range.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import ipaddress
import signal
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, ClassVar, Protocol, Sequence

from ...errors import ConfigError
from ...runtime.network import route_address

if TYPE_CHECKING:
    import ipyparallel

    from ...spec import TaskSpec
    from ..roles import EngineInfo

DEFAULT = "local"  # the launcher a cluster uses when none is named
LOOPBACK = "127.0.0.1"
# An engine that misses its heartbeats for HEARTBEAT_DEADLINE_S is lost, as a dead one is: a hung process
# (SIGSTOP, a long pause) or a cut link is replaced like a killed one. (Remote engines end themselves when the
# controller goes away through runtime.remote.watch_controller: ipyparallel 9's own
# IPEngine.max_heartbeat_misses check never runs under ipykernel 7.)
HEARTBEAT_DEADLINE_S = 4.0
HB_PERIOD_MS = 1000
# A remote engine that reaches no controller for this long ends itself: a controller still running has counted it
# lost (HEARTBEAT_DEADLINE_S) and replaced it by then.
ORPHAN_DEADLINE_S = 2 * HEARTBEAT_DEADLINE_S
CONTROLLER_HB_MISSES = round(HEARTBEAT_DEADLINE_S * 1000 / HB_PERIOD_MS)
# The controller counts an engine registered one heartbeat after the first one it answers: ipyparallel's
# default period (3 s) makes every start wait 3 to 6 s for nothing. A local engine that dies is seen at once by
# its pid; one that hangs misses the same deadline.
LOCAL_HB_PERIOD_MS = 200
LOCAL_HB_MISSES = round(HEARTBEAT_DEADLINE_S * 1000 / LOCAL_HB_PERIOD_MS)
ENTRY_POINTS = "pscluster.launchers"  # third-party Launcher subclasses, by name
IPP_ENTRY_POINTS = "ipyparallel.engine_launchers"


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


def _given(value) -> bool:
    """Whether an option was given a value (None and empty sequences are "left out", as the magic leaves them)."""
    return value is not None and not (isinstance(value, (str, tuple, list, dict, set)) and not value)


class Engines(Protocol):
    """What a launcher may use of the cluster's engines (``cluster.engines.EngineSet``, which calls it)."""

    cluster_id: str
    since: float  # when the controller started: its connection file is newer
    detached: bool  # whether the cluster outlives the process that started it
    client: "ipyparallel.Client"  # connected once the first engines were launched
    engines: dict[int, int]  # engine id -> pid, of the engines in use
    info: dict[int, "EngineInfo"]  # engine id -> what the engine reported, of the engines in use

    @property
    def cluster(self) -> "ipyparallel.Cluster":
        """The ipyparallel cluster: its controller, and the engine sets launched (``cluster.engines``)."""

    def new_set_id(self) -> str:
        """A name for the next engine set, unique in this cluster."""

    def launch(self, n: int, set_id: str | None = None, **options) -> str:
        """Start ``n`` engines through the ipyparallel cluster's engine launcher, with these options of it;
        returns the engine set's id."""


class _ByKind(abc.ABCMeta):
    """``Launcher(kind, **options)`` builds the launcher class of that kind (see ``find``); a subclass called
    directly is built as any dataclass."""

    def __call__(cls, *args, **options):
        if cls is not Launcher:
            return super().__call__(*args, **options)
        if len(args) > 1:
            raise TypeError("Launcher(kind, **options) takes one positional argument, the kind")
        kind = args[0] if args else options.pop("kind", DEFAULT)
        made = find(kind)
        if isinstance(kind, type):  # named by its class
            kind = made.__dataclass_fields__["kind"].default or f"{kind.__module__}.{kind.__qualname__}"
        elif not any(c in kind for c in ".:"):
            kind = kind.strip().lower()
        return made.from_options(kind, options)


def option(default=dataclasses.MISSING, *, help: str, metavar: str | None = None, repeat: bool = False,
           default_factory=dataclasses.MISSING):
    """A launcher's option: a dataclass field that is also a flag of ``%pscluster start`` (``flags``): ``--name``
    with ``help`` and ``metavar``; ``repeat``: a sequence given one value a flag (``--ssh-arg A --ssh-arg B``)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"help": help, "metavar": metavar, "repeat": repeat})


@dataclass(frozen=True)
class Flag:
    """A flag of ``%pscluster start`` made from a launcher's option (``flags``)."""

    name: str  # the option's name, the keyword of ``Cluster(...)``
    owner: str | None  # the launcher that takes it (None: every launcher does)
    help: str
    metavar: str | None
    repeat: bool

    @property
    def flag(self) -> str:
        """``--ps-hosts``; a repeated option's in the singular: ``--ssh-arg``."""
        return "--" + (self.name.removesuffix("s") if self.repeat else self.name).replace("_", "-")


def flags() -> list[Flag]:
    """The flags of every registered launcher's options (those declared with ``option``): the common ones, then
    each launcher's own, in the order of registration, each named once."""
    made: dict[str, Flag] = {}
    for owner, cls in ((None, Launcher), *_REGISTERED.items()):
        for f in dataclasses.fields(cls):
            if "help" in f.metadata and f.name not in made:
                made[f.name] = Flag(f.name, owner, f.metadata["help"], f.metadata["metavar"], f.metadata["repeat"])
    return list(made.values())


@dataclass(frozen=True)
class Launcher(metaclass=_ByKind):
    """How the engines of a cluster start and end. Options every launcher takes: ``interface`` (the address the
    controller and the metrics collector listen on), ``ports`` (``(lo, hi)``: the data-plane and metrics ports
    are picked there), ``ps_hosts`` (the hosts whose engines serve the ps tasks). Each kind adds its own (see
    its class); an option of another kind is refused in one line naming the launcher that takes it.

    Subclasses are frozen dataclasses; they implement ``start`` and ``add`` and may override any other method
    (the defaults suit engines on other hosts, watched through the controller's heartbeats). A method that
    gets ``engines`` may use what ``Engines`` lists: ``launch`` (start engines through ipyparallel), ``cluster``
    (the ``ipyparallel.Cluster``), ``client``, ``info`` and ``engines`` (what each engine reported, its pid).
    """

    kind: str = ""
    interface: str | None = option(None, metavar="IP", help="the address the controller and the metrics collector "
                                   "listen on (default: 127.0.0.1 for local and mpi, else this machine's address on "
                                   "the route to the first host)")
    ports: tuple[int, int] | None = option(None, metavar="LO-HI", help="pick the data-plane and metrics ports here")
    ps_hosts: tuple[str, ...] = option((), metavar="HOST,...", help="the hosts of the ps tasks (default: the first "
                                       "host); the workers go to the others")

    local: ClassVar[bool] = False  # the engines are processes of this machine, signalled and watched by pid here
    ipp_class: ClassVar[str | type | None] = None  # ipyparallel's engine set launcher (an entry point name)
    default_interface: ClassVar[str | None] = None  # where the controller listens without ``interface``
    hosts_fix: ClassVar[str | None] = None  # what to do instead of ``hosts=`` (the ssh launcher's option)
    # engines a cluster keeps started beyond its tasks' without ``spares=`` (a remote one holds a host's slot or
    # a batch allocation: asked for, not assumed)
    default_spares: ClassVar[int] = 0

    # --- options ------------------------------------------------------------------------------
    @classmethod
    def from_options(cls, kind: str, options: dict) -> "Launcher":
        """The launcher of ``kind`` with ``options``; options of other launchers refused in one line."""
        own = {f.name for f in dataclasses.fields(cls)} - {"kind"}
        wrong = [k for k, v in options.items() if k not in own and _given(v)]
        if wrong:
            raise ConfigError(cls.misplaced(kind, wrong))
        return cls(kind=kind, **{k: v for k, v in options.items() if k in own})

    @classmethod
    def misplaced(cls, kind: str, names: list[str]) -> str:
        """The one-line error for options ``names`` that this launcher does not take."""
        owners = {n: owner_of(n) for n in names}
        if "hosts" in names and owners["hosts"] and cls.hosts_fix:
            return f"hosts are for the {owners['hosts']} launcher, not {kind}: {cls.hosts_fix}"
        owned = [n for n in names if owners[n]]
        if owned:
            owner = owners[owned[0]]
            same = ", ".join(n for n in owned if owners[n] == owner)
            return (f"{same} are {owner} launcher options, and this cluster uses {kind}: drop them or use "
                    f"launcher={owner!r}")
        fields = ", ".join(f.name for f in dataclasses.fields(cls) if f.name != "kind")
        return (f"{names[0]!r} is not an option of a cluster or of the {kind} launcher (its options: {fields}): "
                "check the spelling")

    def __post_init__(self):
        if not self.kind:
            object.__setattr__(self, "kind", type(self).__dataclass_fields__["kind"].default or type(self).__name__)
        object.__setattr__(self, "ports", parse_ports(self.ports))
        ps_hosts = self.ps_hosts.split(",") if isinstance(self.ps_hosts, str) else self.ps_hosts
        object.__setattr__(self, "ps_hosts", tuple(h.strip() for h in ps_hosts))
        if self.interface is not None:
            try:
                ipaddress.ip_address(self.interface)
            except ValueError:
                raise ConfigError(f"interface {self.interface!r}: give an IP address of this machine, "
                                  "e.g. 10.0.0.1") from None

    def check_tasks(self, num_ps: int, num_workers: int) -> None:
        """Refuse (ConfigError) a cluster of ``num_ps`` ps and ``num_workers`` workers that these options cannot
        hold; called before anything starts."""

    def hint(self) -> str:
        """What to check when the engines do not register in time (the end of a one-line error)."""
        return f"check that the {self.kind} launcher's engines start and reach {self.controller_ip()}"

    # --- addresses and the ipyparallel cluster ---------------------------------------------------
    def route_target(self) -> str:
        """An address the engines run near: the controller listens on this machine's address towards it."""
        return "192.0.2.1"  # TEST-NET: the default route

    def controller_ip(self) -> str:
        """The address the controller (and the metrics collector) listens on."""
        if self.interface is not None:
            return self.interface
        if self.default_interface is not None:
            return self.default_interface
        target = self.route_target()
        address = route_address(target)
        if address is None:
            raise ConfigError(f"no route from this machine to {target}: pass interface=<this machine's address "
                              "the engines reach> (--interface IP)")
        return address

    def cluster_options(self) -> dict:
        """Keyword arguments of ``ipyparallel.Cluster`` for this launcher."""
        period, misses = (LOCAL_HB_PERIOD_MS, LOCAL_HB_MISSES) if self.local else (HB_PERIOD_MS, CONTROLLER_HB_MISSES)
        return {"engine_launcher_class": self.ipp_class, "controller_ip": self.controller_ip(),
                "controller_args": [f"--HeartMonitor.period={period}",
                                    f"--HeartMonitor.max_heartmonitor_misses={misses}"]}

    def engine_options(self, counts: dict[str, int] | None = None) -> dict:
        """Keyword arguments of ipyparallel's engine set launcher for one launch."""
        return {}

    def bind_host(self, engine_address: str | None) -> str:
        """Where a ps on an engine (that reported ``engine_address``, its address towards the controller)
        listens."""
        if self.controller_ip() == LOOPBACK:
            return LOOPBACK
        return engine_address or LOOPBACK

    def ps_machines(self, engines: Engines, infos: list["EngineInfo"], num_ps: int,
                    num_workers: int) -> list[str] | None:
        """The machine (``EngineInfo.machine``) of each ps task, or None: the first engines. Default: engines of
        the named ``ps_hosts``, by host name or address, round-robin."""
        if not self.ps_hosts:
            return None
        named = [e.machine for h in self.ps_hosts for e in infos if h in (e.host, e.address)]
        if not named:
            from ...errors import ClusterStateError

            raise ClusterStateError(f"no engine runs on the ps hosts {', '.join(self.ps_hosts)}: name "
                                    "hosts the launcher places engines on")
        return [named[i % len(named)] for i in range(num_ps)]

    # --- the engines ---------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self, engines: Engines, n: int, num_ps: int, num_workers: int) -> None:
        """Launch the cluster's first ``n`` engines (``num_ps + num_workers``), e.g. through
        ``engines.launch(n, **options)``. Returns once they are launched; ``EngineSet`` waits for them to
        register (and stops everything if they do not)."""

    @abc.abstractmethod
    def add(self, engines: Engines, task: "TaskSpec | None", live: Sequence["TaskSpec"]) -> None:
        """Launch one more engine: for ``task`` (in place of its lost engine, or a new worker; None: any), where
        the launcher picks hosts near ``live``, the tasks whose engines still answer. Returns once launched;
        the first new engine to register is taken."""

    def job_variable(self) -> str | None:
        """The environment variable that holds, on an engine, the id of the job it runs in (a batch system's,
        e.g. ``SLURM_JOB_ID``), read by each engine once it registered and kept as ``EngineInfo.job``; None:
        the engines run in no job."""
        return None

    def launched_pids(self, engines: Engines) -> list[int]:
        """Processes of this machine launched so far that the engines come from: the reaper kills them (and
        every process below) if this process dies before the start ends. Default: none."""
        return []

    def kill(self, engines: Engines, engine_id: int) -> None:
        """Kill the engine's process now (a task killed on purpose, or a lost one that might still run): by
        default SIGKILL through its nanny on its host. May raise when it is gone already."""
        engines.client.send_signal(signal.SIGKILL, targets=[engine_id], block=True)

    def where(self, engines: Engines, engine_id: int) -> dict:
        """Where the engine lives: ``host``, ``pid``, ``address`` (towards the controller) and ``job`` (None
        where the launcher has no jobs)."""
        info = engines.info[engine_id]
        return {"host": info.host, "pid": info.pid, "address": info.address, "job": info.job}

    def release(self, engines: Engines, engine_ids: list[int]) -> None:
        """These engines were asked to exit and are removed for good (the cluster shrank): end what the
        launcher started for them alone. Default: nothing (they exit when asked)."""

    def stop(self, engines: Engines) -> None:
        """The cluster stops; the client asked every engine to exit. End whatever this launcher started that
        ipyparallel's own stop (of the controller and of every engine set still listed in ``cluster.engines``,
        right after this) would leave, so that nothing runs or waits in a queue afterwards; local pids are
        killed last. Default: nothing more."""


# --- which class a kind names ---------------------------------------------------------------------
_REGISTERED: dict[str, type[Launcher]] = {}


def register(name: str, cls: type[Launcher]) -> None:
    """Make ``Launcher(name, ...)`` (and ``Cluster(launcher=name)``, ``%pscluster start --launcher name``) build
    ``cls``, a ``Launcher`` subclass."""
    if not (isinstance(cls, type) and issubclass(cls, Launcher)):
        raise TypeError(f"{cls!r} is not a pscluster Launcher subclass")
    _REGISTERED[name.lower()] = cls


def _own_entry_points() -> dict:
    return {e.name.lower(): e for e in entry_points(group=ENTRY_POINTS)}


def _ipp_entry_points() -> dict:
    return {e.name.lower(): e for e in entry_points(group=IPP_ENTRY_POINTS)}


def names() -> list[str]:
    """Every launcher name: pscluster's own, registered ones, then ipyparallel's engine set launchers."""
    seen = list(_REGISTERED)
    seen += [n for n in _own_entry_points() if n not in seen]
    seen += sorted(n for n in _ipp_entry_points() if n not in seen)
    return seen


def find(kind) -> type[Launcher]:
    """The Launcher class of ``kind`` (a name, an importable ``package.module.Class``, or a class); ConfigError
    naming the choices when there is none."""
    if isinstance(kind, type):
        return _wrap(kind, kind.__name__)
    if not isinstance(kind, str) or not kind.strip():
        raise ConfigError(f"launcher {kind!r}: give a name, one of {', '.join(names())}")
    key = kind.strip().lower()
    if key in _REGISTERED:
        return _REGISTERED[key]
    for group in (_own_entry_points(), _ipp_entry_points()):
        if key in group:
            try:
                return _wrap(group[key].load(), kind)
            except Exception as e:  # a broken third-party package
                raise ConfigError(f"launcher {kind!r} ({group[key].value}) does not load ({type(e).__name__}: "
                                  f"{e}): reinstall the package that provides it") from None
    if "." in kind or ":" in kind:
        module, _, name = kind.replace(":", ".").rpartition(".")
        try:
            return _wrap(getattr(importlib.import_module(module), name), kind)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"launcher {kind!r} does not import ({e}): give an importable package.module.Class, "
                              "or one of " + ", ".join(names())) from None
    raise ConfigError(f"launcher {kind!r}: use one of {', '.join(names())} (or an ipyparallel engine launcher as "
                      "package.module.Class)")


# How a class of another framework runs as a Launcher: functions (class) -> Launcher subclass, or None when the
# class is not theirs (``ipp`` adds ipyparallel's engine launchers).
ADAPTERS: list = []


def _wrap(cls, kind: str) -> type[Launcher]:
    """``cls`` itself when it is a Launcher, else the Launcher that runs it (see ``ADAPTERS``)."""
    if isinstance(cls, type) and issubclass(cls, Launcher):
        return cls
    for adapt in ADAPTERS:
        made = adapt(cls)
        if made is not None:
            return made
    raise ConfigError(f"launcher {kind!r} is {cls!r}, neither a pscluster Launcher nor an ipyparallel engine "
                      "launcher: name one of those")


def owner_of(option: str) -> str | None:
    """The registered launcher that takes ``option`` (other than the common ones), or None."""
    common = {f.name for f in dataclasses.fields(Launcher)}
    for name, cls in _REGISTERED.items():
        if option not in common and option in {f.name for f in dataclasses.fields(cls)}:
            return name
    return None
