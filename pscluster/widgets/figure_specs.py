"""Figure specs: a figure as plain data (trace dicts, a layout dict) in the dashboard's style.

The dashboard builds specs several times a second while a run trains and sends a widget only what
differs from the spec it showed last; reports and tests turn a spec into a plotly figure (``figure``).
Specs hold numpy arrays and plain Python values only, never pandas objects or numpy scalars: they go
into widget messages as they are.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

HEIGHT = 300
TEMPLATE = "plotly_white"
COLORS = qualitative.Plotly
MAX_POINTS = 500  # per trace: bounds widget messages and static HTML on long runs

Rows = Mapping[str, np.ndarray]  # columns of equal length, by name: new rows of a run-store table


class Spec(NamedTuple):
    """A figure as plain data: ``traces`` (dicts, as for ``go.Figure(data=...)``) and ``layout``."""

    traces: list[dict]
    layout: dict


def spec(title: str, traces: list[dict], *, height: int = HEIGHT, **layout) -> Spec:
    """A spec in the dashboard's style: compact, ``plotly_white``, a small title at the top left.

    The template goes by name: validation (a FigureWidget, static HTML) resolves it, and a template
    object would be deep-copied into every figure."""
    return Spec(traces, dict(template=TEMPLATE, height=height, title=dict(text=title, x=0.01, font=dict(size=14)),
                             margin=dict(l=55, r=20, t=45, b=40), legend=dict(font=dict(size=10)), **layout))


def no_data(title: str) -> Spec:
    """The spec shown before a run has produced what ``title`` plots."""
    return spec(title, [], xaxis=dict(visible=False), yaxis=dict(visible=False),
                annotations=[dict(text="no data yet", x=0.5, y=0.5, xref="paper", yref="paper",
                                  showarrow=False, font=dict(size=14, color="gray"))])


def _nested(props: dict) -> dict:
    """``props`` with plotly's magic underscores spelled out, at every depth: ``title_text`` becomes
    ``{"title": {"text": ...}}`` (plotly.js attribute names have no underscores)."""
    out: dict = {}
    for key, value in props.items():
        head, _, rest = key.partition("_")
        if rest and head:
            value, key = _nested({rest: value}), head
        elif isinstance(value, dict):
            value = _nested(value)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            value = [_nested(v) for v in value]
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _merged(a: dict, b: dict) -> dict:
    """``a`` updated with ``b``, dicts merged at every depth."""
    return {**a, **{k: _merged(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                    for k, v in b.items()}}


def expanded(s: Spec) -> Spec:
    """Spec ``s`` as plotly.js takes it: magic underscores spelled out (``_nested``)."""
    return Spec([_nested(t) for t in s.traces], _nested(s.layout))


def figure(s: Spec) -> go.Figure:
    """The plotly figure of spec ``s``, built without plotly's validation (which costs 5-10x the rest;
    the tests build every figure again with validation on)."""
    s = expanded(s)
    return go.Figure(data=s.traces, layout=s.layout, _validate=False)


def of_figure(fig: go.Figure) -> Spec:
    """The spec of a plotly figure (``pscluster.compare`` and ``Cluster.plan`` build figures)."""
    return Spec([t.to_plotly_json() for t in fig.data], fig.layout.to_plotly_json())


def columns(split: float = 0.5, *, left: dict, right: dict) -> dict:
    """Layout of two side-by-side plots; traces of the right one use ``xaxis="x2", yaxis="y2"``.
    ``left`` and ``right`` are y axis properties, with the x axis's under the key ``"x"``."""
    return dict(xaxis=dict(domain=[0, split - 0.05], **left.pop("x", {})), yaxis=left,
                xaxis2=dict(domain=[split + 0.05, 1], anchor="y2", **right.pop("x", {})),
                yaxis2=dict(anchor="x2", **right))


def color(i: int) -> str:
    return COLORS[int(i) % len(COLORS)]


def rows(frame: pd.DataFrame | None) -> dict[str, np.ndarray]:
    """The columns of ``frame`` (a run-store answer) as numpy arrays; an empty mapping for None."""
    return {} if frame is None else {c: frame[c].to_numpy() for c in frame.columns}


def size(r: Rows) -> int:
    """The number of rows in ``r``."""
    return len(next(iter(r.values()))) if r else 0
