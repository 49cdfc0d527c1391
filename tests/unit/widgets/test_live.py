"""Live figures: what a view is sent (the whole figure once, then only what changed), and the static HTML
that outlives the kernel (plotly.js loaded once, put into an HTML report once)."""

import json

import nbformat
import numpy as np
from nbconvert import HTMLExporter

from pscluster.report import InlinePlotly
from pscluster.widgets import figure_specs, live, panels


def series(n: int, *, title: str = "loss") -> figure_specs.Spec:
    x = np.arange(n, dtype=float)
    return figure_specs.spec(title, [dict(type="scatter", mode="lines", x=x, y=1 / (1 + x), name="worker 0",
                                   line_color="red")], xaxis=dict(title_text="global step"))


def sent(monkeypatch, figure: live.LiveFigure) -> list[dict]:
    messages = []
    monkeypatch.setattr(figure, "send", messages.append)
    return messages


def test_a_view_that_says_ready_gets_the_whole_figure_as_plotly_js_takes_it(monkeypatch):
    figure = live.LiveFigure(series(3))
    messages = sent(monkeypatch, figure)
    figure._from_view(figure, {"type": "ready"}, [])
    (message,) = messages
    assert message["type"] == "figure"
    trace = message["figure"]["data"][0]
    assert trace["x"] == [0.0, 1.0, 2.0] and trace["line"] == {"color": "red"}  # no magic underscores
    layout = message["figure"]["layout"]
    assert layout["xaxis"]["title"]["text"] == "global step"
    assert isinstance(layout["template"], dict)  # plotly.js knows no template names
    json.dumps(message, allow_nan=False)  # valid JSON: no NaN


def test_a_growing_series_is_sent_its_new_points_only(monkeypatch):
    figure = live.LiveFigure(series(100))
    messages = sent(monkeypatch, figure)
    figure.show(series(103))
    (message,) = messages
    assert message["type"] == "patch" and set(message) == {"type", "traces"}
    x = message["traces"]["0"]["x"]
    assert x == {"keep": 100, "append": [100.0, 101.0, 102.0]}
    figure.show(series(103))  # nothing changed: nothing sent
    assert len(messages) == 1
    figure.show(series(103, title="loss (smoothed)"))  # a new title: the layout key alone
    assert set(messages[-1]) == {"type", "layout"} and messages[-1]["layout"]["title"]["text"] == "loss (smoothed)"
    assert figure.messages == 2 and figure.bytes_sent > 0


def test_a_thinned_series_keeps_its_common_prefix_and_nan_is_null(monkeypatch):
    figure = live.LiveFigure(series(10))
    messages = sent(monkeypatch, figure)
    thinned = series(10)
    thinned.traces[0]["y"] = np.concatenate([thinned.traces[0]["y"][:4], [np.nan, 7.0]])
    thinned.traces[0]["x"] = thinned.traces[0]["x"][:6]
    figure.show(thinned)
    y = messages[0]["traces"]["0"]["y"]
    assert y == {"keep": 4, "append": [None, 7.0]}
    assert messages[0]["traces"]["0"]["x"] == {"keep": 6, "append": []}


def test_new_traces_send_the_whole_figure(monkeypatch):
    figure = live.LiveFigure(figure_specs.no_data("loss"))
    messages = sent(monkeypatch, figure)
    figure.show(series(5))
    assert [m["type"] for m in messages] == ["figure"]


def test_the_dashboards_figures_patch_to_what_they_show(monkeypatch):
    """Applying each patch the way the view does gives the figure sent whole: fed in chunks that thin the
    series, the convergence panel's figure stays the same in the view as in the kernel."""
    panel, rng = panels.Convergence(), np.random.default_rng(0)
    figure = live.LiveFigure(panel.spec())
    messages = sent(monkeypatch, figure)
    step, view = 0, None
    for chunk in (50, 300, 700, 20):
        steps = np.arange(step + 1, step + chunk + 1, dtype=float)
        step += chunk
        rows = {"worker": np.zeros(chunk), "time": steps / 100, "local_step": steps, "global_step": steps,
                "loss": rng.random(chunk), "accuracy": rng.random(chunk)}
        for name in ("compute_s", "wait_s", "comm_s", "bytes_sent", "bytes_received", "staleness", "dropped"):
            rows[name] = np.zeros(chunk)
        panel.feed({"metrics": rows})
        figure.show(panel.spec())
        message = messages[-1]
        if message["type"] == "figure":
            view = message["figure"]
        else:
            for index, props in message.get("traces", {}).items():
                trace = view["data"][int(index)]
                for key, value in props.items():
                    trace[key] = trace[key][:value["keep"]] + value["append"] if isinstance(value, dict) and \
                        "keep" in value else value
            view["layout"].update(message.get("layout", {}))
        assert view == live.figure_json(figure.spec)
    assert [m["type"] for m in messages].count("patch") >= 2


def test_static_html_draws_with_plotly_loaded_once_and_a_report_carries_it_once():
    html = live.static_html(series(4))
    assert live.STATIC_CALL in html and "plotly.js v" not in html and "</script>" in html
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output(
        "display_data", data={"text/html": html + live.static_html(series(5))}) for _ in range(2)])])
    report, _ = HTMLExporter(preprocessors=[InlinePlotly]).from_notebook_node(nb)
    assert report.count("* plotly.js v") == 1 and report.count(live.STATIC_CALL) == 4
    assert report.index("* plotly.js v") < report.index(live.STATIC_CALL)
    assert "plotly.js v" not in json.dumps(nb)  # the notebook itself is left as it was


def test_the_convergence_figure_gives_the_view_its_controls():
    """Smoothed traces name their raw trace, every worker point carries its time, and the layout the
    smoothing weight of the kernel's own moving average (the slider's start) and the run's first time."""
    panel = panels.Convergence()
    steps = np.arange(1, 41, dtype=float)
    rows = {"worker": np.repeat([0.0, 1.0], 20), "time": 100 + steps / 10, "local_step": steps,
            "global_step": steps, "loss": 1 / steps, "accuracy": np.full(40, np.nan)}
    for name in ("compute_s", "wait_s", "comm_s", "bytes_sent", "bytes_received", "staleness", "dropped"):
        rows[name] = np.zeros(40)
    panel.feed({"metrics": rows})
    s = figure_specs.expanded(panel.spec())
    controls = s.layout["meta"]["controls"]
    assert controls == {"smoothing": round(1 - 2 / (panels.SMOOTH_SPAN + 1), 4), "start": 100.1}
    smoothed = [t for t in s.traces if t["name"].endswith("(smoothed)")]
    assert len(smoothed) == 2
    for trace in smoothed:
        raw = s.traces[trace["meta"]["smooths"]]
        assert raw["name"] + " (smoothed)" == trace["name"]
        np.testing.assert_array_equal(raw["customdata"], trace["customdata"])
    np.testing.assert_allclose(s.traces[0]["customdata"], 100 + steps[:20] / 10)
