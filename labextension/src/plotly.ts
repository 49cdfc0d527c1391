/**
 * plotly.js and the notebook's drawing of its figures, each loaded once per page with a <script> tag from the
 * pscluster server extension: plotly.js from <base url>pscluster/static/plotly.min.js (the notebook's live
 * figures load the same one, through the same `window.psclusterPlotly` promise), then figures.js, the notebook's
 * own code that draws a figure with its controls (pscluster/widgets/controls.js). The extension's bundle carries
 * neither, and no drawing of a chart of its own.
 */
import { PageConfig, URLExt } from '@jupyterlab/coreutils';

/** The part of plotly.js used here. */
export interface PlotlyStatic {
  purge(div: HTMLElement): void;
}

/** Shows a figure (`{data, layout}`) in the node it was made for, and again each newer version of it. */
export type FigureView = (figure: object) => Promise<unknown>;

/** What figures.js gives: a figure view of a node, and the notebook's plotly config. */
export interface Figures {
  figureView(node: HTMLElement, config: object): FigureView;
  config: object;
}

type PlotlyWindow = Window & {
  Plotly?: PlotlyStatic;
  psclusterPlotly?: Promise<PlotlyStatic> | null;
  psclusterFigures?: Figures;
  psclusterFiguresScript?: Promise<Figures> | null;
  define?: unknown;
};

/** Loads `<base url>pscluster/static/<name>` once, then resolves with `value()`; rejects with what to do. */
function loadScript<T>(name: string, value: () => T, forget: () => void): Promise<T> {
  const w = window as PlotlyWindow;
  return new Promise((resolve, reject) => {
    const script = document.createElement('script');
    script.src = URLExt.join(PageConfig.getBaseUrl(), 'pscluster', 'static', name);
    // with an AMD loader on the page, plotly.js would register as a module instead of setting window.Plotly
    const define = w.define;
    w.define = undefined;
    script.onload = () => {
      w.define = define;
      resolve(value());
    };
    script.onerror = () => {
      w.define = define;
      forget();
      reject(new Error(`cannot load ${script.src}: install pscluster where the Jupyter server runs`));
    };
    document.head.appendChild(script);
  });
}

/** plotly.js, loaded on the first call. */
export function loadPlotly(): Promise<PlotlyStatic> {
  const w = window as PlotlyWindow;
  if (w.Plotly) {
    return Promise.resolve(w.Plotly);
  }
  if (!w.psclusterPlotly) {
    w.psclusterPlotly = loadScript('plotly.min.js', () => w.Plotly!, () => (w.psclusterPlotly = null));
  }
  return w.psclusterPlotly;
}

/** plotly.js, then figures.js, loaded on the first call. */
export function loadFigures(): Promise<Figures> {
  const w = window as PlotlyWindow;
  if (!w.psclusterFiguresScript) {
    w.psclusterFiguresScript = loadPlotly()
      .then(() => loadScript('figures.js', () => w.psclusterFigures!, () => undefined))
      .catch(error => {
        w.psclusterFiguresScript = null; // the next call tries again
        throw error;
      });
  }
  return w.psclusterFiguresScript;
}
