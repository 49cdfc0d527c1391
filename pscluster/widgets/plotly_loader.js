// Loads plotly.js once per page: the page's own (a report carries it), else the copy the pscluster server
// extension serves at <base url>pscluster/static/plotly.min.js. Prepended to the live figure's module and
// to each static figure's script.

function baseUrl() {
  try {
    return JSON.parse(document.getElementById('jupyter-config-data').textContent).baseUrl || '/';
  } catch {
    return '/';
  }
}

function loadPlotly() {
  if (window.Plotly) {
    return Promise.resolve(window.Plotly);
  }
  if (!window.psclusterPlotly) {
    window.psclusterPlotly = new Promise((resolve, reject) => {
      const script = document.createElement('script');
      script.src = new URL(baseUrl() + 'pscluster/static/plotly.min.js', window.location.href).href;
      script.onload = () => resolve(window.Plotly);
      script.onerror = () => {
        window.psclusterPlotly = null;
        reject(new Error(`cannot load plotly.js from ${script.src}: install pscluster where the Jupyter server runs`));
      };
      document.head.appendChild(script);
    });
  }
  return window.psclusterPlotly;
}
