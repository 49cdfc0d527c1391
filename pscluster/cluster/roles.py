"""Role assignment: a pure function from the registered engines to a ClusterSpec."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..spec import ClusterSpec, TaskSpec


@dataclass(frozen=True)
class EngineInfo:
    """What the control plane knows of one engine: its host name, pid, its address towards the controller
    (None on a local cluster), the GPUs it sees and the id of the batch job it runs in (None: none)."""

    engine_id: int
    host: str
    pid: int
    address: str | None = None
    gpus: int = 0
    job: str | None = None

    @property
    def machine(self) -> str:
        """What tells its machine apart from the others: the address (hosts may share a name), else the name."""
        return self.address or self.host


def worker_devices(num_workers: int, gpus: int) -> list[str]:
    """One device per worker: ``cuda:i`` round-robin over ``gpus`` GPUs, or all ``cpu``."""
    if gpus < 0:
        raise ConfigError(f"gpus={gpus}: use 0 (CPU only) or a positive count")
    return [f"cuda:{i % gpus}" if gpus else "cpu" for i in range(num_workers)]


def host_gpus(engines: list[EngineInfo], gpus: int | None) -> dict[str, int]:
    """GPUs the workers use on each machine: ``gpus`` on every one (None: all it has); more than a machine
    has is an error naming it."""
    found: dict[str, int] = {}
    for e in engines:
        found[e.machine] = max(found.get(e.machine, 0), e.gpus)
    if gpus is None:
        return found
    short = [(m, n) for m, n in found.items() if n < gpus]
    if short:
        machine, n = short[0]
        raise ConfigError(f"gpus={gpus} but host {machine} has {n}: use gpus <= {n} (or leave it out: every "
                          "host's own GPUs)")
    return {m: gpus for m in found}


def assign_roles(engines: list[EngineInfo], num_ps: int, num_workers: int, *, gpus: int | dict[str, int] = 0,
                 name: str = "pscluster", secret: str | None = None, data_host: str = "127.0.0.1",
                 ps_machines: list[str] | None = None, bind_host=None) -> ClusterSpec:
    """ps tasks on the first engines (by engine id), workers on the next; worker 0 is the chief.

    ``ps_machines``: the machine of each ps task (see ``EngineInfo.machine``): ps ``i`` takes an engine there,
    the workers the engines left. ``bind_host(engine)``: where the ps of that engine listens (default:
    ``data_host``). Each worker gets a GPU of its own machine, round-robin over ``gpus`` GPUs (a count for
    every machine, or ``{machine: count}``, see ``host_gpus``), or the CPU.
    """
    if len(engines) < num_ps + num_workers:
        raise ConfigError(f"{len(engines)} engines for {num_ps} ps + {num_workers} workers: "
                          "start more engines")
    free = sorted(engines, key=lambda e: e.engine_id)
    ps_engines = []
    for i, machine in enumerate(ps_machines or [None] * num_ps):
        engine = next((e for e in free if machine is None or e.machine == machine), None)
        if engine is None:
            raise ConfigError(f"no engine registered from {machine} for ps {i}: check that host's engines "
                              "(and that it reaches the controller)")
        free.remove(engine)
        ps_engines.append(engine)
    where = bind_host or (lambda e: data_host)
    ps = tuple(TaskSpec("ps", i, host=where(e), engine_id=e.engine_id, pid=e.pid) for i, e in enumerate(ps_engines))
    if gpus is not None and not isinstance(gpus, dict):
        worker_devices(num_workers, gpus)  # refuses a negative count
    per_machine = gpus if isinstance(gpus, dict) else {e.machine: gpus for e in engines}
    seen: dict[str, int] = {}
    workers = []
    for i, e in enumerate(free[:num_workers]):
        n, k = per_machine.get(e.machine, 0), seen.get(e.machine, 0)
        seen[e.machine] = k + 1
        workers.append(TaskSpec("worker", i, host=where(e), device=f"cuda:{k % n}" if n else "cpu",
                                engine_id=e.engine_id, pid=e.pid))
    extra = {} if secret is None else {"secret": secret}
    return ClusterSpec(ps=ps, workers=tuple(workers), name=name, **extra)
