"""Shared fixtures of the unit tests: in-process ps servers and clients on 127.0.0.1.

Everything a fixture starts is stopped at teardown (servers shut down, clients closed),
also when the test fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pytest
import torch

from pscluster.runtime.client import PSClient
from pscluster.runtime.optim import OptimizerSpec
from pscluster.runtime.options import OPTIONS
from pscluster.runtime.plan import PsConfig
from pscluster.runtime.protocol import NO_TASK
from pscluster.runtime.ps import ParameterServer
from pscluster.spec import ClusterSpec, TaskSpec

RUN_ID = 7
TIMEOUT = 30.0  # generous: the first optimizer a process builds imports torch._dynamo (seconds)


def make_spec(num_ps: int = 1, num_workers: int = 2) -> ClusterSpec:
    return ClusterSpec(ps=tuple(TaskSpec("ps", i) for i in range(num_ps)),
                       workers=tuple(TaskSpec("worker", i) for i in range(num_workers)))


@dataclass
class LocalPS:
    """ps servers running in threads of this process, and the clients connected to them."""

    servers: list[ParameterServer] = field(default_factory=list)
    clients: list[PSClient] = field(default_factory=list)

    def start(self, num_ps: int = 1, num_workers: int = 2) -> ClusterSpec:
        """Start ``num_ps`` servers; the spec that points at them."""
        spec = make_spec(num_ps, num_workers)
        servers = [ParameterServer(spec.key, index=i).start() for i in range(num_ps)]
        self.servers.extend(servers)
        return spec.with_ps_ports([s.port for s in servers])

    def client(self, spec: ClusterSpec, task: int = NO_TASK, *, run_id: int = 0, timeout: float = TIMEOUT,
               **options) -> PSClient:
        """A client of ``spec``'s ps tasks, closed with them; ``options``: more of ``PSClient``'s."""
        client = PSClient(spec, task=task, timeout=timeout, **options)
        self.clients.append(client)
        client.run_id = run_id
        return client

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.servers:
            s.shutdown()
        assert not any(s.running for s in self.servers), "a ps server did not stop"


def ps_config(names, *, mode="sync", steps=100, replicas=1, optimizer="sgd", workers=1, checkpoint_dir=None,
              **more) -> dict:
    """The INIT configuration of one ps task, as the chief sends it; ``more``: run options and PsConfig fields by
    name, and the optimizer's keyword arguments."""
    own = {f.name for f in fields(PsConfig)}
    settings = {"mode": mode, "steps": steps, "replicas_to_aggregate": replicas, "num_workers": workers,
                "checkpoint_dir": checkpoint_dir, **{k: more.pop(k) for k in list(more) if k in OPTIONS or k in own}}
    return PsConfig.of(optimizer=OptimizerSpec(optimizer, more or {"lr": 0.1}).to_dict(), names=tuple(names),
                       **settings).to_dict()


@dataclass
class PSRun:
    """One initialized run on local ps servers: variable ``i`` lives on ps ``i % num_ps``."""

    spec: ClusterSpec
    servers: list[ParameterServer]
    names: list[str]
    initial: list[torch.Tensor]
    local: LocalPS

    def client(self, task: int = NO_TASK, **kw) -> PSClient:
        return self.local.client(self.spec, task, run_id=RUN_ID, **kw)

    def split(self, tensors) -> dict:
        """``tensors`` (one per variable, in id order) as the per-ps dict of PSClient requests."""
        n = len(self.spec.ps)
        return {p: ([i for i in range(len(tensors)) if i % n == p],
                    [t for i, t in enumerate(tensors) if i % n == p]) for p in range(n)}

    def values(self, client: PSClient) -> list[torch.Tensor]:
        """Current parameters in id order (copies), pulled through ``client``."""
        reply = client.pull()
        by_id = {i: t.clone() for m in reply.messages for i, t in zip(m.ids, m.tensors)}
        return [by_id[i] for i in range(len(self.names))]


@pytest.fixture
def local_ps():
    """Factory for in-process ps servers and clients; stops all of them at teardown."""
    local = LocalPS()
    yield local
    local.close()


@pytest.fixture
def start_run(local_ps):
    """Start ps servers and INIT a run with ``values`` ({name: tensor}) through a controller client."""

    def start(values: dict[str, torch.Tensor], *, num_ps: int = 1, num_workers: int = 2, **config) -> PSRun:
        spec = local_ps.start(num_ps, num_workers)
        run = PSRun(spec, local_ps.servers[-num_ps:], list(values), [v.clone() for v in values.values()],
                    local_ps)
        per_ps = run.split(run.initial)
        configs = [ps_config([run.names[i] for i in per_ps[p][0]], workers=num_workers, **config)
                   for p in range(num_ps)]
        local_ps.client(spec).init(RUN_ID, per_ps, configs)
        return run

    return start
