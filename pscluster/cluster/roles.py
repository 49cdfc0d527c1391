"""Role assignment: a pure function from the registered engines to a ClusterSpec."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..spec import ClusterSpec, TaskSpec


@dataclass(frozen=True)
class EngineInfo:
    """What the control plane knows of one engine."""

    engine_id: int
    host: str
    pid: int


def worker_devices(num_workers: int, gpus: int) -> list[str]:
    """One device per worker: ``cuda:i`` round-robin over ``gpus`` GPUs, or all ``cpu``."""
    if gpus < 0:
        raise ConfigError(f"gpus={gpus}: use 0 (CPU only) or a positive count")
    return [f"cuda:{i % gpus}" if gpus else "cpu" for i in range(num_workers)]


def assign_roles(engines: list[EngineInfo], num_ps: int, num_workers: int, *, gpus: int = 0,
                 name: str = "pscluster", secret: str | None = None,
                 data_host: str = "127.0.0.1") -> ClusterSpec:
    """ps tasks on the first engines (by engine id), workers on the next; worker 0 is the chief."""
    if len(engines) < num_ps + num_workers:
        raise ConfigError(f"{len(engines)} engines for {num_ps} ps + {num_workers} workers: "
                          "start more engines")
    ordered = sorted(engines, key=lambda e: e.engine_id)
    ps = tuple(TaskSpec("ps", i, host=data_host, engine_id=e.engine_id, pid=e.pid)
               for i, e in enumerate(ordered[:num_ps]))
    devices = worker_devices(num_workers, gpus)
    workers = tuple(TaskSpec("worker", i, host=data_host, device=devices[i], engine_id=e.engine_id, pid=e.pid)
                    for i, e in enumerate(ordered[num_ps:num_ps + num_workers]))
    extra = {} if secret is None else {"secret": secret}
    return ClusterSpec(ps=ps, workers=workers, name=name, **extra)
