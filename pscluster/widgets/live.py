"""Figures in the notebook at a fixed cost: a live widget that carries no plotly.js, and static HTML that
loads it once.

``LiveFigure`` is an anywidget whose view draws with plotly.js that the page loads once from the pscluster
server extension (``<base url>pscluster/static/plotly.min.js``): its widget state is a few kilobytes, where a
plotly ``FigureWidget`` embeds all 5 MB of plotly.js in every figure's state (in every message that opens
one, and in every executed notebook that stores widget state). The kernel sends a view the whole figure
when the view says it is ready (first display, a page reload, a second view; a view says it again every 2 s
until the figure has come) and afterwards, per
``show``, at most one message with only what changed: for an array, the length of the prefix that did not
change and the points after it, so a growing series costs its new points.

``static_html`` gives the same figures as HTML for outputs that outlive the kernel (nbconvert reports, a
reopened notebook): each figure's data inline and plotly.js loaded once, from the page if a report carries
it (``pscluster.report``), else from the server extension; the convergence figure's controls with it
(``controls.js``); and, for a page that runs no script (an untrusted notebook, a notebook viewer, a
repository's page), the figure's image (``still``) in its place until plotly.js draws it.
"""

from __future__ import annotations

import base64
import html
import json
import math
import pathlib
import threading
import uuid

import anywidget
import numpy as np
import plotly.io as pio

from . import still
from .figure_specs import Spec, expanded, figure

_LOADER, _CONTROLS, _VIEW = (pathlib.Path(__file__).with_name(name).read_text()
                             for name in ("plotly_loader.js", "controls.js", "live.js"))
CONFIG = {"displaylogo": False, "responsive": True}
# The figures' drawing for the JupyterLab side panel, which the lab server serves as pscluster/static/figures.js: the
# functions of plotly_loader.js and controls.js in a scope of their own, figureView and CONFIG on the page's window.
PANEL_SCRIPT = (f"window.psclusterFigures = (() => {{\n{_LOADER}\n{_CONTROLS}\n"
                f"return {{ figureView, config: {json.dumps(CONFIG)} }};\n}})();\n")
STATIC_CALL = "drawStatic(div, "  # in a static figure's script, followed by the figure as JSON ({"data", "layout"})


def plain(value):
    """``value`` (a spec's traces or layout) as JSON-ready Python: arrays as lists, NaN and infinities as
    None (JSON has neither), numpy scalars as Python numbers, a template name as the template itself
    (plotly.js knows no names)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "f":
            return [None if not math.isfinite(v) else v for v in value.tolist()]
        return [plain(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: (pio.templates[v].to_plotly_json() if k == "template" and isinstance(v, str) else plain(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return plain(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _kept_prefix(old, new) -> int:
    """How many leading points ``old`` and ``new`` (arrays or lists) have in common."""
    a, b = np.asarray(old), np.asarray(new)
    n = min(len(a), len(b))
    if a.dtype.kind == b.dtype.kind == "f":
        differ = ~((a[:n] == b[:n]) | (np.isnan(a[:n]) & np.isnan(b[:n])))
    else:
        differ = np.array([x != y for x, y in zip(a[:n].tolist(), b[:n].tolist())], dtype=bool)
    return int(np.argmax(differ)) if differ.any() else n


def _is_array(v) -> bool:
    return isinstance(v, np.ndarray) and v.ndim == 1


def _same(a, b) -> bool:
    if _is_array(a) or _is_array(b):
        return _is_array(a) and _is_array(b) and len(a) == len(b) and _kept_prefix(a, b) == len(a)
    try:
        return bool(a == b)
    except ValueError:  # containers holding arrays
        return False


def patch(old: Spec, new: Spec) -> dict | None:
    """What turns figure ``old`` into ``new``: ``{"traces": {index: {key: value or {"keep": n, "append":
    points}}}, "layout": {key: value}}`` (empty when nothing changed), or None when the traces changed in
    number, kind or properties (the figure is sent whole)."""
    if len(old.traces) != len(new.traces) or any(a.keys() != b.keys() or a.get("type") != b.get("type")
                                                 for a, b in zip(old.traces, new.traces)):
        return None
    if not old.layout.keys() <= new.layout.keys():
        return None
    traces = {}
    for i, (a, b) in enumerate(zip(old.traces, new.traces)):
        changed = {}
        for key, value in b.items():
            if _same(a[key], value):
                continue
            if _is_array(a[key]) and _is_array(value):
                keep = _kept_prefix(a[key], value)
                changed[key] = {"keep": keep, "append": plain(value[keep:])}
            else:
                changed[key] = plain(value)
        if changed:
            traces[str(i)] = changed
    layout = {k: plain(v) for k, v in new.layout.items() if not _same(old.layout.get(k), v)}
    return {k: v for k, v in (("traces", traces), ("layout", layout)) if v}


def figure_json(s: Spec) -> dict:
    """The whole figure of spec ``s`` (``figure_specs.expanded``) as plotly.js takes it."""
    return {"data": plain(s.traces), "layout": plain(s.layout)}


class LiveFigure(anywidget.AnyWidget):
    """A figure that ``show`` updates: one message per call at most, holding what changed since the last.
    ``messages`` and ``bytes_sent`` count what it sent (the dashboard's message budget is checked on
    them)."""

    _esm = _LOADER + _CONTROLS + _VIEW

    def __init__(self, spec: Spec):
        super().__init__()
        self._spec = expanded(spec)
        self._lock = threading.Lock()
        self.messages = self.bytes_sent = 0
        self.on_msg(self._from_view)

    @property
    def spec(self) -> Spec:
        """The figure shown now."""
        return self._spec

    @property
    def figure(self):
        """The figure shown now, as a plotly Figure."""
        return figure(self._spec)

    def show(self, spec: Spec) -> None:
        """Show ``spec``: its changes since the figure shown last, or the whole figure, in one message;
        nothing when nothing changed."""
        spec = expanded(spec)
        with self._lock:
            change = patch(self._spec, spec)
            self._spec = spec
            if change is None:
                self._message({"type": "figure", "figure": figure_json(spec)})
            elif change:
                self._message({"type": "patch", **change})

    def _from_view(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("type") == "ready":
            with self._lock:
                self._message({"type": "figure", "figure": figure_json(self._spec)})

    def _message(self, message: dict) -> None:
        if self.comm is None:  # closed
            return
        self.messages += 1
        self.bytes_sent += len(json.dumps(message))
        self.send(message)


def static_html(s: Spec, *, image: bool = True) -> str:
    """Figure ``s`` as HTML that draws itself with plotly.js, loaded once per page: the figure's data inline,
    plotly.js from the page or the server extension, the controls the figure has. With
    ``image``, its PNG (``still.png``) holds the figure's place, and stays where no script runs or plotly.js
    cannot be loaded."""
    s = expanded(s)
    div = f"pscluster-{uuid.uuid4().hex[:12]}"
    height = s.layout.get("height", 300)
    fig = figure_json(s)  # arrays as lists: the controls compute with them

    def js(value) -> str:
        return json.dumps(value).replace("</", "<\\/")  # no '</script>' inside the script

    still_img = ""
    if image:
        title = (s.layout.get("title") or {}).get("text") or "pscluster figure"
        still_img = (f"<img class='pscluster-still' alt='{html.escape(title, quote=True)}' style='max-width: 100%' "
                     f"src='data:image/png;base64,{base64.b64encode(still.png(s)).decode()}'>")
    note = "div.appendChild(Object.assign(document.createElement('div'), { textContent: e.message }))"
    return (f"<div><div id='{div}' class='pscluster-figure' style='min-height: {height}px'>{still_img}</div>"
            f"<script type='text/javascript'>{_LOADER}\n{_CONTROLS}\n"
            f"(div => {STATIC_CALL}{js(fig)}, {js(CONFIG)})"
            f".catch(e => {{ {note}; }}))(document.getElementById({js(div)}));</script></div>")
