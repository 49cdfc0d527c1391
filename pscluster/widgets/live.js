// A pscluster figure in the notebook: the view of pscluster.widgets.live.LiveFigure (plotly_loader.js comes
// first). plotly.js is not part of the widget, so a figure's widget state is a few kilobytes. The kernel
// sends the whole figure when a view says it is ready ("figure") and then only what changed ("patch": per
// trace, arrays as the length of their kept prefix and the points after it; layout keys replaced whole).

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
  let drawing = Promise.resolve();
  const draw = () => {
    const data = figure.data;
    const layout = { uirevision: 'pscluster', ...figure.layout };
    drawing = drawing
      .then(loadPlotly)
      .then(Plotly => Plotly.react(div, data, layout, { displaylogo: false, responsive: true }))
      .catch(error => {
        div.textContent = String(error.message || error);
      });
  };
  const onMessage = message => {
    if (message.type === 'figure') {
      figure = message.figure;
      draw();
    } else if (message.type === 'patch' && figure) {
      applyPatch(figure, message);
      draw();
    }
  };
  model.on('msg:custom', onMessage);
  model.send({ type: 'ready' });
  return () => model.off('msg:custom', onMessage);
}

export default { render };
