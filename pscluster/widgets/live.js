// A pscluster figure in the notebook: the view of pscluster.widgets.live.LiveFigure (plotly_loader.js comes
// first). plotly.js is not part of the widget, so a figure's widget state is a few kilobytes. The kernel
// sends the whole figure when a view says it is ready ("figure") and then only what changed ("patch": per
// trace, arrays as the length of their kept prefix and the points after it; layout keys replaced whole).

const ASK_AGAIN_MS = 2000;
const REDRAW_MS = 1000; // the kernel's updates are drawn at most this often; the viewer's own changes at once

function applyPatch(figure, patch) {
  for (const [index, props] of Object.entries(patch.traces || {})) {
    const trace = figure.data[Number(index)];
    for (const [key, value] of Object.entries(props)) {
      const tail = value !== null && typeof value === 'object' && 'keep' in value;
      trace[key] = tail ? (trace[key] || []).slice(0, value.keep).concat(value.append) : value;
    }
  }
  Object.assign(figure.layout, patch.layout || {});
}

function render({ model, el }) {
  const div = document.createElement('div');
  div.className = 'pscluster-figure';
  el.appendChild(div);
  let figure = null;
  let choice = null; // the viewer's smoothing, log scale and x axis, once the figure has controls
  // Draws are coalesced: the messages that come before the next draw are drawn once, at most one draw waits
  // behind the one in flight, and the kernel's updates are drawn at most every REDRAW_MS. (A draw per message fell
  // behind for good on a page slower than the kernel's refreshes, a browser on a loaded machine: its main thread
  // never idle, the page unanswering.) What the viewer does (a control, scrolling the figure into view) is drawn at
  // once. A figure out of view (scrolled away, in a hidden tab) is drawn when it comes into view, not before: once
  // drawn, it costs the page nothing while no one can see it.
  let scheduled = false;
  let hurry = false; // the viewer waits for the draw scheduled
  let wake = null; // ends the pause before the draw scheduled
  let drawnAt = -Infinity;
  let drawing = Promise.resolve();
  let visible = true;
  let waiting = false; // a draw put off while out of view
  const pause = () =>
    new Promise(resolve => {
      wake = resolve;
      setTimeout(resolve, hurry ? 0 : drawnAt + REDRAW_MS - performance.now());
    });
  const drawNow = () => {
    scheduled = false;
    hurry = false;
    if (!visible && div.data) {
      waiting = true;
      return Promise.resolve();
    }
    drawnAt = performance.now();
    const { data, layout } = viewed(figure, choice);
    const revision = choice ? `${choice.x}/${choice.log}` : 'pscluster';
    return loadPlotly()
      .then(Plotly => Plotly.react(div, data, { uirevision: revision, ...layout }, { displaylogo: false, responsive: true }))
      .catch(error => {
        div.textContent = String(error.message || error);
      });
  };
  const draw = (now = false) => {
    if (now) {
      hurry = true;
      wake?.();
    }
    if (!scheduled) {
      scheduled = true;
      drawing = drawing.then(pause).then(() => new Promise(requestAnimationFrame)).then(drawNow);
    }
  };
  const onMessage = message => {
    if (message.type === 'figure') {
      figure = message.figure;
    } else if (message.type === 'patch' && figure) {
      applyPatch(figure, message);
    } else {
      return;
    }
    const controls = (figure.layout.meta || {}).controls;
    if (controls && !choice) {
      choice = { smoothing: controls.smoothing, log: false, x: 'step' };
      el.insertBefore(toolbar(controls, choice, () => draw(true)), div);
    }
    draw();
  };
  // A view without its figure asks again every ASK_AGAIN_MS: a message lost on the way (a page reloaded
  // while the kernel is busy) must not leave a figure blank that the kernel only ever patches afterwards.
  const ask = () => {
    if (!figure) {
      model.send({ type: 'ready' });
    }
  };
  const asking = setInterval(ask, ASK_AGAIN_MS);
  const seen = new IntersectionObserver(entries => {
    visible = entries[entries.length - 1].isIntersecting;
    if (visible && waiting) {
      waiting = false;
      draw(true);
    }
  });
  seen.observe(div);
  model.on('msg:custom', onMessage);
  ask();
  return () => {
    seen.disconnect();
    clearInterval(asking);
    model.off('msg:custom', onMessage);
  };
}

export default { render };
