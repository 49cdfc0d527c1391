"""The payloads of the REST API, as dataclasses.

``labextension/src/api.ts`` declares one TypeScript interface per class here, with the same
fields (a test compares them): change both together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TaskInfo:
    """One task of a cluster: ``role`` is ps, chief or worker; ``state`` running or dead."""

    role: str
    task: int
    engine: int | None
    host: str
    pid: int | None
    device: str
    state: str


@dataclass
class ClusterInfo:
    """A running cluster, from its registry entry."""

    name: str
    owner_pid: int
    owner_kernel: str | None
    started: float
    state: str
    ps: int
    workers: int
    hosts: list[str]
    devices: list[str]
    tasks: list[TaskInfo]


@dataclass
class SkippedCluster:
    """A registry entry not listed, and why (its kernel died, the file is unreadable)."""

    name: str
    reason: str


@dataclass
class ClusterList:
    clusters: list[ClusterInfo]
    skipped: list[SkippedCluster]


@dataclass
class RunInfo:
    """A run of the run store at path ``store`` (ids are unique within one store): ``global_step`` of
    ``steps``, ``steps_per_s`` over the last seconds (over the whole run once it ended), ``loss`` the latest,
    ``sparkline`` the loss over the run (at most 40 points)."""

    id: int
    store: str
    name: str
    cluster: str
    mode: str
    status: str
    started: float
    ended: float | None
    steps: int | None
    global_step: int
    steps_per_s: float | None
    loss: float | None
    sparkline: list[float]


@dataclass
class RunList:
    """Every run of the default store and of the stores of running clusters, newest first; ``message`` says
    why there are none when there is no store yet."""

    runs: list[RunInfo]
    message: str | None = None


@dataclass
class MetricRows:
    """The worker metrics stored after cursor ``after``, column by column; ``cursor`` is the ``after``
    of the next request. ``more`` is true when rows were left for the next request."""

    run: RunInfo
    cursor: int
    more: bool
    worker: list[int] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    local_step: list[int] = field(default_factory=list)
    global_step: list[int] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)


@dataclass
class ActionResult:
    """What an action started: ``state`` is the state of ``target`` now (e.g. stopping)."""

    action: str
    target: str
    state: str


@dataclass
class ErrorReply:
    """Every error answer: one line that says what to do."""

    error: str


PAYLOADS = (TaskInfo, ClusterInfo, SkippedCluster, ClusterList, RunInfo, RunList, MetricRows, ActionResult,
            ErrorReply)


def to_json(payload) -> dict:
    """A payload as JSON-ready data."""
    return asdict(payload)
