/**
 * plotly.js, loaded once per page with a <script> tag from the copy the pscluster server extension serves
 * at <base url>pscluster/static/plotly.min.js (the notebook's live figures load the same one, through the
 * same `window.psclusterPlotly` promise). The extension's bundle carries no plotly.js.
 */
import { PageConfig, URLExt } from '@jupyterlab/coreutils';

/** The part of plotly.js used here. */
export interface PlotlyStatic {
  react(div: HTMLElement, data: object[], layout: object, config?: object): Promise<HTMLElement>;
  purge(div: HTMLElement): void;
  Plots: { resize(div: HTMLElement): void };
}

/** A div plotly.js has drawn into: it emits plotly's events. */
export interface PlotDiv extends HTMLDivElement {
  on(event: string, handler: (data: Record<string, unknown>) => void): void;
}

type PlotlyWindow = Window & {
  Plotly?: PlotlyStatic;
  psclusterPlotly?: Promise<PlotlyStatic> | null;
  define?: unknown;
};

/** plotly.js, loaded on the first call; rejects with a message that says what to do when it cannot load. */
export function loadPlotly(): Promise<PlotlyStatic> {
  const w = window as PlotlyWindow;
  if (w.Plotly) {
    return Promise.resolve(w.Plotly);
  }
  if (!w.psclusterPlotly) {
    w.psclusterPlotly = new Promise((resolve, reject) => {
      const script = document.createElement('script');
      script.src = URLExt.join(PageConfig.getBaseUrl(), 'pscluster', 'static', 'plotly.min.js');
      // with an AMD loader on the page, plotly.js would register as a module instead of setting window.Plotly
      const define = w.define;
      w.define = undefined;
      script.onload = () => {
        w.define = define;
        resolve(w.Plotly!);
      };
      script.onerror = () => {
        w.define = define;
        w.psclusterPlotly = null;
        reject(new Error(`cannot load plotly.js from ${script.src}: install pscluster where the Jupyter server runs`));
      };
      document.head.appendChild(script);
    });
  }
  return w.psclusterPlotly;
}
