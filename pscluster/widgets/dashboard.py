"""The live dashboard of one run: ipywidgets + plotly FigureWidgets fed from the run store.

A daemon thread polls the store through its own read-only connection, reads only the rows that are
new since the last poll, rebuilds the figures (``figures.py``) and pushes them into the widgets, one
``batch_update`` message per figure. It only reads, so it never blocks training, and it stops by
itself once the run is over. Displayed, the dashboard gives JupyterLab the live widget and gives
nbconvert a static HTML copy of the figures that renders offline (plotly.js included once per
process); ``show`` updates that copy when the run ends.
"""

from __future__ import annotations

import html
import os
import threading
import time
from copy import deepcopy

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from ..errors import ConfigError
from ..metrics.store import RunStore
from ..runtime.placement import optimizer_slots
from . import figures

MAX_FAILURES = 10  # consecutive failed refreshes before the thread gives up
STATUS_COLORS = {"training": "#2a7", "finished": "#36c", "failed": "#c33", "stopped": "#c80"}
MAX_BUSY_RATIO = 4  # the poller waits at least this many times as long as a refresh takes (on average)

_plotlyjs_lock = threading.Lock()
_plotlyjs_sent = False


def plotlyjs_once(owner) -> bool:
    """Whether ``owner``'s static HTML carries plotly.js: only the first object displayed in this process
    does, and it keeps doing so when its display is updated, so a report holds plotly.js exactly once."""
    global _plotlyjs_sent
    with _plotlyjs_lock:
        if not _plotlyjs_sent:
            _plotlyjs_sent = owner._carries_plotlyjs = True
    return getattr(owner, "_carries_plotlyjs", False)


def figures_html(figs, include_plotlyjs: bool) -> str:
    """Static plotly HTML of ``figs`` (figures or FigureWidgets), plotly.js at most once, first."""
    parts = []
    for fig in figs:
        parts.append(pio.to_html(go.Figure(fig), include_plotlyjs=include_plotlyjs, full_html=False,
                                 config={"displaylogo": False}))
        include_plotlyjs = False
    return "\n".join(parts)


def widget_bundle(box: widgets.Widget, figs, static_html: str, **kwargs) -> dict:
    """The display bundle of ``box`` (the live widget) with ``static_html`` as its text/html fallback."""
    for fig in figs:
        # What FigureWidget does when displayed itself: the frontend builds a new view from these.
        fig._widget_layout = deepcopy(fig._layout_obj._props)
        fig._widget_data = deepcopy(fig._data)
    bundle = dict(box._repr_mimebundle_(**kwargs) or {})
    bundle["text/html"] = static_html
    return bundle


class FigureView:
    """Displays like the dashboard: ``figure`` (a plotly Figure) between two pieces of HTML (``_head_html``,
    ``_tail_html``), as a FigureWidget in JupyterLab and as static HTML (plotly.js once per process) in
    an nbconvert report. ``pscluster.compare`` and ``Cluster.plan`` show their results this way."""

    figure: go.Figure

    def _head_html(self) -> str:
        return ""

    def _tail_html(self) -> str:
        return ""

    def static_html(self, include_plotlyjs: bool = True) -> str:
        """The HTML before the figure, the figure as static plotly HTML, the HTML after it."""
        return self._head_html() + figures_html([self.figure], include_plotlyjs) + self._tail_html()

    def _repr_html_(self) -> str:
        return self.static_html(plotlyjs_once(self))

    def _repr_mimebundle_(self, **kwargs) -> dict:
        if getattr(self, "_widget", None) is None:
            self._widget = go.FigureWidget(self.figure)
            self._box = widgets.VBox([*(widgets.HTML(h) for h in [self._head_html()] if h), self._widget,
                                      *(widgets.HTML(h) for h in [self._tail_html()] if h)])
        return widget_bundle(self._box, [self._widget], self._repr_html_(), **kwargs)


class _RunData:
    """What the dashboard knows of a run so far: the frames of the store, grown by each read."""

    def __init__(self, run_id: int):
        self.run_id = run_id
        self.record: dict | None = None
        self.metrics = self.ps_metrics = self.placement = self.evaluations = self.events = None
        self._cursors: dict[str, int] = {}  # per table: the last row read

    def read(self, store: RunStore) -> set[str]:
        """Read what is new; the names of the frames that changed.

        The record is read first: once it says the run is over, the rows read after it are complete.
        """
        self.record = store.run(self.run_id)
        changed = set()
        for name, query in (("metrics", store.metrics), ("ps_metrics", store.ps_metrics)):
            new = query(self.run_id, after_row=self._cursors.get(name, 0))
            old = getattr(self, name)
            if old is None or len(new):
                self._cursors[name] = int(new["row"].max()) if len(new) else 0
                new = new.drop(columns="row")
                setattr(self, name, new if old is None or old.empty else pd.concat([old, new], ignore_index=True))
                changed.add(name)
        if self.placement is None or self.placement.empty:  # recorded once, when training starts
            self.placement = store.placement(self.run_id)
            changed.add("placement")
        for name, query in (("evaluations", store.evaluations), ("events", store.events)):
            old, new = getattr(self, name), query(self.run_id)
            if old is None or len(new) != len(old):
                setattr(self, name, new)
                changed.add(name)
        return changed

    @property
    def final(self) -> bool:
        return self.record is not None and self.record["status"] in figures.FINAL


class Dashboard:
    """Live view of run ``run_id`` of the run store at ``store_path``, refreshed every ``refresh_s`` s.

    ``start()`` starts the polling thread, ``stop()`` ends it, ``refresh()`` refreshes once (now, in
    the caller's thread). Display it (``show``) for the widget in JupyterLab and a static HTML copy in
    nbconvert's output.
    """

    def __init__(self, store_path, run_id: int, *, refresh_s: float = 0.5):
        if refresh_s <= 0:
            raise ConfigError(f"refresh_s={refresh_s}: give a positive number of seconds, e.g. 0.5")
        self.store_path = store_path
        self.run_id = run_id
        self.refresh_s = refresh_s
        self._store = RunStore(store_path, readonly=True)  # the caller's thread's; the poller opens its own
        self._data = _RunData(run_id)
        self._data.record = self._store.run(run_id)
        if self._data.record is None:
            self._store.close()
            raise ConfigError(f"no run {run_id} in the run store {self._store.path}: see pscluster.runs()")
        self.mode = self._data.record["mode"]
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None  # the IPython display to update when the run ends (see show)
        self._drawn: dict[str, go.Figure] = {}  # the figure each widget shows, as built (unvalidated)
        self.error: str | None = None
        self.refreshes = 0  # completed refreshes

        self.header = widgets.HTML()
        self.roles = widgets.HTML()
        self.lines = widgets.HTML()
        progress = "waiting" if self.mode == "sync" else "staleness"
        self.figures: dict[str, go.FigureWidget] = {
            name: go.FigureWidget(figures.no_data_figure(name.replace("_", " ")))
            for name in ("placement", "speed", "convergence", progress, "ps_load", "traffic")}
        self.roles.layout.margin = "0 3em 0 0"
        self.box = widgets.VBox([self.header, widgets.HBox([self.roles, self.lines]), *self.figures.values()])
        self._draw_header()

    # --- polling ----------------------------------------------------------------------------
    def start(self) -> Dashboard:
        """Start polling the store in a daemon thread (no-op when it runs already)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, name=f"pscluster-dashboard-{self.run_id}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the polling thread and wait for it (at most ``timeout`` seconds)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def close(self) -> None:
        """Stop polling and close the store connection of the caller's thread."""
        self.stop()
        self._store.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def refresh(self) -> bool:
        """Read what is new in the store and redraw; True once the run is over."""
        return self._refresh(self._store)

    def _refresh(self, store: RunStore) -> bool:
        with self._lock:
            changed = self._data.read(store)
            self._draw(changed)
            self.refreshes += 1
            return self._data.final

    def _poll(self) -> None:
        failures, final, cost = 0, False, 0.0
        store = None
        _yield_cpu_to_training()
        try:
            store = RunStore(self.store_path, readonly=True)
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    final = self._refresh(store)
                    failures = 0
                except Exception as e:  # shown in the header, never raised into the notebook
                    failures += 1
                    self._fail(e, given_up=failures >= MAX_FAILURES)
                    if failures >= MAX_FAILURES:
                        return
                if final:
                    break
                spent = time.monotonic() - began
                # A moving average of the refresh's cost bounds the poller to ~20% of a core: on a huge
                # run it refreshes less often rather than slow training down.
                cost = 0.7 * cost + 0.3 * spent
                self._stop.wait(max(self.refresh_s - spent, MAX_BUSY_RATIO * cost))
            if final and self._handle is not None:
                self._handle.update(self)  # the static copy in the notebook now holds the final figures
        except Exception as e:
            self._fail(e, given_up=True)
        finally:
            if store is not None:
                store.close()

    def _fail(self, error: Exception, *, given_up: bool) -> None:
        self.error = f"{type(error).__name__}: {error}" + (" (the dashboard stopped refreshing)" if given_up else "")
        try:
            with self._lock:
                self._draw_header()
        except Exception:
            pass

    # --- drawing ----------------------------------------------------------------------------
    def _draw(self, changed: set[str]) -> None:
        d = self._data
        started = d.record["started"]
        if "placement" in changed:
            config = d.record["config"] or {}
            slots = optimizer_slots(config.get("optimizer", "sgd"), config.get("optimizer_kwargs") or {})
            self._set_figure("placement", figures.placement_figure(d.placement, slots,
                                                                   num_ps=len(d.record["spec"]["ps"])))
            self.lines.value = "<pre style='font-size: 12px'>{}</pre>".format(
                html.escape("\n".join(figures.placement_lines(d.placement))))
        if "metrics" in changed:
            self._set_figure("speed", figures.speed_figure(d.metrics, start=started))
        if changed & {"metrics", "evaluations"}:
            self._set_figure("convergence", figures.convergence_figure(d.metrics, d.evaluations))
        if "metrics" in changed and "staleness" in self.figures:
            self._set_figure("staleness", figures.staleness_figure(d.metrics))
        if "ps_metrics" in changed:
            if "waiting" in self.figures:
                num_workers = len(d.record["spec"]["worker"])
                self._set_figure("waiting", figures.waiting_figure(d.ps_metrics, num_workers, start=started))
            self._set_figure("ps_load", figures.ps_load_figure(d.ps_metrics, start=started))
        if changed & {"placement", "ps_metrics"}:
            self._set_figure("traffic", figures.traffic_share_figure(d.placement, d.ps_metrics,
                                                                     num_ps=len(d.record["spec"]["ps"])))
        self.roles.value = figures.table_html(figures.roles_frame(d.record, d.metrics, d.events))
        self._draw_header()

    def _set_figure(self, name: str, fig: go.Figure) -> None:
        """Show ``fig`` in the widget ``name``: in place, sending only what changed since the figure drawn
        last (a message per changed trace, one for the layout), when the traces keep their kinds and axes;
        else (the first data, a new worker...) in a new FigureWidget that takes the old one's place."""
        widget, drawn = self.figures[name], self._drawn.get(name)
        self._drawn[name] = fig
        if drawn is not None and _shape(drawn) == _shape(fig):
            # restyle/relayout take the figure's own (valid) values as they are: validating them again
            # would cost more than building the figure
            for i, (old, new) in enumerate(zip(drawn._data, fig._data)):
                if changes := _changes(old, new):
                    widget.plotly_restyle({k: [v] for k, v in changes.items()}, trace_indexes=[i])
            if changes := _changes(_layout(drawn), _layout(fig)):
                widget.plotly_relayout(changes)
            return
        replacement = go.FigureWidget(fig)
        self.box.children = tuple(replacement if child is widget else child for child in self.box.children)
        self.figures[name] = replacement
        widget.close()

    def _draw_header(self) -> None:
        record, d = self._data.record, self._data
        error = f"<div style='color: #c33'>dashboard error: {html.escape(self.error)}</div>" if self.error else ""
        if record is None:  # the run's row is gone
            self.header.value = f"<b>run {self.run_id}</b>{error}"
            return
        steps = [int(frame[column].max()) for frame, column in ((d.metrics, "global_step"), (d.ps_metrics, "step"))
                 if frame is not None and len(frame)]
        step, target = max(steps, default=0), (record["config"] or {}).get("steps", 0)
        elapsed = (record["ended"] or time.time()) - record["started"]
        spec = record["spec"] or {}
        parts = [f"<b>{html.escape(record['name'])}</b>", html.escape(record["mode"]),
                 f"<span style='color: {STATUS_COLORS.get(record['status'], '#888')}; font-weight: bold'>"
                 f"{html.escape(record['status'])}</span>",
                 f"global step {step} / {target} <progress value='{step}' max='{max(target, 1)}' "
                 "style='width: 8em; vertical-align: middle'></progress>",
                 f"elapsed {elapsed:.1f} s",
                 f"{len(spec.get('ps', []))} ps, {len(spec.get('worker', []))} workers"]
        self.header.value = f"<div style='font-size: 14px'>{' · '.join(parts)}</div>{error}"

    # --- display ----------------------------------------------------------------------------
    def static_html(self, include_plotlyjs: bool = True) -> str:
        """The header, roles table, placement lines and every figure as static HTML (no widgets)."""
        with self._lock:
            return (f"<div class='pscluster-dashboard'>{self.header.value}"
                    f"<div style='display: flex; gap: 3em'>{self.roles.value}{self.lines.value}</div>"
                    f"{figures_html(self.figures.values(), include_plotlyjs)}</div>")

    def _repr_mimebundle_(self, **kwargs) -> dict:
        with self._lock:
            return widget_bundle(self.box, self.figures.values(), self.static_html(plotlyjs_once(self)),
                                 **kwargs)

    def __repr__(self) -> str:
        return f"<pscluster Dashboard of run {self.run_id} ({'polling' if self.running else 'idle'})>"


def _shape(fig: go.Figure) -> list:
    """What must match for an in-place update: each trace's kind and axes, and the 'no data yet' note."""
    return [(t.get("type"), t.get("xaxis"), t.get("yaxis")) for t in fig._data] + \
        [len(fig._layout.get("annotations", ()))]


def _layout(fig: go.Figure) -> dict:
    return {k: v for k, v in fig._layout.items() if k != "template"}


def _changes(old: dict, new: dict) -> dict:
    """The properties of ``new`` that differ from ``old`` (arrays compared by value)."""
    def same(a, b):
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return np.shape(a) == np.shape(b) and np.array_equal(a, b)
        try:
            return bool(a == b)
        except ValueError:  # containers holding arrays: send again
            return False
    return {k: v for k, v in new.items() if k not in ("type", "uid") and not same(old.get(k), v)}


def _yield_cpu_to_training() -> None:
    """Run the calling thread only when a core is idle (Linux SCHED_IDLE; threads have their own policy),
    so the dashboard never delays the ps and workers, which share this machine in local clusters."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed: refresh at normal priority
        pass


def show(store_path, run_id: int, *, refresh_s: float = 0.5) -> Dashboard:
    """Display a live dashboard of run ``run_id`` and start it; when the run ends, the display is updated
    once so that its static copy (what nbconvert keeps) holds the final figures. Returns the dashboard."""
    from IPython.display import display

    dashboard = Dashboard(store_path, run_id, refresh_s=refresh_s)
    dashboard.refresh()
    dashboard._handle = display(dashboard, display_id=True)
    return dashboard.start()
