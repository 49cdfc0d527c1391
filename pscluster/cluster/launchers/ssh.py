"""Engines started over ssh on listed hosts (ipyparallel's SSH launcher), placed by the ps/worker rule: the
ps tasks on the ps hosts, the workers on the others."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Sequence

from ...errors import ClusterStateError, ConfigError
from .base import Engines, Launcher, host_name, option, parse_hosts

if TYPE_CHECKING:
    from ...spec import TaskSpec
    from ..roles import EngineInfo


@dataclass(frozen=True)
class SSHLauncher(Launcher):
    """``hosts`` (required): ``[user@]host[:port][=N]``, N engines there (default: as the role rule places the
    tasks). ``ps_hosts``: the hosts whose engines serve the ps tasks (default: the first host); the workers
    go to the other hosts (all hosts when every one holds a ps). ``ssh_args`` (e.g. ``-i KEY``),
    ``remote_python`` (default: this interpreter's path), ``remote_profile_dir``."""

    kind: str = "ssh"
    hosts: dict = option(default_factory=dict, metavar="HOST[=N],...", help="[user@]host[:port], N engines there "
                         "(default: as the ps/worker rule places them)")
    ssh_args: tuple[str, ...] = option((), metavar="ARG", repeat=True, help="an argument for ssh and scp "
                                       "(repeatable), e.g. --ssh-arg=-i --ssh-arg=KEY")
    remote_python: str | None = option(None, help="the Python on the hosts (default: this one's path)")
    remote_profile_dir: str | None = None

    ipp_class: ClassVar[str] = "ssh"

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "hosts", parse_hosts(self.hosts))
        object.__setattr__(self, "ssh_args", tuple(self.ssh_args))
        if not self.hosts:
            raise ConfigError("the ssh launcher needs hosts: pass hosts=['node1', 'node2'] (--hosts node1,node2)")
        known = {host_name(h) for h in self.hosts} | set(self.hosts)
        unknown = [h for h in self.ps_hosts if h not in known]
        if unknown:
            raise ConfigError(f"ps host {unknown[0]!r} is not one of the hosts ({', '.join(self.hosts)}): "
                              "list it in hosts too")

    # --- placement of the tasks on the hosts -------------------------------------------------
    def task_hosts(self, num_ps: int, num_workers: int) -> tuple[list[str], list[str]]:
        """The host of each ps and each worker task. ps tasks go round-robin to ``ps_hosts`` (default: the
        first host), workers round-robin to the other hosts (to every host when all of them hold a ps). With
        engine counts (``node1=2``, on every host then) the ps take the first engines of the ps hosts and the
        workers the rest, in host order; the counts must add up to the tasks."""
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
        """Engines to start on each host."""
        ps, workers = self.task_hosts(num_ps, num_workers)
        return {h: (ps + workers).count(h) for h in self.hosts if (ps + workers).count(h)}

    def check_tasks(self, num_ps: int, num_workers: int) -> None:
        self.engine_counts(num_ps, num_workers)  # refuses counts that do not add up

    def route_target(self) -> str:
        return host_name(next(iter(self.hosts)))

    def hint(self) -> str:
        return ("check that `ssh HOST python3 -c 1` works without a password on every host and that the "
                f"hosts reach {self.controller_ip()} (pass interface= otherwise)")

    def engine_options(self, counts: dict[str, int] | None = None) -> dict:
        """``counts``: engines per host."""
        options = {"engines": dict(counts or {}), "ssh_args": list(self.ssh_args),
                   "scp_args": ["-P" if a == "-p" else a for a in self.ssh_args],
                   "remote_python": self.remote_python or sys.executable}
        if self.remote_profile_dir:
            options["remote_profile_dir"] = self.remote_profile_dir
        return options

    def ssh_host(self, address: str | None) -> str | None:
        """The host (as listed in ``hosts``) of an engine that reported ``address``."""
        for host in self.hosts:
            if address in _addresses(host_name(host)):
                return host
        return None

    def ps_machines(self, engines: Engines, infos: list["EngineInfo"], num_ps: int,
                    num_workers: int) -> list[str] | None:
        machine = {self.ssh_host(e.address): e.machine for e in infos}
        hosts, _ = self.task_hosts(num_ps, num_workers)
        missing = [h for h in hosts if h not in machine]
        if missing:
            raise ClusterStateError(f"no engine registered from host {missing[0]}: check that it reaches the "
                                    f"controller at {self.controller_ip()}")
        return [machine[h] for h in hosts]

    # --- the engines ---------------------------------------------------------------------------
    def start(self, engines: Engines, n: int, num_ps: int, num_workers: int) -> None:
        engines.launch(n, **self.engine_options(self.engine_counts(num_ps, num_workers)))

    def add(self, engines: Engines, task: "TaskSpec | None", live: Sequence["TaskSpec"]) -> None:
        """On a host whose engines still answer: the task's own host first, else one of a task of its role,
        else any; the first host when none answers."""
        same = ([t for t in live if task is not None and t.host == task.host]
                or [t for t in live if task is not None and t.role == task.role] or list(live))
        host = (self.ssh_host(same[0].host) if same else None) or next(iter(self.hosts))
        engines.launch(1, **self.engine_options({host: 1}))


def _addresses(host: str) -> set[str]:
    try:
        return {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return set()
