"""Dashboard scale: a run of 10M global steps (4 async workers, one global step per worker step) written through the
real metrics path (a ``MetricsEmitter`` per worker, each in its own process, signed JSON batches over ZeroMQ, the
controller's ``Collector``, ``RunStore.add_batch``); then what reading it costs against a run of 10k steps.

    python -m benchmarks.dashboard_scale emit ADDRESS KEY WORKER STEPS RATE    an emitter child: STEPS step events of
                                                                               worker WORKER, RATE a second

``run`` goes through ``SECTIONS`` in order, each adding rows and notes to the result from a shared context (the
stores built, their paths); the last measures what a live dashboard sends the browser a second, following a slow
and a fast run.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pscluster.metrics.collector import Collector
from pscluster.metrics.store import METRIC_COLUMNS, RunStore
from pscluster.runtime.emitter import MetricsEmitter

from . import procs
from .common import Result, Target, alternate, compare, repetitions, timed

WORKERS = 4
STEPS = 10_000_000  # global steps of the large run: 2.5M step events per worker
SMALL = 10_000  # global steps of the run it is compared with
RATE = 60_000  # step events a second from all emitters together, about what one collector thread stores on 2 cores
QUERIES = 40  # rounds of each query
RUN = dict(name=None, cluster="bench", mode="async", config={}, spec={})


def step_event(worker: int, local: int) -> dict:
    """The fields of worker ``worker``'s step ``local`` (1-based): a decaying loss with a spike every ~1M steps."""
    g = (local - 1) * WORKERS + worker + 1
    noise = ((g * 2654435761) % 1000) / 1000
    loss = 50.0 if g % 1_000_003 == 0 else 2.0 * math.exp(-g / 2e6) + 0.1 * noise
    return dict(local_step=local, global_step=g, loss=loss, accuracy=1 - loss / 3, compute_s=0.004 + 0.001 * noise,
                wait_s=0.0005, comm_s=0.001, bytes_sent=400_000, bytes_received=400_000, staleness=int(noise * 4),
                dropped=False)


def emit(address: str, key: str, worker: int, steps: int, rate: float) -> None:
    """An emitter child: ``steps`` step events at ``rate`` a second, then its dropped count as a JSON line."""
    emitter = MetricsEmitter(address, f"worker:{worker}", bytes.fromhex(key))
    began = time.perf_counter()
    for local in range(1, steps + 1):
        emitter.emit("step", **step_event(worker, local))
        if local % 1000 == 0 and (ahead := local / rate - (time.perf_counter() - began)) > 0:
            time.sleep(ahead)
    emitter.close()
    print(json.dumps({"dropped": emitter.dropped}), flush=True)


def write_through_collector(path: str, steps: int, rate: float) -> dict:
    """A run of ``steps`` global steps written through emitter processes and a collector; what it took."""
    store = RunStore(path)
    run = store.create_run(**RUN)
    stored, busy = [0], [0.0]

    def on_batch(events):
        start = time.perf_counter()
        store.add_batch(run, events)
        busy[0] += time.perf_counter() - start
        stored[0] += len(events)
    key = secrets.token_bytes(32)
    collector = Collector(on_batch, key)
    began = time.perf_counter()
    children = [procs.spawn("dashboard_scale", "emit", collector.address, key.hex(), w, steps // WORKERS,
                            rate / WORKERS) for w in range(WORKERS)]
    dropped = sum(json.loads(child.communicate(timeout=steps / rate * 3 + 60)[0])["dropped"] for child in children)
    deadline = time.monotonic() + 120
    while stored[0] < steps - dropped and time.monotonic() < deadline:
        time.sleep(0.05)
    seconds = time.perf_counter() - began
    collector.close()
    store.close()
    return {"run": run, "events": stored[0], "dropped": dropped, "seconds": seconds, "add_batch_s": busy[0]}


def write_section(tiny: bool, ctx: dict, result: Result) -> None:
    """The large run through the collector; its size on disk and in rows; add_batch against the INSERT alone."""
    steps = 40_000 if tiny else STEPS
    ctx["large"] = os.path.join(ctx["dir"], "large.sqlite")
    w = ctx["write"] = write_through_collector(ctx["large"], steps, RATE)
    ctx["small"] = os.path.join(ctx["dir"], "small.sqlite")
    ctx["write_small"] = write_through_collector(ctx["small"], SMALL, RATE)
    db = sqlite3.connect(ctx["large"])
    counts = {table: db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
              for table in ("metrics", "rollups", "rollup_extra")}
    db.close()
    size = sum(os.path.getsize(p) for p in (ctx["large"], ctx["large"] + "-wal") if os.path.exists(p))
    result.extra.update(write=w, rows=counts, bytes_on_disk=size)
    result.notes.append(
        f"Write: {w['events']:,} step events ({steps:,} global steps, {WORKERS} workers; {w['dropped']} dropped) in "
        f"{w['seconds']:.0f} s through {WORKERS} emitter processes paced at {RATE:,} events/s in all, ZeroMQ and the "
        f"collector: {w['events'] / w['seconds']:,.0f} rows/s stored; the collector thread spent "
        f"{w['add_batch_s']:.0f} s in add_batch ({w['events'] / w['add_batch_s']:,.0f} rows/s). On disk "
        f"{size / 2**20:.0f} MiB: "
        f"{counts['metrics']:,} raw rows (the window), {counts['rollups']:,} rollup rows.")
    a, b = compare_writes(tiny)
    result.rows.append(compare("add_batch of 250-event batches, 4 workers", "add_batch (rows, rollups, window)", a,
                               "INSERT into metrics alone (add_batch before schema 5)", b, "rows/s", Target(0.5)))


def compare_writes(tiny: bool, events: int = 200_000, batch: int = 250) -> tuple[list[float], list[float]]:
    """Rows/s of ``add_batch`` against the INSERT of the same rows alone, each round into a new store."""
    n = events // 10 if tiny else events
    batches = [[{"kind": "step", "task": f"worker:{k % WORKERS}", "time": 1e9 + i * 1e-3,
                 **step_event(k % WORKERS, (k // WORKERS) * batch + i + 1)} for i in range(batch)]
               for k in range(n // batch)]

    def add_batch() -> float:
        with tempfile.TemporaryDirectory() as d, RunStore(os.path.join(d, "r.sqlite")) as store:
            run = store.create_run(**RUN)
            return n / timed(lambda: [store.add_batch(run, b) for b in batches])

    def insert_alone() -> float:
        with tempfile.TemporaryDirectory() as d, RunStore(os.path.join(d, "r.sqlite")) as store:
            run = store.create_run(**RUN)
            sql = f"INSERT INTO metrics VALUES (?, {', '.join('?' * (len(METRIC_COLUMNS) + 1))})"

            def write(b):
                rows = [(run, int(e["task"].rsplit(":", 1)[1]), *(e.get(c) for c in METRIC_COLUMNS[1:]), None)
                        for e in b]
                with store._db:
                    store._db.executemany(sql, rows)
            return n / timed(lambda: [write(b) for b in batches])
    out = alternate({"add_batch": add_batch, "insert": insert_alone}, repetitions(tiny))
    return out["add_batch"], out["insert"]


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]


def query_section(tiny: bool, ctx: dict, result: Result) -> None:
    """``series`` on the large run against the same query, same share of the run, on the small one; ``latest``."""
    large, small = RunStore(ctx["large"], readonly=True), RunStore(ctx["small"], readonly=True)
    runs = {"large": (large, ctx["write"]["run"]), "small": (small, ctx["write_small"]["run"])}
    try:
        ends = {name: store.latest(run) for name, (store, run) in runs.items()}

        def extent(name: str, x: str) -> tuple[float, float]:
            e = ends[name]
            last = max(w["global_step" if x == "step" else "time"] for w in e["workers"].values())
            return e["first_step" if x == "step" else "first_time"], last

        cases = [("full range", "step", 0.0, 1.0), ("full range", "time", 0.0, 1.0),
                 ("newest 1%", "step", 0.99, 1.0), ("1% in the middle", "step", 0.5, 0.51),
                 ("first 0.1%", "step", 0.0, 0.001), ("1% in the middle", "time", 0.5, 0.51)]
        timings = {}
        for label, x, f0, f1 in cases:
            def query(name, x=x, f0=f0, f1=f1):
                store, run = runs[name]
                lo, hi = extent(name, x)
                return store.series(run, ["loss", "accuracy"], x=x, start=lo + f0 * (hi - lo),
                                    stop=None if f1 == 1.0 else lo + f1 * (hi - lo))
            out = alternate({"large": lambda q=query: timed(lambda: q("large")),
                             "small": lambda q=query: timed(lambda: q("small"))}, 3 if tiny else QUERIES)
            shape = query("large")
            timings[f"{label}, {x}"] = {k: {"median_ms": statistics.median(v) * 1e3, "p99_ms": _p99(v) * 1e3}
                                        for k, v in out.items()}
            result.rows.append(compare(f"series(loss, accuracy), {label}, x={x}", f"{STEPS // 1_000_000}M steps",
                                       [v * 1e3 for v in out["large"]], f"{SMALL // 1000}k steps",
                                       [v * 1e3 for v in out["small"]], "ms", Target(3.0, higher=False),
                                       note=f"large: p99 {timings[f'{label}, {x}']['large']['p99_ms']:.1f} ms"))
            timings[f"{label}, {x}"]["large"].update(rows=len(shape), resolution=shape.attrs["resolution"])
        latest = [timed(lambda: large.latest(ctx["write"]["run"])) * 1e3 for _ in range(3 if tiny else QUERIES)]
        result.extra.update(queries=timings, latest_ms=statistics.median(latest))
        answers = "; ".join(f"{case} {t['large']['rows']:,} rows of width {t['large']['resolution']:g}"
                            for case, t in timings.items())
        result.notes.append(f"latest() of the large run: {statistics.median(latest):.2f} ms (median). Queries read "
                            "the stores through read-only connections, 2,000 points per worker at most (the default). "
                            f"What the large run answered: {answers}. Its time axis spans the write's wall time, "
                            "minutes where a real run of 10M steps spans hours or days.")
    finally:
        large.close()
        small.close()


LIVE_S = 20.0  # seconds a live dashboard is measured
LIVE_RATES = (1_000, 20_000)  # global steps a second of the live runs it follows (4 workers); a tenth when tiny
FIRST_DRAW_S = 30  # how long the first figures may take to draw before the measured seconds


def follow_live_run(path: str, steps_per_s: int, seconds: float) -> tuple[list[float], list[float]]:
    """A dashboard following a run written at ``steps_per_s`` for ``seconds`` (in 0.1 s batches, as the collector
    stores them), refreshing in its own thread as in a notebook; returns the widget messages and bytes it sent
    the browser in each second: its figures' (counted by ``LiveFigure``) and its HTML widgets' value changes."""
    from pscluster.widgets import Dashboard

    store = RunStore(path)
    tasks = {"ps": [{"role": "ps", "index": 0, "host": "127.0.0.1", "port": 1, "device": "cpu"}],
             "worker": [{"role": "worker", "index": w, "host": "127.0.0.1", "port": 0, "device": "cpu"}
                        for w in range(WORKERS)]}
    run = store.create_run(**{**RUN, "config": {"steps": 10**9}, "spec": tasks})
    store.set_status(run, "training")
    dashboard = Dashboard(path, run)
    html = [0, 0]  # messages, bytes

    def changed(change):
        html[0] += 1
        html[1] += len(change["new"])

    for widget in (dashboard.header, dashboard.roles, dashboard.lines):
        widget.observe(changed, "value")
    messages, sizes, step, second = [], [], 0, 0
    began = time.monotonic()
    dashboard.start()
    try:
        # only the seconds that start once the first figures are drawn count: on a loaded machine the first
        # refresh may take several seconds
        while len(messages) < seconds and second < seconds + FIRST_DRAW_S:
            drawn = dashboard.refreshes > 0
            m0 = sum(f.messages for f in dashboard.figures.values()) + html[0]
            b0 = sum(f.bytes_sent for f in dashboard.figures.values()) + html[1]
            for tenth in range(10):
                now = time.time()
                events = [{"kind": "step", "task": f"worker:{(step + i) % WORKERS}", "time": now,
                           **step_event((step + i) % WORKERS, (step + i) // WORKERS + 1)}
                          for i in range(steps_per_s // 10)]
                step += steps_per_s // 10
                store.add_batch(run, events)
                time.sleep(max(0.0, began + second + (tenth + 1) / 10 - time.monotonic()))
            if drawn:
                messages.append(sum(f.messages for f in dashboard.figures.values()) + html[0] - m0)
                sizes.append(sum(f.bytes_sent for f in dashboard.figures.values()) + html[1] - b0)
            second += 1
    finally:
        dashboard.close()
        store.close()
    if not messages:
        raise RuntimeError(f"the dashboard drew nothing in {second} s of a run at {steps_per_s:,} steps/s")
    return messages, sizes


def dashboard_section(tiny: bool, ctx: dict, result: Result) -> None:
    """What a live dashboard sends the browser each second, following a slow and a fast run."""
    seconds, rates = (3, [r // 10 for r in LIVE_RATES]) if tiny else (LIVE_S, LIVE_RATES)
    slow, fast = (follow_live_run(os.path.join(ctx["dir"], f"live-{r}.sqlite"), r, seconds) for r in rates)
    labels = [f"{r:,} steps/s" for r in rates]
    result.rows.append(compare("live dashboard: widget messages a second", labels[1], fast[0], labels[0], slow[0],
                               "msg/s", Target(1.25, higher=False),
                               note="budget: 2.5 refreshes a second, one message per widget at most"))
    result.rows.append(compare("live dashboard: bytes to the browser a second", labels[1],
                               [b / 1e3 for b in fast[1]], labels[0], [b / 1e3 for b in slow[1]], "kB/s",
                               Target(2.0, higher=False)))
    result.extra.update(live={label: {"messages_per_s": statistics.median(m), "kb_per_s": statistics.median(b) / 1e3,
                                      "max_messages_per_s": max(m)}
                              for label, (m, b) in zip(labels, (slow, fast))})


SECTIONS = {"write": write_section, "query": query_section, "dashboard": dashboard_section}


def run(tiny: bool, out_dir: Path) -> Result:
    result = Result("dashboard_scale", "Dashboard scale: a run of 10M global steps written through the collector, "
                    "and read decimated", tiny)
    with tempfile.TemporaryDirectory() as d:
        ctx = {"dir": d}
        for section in SECTIONS.values():
            section(tiny, ctx, result)
    return result


if __name__ == "__main__":
    emit(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
