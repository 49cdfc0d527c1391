"""The live dashboard of one run: ipywidgets and live plotly figures (``live``) fed from the run store.

A daemon thread polls the store through its own read-only connection and reads only the rows that are
new since the last poll (``reader``). The panels (``panels``, ``ps_panels``) take them and give their
figures as plain data (``figure_specs``); each figure is sent at most one message per refresh (every
``REFRESH_S``), holding only what changed (a growing series: its new points), and nothing when nothing did.
The poller only reads, so it never blocks training, and it stops by itself once the run is over.
Displayed, the dashboard gives JupyterLab the live widget and gives nbconvert a static HTML copy of the
figures; ``show`` replaces the display with the static copy alone when the run ends, so a saved notebook
shows the final figures with or without a kernel and holds no plotly.js (``pscluster.report`` puts it once
into an HTML report).
"""

from __future__ import annotations

import html
import math
import threading
import time

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go

from ..errors import ConfigError
from ..metrics import epochs, speed
from ..metrics.divergence import Diverging
from ..metrics.store import RunStore
from . import figure_specs, figures, live
from .reader import RunReader
from .run_figures import RunFigures
from .task_table import FINAL, roles_frame, task_states

REFRESH_S = 0.4  # 2.5 refreshes per second
MAX_FAILURES = 10  # consecutive failed refreshes before the thread gives up
WARNING_COLOR = "#b35900"  # a run that goes on but wants a look (diverging); 4.5:1 on white, as every colour here
STATUS_COLORS = {"training": "#1a7f37", "finished": "#36c", "failed": "#c33", "stopped": WARNING_COLOR}
MAX_BUSY_RATIO = 4  # the poller waits at least this many times as long as a refresh takes (on average)
# How often the figures of a live run are redrawn, the viewer's choice (the header follows every refresh): a page
# on a slow or busy machine breathes at a lower rate, and paused, the figures hold still to be read or zoomed.
REDRAW_CHOICES = (("live", 0.0), ("every 2 s", 2.0), ("every 10 s", 10.0), ("paused", math.inf))


def figures_html(shown, *, images: bool = True) -> str:
    """Static HTML of ``shown`` (specs), each drawing itself with plotly.js loaded once per page; with
    ``images``, each with its image for pages that run no script (``live.static_html``)."""
    return "\n".join(live.static_html(s, image=images) for s in shown)


def failure_html(record: dict) -> str:
    """Why a failed run (a run store record) failed: its cause, task and step in one line, its traceback folded
    under it; '' for any other run."""
    failure = record.get("failure")
    if record["status"] != "failed" or not failure:
        return ""
    where = " ".join([f"on {failure['task']}"] * bool(failure.get("task")) +
                     [f"at global step {failure['step']}"] * (failure.get("step") is not None))
    traceback = (f"<details><summary>traceback</summary><pre style='font-size: 11px; white-space: pre-wrap'>"
                 f"{html.escape(failure['traceback'])}</pre></details>" if failure.get("traceback") else "")
    return (f"<div class='pscluster-failure' style='color: {STATUS_COLORS['failed']}'><b>failed{' ' * bool(where)}"
            f"{html.escape(where)}:</b> {html.escape(failure['cause'])}{traceback}</div>")


def diverging_html(found: Diverging | None) -> str:
    """``⚠ diverging since step N`` in the warning colour, its numbers in its title, for a run whose loss diverges
    (what the rule ``found``); '' for None."""
    if found is None:
        return ""
    return (f"<span class='pscluster-diverging' style='color: {WARNING_COLOR}; font-weight: bold' "
            f"title='{html.escape(found.line())}'>⚠ {html.escape(found.words())}</span>")


def widget_bundle(box: widgets.Widget, static_html: str, **kwargs) -> dict:
    """The display bundle of ``box`` (the live widget) with ``static_html`` as its text/html fallback."""
    bundle = dict(box._repr_mimebundle_(**kwargs) or {})
    bundle["text/html"] = static_html
    return bundle


class FigureView:
    """Displays like the dashboard: ``figure`` (a plotly Figure) between two pieces of HTML (``_head_html``,
    ``_tail_html``), as a live figure in JupyterLab and as static HTML in an nbconvert report.
    ``pscluster.compare`` and ``Cluster.plan`` show their results this way."""

    figure: go.Figure

    def _head_html(self) -> str:
        return ""

    def _tail_html(self) -> str:
        return ""

    def static_html(self) -> str:
        """The HTML before the figure, the figure as static HTML, the HTML after it."""
        return self._head_html() + figures_html([figure_specs.of_figure(self.figure)]) + self._tail_html()

    def _repr_html_(self) -> str:
        return self.static_html()

    def _repr_mimebundle_(self, **kwargs) -> dict:
        if getattr(self, "_widget", None) is None:
            self._widget = live.LiveFigure(figure_specs.of_figure(self.figure))
            self._box = widgets.VBox([*(widgets.HTML(h) for h in [self._head_html()] if h), self._widget,
                                      *(widgets.HTML(h) for h in [self._tail_html()] if h)])
        return widget_bundle(self._box, self.static_html(), **kwargs)


class Dashboard:
    """Live view of run ``run_id`` of the run store at ``store_path``, refreshed every ``refresh_s`` s.

    ``start()`` starts the polling thread, ``stop()`` ends it, ``refresh()`` refreshes once (now, in
    the caller's thread). Display it (``show``) for the widget in JupyterLab and a static HTML copy in
    nbconvert's output.
    """

    def __init__(self, store_path, run_id: int, *, refresh_s: float = REFRESH_S):
        if refresh_s <= 0:
            raise ConfigError(f"refresh_s={refresh_s}: give a positive number of seconds, e.g. {REFRESH_S}")
        self.store_path = store_path
        self.run_id = run_id
        self.refresh_s = refresh_s
        self._store = RunStore(store_path, readonly=True)  # the caller's thread's; the poller opens its own
        self.record = self._store.run(run_id)
        if self.record is None:
            self._store.close()
            raise ConfigError(f"no run {run_id} in the run store {self._store.path}: see pscluster.runs()")
        self._reader = RunReader(run_id)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None  # the IPython display to update when the run ends (see show)
        self.error: str | None = None
        self.refreshes = 0  # completed refreshes
        self.cpu_s = 0.0  # CPU time the refreshes took, in seconds
        self._placement = None  # recorded once, when training starts
        self._states: dict[str, str] = {}  # each task's latest state
        self._steps = {"metrics": 0, "ps_metrics": 0}  # the latest global step each table has reported
        self._epochs: dict[int, int] = {}  # each worker's epoch of its ctx.shard loader (none without one)
        self._divergence: Diverging | None = None  # what the divergence rule found in the loss

        self.charts = RunFigures(self.record)  # the figures, as the side panel serves them too
        self.panels = self.charts.panels
        shown = self.charts.specs()
        self.figures: dict[str, live.LiveFigure] = {name: live.LiveFigure(s) for name, s in shown.items()}
        self._changed: set[str] = set()  # panels whose figure changed since it was last shown
        self._shown_at = -math.inf  # when the panels' figures were last shown (time.monotonic())
        self.redraw = widgets.ToggleButtons(options=REDRAW_CHOICES, value=0.0, description="figures",
                                            tooltips=["redraw at every refresh", "redraw every 2 seconds",
                                                      "redraw every 10 seconds", "hold the figures still"],
                                            style={"button_width": "auto"})
        self.header = widgets.HTML()
        self.roles = widgets.HTML()
        self.lines = widgets.HTML()
        self.roles.layout.margin = "0 3em 0 0"
        self.box = widgets.VBox([self.header, widgets.HBox([self.roles, self.lines]), self.redraw,
                                 *self.figures.values()])
        self._draw_header()

    @property
    def final(self) -> bool:
        """Whether the run is over (and the dashboard has read all of it)."""
        return self.record is not None and self.record["status"] in FINAL

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
        self.join(timeout)

    def join(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until the polling thread has ended (by itself: after the run's end,
        once the display shows the final figures)."""
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
        """Read what is new in the store and redraw what it changes; True once the run is over."""
        return self._refresh(self._store)

    def _refresh(self, store: RunStore) -> bool:
        began = time.thread_time()
        with self._lock:
            # The record first: once it says the run is over, the rows read after it are complete.
            record, self.record = self.record, store.run(self.run_id)
            new = self._reader.read(store)
            if "events" in new:  # an epoch begins with an event, and a divergence is one
                self._epochs = store.epochs(self.run_id)
                self._divergence = self._divergence or store.divergence(self.run_id)
            if self._placement is None and self.record is not None:
                placement = store.placement(self.run_id)
                if len(placement):
                    self._placement, new["placement"] = placement, figure_specs.rows(placement)
            self._draw(new, record_changed=record != self.record)
            self.refreshes += 1
            self.cpu_s += time.thread_time() - began
            return self.final

    def _poll(self) -> None:
        failures, final, cost = 0, False, 0.0
        store = None
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
    def _draw(self, new: dict, *, record_changed: bool) -> None:
        """Feed the new rows to the panels and send each widget what changed (nothing when nothing did)."""
        if self.record is None:  # the run's row is gone
            self._draw_header()
            return
        if "placement" in new:
            self._show("placement", self.charts.place(self._placement, self.record))
            self.lines.value = "<pre style='font-size: 12px'>{}</pre>".format(
                html.escape("\n".join(figures.placement_lines(self._placement, self.charts.slots))))
        self._changed |= self.charts.feed(new, self.record)
        if record_changed:
            self._changed.add("speed")
        if self._changed and (self.final or time.monotonic() - self._shown_at >= self.redraw.value):
            for name in sorted(self._changed):
                self._show(name, self.panels[name].spec())
            self._changed.clear()
            self._shown_at = time.monotonic()
        if "events" in new:
            self._states.update(task_states(new["events"]))
        for table, column in (("metrics", "global_step"), ("ps_metrics", "step")):
            if table in new:
                self._steps[table] = int(np.max(new[table][column]))
        if new or record_changed:
            rates = self.panels["speed"].worker_rates()
            self.roles.value = figures.table_html(roles_frame(self.record, rates, self._states))
        self._draw_header()

    def _show(self, name: str, spec: figure_specs.Spec) -> None:
        """Show ``spec`` in the figure ``name``: one message at most, holding what changed."""
        self.figures[name].show(spec)

    def _draw_header(self) -> None:
        record = self.record
        error = f"<div style='color: #c33'>dashboard error: {html.escape(self.error)}</div>" if self.error else ""
        if record is None:  # the run's row is gone
            self.header.value = f"<b>run {self.run_id}</b>{error}"
            return
        step, target = max(self._steps.values()), (record["config"] or {}).get("steps")
        times = speed.phases(record["started"], record["ended"], self.panels["speed"].rates.span(), time.time())
        elapsed = f"elapsed {times['wall_s']:.1f} s" + ("" if times["startup_s"] is None else
                                                      f" (startup {times['startup_s']:.1f} s, training "
                                                      f"{times['training_s']:.1f} s)")
        spec = record["spec"] or {}
        parts = [f"<b>{html.escape(record['name'])}</b>", html.escape(record["mode"]),
                 f"<span style='color: {STATUS_COLORS.get(record['status'], '#888')}; font-weight: bold'>"
                 f"{html.escape(record['status'])}</span>",
                 diverging_html(self._divergence),
                 html.escape(epochs.progress(step, target, self._epochs)) + ("" if target is None else
                 f" <progress value='{step}' max='{max(target, 1)}' style='width: 8em; vertical-align: middle'>"
                 "</progress>"),
                 elapsed,
                 f"{len(spec.get('ps', []))} ps, {len(spec.get('worker', []))} workers"]
        self.header.value = (f"<div style='font-size: 14px'>{' · '.join(filter(None, parts))}</div>"
                             f"{failure_html(record)}{error}")

    # --- display ----------------------------------------------------------------------------
    def static_html(self, *, images: bool = True) -> str:
        """The header, roles table, placement lines and every figure as static HTML (no widgets), the figures
        with their images unless ``images`` is false."""
        with self._lock:
            return (f"<div class='pscluster-dashboard'>{self.header.value}"
                    f"<div style='display: flex; gap: 3em'>{self.roles.value}{self.lines.value}</div>"
                    f"{figures_html((f.spec for f in self.figures.values()), images=images)}</div>")

    def _repr_mimebundle_(self, **kwargs) -> dict:
        """The live widget and its static copy (without images: it stands for the moment it was displayed)
        while the run trains; the static copy alone, images included, once it is over (what a reopened
        notebook shows, with or without its kernel, trusted or not)."""
        if self.final:
            return {"text/html": self.static_html(), "text/plain": repr(self)}
        with self._lock:
            return widget_bundle(self.box, self.static_html(images=False), **kwargs)

    def __repr__(self) -> str:
        return f"<pscluster Dashboard of run {self.run_id} ({'polling' if self.running else 'idle'})>"


def show(store_path, run_id: int, *, refresh_s: float = REFRESH_S) -> Dashboard:
    """Display a live dashboard of run ``run_id`` and start it; when the run ends, the display is updated
    once so that its static copy (what nbconvert keeps) holds the final figures. A run already over is displayed
    final at once (its figures' images drawn once), with no poller. Returns the dashboard."""
    from IPython.display import display

    dashboard = Dashboard(store_path, run_id, refresh_s=refresh_s)
    dashboard.refresh()
    dashboard._handle = display(dashboard, display_id=True)
    return dashboard if dashboard.final else dashboard.start()  # a run over is displayed final already
