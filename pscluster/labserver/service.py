"""What the side panel asks, answered from the cluster registry and the run store, without HTTP.

Every method returns a payload of ``models`` or raises ApiError with the HTTP status and a
one-line message; the handlers only translate. Actions go to the kernel that owns the cluster
(``pscluster.cluster.control``), so that the notebook sees what the panel did.
"""

from __future__ import annotations

import math
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import asdict

import numpy as np
import pandas as pd

from ..cluster import control, registry
from ..errors import DamagedStore
from ..metrics import epochs, speed
from ..metrics.store import RAW_WINDOW, RunStore, default_path
from ..runtime.tagged import shown
from ..widgets import figures, run_figures
from ..widgets.figure_specs import Spec, expanded
from ..widgets.live import figure_json
from .models import (ActionResult, ClusterInfo, ClusterList, Comparison, Divergence, Evaluation, Failure, Figure,
                     FigureList, LearningRate, RunInfo, RunList, SeriesData, SkippedCluster, TaskInfo)

ENDED = ("finished", "failed", "stopped")
LOCK_WAIT_S = 1.0      # a query waits this long for another process's lock before the answer is 503
SPARK_POINTS = 40
SUMMARY_POINTS = 4 * SPARK_POINTS  # buckets per worker a run's summary reads: a sparkline's worth, whatever their width
RATE_POINTS = 500      # buckets per worker a live run's steps/s is read from (raw rows when it has fewer)
MAX_POINTS = 10_000    # the most points per worker a series answer may ask for
DEFAULT_NAMES = ("loss", "accuracy")
FOLLOWED_RUNS = 16     # runs whose figures the server keeps, to read only their new rows at the next request
COMPARE_POINTS = 2000  # per worker of each compared run, as pscluster.compare reads them
# A metric as the views name it, where the run store's column is named otherwise: a worker's pushes dropped as
# stale (run.summary()'s and the ps's count has this name).
SHOWN_NAMES = {"dropped": "dropped_stale"}
STORED_NAMES = {v: k for k, v in SHOWN_NAMES.items()}
CONTROL_STATUS = {"not_found": 404, "conflict": 409, "invalid": 400, "unavailable": 504, "forbidden": 502}


class ApiError(Exception):
    """An answer other than 200: ``status`` and a one-line ``message`` that says what to do."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class LabService:
    """The registry and the run store of ``$PSCLUSTER_HOME`` as the panel sees them. Runs that ended are
    summarized once and kept."""

    def __init__(self):
        self._ended: dict[tuple[str, int], RunInfo] = {}
        self._followed: OrderedDict[tuple[str, int], run_figures.FollowedRun] = OrderedDict()  # least recent first
        self._following = threading.Lock()  # requests are answered in threads

    # --- reading ------------------------------------------------------------------------
    def clusters(self) -> ClusterList:
        live, skipped = registry.read_all()
        return ClusterList(clusters=[_cluster_info(e) for e in live],
                           skipped=[SkippedCluster(**s) for s in skipped])

    def runs(self) -> RunList:
        """The runs of every store: the default one and those of the running clusters, newest first."""
        live = registry.read_all()[0]
        names, stores, runs = {e["name"] for e in live}, _stores(live), []
        for path in stores:
            try:
                store = self._open(path)
            except FileNotFoundError:
                continue
            with store, _readable(path):
                runs += [self._run_info(store, row, names) for row in store.runs().itertuples()]
        if not runs and not any(os.path.exists(p) for p in stores):
            return RunList(runs=[], message=f"No run store yet ({default_path()}): runs appear here once a "
                                            "cluster trains.")
        return RunList(runs=sorted(runs, key=lambda r: (r.started, r.id), reverse=True))

    def series(self, run_id: int, store_path: str | None, names: list[str] | None, x: str, start: float | None,
               stop: float | None, points: int) -> SeriesData:
        """Run ``run_id``'s metrics ``names`` (default: those of DEFAULT_NAMES it has) by ``x`` from ``start`` to
        ``stop``, at most ``points`` per worker; 400 for a metric the run does not have."""
        live = {e["name"] for e in registry.read_all()[0]}
        with self._store_with(run_id, store_path) as store, _readable(store.path):
            row = _run_row(store, run_id)
            available = [_shown(n) for n in store.series_names(run_id)]
            if names is None:
                names = [n for n in DEFAULT_NAMES if n in available]
            elif missing := [n for n in names if n not in available]:
                raise ApiError(400, f"run {run_id} has no metric {', '.join(missing)}: ask for some of "
                                    f"{', '.join(available) or 'none yet'}")
            df = store.series(run_id, tuple(STORED_NAMES.get(n, n) for n in names), x=x, start=start, stop=stop,
                              max_points=points)
            df = df.rename(columns=_shown_column)
            info = self._run_info(store, row, live)
            evaluations = [Evaluation(int(e.global_step), float(e.time), _number(e.loss), _number(e.accuracy))
                           for e in store.evaluations(run_id).itertuples()]
            rates = [LearningRate(int(r.step), float(r.time), float(r.lr))
                     for r in store.learning_rates(run_id).itertuples()]
        workers = [{"worker": int(w), "columns": {c: _nulls(rows[c]) for c in rows.columns if c != "worker"} |
                    {"local_steps_per_s": _nulls(_local_speed(rows))}}
                   for w, rows in df.groupby("worker", sort=True)]
        return SeriesData(run=info, x=x, start=start, stop=stop, names=names, available=available,
                          resolution=float(df.attrs.get("resolution", 0)), workers=workers, evaluations=evaluations,
                          learning_rates=rates, speed_window_s=speed.RECENT_S)

    def figures(self, run_id: int, store_path: str | None) -> FigureList:
        """Every figure of run ``run_id`` as the notebook's dashboard draws it from the run store
        (``run_figures``), as plotly.js takes it: the run's rows stored since the last request for it are read, as
        the dashboard reads them at each refresh (for ``FOLLOWED_RUNS`` runs at most; then the least recently
        asked for is read again whole)."""
        live = {e["name"] for e in registry.read_all()[0]}
        with self._store_with(run_id, store_path) as store, _readable(store.path):
            info = self._run_info(store, _run_row(store, run_id), live)
            with self._following:
                key = (store.path, run_id)
                followed = self._followed.pop(key, None) or run_figures.FollowedRun(run_id)
                self._followed[key] = followed
                while len(self._followed) > FOLLOWED_RUNS:
                    self._followed.popitem(last=False)
                specs = followed.update(store).specs()
        return FigureList(run=info, figures=[_figure(name, s) for name, s in specs.items()])

    def compare(self, runs: list[tuple[int, str | None]], metric: str) -> Comparison:
        """Runs ``runs`` (id, store path) compared as ``pscluster.compare`` draws them, by ``metric`` (one of their
        metrics); 400 for a metric none of them has."""
        live, infos, compared, available = {e["name"] for e in registry.read_all()[0]}, [], [], {}
        for run_id, path in runs:
            with self._store_with(run_id, path) as store, _readable(store.path):
                info = self._run_info(store, _run_row(store, run_id), live)
                names = store.series_names(run_id)
                label = info.name + (f" #{run_id}" if any(info.name == i.name for i in infos) else "")
                stored = STORED_NAMES.get(metric, metric)
                compared.append(figures.compared_run(store, run_id, label, (stored,) if stored in names else (),
                                                     points=COMPARE_POINTS))
            infos.append(info)
            available.update(dict.fromkeys(_shown(n) for n in names))
        if metric not in available:
            raise ApiError(400, f"none of runs {', '.join(str(r) for r, _ in runs)} has a metric {metric}: ask for "
                                f"one of {', '.join(available) or 'none yet'}")
        spec = figures.compare_spec(compared, STORED_NAMES.get(metric, metric))
        if metric in STORED_NAMES:  # the axis says the metric's name as the views say it
            spec.layout["yaxis"]["title_text"] = f"{metric} (mean over workers)"
        return Comparison(runs=infos, metric=metric, available=list(available), figure=_figure("compare", spec))

    def download(self, run_id: int, store_path: str | None, points: int | None) -> tuple[pd.DataFrame, str]:
        """Run ``run_id``'s metrics as a frame to download, and a line that says what it holds: the raw rows
        the store keeps (``points`` None: its newest ``RAW_WINDOW`` per run), or every metric over the whole
        run decimated to at most ``points`` rows per worker."""
        with self._store_with(run_id, store_path) as store, _readable(store.path):
            _run_row(store, run_id)
            if points is None:
                df = store.metrics(run_id)
                first = int(df["global_step"].min()) if len(df) else 0
                return df, (f"raw rows: the newest {len(df)} (the store keeps {RAW_WINDOW} per run), from global "
                            f"step {first}; ?points=N for the whole run decimated")
            df = store.series(run_id, tuple(store.series_names(run_id)), max_points=points)
        return df, (f"the whole run decimated to at most {points} rows per worker (bucket width "
                    f"{df.attrs.get('resolution', 0)} global steps, 0: raw rows)")

    def _open(self, path: str) -> RunStore:
        with _readable(path):
            return RunStore(path, readonly=True, timeout=LOCK_WAIT_S)

    def _store_with(self, run_id: int, path: str | None) -> RunStore:
        """Store ``path`` (default: the default store), which should hold run ``run_id``: 404 when it is not
        a store the panel lists or does not exist yet."""
        if path is None:
            path = default_path()
        elif os.path.realpath(path) not in map(os.path.realpath, _stores(registry.read_all()[0])):
            raise ApiError(404, f"no run {run_id}: {path} is neither the default run store nor the store of a "
                                "running cluster")
        try:
            return self._open(path)
        except FileNotFoundError:
            raise ApiError(404, f"no run {run_id}: there is no run store yet ({path})") from None

    def _run_info(self, store: RunStore, row, live: set[str]) -> RunInfo:
        """The run of ``row`` (of ``store.runs()``) from a sparkline-sized ``store.series`` (and, while it trains,
        one of its last seconds), whatever its length; kept once it ended."""
        key = (store.path, int(row.id))
        if key in self._ended:
            return self._ended[key]
        record = store.run(row.id) or {}
        config, failure = record.get("config") or {}, record.get("failure")
        status = row.status
        if status not in ENDED and row.cluster not in live:
            status = "lost"  # its kernel is gone: nobody will finish it
            failure = {"cause": f"the kernel of cluster {row.cluster} is gone, so nothing follows this run: train "
                                "it again (resume='latest' goes on from its latest checkpoint)",
                       "task": "controller", "step": None, "traceback": None}
        ended = None if pd.isna(row.ended) else float(row.ended)
        names = store.series_names(row.id)
        spark = store.series(row.id, tuple(names), max_points=SUMMARY_POINTS)
        worker_epochs = store.epochs(row.id)
        found = store.divergence(row.id)
        line = _sparkline(spark)
        info = RunInfo(id=int(row.id), store=store.path, name=row.name, cluster=row.cluster, mode=row.mode,
                       status=status, started=float(row.started), ended=ended, steps=config.get("steps"),
                       global_step=int(spark["step_last"].max()) if len(spark) else 0,
                       steps_per_s=_speed(store, row.id, spark, live=status not in (*ENDED, "lost")),
                       wall_s=speed.phases(float(row.started), ended, None, now=time.time())["wall_s"],
                       loss=_final(spark, "loss"), final=_finals(spark, names),
                       hyperparameters=_hyperparameters(config), sparkline=line,
                       sparkline_path=figures.sparkline_path(line),
                       failure=Failure(**failure) if failure else None,
                       epochs={str(w): e for w, e in worker_epochs.items()},
                       epochs_text=epochs.words(worker_epochs),
                       divergence=None if found is None else Divergence(**asdict(found), words=found.words(),
                                                                         line=found.line()))
        if status in ENDED:
            self._ended[key] = info
        return info

    # --- actions ------------------------------------------------------------------------
    def stop_cluster(self, name: str) -> ActionResult:
        entry = self._running_cluster(name)
        if entry["state"] == "stopping":
            raise ApiError(409, f"cluster {name} is already stopping")
        return ActionResult("stop_cluster", name, _ask(entry, "stop_cluster")["state"])

    def stop_run(self, run_id: int, store_path: str | None = None) -> ActionResult:
        with self._store_with(run_id, store_path) as store, _readable(store.path):
            row = _run_row(store, run_id)
        if row.status in ENDED:
            raise ApiError(409, f"run {run_id} already ended ({row.status})")
        entry = registry.find(row.cluster)
        if entry is None:
            raise ApiError(409, f"run {run_id} cannot be stopped: its cluster {row.cluster} is not running "
                                "(its kernel is gone)")
        return ActionResult("stop_run", str(run_id), _ask(entry, "stop_run", run_id=run_id)["status"])

    def task_action(self, name: str, role: str, index: int, action: str) -> ActionResult:
        """``action`` is ``kill`` or ``restart`` task ``role`` ``index`` of cluster ``name``: the state is
        ``killed``, or ``restarting`` (its new engine is listed once it runs)."""
        entry = self._running_cluster(name)
        state = _ask(entry, f"{action}_task", role=role, index=index)["state"]
        return ActionResult(f"{action}_task", f"{name}/{role}/{index}", state)

    def _running_cluster(self, name: str) -> dict:
        live, skipped = registry.read_all()
        entry = next((e for e in live if e["name"] == name), None)
        if entry is not None:
            return entry
        gone = next((s for s in skipped if s["name"] == name), None)
        if gone is not None:
            raise ApiError(409, f"cluster {name} is stopped: {gone['reason']}")
        if name in self._trained_on():
            raise ApiError(409, f"cluster {name} is stopped: start a new one with %pscluster start")
        raise ApiError(404, f"no running cluster {name}: see GET /pscluster/api/clusters for the running ones")

    def _trained_on(self) -> set[str]:
        """The names of the clusters that have runs in the store."""
        path = default_path()
        try:
            store = self._open(path)
        except FileNotFoundError:
            return set()
        with store, _readable(path):
            return set(store.runs()["cluster"])


class _readable:
    """Turns SQLite errors of the store into 503 answers that say what is wrong."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, pd.errors.DatabaseError):  # pandas wraps the sqlite3 error
            error = error.__cause__
        if isinstance(error, sqlite3.OperationalError) and "locked" in str(error):
            raise ApiError(503, f"the run store {self.path} is locked by another process: "
                                "retrying; release the lock if it persists") from None
        if isinstance(error, DamagedStore):
            raise ApiError(503, str(error)) from None
        if isinstance(error, sqlite3.DatabaseError):
            raise ApiError(503, f"the run store {self.path} cannot be read ({error}): move it away to start "
                                "a new one") from None
        return False


def _stores(live: list[dict]) -> list[str]:
    """The default store, then the stores of the running clusters of ``live``, each once (by real path)."""
    paths = {}
    for path in (default_path(), *(e["store"] for e in live if e.get("store"))):
        paths.setdefault(os.path.realpath(path), path)
    return list(paths.values())


def _run_row(store: RunStore, run_id: int):
    runs = store.runs()
    match = runs[runs["id"] == run_id]
    if match.empty:
        raise ApiError(404, f"no run {run_id} in the run store {store.path}")
    return next(match.itertuples())


def _ask(entry: dict, action: str, **args) -> dict:
    try:
        return control.request(entry, action, **args)
    except control.ControlError as e:
        raise ApiError(CONTROL_STATUS.get(e.kind, 500), str(e)) from None


def _cluster_info(entry: dict) -> ClusterInfo:
    tasks = [TaskInfo(role=t["role"], task=t["task"], engine=t.get("engine"), host=t["host"], pid=t.get("pid"),
                      device=t["device"], state=t["state"]) for t in entry.get("tasks", [])]
    return ClusterInfo(name=entry["name"], owner_pid=entry["owner_pid"], owner_kernel=entry.get("owner_kernel"),
                       started=entry.get("started", 0.0), state=entry.get("state", "running"), ps=entry.get("ps", 0),
                       workers=entry.get("workers", 0), hosts=entry.get("hosts", []), devices=entry.get("devices", []),
                       tasks=tasks)


def _hyperparameters(config: dict) -> dict:
    """What tells runs apart, from a run's config: the optimizer and its arguments as the user wrote them
    (``tagged.shown``), then the settings the config says to show (``shown``: the options defined as shown that
    its mode reads, see ``run_records``); settings that are None are left out."""
    found = {"optimizer": config.get("optimizer")} | dict(config.get("optimizer_kwargs") or {})
    found |= {k: config.get(k) for k in config.get("shown", ())}
    return {k: v if isinstance(v, (int, float, bool)) else shown(v) for k, v in found.items() if v is not None}


def _nulls(column: pd.Series) -> list:
    """A column as JSON values: NaN and infinities (a loss that diverged) as None."""
    return [None if isinstance(v, float) and not math.isfinite(v) else v for v in column.tolist()]


def _number(value) -> float | None:
    """A stored value as JSON: None for NULL, NaN and infinities."""
    return float(value) if value is not None and math.isfinite(value) else None


def _local_speed(rows: pd.DataFrame) -> pd.Series:
    """A worker's local steps/s at each of its points (``RunStore.series`` rows, by time) by ``speed.over_time``:
    the rule of the notebook's speed chart on the first and last row of each bucket, over at least a bucket
    wider than ``speed.RECENT_S`` (exact on raw rows)."""
    times = np.column_stack([rows["time_first"], rows["time_last"]]).ravel()
    steps = np.column_stack([rows["local_first"], rows["local_last"]]).ravel()
    since = np.repeat(rows["time_first"].to_numpy(dtype=float), 2)
    return pd.Series(speed.over_time(times, steps, since=since)[1::2])


def _shown(name: str) -> str:
    """A metric's name as the views say it (``SHOWN_NAMES``)."""
    return SHOWN_NAMES.get(name, name)


def _shown_column(column: str) -> str:
    """A column of ``RunStore.series`` (``{name}_mean``...) named as the views name its metric."""
    name, _, kind = column.rpartition("_")
    return f"{SHOWN_NAMES[name]}_{kind}" if name in SHOWN_NAMES else column


def _figure(name: str, spec: Spec) -> Figure:
    """Figure ``name`` of ``spec`` as plotly.js takes it: what the notebook's live figure is sent."""
    return Figure(name=name, **figure_json(expanded(spec)))


def _finals(spark: pd.DataFrame, names: list[str]) -> dict[str, float | None]:
    """The last value of each metric of ``names``; of the pushes dropped as stale, how many (``dropped_stale``, as
    ``run.summary()`` counts them)."""
    finals = {_shown(n): _final(spark, n) for n in names if n not in SHOWN_NAMES}
    if "dropped" in names:
        finals["dropped_stale"] = float(np.nansum(spark["dropped_mean"] * spark["count"]))
    return finals


def _final(spark: pd.DataFrame, name: str) -> float | None:
    """Metric ``name``'s last value reported: that of the worker that reported last."""
    if f"{name}_last" not in spark:
        return None
    rows = spark.dropna(subset=[f"{name}_last"])
    value = float(rows.loc[rows["time_last"].idxmax(), f"{name}_last"]) if len(rows) else math.nan
    return value if math.isfinite(value) else None


def _speed(store: RunStore, run_id: int, spark: pd.DataFrame, *, live: bool) -> float | None:
    """The run's global steps/s by ``speed.rate``: over all its rows once it ended (exact from any buckets: they
    keep their rows' first and last time and step), else over its last RECENT_S seconds, read by time."""
    recent = None
    if live and len(spark):
        recent = store.series(run_id, (), x="time", start=float(spark["time_last"].max()) - speed.RECENT_S,
                              max_points=RATE_POINTS)
    value = speed.of_buckets(spark, recent).run(live=live)
    return None if math.isnan(value) else value


def _sparkline(spark: pd.DataFrame) -> list[float]:
    """The loss averaged over at most SPARK_POINTS equal spans of global steps."""
    if "loss_mean" not in spark:
        return []
    spark = spark[np.isfinite(spark["loss_mean"])]
    if spark.empty:
        return []
    bins = pd.cut(spark["x"], bins=min(SPARK_POINTS, spark["x"].nunique()), labels=False)
    return [float(v) for v in spark.groupby(bins)["loss_mean"].mean().tolist()]
