"""The payloads of the REST API, as dataclasses.

``labextension/src/api.ts`` declares one TypeScript interface per class here, with the same
fields (a test compares them): change both together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
class Failure:
    """Why a run failed (``RunStore.set_status``): ``cause`` in one line that says what to do, the ``task`` that
    failed first (``worker:1``; ``controller`` or ``chief`` for the process that followed the run), the global
    ``step`` it failed at (null: unknown), its whole ``traceback`` (null: none)."""

    cause: str
    task: str | None
    step: int | None
    traceback: str | None


@dataclass
class Divergence:
    """What the divergence rule (``metrics.divergence``) found in a run's loss: since which global step, the
    smoothed ``loss`` over the ``threshold`` it crossed, the ``reference`` (the loss at the start); ``words``
    (``diverging since step N``) and ``line`` (with the numbers) as every view says them."""

    since_step: int
    loss: float
    reference: float
    threshold: float
    words: str
    line: str


@dataclass
class RunInfo:
    """A run of the run store at path ``store`` (ids are unique within one store), summarized from its rollups
    (never all its metric rows): ``global_step`` reached of ``steps``; ``steps_per_s`` the run's global steps/s as
    ``metrics.speed.rate`` defines it (its last seconds while it trains, all its rows once it ended);
    ``wall_s`` from its start to its end (to now while it trains); ``loss`` the last loss reported,
    ``final`` the last value of each of its metrics; ``hyperparameters`` the optimizer, its arguments and the
    run's settings from its config; ``sparkline`` the loss over the run (at most 40 points) and ``sparkline_path``
    the SVG path of its line in the unit square (``figures.sparkline_path``); ``failure`` why it
    failed (or was lost), null for any other run; ``epochs`` each worker's epoch of its ``ctx.shard`` loader, by
    worker index (empty for a loop without epochs), and ``epochs_text`` the same in words (``metrics.epochs``:
    ``epoch 3``, or each worker's where they differ; '' without); ``divergence`` what the divergence rule found
    in its loss, null while it found nothing."""

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
    wall_s: float | None
    loss: float | None
    final: dict[str, float | None]
    hyperparameters: dict[str, str | float | int | bool]
    sparkline: list[float]
    sparkline_path: str
    failure: Failure | None
    epochs: dict[str, int]
    epochs_text: str
    divergence: Divergence | None


@dataclass
class RunList:
    """Every run of the default store and of the stores of running clusters, newest first; ``message`` says
    why there are none when there is no store yet."""

    runs: list[RunInfo]
    message: str | None = None


@dataclass
class Evaluation:
    """A test-set evaluation of a run (``RunStore.add_evaluation``): at ``global_step`` and ``time`` (seconds since
    the epoch), its ``loss`` and ``accuracy`` (null: none)."""

    global_step: int
    time: float
    loss: float | None
    accuracy: float | None


@dataclass
class LearningRate:
    """The learning rate ``lr`` the ps tasks applied from global ``step`` (at ``time``, seconds since the epoch) on."""

    step: int
    time: float
    lr: float


@dataclass
class SeriesData:
    """A run's metrics ``names`` decimated to at most ``points`` per worker (``RunStore.series``), by ``x``
    (``step``: global step, ``time``: seconds since the epoch) from ``start`` to ``stop`` (null: the run's
    first or last). ``workers``: per worker, its index and its ``columns`` (``x``, ``x_end``, ``time_first``,
    ``time_last``, ``step_first``, ``step_last``, ``local_first``, ``local_last``, ``count``,
    ``local_steps_per_s`` (by ``speed.over_time``, as the notebook's speed chart) and, per name,
    ``{name}_mean``, ``_min``, ``_max``, ``_last``; NaN as null). ``resolution``: the bucket width in x
    units, 0 for raw rows. ``available``: every metric name the run has. ``evaluations``: every test-set
    evaluation of the run; ``learning_rates``: where the learning rate changed (and its last sample), empty
    when the run reported none; ``speed_window_s``: the seconds ``local_steps_per_s`` counts over."""

    run: RunInfo
    x: str
    start: float | None
    stop: float | None
    names: list[str]
    available: list[str]
    resolution: float
    workers: list[dict]
    evaluations: list[Evaluation]
    learning_rates: list[LearningRate]
    speed_window_s: float


@dataclass
class Figure:
    """A figure as the notebook's dashboard draws it, ready for plotly.js: its ``name`` (``convergence``,
    ``speed``...: ``widgets.run_figures``), its traces (``data``) and its ``layout`` (``live.figure_json``). The
    convergence figure's ``layout.meta.controls`` asks for the viewer's controls (``widgets/controls.js``)."""

    name: str
    data: list[dict]
    layout: dict


@dataclass
class FigureList:
    """Every figure of a ``run``, in the order the notebook's dashboard shows them."""

    run: RunInfo
    figures: list[Figure]


@dataclass
class Comparison:
    """``runs`` compared as ``pscluster.compare`` draws them (``figures.compare_spec``): their ``metric`` against
    the global step and their speeds, in one ``figure``; ``available``: every metric any of them has."""

    runs: list[RunInfo]
    metric: str
    available: list[str]
    figure: Figure


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


PAYLOADS = (TaskInfo, ClusterInfo, SkippedCluster, ClusterList, Failure, Divergence, RunInfo, RunList, Evaluation,
            LearningRate, SeriesData, Figure, FigureList, Comparison, ActionResult, ErrorReply)


def to_json(payload) -> dict:
    """A payload as JSON-ready data."""
    return asdict(payload)
