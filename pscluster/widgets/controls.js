// The viewer's controls of a figure with `layout.meta.controls` (the convergence figure): smoothing, a log loss
// axis, x as the global step or time. Shared by the live figure's view (live.js), the static figure a finished
// run leaves in the notebook and the HTML report (`drawStatic`), so they outlive the kernel, and the JupyterLab
// side panel (`figureView`, served with plotly_loader.js as pscluster/static/figures.js): the one implementation
// of the smoothing a viewer chooses. plotly_loader.js comes first.

// TensorBoard's smoothing: an exponential moving average with weight `w`, debiased at the start. A constant
// series stays as it is (the debiasing's rounding would make it wobble).
function smoothed(values, w) {
  const finite = values.filter(v => v !== null && Number.isFinite(v));
  if (finite.every(v => v === finite[0])) {
    return values;
  }
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

// A figure drawn into `node` with its controls above it when it has some: `show(figure)` draws it, and draws it
// again when given a newer version of it (the side panel's figures of a training run), keeping what the viewer
// chose (smoothing, log scale, x axis, zoom). The static figure's script and the side panel draw with it.
function figureView(node, config) {
  let figure = null;
  let choice = null;
  const draw = () =>
    loadPlotly().then(Plotly => {
      const { data, layout } = viewed(figure, choice);
      const revision = choice ? `${choice.x}/${choice.log}` : 'pscluster';
      return Plotly.react(node, data, { uirevision: revision, ...layout }, config);
    });
  return next => {
    figure = next;
    const controls = (figure.layout.meta || {}).controls;
    if (controls && !choice) {
      choice = { smoothing: controls.smoothing, log: false, x: 'step' };
      node.parentNode.insertBefore(toolbar(controls, choice, draw), node);
    }
    node.style.height = `${figure.layout.height || 300}px`;
    return draw();
  };
}

// Draws `figure` into `node` once, with its controls: the static figure's script. What `node` held before (the
// figure's image, for pages that run no script) goes once plotly.js has loaded.
function drawStatic(node, figure, config) {
  return loadPlotly().then(() => {
    node.replaceChildren();
    return figureView(node, config)(figure);
  });
}
