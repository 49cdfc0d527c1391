"""A figure's image (``widgets.still``): what a page that runs no script shows of a static figure."""

import base64
import io
import re

import numpy as np
from PIL import Image

from pscluster.widgets import figure_specs, live, still
from pscluster.widgets.figure_specs import color, spec


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def mask(image: np.ndarray, hex_color: str, tolerance: int = 12) -> np.ndarray:
    """Which of ``image``'s pixels are within ``tolerance`` of ``hex_color`` in every channel."""
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    return np.abs(image.astype(int) - rgb).max(axis=-1) <= tolerance


def share_of(image: np.ndarray, hex_color: str, tolerance: int = 12) -> float:
    """The share of ``image``'s pixels within ``tolerance`` of ``hex_color``."""
    return float(mask(image, hex_color, tolerance).mean())


def test_an_image_is_as_wide_as_asked_and_as_high_as_the_layout_says():
    s = spec("loss", [dict(type="scatter", mode="lines", x=np.arange(10.0), y=np.arange(10.0), name="worker 0")],
             height=420)
    image = pixels(still.png(s, width_px=640))
    assert image.shape == (420, 640, 3)


def test_lines_and_markers_are_drawn_in_their_colours():
    x = np.arange(50.0)
    s = spec("loss", [dict(type="scatter", mode="lines", x=x, y=np.sin(x / 5), name="worker 0",
                           line=dict(color=color(0), width=3)),
                      dict(type="scatter", mode="markers", x=x[::10], y=np.cos(x[::10] / 5), name="test set",
                           marker=dict(color="#000000", symbol="diamond", size=10))])
    image = pixels(still.png(s))
    assert share_of(image, color(0)) > 0.002  # the line
    assert share_of(image, "#000000", tolerance=40) > 0.001  # the markers (and the text: both dark)
    blank = pixels(still.png(spec("loss", [dict(type="scatter", mode="lines", x=x, y=x * np.nan)])))
    assert share_of(blank, color(0)) == 0  # a trace without a number draws nothing


def test_grouped_bars_stand_side_by_side_and_stacked_bars_on_each_other():
    def bars(barmode):
        return spec("bytes", [dict(type="bar", x=["ps:0"], y=[4.0], name="a", marker_color="#ff0000"),
                              dict(type="bar", x=["ps:0"], y=[4.0], name="b", marker_color="#0000ff")],
                    barmode=barmode, showlegend=False)

    def columns(image, hex_color):
        return set(np.nonzero(mask(image, hex_color).any(axis=0))[0].tolist())

    def rows(image, hex_color):
        return np.nonzero(mask(image, hex_color).any(axis=1))[0]

    grouped, stacked = pixels(still.png(bars("group"))), pixels(still.png(bars("stack")))
    assert columns(grouped, "#ff0000") and not columns(grouped, "#ff0000") & columns(grouped, "#0000ff")  # beside
    assert columns(stacked, "#ff0000") == columns(stacked, "#0000ff")  # in the same columns...
    assert rows(stacked, "#0000ff").max() < rows(stacked, "#ff0000").min()  # ...b on top of a


def test_stacked_plots_take_their_domains_and_an_empty_figure_says_so():
    x = np.arange(20.0)
    s = spec("stack", [dict(type="scatter", mode="lines", x=x, y=x, yaxis="y", line=dict(color="#ff0000")),
                       dict(type="scatter", mode="lines", x=x, y=-x, yaxis="y2", line=dict(color="#0000ff"))],
             height=400, xaxis=dict(anchor="y2"), yaxis=dict(domain=[0.55, 1]), yaxis2=dict(domain=[0, 0.45]))
    image = pixels(still.png(s))
    red_rows = np.nonzero(mask(image, "#ff0000").any(axis=1))[0]
    blue_rows = np.nonzero(mask(image, "#0000ff").any(axis=1))[0]
    assert red_rows.max() < blue_rows.min()  # y on top, y2 under it
    empty = pixels(still.png(figure_specs.no_data("placement")))
    assert share_of(empty, "#808080", tolerance=30) > 0  # "no data yet", in grey


def test_static_html_carries_the_image_in_the_figures_place():
    s = spec("loss", [dict(type="scatter", mode="lines", x=np.arange(5.0), y=np.arange(5.0))])
    html = live.static_html(s)
    found = re.search(r"<div id='[^']+' class='pscluster-figure'[^>]*><img class='pscluster-still' alt='loss' "
                      r"style='max-width: 100%' src='data:image/png;base64,([^']+)'></div>", html)
    assert found, html[:300]
    assert pixels(base64.b64decode(found.group(1))).shape[1] == still.WIDTH_PX
    assert "pscluster-still" not in live.static_html(s, image=False)
