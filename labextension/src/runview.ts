/**
 * A run in the main area, or several runs compared: a header line per run (status, epochs, global step, steps/s,
 * final loss, wall time; the divergence of its loss; hyperparameters, downloads) and the run's figures as the
 * notebook's dashboard draws them, served by the lab server (`runs/<id>/figures`: data and layout for plotly.js)
 * and drawn by the notebook's own code (figures.js: the viewer's controls, smoothing among them); while a run
 * trains it asks again every RUN_REFRESH_MS. Several runs: the figure of `pscluster.compare` for the metric chosen
 * (any the runs stored), and a table of the hyperparameters that differ between them. Nothing here draws a chart
 * of its own: a figure added to the notebook's dashboard shows here too.
 */

import { ApiError, Comparison, Figure, FigureList, RunInfo, apiUrl, requestAPI, runPath } from './api';
import { keptFailureNode } from './failure';
import { duration, setting, settings, sig } from './format';
import { FigureView, Figures, PlotlyStatic, loadFigures, loadPlotly } from './plotly';
import { PollingWidget } from './polling';

const ENDED = new Set(['finished', 'failed', 'stopped', 'lost']);
const RUN_REFRESH_MS = 3000;

function el<K extends keyof HTMLElementTagNameMap>(tag: K, className = '', text = ''): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = className;
  node.textContent = text;
  return node;
}

/** A header line of `run`: what it is, where it is, and its downloads. */
function headerLine(run: RunInfo, node: HTMLElement): void {
  node.className = 'jp-pscluster-runview-header';
  node.dataset.status = run.status;
  const text =
    `${run.name} on ${run.cluster} (${run.mode}): ${run.status}, ${run.epochs_text ? run.epochs_text + ', ' : ''}` +
    `global step ${run.global_step}` +
    `${run.steps ? '/' + run.steps : ''}, ${sig(run.steps_per_s)} steps/s, loss ${sig(run.loss)}, ` +
    `wall ${duration(run.wall_s)}`;
  const links = (['csv', 'json', 'parquet'] as const).map(kind => {
    const a = el('a', 'jp-pscluster-download', kind.toUpperCase());
    a.href = apiUrl(runPath(run, `metrics.${kind}`));
    a.download = `run-${run.id}-metrics.${kind}`;
    a.title = `Download the metrics of ${run.name} as ${kind.toUpperCase()}`;
    return a;
  });
  const line = el('div', 'jp-pscluster-settings', settings(run.hyperparameters));
  line.append(...links);
  const diverging = run.divergence ? [el('div', 'jp-pscluster-diverging', `⚠ ${run.divergence.line}`)] : [];
  node.replaceChildren(
    el('div', '', text),
    ...diverging,
    line,
    ...(run.failure ? [keptFailureNode(node, run.failure, true)] : [])
  );
}

/** A value of a hyperparameter as the header line writes it; an en dash for a run without it. */
function hyperparameter(run: RunInfo, key: string): string {
  const value = run.hyperparameters[key];
  return value === undefined ? '–' : typeof value === 'number' ? setting(value) : String(value);
}

/** The hyperparameters whose values differ between `runs`: a row each, a column per run; or one line when none do. */
function hyperparameterDiff(runs: RunInfo[]): HTMLElement {
  const keys = [...new Set(runs.flatMap(r => Object.keys(r.hyperparameters)))];
  const differ = keys.filter(key => new Set(runs.map(r => hyperparameter(r, key))).size > 1);
  if (!differ.length) {
    const same = keys.length ? `: ${settings(runs[0].hyperparameters)}` : '';
    return el('div', 'jp-pscluster-hyperparameters', `The ${runs.length} runs have the same hyperparameters${same}.`);
  }
  const table = el('table', 'jp-pscluster-hyperparameters');
  table.createCaption().textContent = 'Hyperparameters that differ';
  table.createTHead().insertRow().append(el('th', '', 'hyperparameter'), ...runs.map(r => el('th', '', r.name)));
  const body = table.createTBody();
  for (const key of differ) {
    body.insertRow().append(el('th', '', key), ...runs.map(r => el('td', '', hyperparameter(r, key))));
  }
  return table;
}

export class RunView extends PollingWidget {
  /** The view of `runs[0]`, or with several runs their comparison. */
  constructor(readonly runs: RunInfo[]) {
    super(RUN_REFRESH_MS);
    this.addClass('jp-pscluster-runview');
    if (runs.length === 1) {
      this.node.dataset.runId = String(runs[0].id);
      this.node.dataset.store = runs[0].store;
    } else {
      this.node.dataset.compare = String(runs.length);
    }
    this.headers = runs.map(run => {
      const node = el('div');
      headerLine(run, node);
      return node;
    });
    const compared = runs.length > 1 ? [hyperparameterDiff(runs), this.controls()] : [];
    this.node.append(...this.headers, ...compared, this.status, this.charts);
    this.showStatus(`Loading the figures of ${runs.map(r => r.name).join(', ')}…`);
  }

  /** Ask for the figures again and redraw them; stops polling once every run ended. */
  async refresh(): Promise<void> {
    await this.load();
    if (this.shown.length && this.shown.every(run => ENDED.has(run.status))) {
      this.poll.dispose();
    }
  }

  dispose(): void {
    const plotly = this.plotly;
    if (plotly) {
      this.charts.querySelectorAll<HTMLElement>('.jp-pscluster-plot').forEach(div => plotly.purge(div));
    }
    super.dispose();
  }

  /** The compare view's choice of metric. */
  private controls(): HTMLElement {
    const node = el('div', 'jp-pscluster-controls');
    const label = el('label', '', 'metric ');
    label.append(this.metricChooser);
    this.metricChooser.onchange = () => {
      this.metric = this.metricChooser.value;
      void this.load();
    };
    node.append(label);
    return node;
  }

  private showStatus(text: string, error = false): void {
    this.status.textContent = text;
    this.status.className = error ? 'jp-pscluster-error' : 'jp-pscluster-loading';
    this.status.hidden = !text;
  }

  /** The path that answers this view: the run's figures, or the comparison of the runs by the metric chosen. */
  private path(): string {
    if (this.runs.length === 1) {
      return runPath(this.runs[0], 'figures');
    }
    const runs = this.runs.map(run => ['run', `${run.id}:${run.store}`]);
    return `compare?${new URLSearchParams([...runs, ['metric', this.metric]])}`;
  }

  private async load(): Promise<void> {
    const request = ++this.requests;
    let figures: Figures;
    let answer: FigureList | Comparison;
    try {
      [figures, answer, this.plotly] = await Promise.all([
        loadFigures(),
        requestAPI<FigureList | Comparison>(this.path()),
        loadPlotly()
      ]);
    } catch (error) {
      this.showStatus((error as ApiError).message, true);
      return;
    }
    if (request !== this.requests || this.isDisposed) {
      return; // a later request answers instead
    }
    this.shown = 'runs' in answer ? answer.runs : [answer.run];
    this.shown.forEach((run, i) => headerLine(run, this.headers[i]));
    if ('available' in answer) {
      this.offer(answer.available);
    }
    this.showStatus('');
    await this.draw(figures, 'figure' in answer ? [answer.figure] : answer.figures);
  }

  /** The metrics the compare view offers: every one the runs stored. */
  private offer(available: string[]): void {
    if (available.join('\n') !== Array.from(this.metricChooser.options, o => o.value).join('\n')) {
      this.metricChooser.replaceChildren(...available.map(m => new Option(m, m)));
    }
    this.metricChooser.value = this.metric;
  }

  /** Each figure in a div of its own (`data-chart`: its name), in their order, drawn as the notebook draws it. */
  private async draw(figures: Figures, list: Figure[]): Promise<void> {
    const names = new Set(list.map(f => f.name));
    for (const [name, [box, div]] of this.views) {
      if (!names.has(name)) {
        this.plotly?.purge(div);
        box.remove();
        this.views.delete(name);
      }
    }
    const drawn = list.map(figure => {
      let found = this.views.get(figure.name);
      if (!found) {
        const box = el('div', 'jp-pscluster-figure');
        const div = el('div', 'jp-pscluster-plot');
        div.dataset.chart = figure.name;
        box.append(div);
        this.charts.append(box); // attached before it is drawn: its controls go above it
        found = [box, div, figures.figureView(div, figures.config)];
        this.views.set(figure.name, found);
      }
      this.charts.append(found[0]); // in the order of the figures
      return found[2]({ data: figure.data, layout: figure.layout });
    });
    await Promise.all(drawn);
  }

  private readonly headers: HTMLElement[];
  private readonly metricChooser = el('select', 'jp-pscluster-metric');
  private readonly status = el('div', 'jp-pscluster-loading');
  private readonly charts = el('div', 'jp-pscluster-charts');
  private readonly views = new Map<string, [HTMLElement, HTMLElement, FigureView]>();
  private plotly: PlotlyStatic | null = null;
  private shown: RunInfo[] = [];
  private requests = 0;
  private metric = 'loss'; // the compared metric
}
