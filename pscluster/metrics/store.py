"""The run store: one SQLite file of runs, their placement, metrics and events.

The schema is defined once, below, as numbered migrations applied by
``PRAGMA user_version``. The file is in WAL mode: readers (the dashboard, the
side panel, another notebook) use read-only connections and never block the
writer, which is the controller's collector thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time

import pandas as pd

from .. import environ

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
]

METRIC_COLUMNS = ("worker", "time", "local_step", "global_step", "loss", "accuracy", "compute_s", "wait_s",
                   "comm_s", "bytes_sent", "bytes_received", "staleness", "dropped")
_PS_COLUMNS = ("ps", "time", "step", "pushes", "pulls", "applied", "dropped_stale", "late", "bytes_in",
               "bytes_out", "waiting_for")
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


def default_path() -> str:
    """``$PSCLUSTER_HOME/runs.sqlite`` (default home: the user's data directory)."""
    return os.path.join(environ.home(), STORE_FILE)


def _task_index(task: str) -> int:
    return int(task.rsplit(":", 1)[1])


class RunStore:
    """The run store. ``readonly=True`` opens a reader that never writes or blocks the writer.
    ``timeout``: how long a query waits for a lock another process holds before it fails."""

    def __init__(self, path: str | os.PathLike | None = None, *, readonly: bool = False, timeout: float = 10.0):
        self.path = os.fspath(path or default_path())
        self.readonly = readonly
        self._lock = threading.Lock()
        if readonly:
            if not os.path.exists(self.path):
                raise FileNotFoundError(f"no run store at {self.path}: train a run first, or set PSCLUSTER_HOME")
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False,
                                       timeout=timeout)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=timeout)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._migrate()

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
            with self._db:
                self._db.executescript(f"BEGIN; {script}; PRAGMA user_version = {number}; COMMIT;")

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

    def set_spec(self, run_id: int, spec: dict) -> None:
        """The run's cluster now (tasks replaced, workers added or removed), without its secret."""
        with self._lock, self._db:
            self._db.execute("UPDATE runs SET spec = ? WHERE id = ?", (json.dumps(spec), run_id))

    def set_status(self, run_id: int, status: str, summary: dict | None = None) -> None:
        ended = time.time() if status in ("finished", "failed", "stopped") else None
        with self._lock, self._db:
            self._db.execute("UPDATE runs SET status = ?, ended = COALESCE(?, ended), "
                             "summary = COALESCE(?, summary) WHERE id = ?",
                             (status, ended, None if summary is None else json.dumps(summary), run_id))

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
        steps, ps_rows, other = [], [], []
        for e in events:
            kind = e.get("kind")
            try:
                if kind == "step":
                    steps.append((run_id, _task_index(e["task"]), *(e.get(c) for c in METRIC_COLUMNS[1:]),
                                  json.dumps(e["metrics"]) if e.get("metrics") else None))
                elif kind == "ps":
                    ps_rows.append((run_id, _task_index(e["task"]), *(e.get(c, 0) for c in _PS_COLUMNS[1:-1]),
                                    json.dumps(e.get("waiting_for", [])), e.get("lr")))
                else:
                    detail = {k: v for k, v in e.items() if k not in ("kind", "task", "time")}
                    other.append((run_id, e["time"], e["task"], str(kind), json.dumps(detail)))
            except (KeyError, ValueError, IndexError, TypeError):
                continue  # a malformed event is skipped, never fatal
        with self._lock, self._db:
            if steps:
                self._db.executemany(f"INSERT INTO metrics VALUES (?, {', '.join('?' * (len(METRIC_COLUMNS) + 1))})",
                                     steps)
            if ps_rows:
                self._db.executemany(f"INSERT INTO ps_metrics VALUES (?, {', '.join('?' * (len(_PS_COLUMNS) + 1))})",
                                     ps_rows)
            if other:
                self._db.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?)", other)

    # --- reading (anyone) ------------------------------------------------------------------
    def _frame(self, sql: str, params=()) -> pd.DataFrame:
        with self._lock:
            return pd.read_sql_query(sql, self._db, params=params)

    def runs(self) -> pd.DataFrame:
        """One row per run, newest first: id, name, cluster, mode, status, started, ended, wall_s."""
        df = self._frame("SELECT id, name, cluster, mode, status, started, ended FROM runs ORDER BY id DESC")
        df["wall_s"] = df["ended"] - df["started"]
        return df

    def run(self, run_id: int) -> dict | None:
        """A run's row with config, spec and summary decoded; None if there is no such run."""
        with self._lock:
            cur = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,))
            row = cur.fetchone()
            names = [d[0] for d in cur.description]
        if row is None:
            return None
        record = dict(zip(names, row))
        for key in ("config", "spec", "summary"):
            record[key] = json.loads(record[key]) if record[key] else None
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
        tuples."""
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
        """
        if self.schema_version < 4:
            return self._table_rows("metrics", METRIC_COLUMNS, "time, worker", run_id, after_row)
        df = self._table_rows("metrics", (*METRIC_COLUMNS, "extra"), "time, worker", run_id, after_row)
        # NULL reads as NaN when other rows have metrics
        extra = pd.DataFrame([json.loads(x) if isinstance(x, str) else {} for x in df.pop("extra")],
                             index=df.index)
        return df.join(extra.drop(columns=[c for c in extra.columns if c in df.columns]))

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

    def events(self, run_id: int) -> pd.DataFrame:
        df = self._frame("SELECT time, task, kind, detail FROM events WHERE run_id = ? ORDER BY time, rowid",
                         (run_id,))
        df["detail"] = df["detail"].map(json.loads)
        return df
