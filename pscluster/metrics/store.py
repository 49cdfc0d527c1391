"""The run store: one SQLite file of runs, their placement, metrics and events.

The schema is defined once, below, as numbered migrations applied by
``PRAGMA user_version``. The file is in WAL mode: readers (the dashboard, the
side panel, another notebook) use read-only connections and never block the
writer, which is the controller's collector thread.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Sequence

import numpy as np
import pandas as pd

from .. import environ
from ..errors import DamagedStore
from . import rollup
from .divergence import Diverging

STORE_FILE = "runs.sqlite"

MIGRATIONS = [
    """
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        cluster TEXT NOT NULL,
        mode TEXT NOT NULL,
        status TEXT NOT NULL,
        started REAL NOT NULL,
        ended REAL,
        config TEXT NOT NULL,
        spec TEXT NOT NULL,
        code TEXT,
        summary TEXT
    );
    CREATE TABLE placement (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        variable TEXT NOT NULL,
        ps INTEGER NOT NULL,
        shape TEXT NOT NULL,
        dtype TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        PRIMARY KEY (run_id, variable)
    );
    CREATE TABLE metrics (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        worker INTEGER NOT NULL,
        time REAL NOT NULL,
        local_step INTEGER NOT NULL,
        global_step INTEGER NOT NULL,
        loss REAL,
        accuracy REAL,
        compute_s REAL,
        wait_s REAL,
        comm_s REAL,
        bytes_sent INTEGER,
        bytes_received INTEGER,
        staleness INTEGER,
        dropped INTEGER
    );
    CREATE INDEX metrics_by_run ON metrics (run_id, worker, local_step);
    CREATE TABLE ps_metrics (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        ps INTEGER NOT NULL,
        time REAL NOT NULL,
        step INTEGER NOT NULL,
        pushes INTEGER NOT NULL,
        pulls INTEGER NOT NULL,
        applied INTEGER NOT NULL,
        dropped_stale INTEGER NOT NULL,
        late INTEGER NOT NULL,
        bytes_in INTEGER NOT NULL,
        bytes_out INTEGER NOT NULL,
        waiting_for TEXT NOT NULL
    );
    CREATE INDEX ps_metrics_by_run ON ps_metrics (run_id, ps, time);
    CREATE TABLE evaluations (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        global_step INTEGER NOT NULL,
        time REAL NOT NULL,
        loss REAL,
        accuracy REAL
    );
    CREATE TABLE events (
        run_id INTEGER NOT NULL REFERENCES runs(id),
        time REAL NOT NULL,
        task TEXT NOT NULL,
        kind TEXT NOT NULL,
        detail TEXT NOT NULL
    );
    CREATE INDEX events_by_run ON events (run_id, time);
    """,
    # 2: partitioned variables: the rows [start, stop) of the parameter a shard holds, its part number
    # (NULL for a whole variable), and whether the parameter is sparse (moved by touched rows only).
    """
    ALTER TABLE placement ADD COLUMN start INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE placement ADD COLUMN stop INTEGER;
    ALTER TABLE placement ADD COLUMN part INTEGER;
    ALTER TABLE placement ADD COLUMN sparse INTEGER NOT NULL DEFAULT 0;
    """,
    # 3: what a variable of the model's state is: a trained parameter, a frozen one, or a buffer
    """
    ALTER TABLE placement ADD COLUMN kind TEXT NOT NULL DEFAULT 'param';
    """,
    # 4: a step's own metrics (a step_fn's, as JSON {name: value}) and the learning rate a ps applied
    """
    ALTER TABLE metrics ADD COLUMN extra TEXT;
    ALTER TABLE ps_metrics ADD COLUMN lr REAL;
    """,
    # 5: metrics at bounded cost (see ``rollup``): a run's metrics rolled up per worker by global step (axis 0) and by
    # time (axis 1) at several levels; the raw row's metrics in columns of their own, a step_fn's in rollup_extra
    """
    CREATE TABLE rollups (
        run_id INTEGER NOT NULL, axis INTEGER NOT NULL, level INTEGER NOT NULL, worker INTEGER NOT NULL,
        bucket INTEGER NOT NULL, count INTEGER NOT NULL, time_first REAL, time_last REAL, step_first INTEGER,
        step_last INTEGER, local_first INTEGER, local_last INTEGER, row_first INTEGER, row_last INTEGER,
    """ + "".join(f"{m}_n INTEGER, {m}_sum REAL, {m}_min REAL, {m}_max REAL, {m}_last REAL, "
                  for m in ("loss", "accuracy", "compute_s", "wait_s", "comm_s", "bytes_sent", "bytes_received",
                            "staleness", "dropped")) + """
        PRIMARY KEY (run_id, axis, level, worker, bucket)
    );
    CREATE TABLE rollup_extra (
        run_id INTEGER NOT NULL, axis INTEGER NOT NULL, level INTEGER NOT NULL, worker INTEGER NOT NULL,
        bucket INTEGER NOT NULL, name TEXT NOT NULL, n INTEGER, sum REAL, min REAL, max REAL, last REAL,
        PRIMARY KEY (run_id, axis, level, worker, bucket, name)
    );
    """,
    # 6: the run's owner (the process that follows it: "pid N on host") and when its lease runs out; the owner
    # renews it while the run has not ended (``Lease``)
    """
    ALTER TABLE runs ADD COLUMN owner TEXT;
    ALTER TABLE runs ADD COLUMN lease_until REAL;
    """,
    # 7: why a failed run failed (JSON, see ``RunStore.set_status``)
    """
    ALTER TABLE runs ADD COLUMN failure TEXT;
    """,
    # 8: a run's events of one kind found without reading its others (each worker's latest epoch: ``epochs``)
    """
    CREATE INDEX events_by_kind ON events (run_id, kind);
    """,
]

LEASE_S = 8.0  # a run not ended whose owner has not renewed its lease for this long has lost its owner
UNENDED = ("starting", "training")

METRIC_COLUMNS = ("worker", "time", "local_step", "global_step", "loss", "accuracy", "compute_s", "wait_s",
                   "comm_s", "bytes_sent", "bytes_received", "staleness", "dropped")
_PS_COLUMNS = ("ps", "time", "step", "pushes", "pulls", "applied", "dropped_stale", "late", "bytes_in",
               "bytes_out", "waiting_for")
_REQUIRED_METRICS = ("time", "local_step", "global_step")  # NOT NULL in the metrics table
ROLLED = METRIC_COLUMNS[4:]  # the metrics of a raw row that rollups hold in columns of their own (schema 5)
RAW_WINDOW = 100_000  # the newest metric rows of a run kept raw; older ones live on in the rollups only
RAW_SLACK = RAW_WINDOW // 10  # rows past the window before the oldest are deleted, in one go
RAW_MERGED = 8  # series merges raw rows when a range has at most RAW_MERGED * max_points of them
SERIES_SPAN = rollup.FRAME_SPAN
PLACEMENT_COLUMNS = ("variable", "ps", "shape", "dtype", "bytes", "start", "stop", "part", "sparse", "kind")


def _placement_row(v) -> tuple:
    """A VariableSpec-like object as a placement row (``PLACEMENT_COLUMNS``, shape as a tuple); objects
    without ``start``/``part``/``sparse``/``kind`` are whole, dense, trained parameters."""
    shape = tuple(v.shape)
    start = getattr(v, "start", 0)
    return (v.name, v.ps, shape, v.dtype, v.nbytes, start, start + (shape[0] if shape else 1),
            getattr(v, "part", None), int(bool(getattr(v, "sparse", False))), getattr(v, "kind", "param"))


def placement_frame(variables) -> pd.DataFrame:
    """The placement of VariableSpec-like objects as ``RunStore.placement`` returns it, without a store:
    what ``Cluster.plan`` shows before any run."""
    df = pd.DataFrame([_placement_row(v) for v in variables], columns=list(PLACEMENT_COLUMNS))
    df["part"] = df["part"].astype("Int64")
    return df


_POLLED = {"metrics": (*METRIC_COLUMNS, "extra"), "ps_metrics": (*_PS_COLUMNS, "lr"),
           "evaluations": ("global_step", "time", "loss", "accuracy"), "events": ("time", "task", "kind", "detail")}
_ADDED_IN = {"extra": 4, "lr": 4}  # the schema that added a polled column: a store opened read-only may be older


def _since(run_id: int, after_row: int | None) -> tuple[str, tuple]:
    """The WHERE clause (and its parameters) of a run's rows stored after the cursor ``after_row``. After a
    cursor, ``+run_id`` keeps SQLite off the run_id index, which would walk every row of the run: the rowid
    range finds the new rows at once."""
    if not after_row:
        return "run_id = ?", (int(run_id),)
    return "rowid > ? AND +run_id = ?", (int(after_row), int(run_id))


def _owner_lost(status: str, owner: str | None, lease_until: float | None, now: float) -> str | None:
    """Why a run that has not ended has no owner any more (its lease ran out at ``now``), or None: it is held,
    it has ended, or it was never leased (a store older than leases)."""
    if status not in UNENDED or lease_until is None or not lease_until < now:  # NaN: never leased
        return None
    renewed = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease_until - LEASE_S))
    return f"owner lost: {owner} renewed its lease last at {renewed}"


def default_path() -> str:
    """``$PSCLUSTER_HOME/runs.sqlite`` (default home: the user's data directory)."""
    return os.path.join(environ.home(), STORE_FILE)


def _task_index(task: str) -> int:
    return int(task.rsplit(":", 1)[1])


# a run's divergence: the controller's own event (a worker's event of that kind is not the rule's finding)
_DIVERGENCE_SQL = "SELECT detail FROM events WHERE kind = 'diverging' AND task = 'controller'"


def _diverging(detail) -> Diverging | None:
    """The finding a ``diverging`` event's detail holds (None for none: None, or NaN in a DataFrame)."""
    return Diverging(**json.loads(detail)) if isinstance(detail, str) else None


_SQL_INTEGERS = range(-2**63, 2**63)


def _number(value, required: bool = False):
    """``value`` as SQLite stores a metric: a number (an integer SQLite holds), or None (NaN) unless ``required``;
    TypeError otherwise (the event that carries it is skipped)."""
    if isinstance(value, float) and (not required or math.isfinite(value)) or \
            isinstance(value, int) and value in _SQL_INTEGERS or value is None and not required:
        return value
    raise TypeError(f"not a {'finite ' if required else ''}number: {value!r:.40}")


def _numbers(values) -> np.ndarray:
    """Values as floats, NaN for None and for anything that is not a number."""
    try:
        return np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        return pd.to_numeric(pd.Series(values, dtype=object), errors="coerce").to_numpy(float)


def _columns(rows: list[tuple]) -> list:
    """Raw metric rows ``(rowid, worker, time, local_step, global_step, *ROLLED, extra)`` as columns."""
    return list(zip(*rows)) or [()] * (6 + len(ROLLED))


def _raw_buckets(columns: list, names: Sequence[str] | None = None) -> tuple[rollup.Buckets, list[str]]:
    """Raw metric rows as ``_columns`` (``extra`` a dict, its JSON or None) as one-row buckets of the metrics ``names``;
    None: every metric of ``ROLLED`` and every name with a number in ``extra``. Returns the buckets and the names."""
    extras = [json.loads(x) if isinstance(x, str) else x or {} for x in columns[-1]]
    if names is None:
        found = {k for d in extras for k, v in d.items() if isinstance(v, (int, float))}
        names = [*ROLLED, *sorted(found - set(ROLLED))]
    values = [_numbers(columns[5 + ROLLED.index(name)]) if name in ROLLED else _numbers([d.get(name) for d in extras])
              for name in names]
    span = np.column_stack([_numbers(columns[i]) for i in (2, 4, 3, 0)]).reshape(-1, len(rollup.SPAN))
    values = np.column_stack(values) if values else np.empty((len(span), 0))
    return rollup.from_rows(_numbers(columns[1]).astype(np.int64), span, values), list(names)


def _newest(b: rollup.Buckets) -> tuple[list[int], list[int]]:
    """Each worker of ``b`` and its newest bucket."""
    at = np.flatnonzero(np.r_[b.worker[1:] != b.worker[:-1], True])
    return b.worker[at].tolist(), b.bucket[at].tolist()


def _merge_sql(prefixes: Sequence[str], later: str) -> str:
    """The SET clause that merges a bucket's new rows (``excluded``) into the stored bucket: the stats of each
    ``{prefix}n/sum/min/max/last``; ``later``: the condition under which the new rows come after the stored ones."""
    return ", ".join(
        f"{p}n = {p}n + excluded.{p}n, {p}sum = {p}sum + excluded.{p}sum, "
        f"{p}min = coalesce(min({p}min, excluded.{p}min), {p}min, excluded.{p}min), "
        f"{p}max = coalesce(max({p}max, excluded.{p}max), {p}max, excluded.{p}max), "
        f"{p}last = CASE WHEN excluded.{p}n > 0 AND ({p}n = 0 OR {later}) "
        f"THEN excluded.{p}last ELSE {p}last END" for p in prefixes)


def _upserts() -> tuple[str, str]:
    """The statements that add bucket rows to ``rollups`` and ``rollup_extra``."""
    key = "run_id, axis, level, worker, bucket"
    spans = ", ".join(f"{c}_first = min({c}_first, excluded.{c}_first), {c}_last = max({c}_last, excluded.{c}_last)"
                      for c in rollup.SPAN)
    xs = {ladder.code: rollup.SPAN[ladder.column] for ladder in rollup.LADDERS.values()}
    later = f"CASE axis {' '.join(f'WHEN {code} THEN excluded.{x}_last >= {x}_last' for code, x in xs.items())} END"
    main = (f"INSERT INTO rollups VALUES ({', '.join('?' * (14 + 5 * len(ROLLED)))}) ON CONFLICT ({key}) DO UPDATE "
            f"SET count = count + excluded.count, {spans}, {_merge_sql([f'{m}_' for m in ROLLED], later)}")
    # rollup_extra keeps no span: a batch's values of a step_fn's metric are taken as the later ones
    extra = (f"INSERT INTO rollup_extra VALUES ({', '.join('?' * 11)}) ON CONFLICT ({key}, name) DO UPDATE SET "
             f"{_merge_sql([''], '1')}")
    return main, extra


_UPSERT_MAIN, _UPSERT_EXTRA = _upserts()


def _damaged(path: str, what: str) -> DamagedStore:
    return DamagedStore(f"the run store {path} is damaged ({what}): move it aside (mv {path} {path}.damaged) and "
                        "train again: a new, empty store is made; the runs' checkpoints are kept apart from it")


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class RunStore:
    """The run store. ``readonly=True`` opens a reader that never writes or blocks the writer.
    ``timeout``: how long a query waits for a lock another process holds before it fails."""

    def __init__(self, path: str | os.PathLike | None = None, *, readonly: bool = False, timeout: float = 10.0):
        self.path = os.fspath(path or default_path())
        self.readonly = readonly
        self._lock = threading.Lock()
        self._raw: dict[int, list[int]] = {}  # run -> [its raw metric rows, the rowid its oldest is at or after]
        if readonly and not os.path.exists(self.path):
            raise FileNotFoundError(f"no run store at {self.path}: train a run first, or set PSCLUSTER_HOME")
        # damage is SQLite's to find: this process may hold the file open already, and closing any other
        # descriptor of it (a look at its header) would drop that connection's locks
        try:
            if readonly:
                self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False,
                                           timeout=timeout)
                self._db.execute("PRAGMA page_count").fetchone()  # reads the header: a truncated file fails here
            else:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=timeout)
                self._use_wal(timeout)
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._migrate()
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError):  # a lock, a full disk: the file itself is whole
                raise
            raise _damaged(self.path, str(e)) from None
        self._file = _identity(self.path)

    def gone(self) -> str | None:
        """Why the path no longer names the file this store opened (removed, or replaced, with its directory
        perhaps), or None while it does. SQLite itself goes on writing to a removed file, which nobody reads."""
        now = _identity(self.path)
        if now == self._file:
            return None
        return "removed" if now is None else "replaced by another file"

    def _use_wal(self, timeout: float) -> None:
        """Switch the file to WAL. On a new file that other processes open at the same moment, SQLite answers
        "locked" without waiting for the lock: tried again until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _migrate(self) -> None:
        """Bring the schema up to date, each migration in a transaction that holds the write lock from its start
        and reads the version inside it: processes that open a new store at once (a script's chief writing it,
        a notebook reading it) apply each migration once."""
        found = self.schema_version
        while True:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                version = self.schema_version
                if version < len(MIGRATIONS):
                    for statement in MIGRATIONS[version].split(";"):  # no migration has a ';' but between statements
                        if statement.strip():
                            self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version = {version + 1}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            if version + 1 >= len(MIGRATIONS):
                break
        if found < 5 <= len(MIGRATIONS):
            self._backfill()

    def _backfill(self, chunk: int = 50_000) -> None:
        """Roll up the metric rows stored before schema 5, in one pass over them (every one is kept raw)."""
        after = 0
        while rows := self._db.execute(
                f"SELECT rowid, run_id, worker, time, local_step, global_step, {', '.join(ROLLED)}, extra "
                "FROM metrics WHERE rowid > ? ORDER BY rowid LIMIT ?", (after, chunk)).fetchall():
            after = rows[-1][0]
            for run_id in {row[1] for row in rows}:
                with self._db:
                    self._roll(run_id, _columns([(row[0], *row[2:]) for row in rows if row[1] == run_id]), trim=True)

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def close(self) -> None:
        self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _write(self, sql: str, rows) -> None:
        with self._lock, self._db:
            self._db.executemany(sql, rows)

    # --- writing (the controller) ----------------------------------------------------------
    def create_run(self, *, name: str | None, cluster: str, mode: str, config: dict, spec: dict,
                   code: str | None = None) -> int:
        """A new run row in status 'starting'; returns its id (also the data plane's run id)."""
        with self._lock, self._db:
            cur = self._db.execute(
                "INSERT INTO runs (name, cluster, mode, status, started, config, spec, code) "
                "VALUES ('', ?, ?, 'starting', ?, ?, ?, ?)",
                (cluster, mode, time.time(), json.dumps(config), json.dumps(spec), code))
            run_id = cur.lastrowid
            self._db.execute("UPDATE runs SET name = ? WHERE id = ?", (name or f"run-{run_id}", run_id))
        return run_id

    def set_config(self, run_id: int, config: dict) -> None:
        """The run's settings, once all are known (its checkpoint folder may name its id)."""
        with self._lock, self._db:
            self._db.execute("UPDATE runs SET config = ? WHERE id = ?", (json.dumps(config), run_id))

    def set_spec(self, run_id: int, spec: dict) -> None:
        """The run's cluster now (tasks replaced, workers added or removed), without its secret."""
        with self._lock, self._db:
            self._db.execute("UPDATE runs SET spec = ? WHERE id = ?", (json.dumps(spec), run_id))

    def set_status(self, run_id: int, status: str, summary: dict | None = None,
                   failure: dict | None = None, ended: float | None = None) -> None:
        """The run's status now; an ended one (finished, failed, stopped) ends at ``ended`` (default: now).
        ``failure``, of a failed run: ``cause`` (one line that says what to do), ``task`` (the task that failed:
        ``worker:1``, or ``controller`` when finalizing failed), ``step`` (the global step it failed at, or None)
        and ``traceback`` (the whole of it, or None)."""
        ended = (ended or time.time()) if status in ("finished", "failed", "stopped") else None
        with self._lock, self._db:
            self._db.execute("UPDATE runs SET status = ?, ended = COALESCE(?, ended), "
                             "summary = COALESCE(?, summary), failure = COALESCE(?, failure) WHERE id = ?",
                             (status, ended, None if summary is None else json.dumps(summary),
                              None if failure is None else json.dumps(failure), run_id))

    def renew_lease(self, run_id: int, owner: str) -> None:
        """``owner`` holds run ``run_id`` for ``LEASE_S`` more seconds."""
        with self._lock, self._db:
            self._db.execute("UPDATE runs SET owner = ?, lease_until = ? WHERE id = ?",
                             (owner, time.time() + LEASE_S, run_id))

    def record_placement(self, run_id: int, variables) -> None:
        """One row per variable or shard: name, ps task, shape, dtype, bytes, rows, part, sparse
        (VariableSpec-like objects)."""
        rows = [(run_id, name, ps, json.dumps(list(shape)), *rest)
                for name, ps, shape, *rest in map(_placement_row, variables)]
        self._write(f"INSERT OR REPLACE INTO placement (run_id, {', '.join(PLACEMENT_COLUMNS)}) "
                    f"VALUES (?, {', '.join('?' * len(PLACEMENT_COLUMNS))})", rows)

    def add_event(self, run_id: int, task: str, kind: str, detail: dict | None = None) -> None:
        self._write("INSERT INTO events VALUES (?, ?, ?, ?, ?)",
                    [(run_id, time.time(), task, kind, json.dumps(detail or {}))])

    def add_evaluation(self, run_id: int, global_step: int, loss: float, accuracy: float | None) -> None:
        self._write("INSERT INTO evaluations VALUES (?, ?, ?, ?, ?)",
                    [(run_id, global_step, time.time(), loss, accuracy)])

    def add_batch(self, run_id: int, events: list[dict]) -> None:
        """Store one batch of runtime events: 'step' -> metrics, 'ps' -> ps_metrics, the rest -> events."""
        steps, extras, ps_rows, other = [], [], [], []
        for e in events:
            kind = e.get("kind")
            try:
                if kind == "step":
                    metrics = e.get("metrics") or None
                    if metrics is not None and not isinstance(metrics, dict):
                        raise TypeError("metrics: not an object")
                    numbers = (_number(e.get(c), c in _REQUIRED_METRICS) for c in METRIC_COLUMNS[1:])
                    steps.append((run_id, _task_index(e["task"]), *numbers, json.dumps(metrics) if metrics else None))
                    extras.append(metrics)
                elif kind == "ps":
                    numbers = (_number(e.get(c, 0), True) for c in _PS_COLUMNS[1:-1])
                    ps_rows.append((run_id, _task_index(e["task"]), *numbers, json.dumps(e.get("waiting_for", [])),
                                    _number(e.get("lr"))))
                else:
                    detail = {k: v for k, v in e.items() if k not in ("kind", "task", "time")}
                    other.append((run_id, _number(e["time"], True), str(e["task"]), str(kind), json.dumps(detail)))
            except (KeyError, ValueError, IndexError, TypeError, AttributeError, RecursionError):
                continue  # a malformed event is skipped, never fatal
        with self._lock, self._db:
            if steps:
                self._db.executemany(f"INSERT INTO metrics VALUES (?, {', '.join('?' * (len(METRIC_COLUMNS) + 1))})",
                                     steps)
                # inside this transaction no one else writes: the rows just stored have the greatest rowids
                first = self._db.execute("SELECT max(rowid) FROM metrics").fetchone()[0] - len(steps) + 1
                trimmed = self._trim_raw(run_id, len(steps))
                self._roll(run_id, [range(first, first + len(steps)), *list(zip(*steps))[1:-1], extras], trim=trimmed)
            if ps_rows:
                self._db.executemany(f"INSERT INTO ps_metrics VALUES (?, {', '.join('?' * (len(_PS_COLUMNS) + 1))})",
                                     ps_rows)
            if other:
                self._db.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?)", other)

    def _roll(self, run_id: int, columns: list, trim: bool) -> None:
        """Add raw metric rows (``_columns``) of run ``run_id`` to its rollups at every level; with ``trim``, then
        drop the buckets its levels keep no more: below the top, those older than the newest ``KEEP`` bucket widths of
        each worker (in the caller's transaction)."""
        rows, names = _raw_buckets(columns)
        found = [(ladder.code, level, b) for ladder in rollup.LADDERS.values()
                 for level, b in rollup.levels(rows, ladder)]
        if trim:
            old = [(run_id, axis, level, w, newest - rollup.KEEP) for axis, level, b in found if level < rollup.TOP
                   for w, newest in zip(*_newest(b))]
            for table in ("rollups", "rollup_extra"):
                self._db.executemany(f"DELETE FROM {table} WHERE run_id = ? AND axis = ? AND level = ? AND worker = ? "
                                     "AND bucket <= ?", old)
        b = rollup.concat([b for *_, b in found])
        sizes = [len(b) for *_, b in found]
        keys = np.column_stack([np.full(len(b), run_id), np.repeat([axis for axis, *_ in found], sizes),
                                np.repeat([level for _, level, _ in found], sizes), b.worker, b.bucket])
        stats = np.stack([b.n, b.sum, b.min, b.max, b.last], axis=2)  # (buckets, metrics, STATS)
        self._db.executemany(_UPSERT_MAIN, np.column_stack([keys, b.count, np.stack([b.lo, b.hi], axis=2).reshape(
            len(b), -1), stats[:, :len(ROLLED)].reshape(len(b), -1)]).tolist())
        for j, name in enumerate(names[len(ROLLED):], start=len(ROLLED)):
            has = b.n[:, j] > 0
            self._db.executemany(_UPSERT_EXTRA, [(*key, name, *stat) for key, stat in
                                                 zip(keys[has].tolist(), stats[has, j].tolist())])

    def _trim_raw(self, run_id: int, added: int) -> bool:
        """Count ``added`` new raw rows of run ``run_id`` and, once it has ``RAW_SLACK`` more than ``RAW_WINDOW``,
        delete its oldest down to the window (in the caller's transaction); whether it did."""
        if run_id not in self._raw:
            count, oldest = self._db.execute("SELECT count(*), min(rowid) FROM metrics WHERE run_id = ?",
                                             (run_id,)).fetchone()
            self._raw[run_id] = [count - added, oldest or 0]
        state = self._raw[run_id]
        state[0] += added
        if state[0] <= RAW_WINDOW + RAW_SLACK:
            return False
        # a scan in rowid order from the oldest row kept: the run's rows to delete come first
        cut = self._db.execute("SELECT rowid FROM metrics WHERE rowid >= ? AND +run_id = ? ORDER BY rowid "
                               "LIMIT 1 OFFSET ?", (state[1], run_id, state[0] - RAW_WINDOW - 1)).fetchone()[0]
        state[0] -= self._db.execute("DELETE FROM metrics WHERE rowid BETWEEN ? AND ? AND +run_id = ?",
                                     (state[1], cut, run_id)).rowcount
        state[1] = cut + 1
        return True

    # --- reading (anyone) ------------------------------------------------------------------
    def _frame(self, sql: str, params=()) -> pd.DataFrame:
        with self._lock:
            return pd.read_sql_query(sql, self._db, params=params)

    def runs(self) -> pd.DataFrame:
        """One row per run, newest first: id, name, cluster, mode, status, started, ended, wall_s (to its end, or
        to now while it has none, as ``speed.phases`` counts it), cause (why a failed run failed, in one line; None
        for every other run), diverging_since (the global step its loss began to diverge at, ``divergence``; None
        for a run that has not), owner, owner_lost. A run whose owner was lost (its lease ran out before it ended)
        reads ``failed``, ended when its lease did, and ``owner_lost`` (its cause too) says who held it and when it
        renewed last (None for every other run)."""
        version = self.schema_version
        leased = "owner, lease_until" if version >= 6 else "NULL AS owner, NULL AS lease_until"
        failure = "failure" if version >= 7 else "NULL AS failure"
        df = self._frame(f"SELECT id, name, cluster, mode, status, started, ended, {failure}, ({_DIVERGENCE_SQL} "
                         f"AND run_id = runs.id) AS diverging, {leased} FROM runs ORDER BY id DESC")
        now = time.time()
        df["owner_lost"] = [_owner_lost(*row, now) for row in zip(df["status"], df["owner"], df["lease_until"])]
        lost = df["owner_lost"].notna()
        df["status"] = df["status"].where(~lost, "failed")
        df["ended"] = df["ended"].astype(float).where(~lost, df["lease_until"])
        df["wall_s"] = df["ended"].fillna(now) - df["started"]
        causes = [json.loads(f)["cause"] if isinstance(f, str) else None for f in df["failure"]]
        df.insert(df.columns.get_loc("failure"), "cause", df["owner_lost"].where(lost, pd.Series(causes, dtype=object)))
        since = [found.since_step if (found := _diverging(d)) else None for d in df["diverging"]]
        df.insert(df.columns.get_loc("failure"), "diverging_since", pd.Series(since, dtype=object))
        return df.drop(columns=["lease_until", "failure", "diverging"])

    def run(self, run_id: int) -> dict | None:
        """A run's row with config, spec, summary and failure (see ``set_status``) decoded; None if there is no
        such run. A run whose owner was lost reads ``failed`` (as in ``runs``), with ``owner_lost``: when and who,
        which is its failure's cause too."""
        with self._lock:
            cur = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,))
            row = cur.fetchone()
            names = [d[0] for d in cur.description]
        if row is None:
            return None
        record = dict(zip(names, row))
        record.setdefault("failure", None)  # a store older than schema 7 has none
        for key in ("config", "spec", "summary", "failure"):
            record[key] = json.loads(record[key]) if record[key] else None
        lease = record.pop("lease_until", None)  # a reader of a store older than leases (schema 6) has none
        record.setdefault("owner", None)
        record["owner_lost"] = _owner_lost(record["status"], record["owner"], lease, time.time())
        if record["owner_lost"]:
            record["status"], record["ended"] = "failed", lease
            record["failure"] = {"cause": record["owner_lost"], "task": "controller", "step": None, "traceback": None}
        return record

    def _table_rows(self, table: str, columns, order: str, run_id: int, after_row: int | None) -> pd.DataFrame:
        cursor = "" if after_row is None else "rowid AS row, "
        where, params = _since(run_id, after_row)
        return self._frame(f"SELECT {cursor}{', '.join(columns)} FROM {table} WHERE {where} ORDER BY {order}", params)

    def new_rows(self, table: str, run_id: int, after_row: int = 0) -> tuple[list[str], list[tuple]]:
        """What a poller reads: the rows of ``table`` (metrics, ps_metrics, evaluations or events) of run
        ``run_id`` stored after the cursor ``after_row`` (0 to start), in the order they were stored, as SQLite
        holds them (JSON not decoded, no DataFrame; a metric row's own metrics in ``extra``, a ps sample's learning
        rate in ``lr``, from schema 4). Returns the column names, ``row`` (the cursor) first, and the rows as
        tuples. Metric rows are those of the raw window (see ``metrics``)."""
        where, params = _since(run_id, after_row)
        with self._lock:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            columns = [c for c in _POLLED[table] if _ADDED_IN.get(c, 0) <= version]
            cur = self._db.execute(f"SELECT rowid AS row, {', '.join(columns)} FROM {table} WHERE {where} "
                                   "ORDER BY rowid", params)
            return [d[0] for d in cur.description], cur.fetchall()

    def metrics(self, run_id: int, after_row: int | None = None) -> pd.DataFrame:
        """Per-step worker metrics (one row per reported step per worker), oldest first.

        With ``after_row``, only the rows stored after that cursor, with a ``row`` column whose maximum
        is the cursor to give next time (0 to start): rows are numbered in the order they are stored.
        A step's own metrics (a ``step_fn``'s) follow as one column each, NaN where a row has none.

        Only the raw window: the newest ``RAW_WINDOW`` rows of a run (up to ``RAW_SLACK`` more), which is every row of
        a shorter run; ``series`` reads a run of any length, decimated.
        """
        if self.schema_version < 4:
            return self._table_rows("metrics", METRIC_COLUMNS, "time, worker", run_id, after_row)
        df = self._table_rows("metrics", (*METRIC_COLUMNS, "extra"), "time, worker", run_id, after_row)
        # NULL reads as NaN when other rows have metrics
        extra = pd.DataFrame([json.loads(x) if isinstance(x, str) else {} for x in df.pop("extra")],
                             index=df.index)
        return df.join(extra.drop(columns=[c for c in extra.columns if c in df.columns]))

    def series(self, run_id: int, names: Sequence[str] = ("loss",), *, x: str = "step", start: float | None = None,
               stop: float | None = None, max_points: int = 2000, workers: Sequence[int] | None = None
               ) -> pd.DataFrame:
        """Metrics ``names`` of run ``run_id`` along ``x`` ("step": the global step; "time": unix seconds) in
        [``start``, ``stop``) (None: open), at most ``max_points`` rows per worker (of ``workers``; None: all): a run of
        ten million steps costs what one of ten thousand does.

        One row per bucket per worker, sorted by worker then x: ``SERIES_SPAN`` (``x``/``x_end``: the bucket's
        bounds; the first and last time, global and local step of its rows; ``count``: its rows), then per name
        ``{name}_mean``, ``_min``, ``_max`` and ``_last`` (NaN where a bucket has no value of it; a name no row has
        gives NaN columns, an unknown run no rows). ``attrs["resolution"]``: the buckets' width in x units, 0 for raw
        rows.

        Raw rows (``count`` 1, ``x_end`` = ``x``, mean = min = max = last = the value) when the range holds at most
        ``max_points`` of each worker and the raw window still has them all; buckets merged from them when it holds at
        most ``RAW_MERGED * max_points``; else the buckets of the finest rollup level that covers the range in at most
        ``2 * max_points`` buckets a worker. Adjacent buckets are merged into wider ones, the same for every worker,
        while a worker has more than ``max_points`` (counts add, min of mins, max of maxes, mean weighted by count, the
        later last: a spike stays). A rollup bucket at either end of the range may hold rows beyond it (its
        ``x``/``x_end`` say so); a bucket is never split."""
        ladder = rollup.LADDERS.get(x)
        if ladder is None:
            raise ValueError(f"x={x!r}: choose 'step' (the global step) or 'time' (unix seconds)")
        if max_points < 1:
            raise ValueError(f"max_points={max_points}: give 1 or more")
        names = list(names)
        with self._lock:
            if self.schema_version < 5:  # a store opened read-only before its upgrade: from the raw rows
                rows = self._db.execute(f"SELECT rowid, worker, time, local_step, global_step, {', '.join(ROLLED)}, "
                                        f"{'extra' if self.schema_version >= 4 else 'NULL'} FROM metrics "
                                        "WHERE run_id = ?", (run_id,)).fetchall()
                raw = _raw_buckets(_columns(rows), names)[0]
                found = rollup.from_raw(raw, ladder, start, stop, max_points, workers)
            else:
                found = self._series(run_id, names, ladder, start, stop, max_points, workers)
        return rollup.frame(*found, names, ladder)

    def _series(self, run_id, names, ladder, start, stop, max_points, workers):
        """``series`` from the rollups (and the raw rows when few enough): the buckets, their width, and the x
        range they are clipped to (as ``rollup.frame`` takes them)."""
        x = rollup.SPAN[ladder.column]
        ends = [row for row in self._db.execute(
            f"SELECT worker, min({x}_first), max({x}_last) FROM rollups WHERE run_id = ? AND axis = ? AND level = ? "
            "GROUP BY worker", (run_id, ladder.code, rollup.TOP)) if workers is None or row[0] in workers]
        if not ends:
            return rollup.empty(len(names)), 0, (start, stop)
        lo = min(first for _, first, _ in ends) if start is None else max(start, min(first for _, first, _ in ends))
        hi = max(last for *_, last in ends) if stop is None else min(stop, max(last for *_, last in ends))
        for level in range(rollup.LEVELS):
            width = ladder.width_of(level)
            if level == rollup.TOP or ((hi - lo) / width <= 2 * max_points and all(
                    self._covers(run_id, ladder, level, worker, -np.inf if start is None else start, first)
                    for worker, first, _ in ends)):
                break
        b = self._buckets(run_id, ladder, level, [worker for worker, *_ in ends], names, start, stop)
        if len(b) and b.count.sum() <= RAW_MERGED * max_points:
            raw = self._raw_rows(run_id, b, width, names, ladder)
            if raw is not None:
                return rollup.from_raw(raw, ladder, start, stop, max_points, np.unique(b.worker))
        first, last = (start if start is None else np.floor(start / width) * width,
                       stop if stop is None else np.ceil(stop / width) * width)
        b, factor = rollup.decimate(b, width, max_points)
        return b, width * factor, (first, last)

    def _covers(self, run_id: int, ladder: rollup.Ladder, level: int, worker: int, start: float, first: float) -> bool:
        """Whether ``level`` still has the buckets of ``worker`` from ``start`` on (``first``: its first x)."""
        oldest = self._db.execute("SELECT min(bucket) FROM rollups WHERE run_id = ? AND axis = ? AND level = ? "
                                  "AND worker = ?", (run_id, ladder.code, level, worker)).fetchone()[0]
        return oldest is not None and oldest * ladder.width_of(level) <= max(start, first)

    def _buckets(self, run_id, ladder, level, workers, names, start, stop) -> rollup.Buckets:
        """The buckets of ``level`` that reach into [start, stop), of ``workers``, with the metrics ``names``."""
        width = ladder.width_of(level)
        where = (f"run_id = ? AND axis = ? AND level = ? AND worker IN ({', '.join('?' * len(workers))}) "
                 "AND bucket >= ? AND bucket < ? ORDER BY worker, bucket")
        params = (run_id, ladder.code, level, *workers, -2 ** 62 if start is None else int(np.floor(start / width)),
                  2 ** 62 if stop is None else int(np.ceil(stop / width)))
        rolled = [name for name in names if name in ROLLED]
        span = ", ".join(f"{c}_{end}" for c in rollup.SPAN for end in ("first", "last"))
        stats = "".join(f", {name}_{stat}" for name in rolled for stat in rollup.STATS)
        rows = np.array(self._db.execute(f"SELECT worker, bucket, count, {span}{stats} FROM rollups WHERE {where}",
                                         params).fetchall(), dtype=float).reshape(-1, 3 + 2 * len(rollup.SPAN)
                                                                                   + len(rollup.STATS) * len(rolled))
        g, per = len(rows), len(rollup.SPAN)
        worker, bucket = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
        n, stat = np.zeros((g, len(names)), np.int64), np.full((4, g, len(names)), np.nan)
        stat[0] = 0.0
        values = rows[:, 3 + 2 * per:].reshape(g, len(rolled), len(rollup.STATS))
        for j, name in enumerate(names):
            if name in ROLLED:
                i = rolled.index(name)
                n[:, j], stat[:, :, j] = values[:, i, 0], values[:, i, 1:].T
        extras = [name for name in names if name not in ROLLED]
        if extras and g:
            at = {key: i for i, key in enumerate(zip(worker.tolist(), bucket.tolist()))}
            for w, k, name, *values in self._db.execute(
                    f"SELECT worker, bucket, name, {', '.join(rollup.STATS)} FROM rollup_extra WHERE "
                    f"name IN ({', '.join('?' * len(extras))}) AND {where}", (*extras, *params)):
                i, j = at[w, k], names.index(name)
                n[i, j], stat[:, i, j] = values[0], np.array(values[1:], dtype=float)
        return rollup.Buckets(worker, bucket, rows[:, 2].astype(np.int64), rows[:, 3:3 + 2 * per:2],
                              rows[:, 4:4 + 2 * per:2], n, *stat)

    def _raw_rows(self, run_id, b, width, names, ladder) -> rollup.Buckets | None:
        """The raw rows of buckets ``b`` (of ``width``), with others, or None when the raw window no longer holds
        every one of them."""
        rows = self._db.execute(f"SELECT rowid, worker, time, local_step, global_step, {', '.join(ROLLED)}, extra "
                                "FROM metrics WHERE rowid BETWEEN ? AND ? AND +run_id = ?",
                                (int(b.lo[:, 3].min()), int(b.hi[:, 3].max()), run_id)).fetchall()
        raw = _raw_buckets(_columns(rows), names)[0]
        x = raw.lo[:, ladder.column]
        mine = np.isin(raw.worker, b.worker) & (x >= b.bucket.min() * width) & (x < (b.bucket.max() + 1) * width)
        return raw if mine.sum() == b.count.sum() else None

    def series_names(self, run_id: int) -> list[str]:
        """The metrics run ``run_id`` has values of: those of ``ROLLED`` first, then a step_fn's, sorted."""
        if self.schema_version < 5:
            df = self.metrics(run_id)
            return [c for c in df.columns[len(METRIC_COLUMNS) - len(ROLLED):] if df[c].notna().any()]
        with self._lock:
            counts = self._db.execute(f"SELECT {', '.join(f'sum({m}_n)' for m in ROLLED)} FROM rollups "
                                      "WHERE run_id = ? AND axis = 0 AND level = ?", (run_id, rollup.TOP)).fetchone()
            extras = self._db.execute("SELECT DISTINCT name FROM rollup_extra WHERE run_id = ? AND axis = 0 "
                                      "AND level = ? ORDER BY name", (run_id, rollup.TOP)).fetchall()
        return [m for m, count in zip(ROLLED, counts) if count] + [name for name, in extras]

    def latest(self, run_id: int) -> dict:
        """Where run ``run_id`` stands, without reading its rows: ``first_time``, ``first_step`` (of its first metric
        row; None without any) and ``workers``: {worker: {time, global_step, local_step, loss}} of each worker's newest
        row (the one at its greatest global step; ``loss``: its last loss reported)."""
        with self._lock:
            if self.schema_version >= 5:  # the top level of the step axis: a bucket or two per worker
                rows = self._db.execute(
                    "SELECT worker, time_first, step_first, time_last, step_last, local_last, loss_last FROM rollups "
                    "WHERE run_id = ? AND axis = 0 AND level = ? ORDER BY worker, bucket",
                    (run_id, rollup.TOP)).fetchall()
            else:
                rows = self._db.execute(
                    "SELECT worker, (SELECT min(time) FROM metrics WHERE run_id = ?), "
                    "(SELECT min(global_step) FROM metrics WHERE run_id = ?), time, global_step, local_step, loss "
                    "FROM metrics WHERE rowid IN (SELECT max(rowid) FROM metrics WHERE run_id = ? GROUP BY worker)",
                    (run_id,) * 3).fetchall()
        return {"first_time": min((row[1] for row in rows), default=None),
                "first_step": min((row[2] for row in rows), default=None),
                "workers": {worker: {"time": t, "global_step": step, "local_step": local, "loss": loss}
                            for worker, _, _, t, step, local, loss in rows}}

    def ps_metrics(self, run_id: int, after_row: int | None = None) -> pd.DataFrame:
        """The ps tasks' counters, sampled every ~0.5 s, oldest first; ``after_row`` as in ``metrics``. ``lr``:
        the learning rate of the ps's last update (of its default parameter group, the last one)."""
        columns = (*_PS_COLUMNS, "lr") if self.schema_version >= 4 else _PS_COLUMNS
        df = self._table_rows("ps_metrics", columns, "time, ps", run_id, after_row)
        df["waiting_for"] = df["waiting_for"].map(json.loads)
        return df

    def placement(self, run_id: int) -> pd.DataFrame:
        """One row per variable or shard, in model order: ``PLACEMENT_COLUMNS``. ``start``/``stop``: the rows
        of the parameter it holds (all of them for a whole variable); ``part``: NA for a whole variable;
        ``sparse``: 1 for a parameter moved by touched rows only; ``kind``: ``param``, ``frozen`` or ``buffer``.
        A store of schema 1 (opened read-only, not migrated) reads as whole dense variables, one of schema 2 as
        trained parameters."""
        columns = PLACEMENT_COLUMNS[:{1: 5, 2: 9}.get(self.schema_version, len(PLACEMENT_COLUMNS))]
        df = self._frame(f"SELECT {', '.join(columns)} FROM placement WHERE run_id = ? ORDER BY rowid", (run_id,))
        df["shape"] = df["shape"].map(lambda s: tuple(json.loads(s)))
        rows = df["shape"].map(lambda shape: shape[0] if shape else 1)
        if "start" not in df:
            df["start"], df["stop"], df["part"], df["sparse"] = 0, rows, None, 0
        if "kind" not in df:
            df["kind"] = "param"
        df["stop"] = df["stop"].fillna(df["start"] + rows).astype(int)
        df["part"] = df["part"].astype("Int64")
        return df

    def evaluations(self, run_id: int) -> pd.DataFrame:
        return self._frame("SELECT global_step, time, loss, accuracy FROM evaluations WHERE run_id = ? "
                           "ORDER BY global_step", (run_id,))

    def learning_rates(self, run_id: int) -> pd.DataFrame:
        """The learning rate the ps tasks applied (``lr`` of ``ps_metrics``) where it changed, and its last sample:
        ``time``, ``step`` (the global step), ``lr``, oldest first. Empty before schema 4 or without one reported."""
        if self.schema_version < 4:
            return pd.DataFrame(columns=["time", "step", "lr"], dtype=float)
        df = self._frame("SELECT time, step, lr FROM ps_metrics WHERE run_id = ? AND lr IS NOT NULL ORDER BY time",
                         (run_id,))
        changed = df["lr"].ne(df["lr"].shift())
        changed.iloc[-1:] = True
        return df[changed].reset_index(drop=True)

    def epochs(self, run_id: int) -> dict[int, int]:
        """Each worker's epoch of its ``ctx.shard`` loader (1 for the first), from its latest epoch event: ``{worker:
        epoch}``, empty for a loop without epochs. The events (``events``) also say each epoch's ``batches`` (the
        loader's ``len()``, None where it has none) and the ``global_step`` it began at."""
        with self._lock:
            rows = self._db.execute("SELECT task, detail FROM events WHERE rowid IN (SELECT max(rowid) FROM events "
                                    "WHERE run_id = ? AND kind = 'epoch' GROUP BY task)", (run_id,)).fetchall()
        found = {_task_index(task): json.loads(detail).get("epoch") for task, detail in rows}
        return {w: e for w, e in sorted(found.items()) if isinstance(e, int)}

    def divergence(self, run_id: int) -> Diverging | None:
        """What the divergence rule found in run ``run_id``'s loss (the supervisor's ``diverging`` event): since
        which global step, the smoothed loss, its reference and threshold; None while it has found nothing."""
        with self._lock:
            row = self._db.execute(f"{_DIVERGENCE_SQL} AND run_id = ?", (run_id,)).fetchone()
        return _diverging(row[0] if row else None)

    def events(self, run_id: int) -> pd.DataFrame:
        df = self._frame("SELECT time, task, kind, detail FROM events WHERE run_id = ? ORDER BY time, rowid",
                         (run_id,))
        df["detail"] = df["detail"].map(json.loads)
        return df
