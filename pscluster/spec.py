"""ClusterSpec: who is in the cluster, where, and on which device.

A spec is plain frozen data with a JSON form. The JSON form is what a process
receives in ``PSCLUSTER_CONFIG`` (together with its own task) to join a cluster
without a notebook, the TF_CONFIG analog (see ``task_config``)::

    {"cluster": {...ClusterSpec...}, "task": {"type": "worker", "index": 0}}
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field, replace

from .errors import ConfigError

ROLES = ("ps", "worker", "evaluator")


def threads_per_task(tasks: int) -> int:
    """torch threads for each of ``tasks`` processes that share this machine: its cores divided among them (at
    least one). More, and the tasks' threads only wait on each other's."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // tasks)


@dataclass(frozen=True)
class TaskSpec:
    """One task: a ps, a worker or the evaluator (TF's side task that evaluates checkpoints). Worker 0 is the
    chief."""

    role: str
    index: int
    host: str = "127.0.0.1"
    port: int = 0          # ps: its data-plane port; the chief of a script run: its metrics port; else 0
    device: str = "cpu"    # "cpu" or "cuda:<physical gpu index>"
    engine_id: int | None = None
    pid: int | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConfigError(f"unknown role {self.role!r}: use 'ps', 'worker' or 'evaluator'")
        if self.index < 0:
            raise ConfigError(f"task index {self.index} is negative: indices start at 0")
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda:")):
            raise ConfigError(f"device {self.device!r}: use 'cpu' or 'cuda:<n>'")

    @property
    def name(self) -> str:
        """The TF-style task name, e.g. ``/job:ps/task:0``."""
        return f"/job:{self.role}/task:{self.index}"

    @property
    def is_chief(self) -> bool:
        return self.role == "worker" and self.index == 0

    @property
    def address(self) -> str:
        """The ZeroMQ endpoint of a ps task's data plane."""
        return f"tcp://{self.host}:{self.port}"


@dataclass(frozen=True)
class ClusterSpec:
    """The whole cluster: ps tasks, worker tasks, the evaluator if it has one, and the data-plane secret (the key
    every data-plane message is signed with). ``encrypt``: the data plane also runs over ZeroMQ CURVE
    encryption."""

    ps: tuple[TaskSpec, ...]
    workers: tuple[TaskSpec, ...]
    secret: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    name: str = "pscluster"
    encrypt: bool = False
    evaluator: TaskSpec | None = None

    def __post_init__(self):
        if not self.ps:
            raise ConfigError("a cluster needs at least one ps task: use ps >= 1")
        if not self.workers:
            raise ConfigError("a cluster needs at least one worker: use workers >= 1")
        for role, tasks in (("ps", self.ps), ("worker", self.workers)):
            if [t.index for t in tasks] != list(range(len(tasks))) or any(t.role != role for t in tasks):
                raise ConfigError(f"{role} tasks must be numbered 0..{len(tasks) - 1} in order")
        if self.evaluator is not None and (self.evaluator.role, self.evaluator.index) != ("evaluator", 0):
            raise ConfigError("a cluster has at most one evaluator task, evaluator 0")
        if not isinstance(self.encrypt, bool):
            raise ConfigError(f"encrypt={self.encrypt!r}: use True or False")

    @property
    def key(self) -> bytes:
        """The data-plane signing key."""
        return bytes.fromhex(self.secret)

    @property
    def chief(self) -> TaskSpec:
        return self.workers[0]

    def task(self, role: str, index: int) -> TaskSpec:
        evaluators = (self.evaluator,) if self.evaluator else ()
        tasks = {"ps": self.ps, "worker": self.workers, "evaluator": evaluators}.get(role)
        if tasks is None:
            raise ConfigError(f"unknown role {role!r}: use 'ps', 'worker' or 'evaluator'")
        if not 0 <= index < len(tasks):
            raise ConfigError(f"no {role} task {index}: this cluster has {len(tasks)}")
        return tasks[index]

    def with_ps_ports(self, ports: list[int]) -> "ClusterSpec":
        """A copy whose ps tasks listen on ``ports``."""
        return replace(self, ps=tuple(replace(t, port=p) for t, p in zip(self.ps, ports, strict=True)))

    def with_task(self, task: TaskSpec) -> "ClusterSpec":
        """A copy in which ``task`` takes the place of the task of its role and index (a replacement)."""
        self.task(task.role, task.index)
        field_name = "ps" if task.role == "ps" else "workers"
        tasks = tuple(task if t.index == task.index else t for t in getattr(self, field_name))
        return replace(self, **{field_name: tasks})

    def to_dict(self) -> dict:
        return {"name": self.name, "secret": self.secret, "encrypt": self.encrypt,
                "ps": [asdict(t) for t in self.ps], "worker": [asdict(t) for t in self.workers],
                "evaluator": asdict(self.evaluator) if self.evaluator else None}

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterSpec":
        try:
            return cls(ps=tuple(TaskSpec(**t) for t in d["ps"]),
                       workers=tuple(TaskSpec(**t) for t in d["worker"]),
                       secret=d["secret"], name=d.get("name", "pscluster"), encrypt=d.get("encrypt", False),
                       evaluator=TaskSpec(**d["evaluator"]) if d.get("evaluator") else None)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"not a ClusterSpec ({e}): expected keys name, secret, ps, worker") from None

    def public_dict(self) -> dict:
        """``to_dict()`` without the secret: what may be stored and shown."""
        return {k: v for k, v in self.to_dict().items() if k != "secret"}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "ClusterSpec":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise ConfigError(f"ClusterSpec JSON does not parse ({e.msg}): pass the output of to_json()") from None

    def config_for(self, role: str, index: int) -> str:
        """The ``PSCLUSTER_CONFIG`` value for one task of this cluster."""
        self.task(role, index)
        return json.dumps({"cluster": self.to_dict(), "task": {"type": role, "index": index}})

