"""The live figure's view (``pscluster/widgets/live.js``) in Debian's chromium, fed the messages the kernel sends
faster than it can draw them: what a browser on a loaded machine gets during a fast run."""

import json
from pathlib import Path

import plotly
import pytest

from pscluster.widgets.live import LiveFigure

pytestmark = pytest.mark.browser

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
PATCHES = 300

# Renders the view with a stand-in for the widget model (anywidget's on / off / send), counts plotly's draws,
# then delivers the whole figure and PATCHES patches of one point each in a single task: as many messages as
# reach a page that was busy for a while.
FEED = """async ({ source, patches }) => {
    const url = URL.createObjectURL(new Blob([source], { type: 'text/javascript' }));
    const view = (await import(url)).default;
    const handlers = {};
    const model = { on: (name, f) => { handlers[name] = f; }, off: () => {}, send: () => {} };
    const el = document.createElement('div');
    document.body.appendChild(el);
    window.draws = 0;
    const react = Plotly.react;
    Plotly.react = (...args) => { window.draws += 1; return react(...args); };
    view.render({ model, el });
    handlers['msg:custom']({ type: 'figure', figure: { data: [{ type: 'scatter', x: [0], y: [0] }], layout: {} } });
    for (let i = 1; i <= patches; i++) {
        handlers['msg:custom']({ type: 'patch', traces: { 0: { x: { keep: i, append: [i] }, y: { keep: i, append: [i] } } } });
    }
}"""
SETTLED = """() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(() => setTimeout(() => {
    const div = document.querySelector('.pscluster-figure');
    done({ draws: window.draws, points: div.data ? div.data[0].x.length : 0 });
}, 200))))"""


def test_messages_faster_than_the_page_draws_are_drawn_once_each_frame_newest_first(browser):
    context = browser.new_context()
    page = context.new_page()
    try:
        page.set_content("<html><body></body></html>")
        page.add_script_tag(path=str(PLOTLY_JS))
        page.evaluate(FEED, {"source": LiveFigure._esm, "patches": PATCHES})
        for _ in range(50):
            settled = page.evaluate(SETTLED)
            if settled["points"] == PATCHES + 1:
                break
        # every point is drawn, in a few draws: one per frame, not one per message (which kept a slow page's
        # main thread busy for good)
        assert settled["points"] == PATCHES + 1, json.dumps(settled)
        assert settled["draws"] <= 3, f"{settled['draws']} draws for {PATCHES + 1} messages"
    finally:
        context.close()
