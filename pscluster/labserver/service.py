"""What the side panel asks, answered from the cluster registry and the run store, without HTTP.

Every method returns a payload of ``models`` or raises ApiError with the HTTP status and a
one-line message; the handlers only translate. Actions go to the kernel that owns the cluster
(``pscluster.cluster.control``), so that the notebook sees what the panel did.
"""

from __future__ import annotations

import os
import sqlite3

import pandas as pd

from ..cluster import control, registry
from ..metrics.store import RunStore, default_path
from .models import ActionResult, ClusterInfo, ClusterList, MetricRows, RunInfo, RunList, SkippedCluster, TaskInfo

ENDED = ("finished", "failed", "stopped")
LOCK_WAIT_S = 1.0      # a query waits this long for another process's lock before the answer is 503
SPEED_WINDOW_S = 5.0   # steps/s of a live run: over its last seconds
SPARK_POINTS = 40
MAX_ROWS = 20_000      # metric rows per answer; the rest come with the next cursor
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

    def metrics(self, run_id: int, after: int, store_path: str | None = None) -> MetricRows:
        live = {e["name"] for e in registry.read_all()[0]}
        with self._store_with(run_id, store_path) as store, _readable(store.path):
            row = _run_row(store, run_id)
            df = store.metrics(run_id, after_row=after).sort_values("row").head(MAX_ROWS)
            info = self._run_info(store, row, live)
        more = len(df) == MAX_ROWS
        columns = {c: [None if pd.isna(v) else v for v in df[c].tolist()] for c in
                   ("worker", "time", "local_step", "global_step", "loss")}
        return MetricRows(run=info, cursor=int(df["row"].max()) if len(df) else after, more=more, **columns)

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
        key = (store.path, int(row.id))
        if key in self._ended:
            return self._ended[key]
        m = store.metrics(row.id)
        config = (store.run(row.id) or {}).get("config") or {}
        status = row.status
        if status not in ENDED and row.cluster not in live:
            status = "lost"  # its kernel is gone: nobody will finish it
        info = RunInfo(id=int(row.id), store=store.path, name=row.name, cluster=row.cluster, mode=row.mode,
                       status=status, started=float(row.started),
                       ended=None if pd.isna(row.ended) else float(row.ended),
                       steps=config.get("steps"), global_step=int(m["global_step"].max()) if len(m) else 0,
                       steps_per_s=_speed(m, ended=status in ENDED), loss=_last(m["loss"]),
                       sparkline=_sparkline(m))
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
                       started=entry.get("started", 0.0), state=entry.get("state", "running"), ps=entry["ps"],
                       workers=entry["workers"], hosts=entry.get("hosts", []), devices=entry.get("devices", []),
                       tasks=tasks)


def _last(series: pd.Series) -> float | None:
    series = series.dropna()
    return float(series.iloc[-1]) if len(series) else None


def _speed(m: pd.DataFrame, *, ended: bool) -> float | None:
    """Global steps per second: over the whole run once it ended, else over its last SPEED_WINDOW_S."""
    if len(m) < 2:
        return None
    recent = m if ended else m[m["time"] >= m["time"].max() - SPEED_WINDOW_S]
    span = recent["time"].max() - recent["time"].min()
    return float((recent["global_step"].max() - recent["global_step"].min()) / span) if span > 0 else None


def _sparkline(m: pd.DataFrame) -> list[float]:
    """The loss averaged over at most SPARK_POINTS equal spans of global steps."""
    m = m.dropna(subset=["loss"])
    if m.empty:
        return []
    buckets = pd.cut(m["global_step"], bins=min(SPARK_POINTS, m["global_step"].nunique()), labels=False)
    return [float(v) for v in m.groupby(buckets)["loss"].mean().tolist()]
