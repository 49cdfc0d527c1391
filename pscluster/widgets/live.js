// A pscluster figure in the notebook: the view of pscluster.widgets.live.LiveFigure (plotly_loader.js comes
// first). plotly.js is not part of the widget, so a figure's widget state is a few kilobytes. The kernel
// sends the whole figure when a view says it is ready ("figure") and then only what changed ("patch": per
// trace, arrays as the length of their kept prefix and the points after it; layout keys replaced whole).

const ASK_AGAIN_MS = 2000;

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

// TensorBoard's smoothing: an exponential moving average with weight `w`, debiased at the start.
function smoothed(values, w) {
  let last = 0;
  let n = 0;
  return values.map(v => {
    if (v === null || !Number.isFinite(v)) {
      return null;
    }
    last = last * w + (1 - w) * v;
    n += 1;
    return last / (1 - Math.pow(w, n));
  });
}

// What a figure with controls (`layout.meta.controls`: {smoothing, start}) shows for the viewer's choices:
// smoothed traces (`meta.smooths`: the index of their raw trace) at the chosen weight, a log loss axis, and
// x as the global step, the seconds since the run started or the wall time (traces with the time of each
// point in `customdata`; the others, and the step marks, hidden).
function viewed(figure, choice) {
  const controls = (figure.layout.meta || {}).controls;
  if (!controls) {
    return figure;
  }
  const raw = figure.data;
  let data = raw.map(trace => {
    const smooths = (trace.meta || {}).smooths;
    return smooths === undefined || choice.smoothing === controls.smoothing
      ? trace
      : { ...trace, y: smoothed(raw[smooths].y, choice.smoothing) };
  });
  const layout = { ...figure.layout, yaxis: { ...figure.layout.yaxis, type: choice.log ? 'log' : 'linear' } };
  if (choice.x !== 'step') {
    const wall = choice.x === 'wall';
    data = data.map(trace =>
      trace.customdata
        ? { ...trace, x: trace.customdata.map(t => (wall ? new Date(t * 1000).toISOString() : t - controls.start)) }
        : { ...trace, visible: false }
    );
    layout.shapes = [];
    layout.xaxis = {
      ...layout.xaxis,
      type: wall ? 'date' : 'linear',
      title: { text: wall ? 'wall time' : 'seconds since the run started' }
    };
  }
  return { data, layout };
}

function toolbar(controls, choice, changed) {
  const bar = document.createElement('div');
  bar.className = 'pscluster-controls';
  bar.style.cssText = 'display: flex; gap: 1.5em; align-items: center; font-size: 12px; margin: 4px 0 0 55px';
  bar.innerHTML =
    '<label>smoothing <input type="range" min="0" max="0.999" step="0.001"> <span></span></label>' +
    '<label><input type="checkbox"> log scale (loss)</label>' +
    '<label>x axis <select><option value="step">global step</option>' +
    '<option value="relative">relative time</option><option value="wall">wall time</option></select></label>';
  const [slider, log] = bar.querySelectorAll('input');
  const weight = bar.querySelector('span');
  const x = bar.querySelector('select');
  slider.value = String(controls.smoothing);
  weight.textContent = Number(controls.smoothing).toFixed(3);
  slider.addEventListener('input', () => {
    choice.smoothing = Number(slider.value);
    weight.textContent = choice.smoothing.toFixed(3);
    changed();
  });
  log.addEventListener('change', () => {
    choice.log = log.checked;
    changed();
  });
  x.addEventListener('change', () => {
    choice.x = x.value;
    changed();
  });
  return bar;
}

function render({ model, el }) {
  const div = document.createElement('div');
  div.className = 'pscluster-figure';
  el.appendChild(div);
  let figure = null;
  let choice = null; // the viewer's smoothing, log scale and x axis, once the figure has controls
  // Draws are coalesced: the messages that come before the next animation frame are drawn once, and at most
  // one draw waits behind the one in flight. (A draw per message fell behind for good on a page slower than
  // the kernel's refreshes, a browser on a loaded machine: its main thread never idle, the page unanswering.)
  let scheduled = false;
  let drawing = Promise.resolve();
  const drawNow = () => {
    scheduled = false;
    const { data, layout } = viewed(figure, choice);
    const revision = choice ? `${choice.x}/${choice.log}` : 'pscluster';
    return loadPlotly()
      .then(Plotly => Plotly.react(div, data, { uirevision: revision, ...layout }, { displaylogo: false, responsive: true }))
      .catch(error => {
        div.textContent = String(error.message || error);
      });
  };
  const draw = () => {
    if (!scheduled) {
      scheduled = true;
      drawing = drawing.then(() => new Promise(requestAnimationFrame)).then(drawNow);
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
      el.insertBefore(toolbar(controls, choice, draw), div);
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
  model.on('msg:custom', onMessage);
  ask();
  return () => {
    clearInterval(asking);
    model.off('msg:custom', onMessage);
  };
}

export default { render };
