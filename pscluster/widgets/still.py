"""A figure spec as a PNG image: what a figure shows where no script runs.

An untrusted notebook in JupyterLab, a notebook viewer and a repository's page drop the script that draws a
static figure with plotly.js; the image beside it (``live.static_html``) still shows the figure. It is drawn by
matplotlib, with no browser: plotly's own export (kaleido) needs a Chrome on the machine that runs the kernel
and, without one, a download, which neither an engine host nor an offline CI runner has.

The image follows the spec's layout: its plots where their axes' domains put them (side by side, stacked),
scatter lines and markers, grouped and stacked bars, a heatmap, vertical marks (layout shapes on ``x``), axis
titles, log and from-zero axes, a title and a legend. Hover text, zoom and the interactive controls are the
live and the scripted figures' own.
"""

from __future__ import annotations

import io
import math
import textwrap

import numpy as np

from .figure_specs import COLORS, HEIGHT, Spec, expanded

WIDTH_PX = 900  # about a notebook's output width; the image scales down in a narrower one
DPI = 100
FONT_PX = 10
MAX_LEGEND = 12  # entries: beyond this many, the legend would cover the plots
MARKERS = {"diamond": "D", "circle": "o", "square": "s", "x": "x", "cross": "+"}


def png(s: Spec, *, width_px: int = WIDTH_PX) -> bytes:
    """Spec ``s`` drawn as a PNG ``width_px`` wide and as high as its layout says."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s = expanded(s)
    layout = s.layout
    height_px = int(layout.get("height") or HEIGHT)
    fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    with _font():
        axes = _Axes(fig, layout, width_px, height_px, s.traces)
        for i, trace in enumerate(s.traces):
            _draw_trace(axes, trace, i)
        axes.finish()
        _title(fig, layout, height_px)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _font():
    import matplotlib

    return matplotlib.rc_context({"font.size": FONT_PX * 72 / DPI, "axes.titlesize": FONT_PX * 72 / DPI,
                                  "axes.edgecolor": "#cccccc", "xtick.color": "#444444", "ytick.color": "#444444",
                                  "axes.grid": True, "grid.color": "#eeeeee", "axes.axisbelow": True})


def _title(fig, layout: dict, height_px: int) -> None:
    text = (layout.get("title") or {}).get("text")
    if text:
        fig.text(0.01, 1 - 8 / height_px, textwrap.shorten(_plain(text), 150), va="top", ha="left",
                 fontsize=13 * 72 / DPI)


def _plain(text: str) -> str:
    """Plotly's rich text as plain text (the specs use ``<br>`` at most)."""
    return str(text).replace("<br>", " ")


class _Axes:
    """The matplotlib axes of a layout, made on first use: one per pair of plotly axes (``x``/``y``,
    ``x2``/``y2``, ...), placed in the plot area (the figure less the layout's margins) by their domains."""

    def __init__(self, fig, layout: dict, width_px: int, height_px: int, traces: list[dict]):
        self.fig, self.layout = fig, layout
        self._bar_counts: dict[tuple[str, str], int] = {}
        for trace in traces:
            if trace.get("type") == "bar":
                self._bar_counts[self._key(trace)] = self._bar_counts.get(self._key(trace), 0) + 1
        self._bars: dict[tuple[str, str], _Bars] = {}
        margin = {"l": 55, "r": 20, "t": 45, "b": 40, **(layout.get("margin") or {})}
        self.left, self.bottom = margin["l"] / width_px, margin["b"] / height_px
        self.width = 1 - (margin["l"] + margin["r"]) / width_px
        self.height = 1 - (margin["t"] + margin["b"]) / height_px
        self.made: dict[tuple[str, str], object] = {}

    def axis(self, name: str) -> dict:
        """The layout of plotly axis ``name`` (``x``, ``y2``...)."""
        return self.layout.get(f"{name[0]}axis{name[1:]}") or {}

    @staticmethod
    def _key(trace: dict) -> tuple[str, str]:
        return trace.get("xaxis") or "x", trace.get("yaxis") or "y"

    def of(self, trace: dict):
        """The matplotlib axes ``trace`` is drawn in."""
        key = self._key(trace)
        if key not in self.made:
            x0, x1 = self.axis(key[0]).get("domain") or (0, 1)
            y0, y1 = self.axis(key[1]).get("domain") or (0, 1)
            shared = next((ax for (x, _), ax in self.made.items() if x == key[0]), None)
            self.made[key] = self.fig.add_axes((self.left + x0 * self.width, self.bottom + y0 * self.height,
                                                (x1 - x0) * self.width, (y1 - y0) * self.height), sharex=shared)
        return self.made[key]

    def bars_of(self, trace: dict) -> _Bars:
        """The bars of the plot of bar trace ``trace``."""
        key = self._key(trace)
        if key not in self._bars:
            self._bars[key] = _Bars(self.of(trace), self.layout.get("barmode") or "group", self._bar_counts[key],
                                    self.axis(key[0]).get("categoryarray"))
        return self._bars[key]

    def finish(self) -> None:
        """Axis titles and scales, the marks, the legend; the "no data yet" note of an empty figure."""
        if not self.made:
            self._empty()
            return
        for (x, y), ax in self.made.items():
            xaxis, yaxis = self.axis(x), self.axis(y)
            anchor = xaxis.get("anchor")
            lowest = anchor == y if anchor and anchor != "free" else ax is self._lowest(x)
            ax.tick_params(axis="x", labelbottom=lowest)
            if lowest:
                ax.set_xlabel(_text(xaxis))
            ax.set_ylabel(_text(yaxis))
            _scale(ax, yaxis, "y")
            _scale(ax, xaxis, "x")
            for shape in self.layout.get("shapes") or []:
                if shape.get("type") == "line" and (shape.get("xref") or "x") == x and shape.get("x0") is not None:
                    line = shape.get("line") or {}
                    ax.axvline(float(shape["x0"]), color=line.get("color", "#888888"), lw=line.get("width", 1),
                               ls="--" if line.get("dash") in ("dash", "dot", "dashdot") else "-", zorder=0)
        self._legend()

    def _lowest(self, x: str):
        return min((ax for (xa, _), ax in self.made.items() if xa == x), key=lambda ax: ax.get_position().y0)

    def _legend(self) -> None:
        if self.layout.get("showlegend") is False:
            return
        handles, names = [], []
        for ax in self.made.values():
            for handle, name in zip(*ax.get_legend_handles_labels()):
                if name not in names:
                    handles.append(handle)
                    names.append(name)
        if 0 < len(names) <= MAX_LEGEND:
            first = next(iter(self.made.values()))
            first.legend(handles, names, loc="upper right", fontsize=9 * 72 / DPI, framealpha=0.8)

    def _empty(self) -> None:
        for note in self.layout.get("annotations") or []:
            self.fig.text(note.get("x", 0.5), note.get("y", 0.5), _plain(note.get("text", "")), ha="center",
                          va="center", color="gray", fontsize=14 * 72 / DPI)


def _text(axis: dict) -> str:
    title = axis.get("title")
    return _plain(title.get("text", "") if isinstance(title, dict) else title or "")


def _scale(ax, axis: dict, which: str) -> None:
    """Axis ``which`` of ``ax`` as the plotly ``axis`` says: log or from zero, reversed, its tick step and suffix
    (bytes in engineering units: 120kB, as plotly writes them), or hidden."""
    from matplotlib import ticker

    target = getattr(ax, f"{which}axis")
    if axis.get("type") == "log":
        getattr(ax, f"set_{which}scale")("log")
    elif axis.get("rangemode") == "tozero":
        ax.relim()
        ax.autoscale_view()
        low, high = getattr(ax, f"get_{which}lim")()
        getattr(ax, f"set_{which}lim")(min(low, 0), max(high, 0))
    if axis.get("autorange") == "reversed":
        getattr(ax, f"invert_{which}axis")()
    if axis.get("dtick"):
        target.set_major_locator(ticker.MultipleLocator(float(axis["dtick"])))
    suffix = axis.get("ticksuffix")
    if suffix == "B":
        target.set_major_formatter(ticker.EngFormatter(unit="B", sep=""))
    elif suffix:
        target.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}{suffix}"))
    if axis.get("visible") is False:
        ax.set_axis_off()


def _values(trace: dict, key: str):
    value = trace.get(key)
    return [] if value is None else value


def _floats(values) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in np.asarray(values, dtype=object).tolist()], dtype=float)


def _color(trace: dict, i: int) -> str:
    for part in ("line", "marker"):
        value = (trace.get(part) or {}).get("color")
        if isinstance(value, str):
            return value
    return COLORS[i % len(COLORS)]


def _label(trace: dict) -> str | None:
    """The trace's legend entry, or None (matplotlib leaves out names starting with an underscore)."""
    name = trace.get("name")
    return "_" if not name or trace.get("showlegend") is False else _plain(name)


def _draw_trace(axes: _Axes, trace: dict, i: int) -> None:
    kind = trace.get("type", "scatter")
    if kind == "scatter":
        _scatter(axes.of(trace), trace, i)
    elif kind == "bar":
        axes.bars_of(trace).draw(trace, i)
    elif kind == "heatmap":
        _heatmap(axes.of(trace), trace)


def _scatter(ax, trace: dict, i: int) -> None:
    x, y = trace.get("x"), trace.get("y")
    if x is None or y is None or not len(y):
        return
    x, y = _floats(x), _floats(y)
    mode, color = trace.get("mode", "lines"), _color(trace, i)
    alpha = trace.get("opacity", 1.0)
    if "lines" in mode:
        ax.plot(x, y, color=color, lw=(trace.get("line") or {}).get("width", 2) * 0.75, alpha=alpha,
                label=_label(trace))
    if "markers" in mode:
        marker = trace.get("marker") or {}
        ax.scatter(x, y, color=color, s=(marker.get("size", 6) * 0.75) ** 2, alpha=alpha,
                   marker=MARKERS.get(marker.get("symbol"), "o"), zorder=3,
                   label=_label(trace) if "lines" not in mode else "_")


class _Bars:
    """The bar traces of one plot: side by side in each category (barmode ``group``, of ``count`` traces) or
    stacked (``stack``); categories in the order of ``categoryarray``, else as they come."""

    def __init__(self, ax, mode: str, count: int, categories: list | None):
        self.ax, self.mode, self.count = ax, mode, count
        self.categories = list(categories or [])
        self.drawn = 0
        self.tops: dict[float, float] = {}  # stacked: the top of the bars at each position

    def draw(self, trace: dict, i: int) -> None:
        x, y = list(_values(trace, "x")), np.nan_to_num(_floats(_values(trace, "y")))
        if not len(x):
            return
        categorical = any(isinstance(v, str) for v in x)
        positions = np.array([self._category(v) for v in x] if categorical else _floats(x))
        spacing = 1.0 if categorical or len(positions) < 2 else float(np.min(np.diff(np.unique(positions))))
        color = (trace.get("marker") or {}).get("color") or COLORS[i % len(COLORS)]
        if self.mode == "stack":
            base = np.array([self.tops.get(p, 0.0) for p in positions])
            self.ax.bar(positions, y, width=0.8 * spacing, bottom=base, color=color, label=_label(trace))
            self.tops.update(zip(positions.tolist(), (base + y).tolist()))
        else:
            width = 0.8 * spacing / max(self.count, 1)
            offset = (self.drawn - (self.count - 1) / 2) * width if self.mode == "group" else 0.0
            self.ax.bar(positions + offset, y, width=width, color=color, label=_label(trace))
        if categorical:
            self.ax.set_xticks(range(len(self.categories)), self.categories)
        self.drawn += 1

    def _category(self, value) -> int:
        if value not in self.categories:
            self.categories.append(value)
        return self.categories.index(value)


def _heatmap(ax, trace: dict) -> None:
    from matplotlib.colors import LinearSegmentedColormap

    z = np.array([_floats(row) for row in trace.get("z") or []])
    if not z.size:
        return
    stops = trace.get("colorscale") or [[0, "#eeeeee"], [1, "#ef553b"]]
    cmap = LinearSegmentedColormap.from_list("pscluster", [(float(p), c) for p, c in stops])
    x = _floats(trace["x"]) if trace.get("x") is not None else np.arange(z.shape[1], dtype=float)
    y = list(trace["y"]) if trace.get("y") is not None else list(range(z.shape[0]))
    step = float(np.min(np.diff(x))) if len(x) > 1 else 1.0
    ax.imshow(z, aspect="auto", cmap=cmap, vmin=trace.get("zmin"), vmax=trace.get("zmax"), interpolation="nearest",
              extent=(x[0] - step / 2, x[-1] + step / 2, len(y) - 0.5, -0.5))
    ax.set_yticks(range(len(y)), [str(v) for v in y])
    ax.grid(False)
