/**
 * A run in the main area, or several runs compared: a header line per run (status, global step, steps/s,
 * final loss, wall time, hyperparameters, downloads) and plotly charts of their metrics from the series
 * endpoint, decimated whatever the runs' length. It shows the header and "Loading" at once; a zoom asks for
 * the zoomed range at a finer resolution; while a run trains it asks again every RUN_REFRESH_MS.
 *
 * One run: a chart per metric (loss, accuracy when it has one) with a curve and a min..max band per worker,
 * and each worker's local steps/s. Several runs: their loss curves overlaid, one per run (its workers'
 * points averaged where they share a global step).
 */

import { ApiError, Columns, RunInfo, SeriesData, apiUrl, requestAPI, runPath } from './api';
import { ChartSpec, Charts, Line } from './charts';
import { failureNode } from './failure';
import { duration, settings, sig } from './format';
import { PlotlyStatic, loadPlotly } from './plotly';
import { PollingWidget } from './polling';

const ENDED = new Set(['finished', 'failed', 'stopped', 'lost']);
const RUN_REFRESH_MS = 3000;
const POINTS = 1500; // per worker: what a chart's width can show
const TZ_MS = new Date().getTimezoneOffset() * 60_000; // plotly draws dates as UTC: shifted to show local time

type XMode = 'step' | 'wall' | 'relative';
const X_TITLES: Record<XMode, string> = { step: 'global step', wall: 'wall time', relative: 'seconds since start' };

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
    `${run.name} on ${run.cluster} (${run.mode}): ${run.status}, global step ${run.global_step}` +
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
  node.replaceChildren(el('div', '', text), line, ...(run.failure ? [failureNode(run.failure, true)] : []));
}

/** Each worker's local steps/s between consecutive points. */
function speedLine(worker: number, c: Columns, toX: (v: number) => number): Line {
  const x: number[] = [];
  const y: number[] = [];
  const t = c.time_last;
  const local = c.local_last;
  for (let i = 1; i < t.length; i++) {
    const dt = (t[i] ?? NaN) - (t[i - 1] ?? NaN);
    if (dt > 0) {
      x.push(toX(c.x[i]!));
      y.push(((local[i] ?? NaN) - (local[i - 1] ?? NaN)) / dt);
    }
  }
  return { name: `worker ${worker}`, x, y };
}

/** One curve of `name` for a whole run: its workers' points, averaged where they share an x. */
function runLine(data: SeriesData, name: string, toX: (v: number) => number): Line {
  const sums = new Map<number, [number, number]>();
  for (const { columns } of data.workers) {
    columns.x.forEach((x, i) => {
      const y = columns[`${name}_mean`][i];
      if (x !== null && y !== null) {
        const s = sums.get(x) ?? [0, 0];
        sums.set(x, [s[0] + y, s[1] + 1]);
      }
    });
  }
  const xs = [...sums.keys()].sort((a, b) => a - b);
  return { name: data.run.name, x: xs.map(toX), y: xs.map(x => sums.get(x)![0] / sums.get(x)![1]) };
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
    this.node.append(...this.headers, this.controls(), this.status, this.charts.node);
    this.showStatus(`Loading the metrics of ${runs.map(r => r.name).join(', ')}…`);
  }

  /** Ask for the series again (at the current zoom) and redraw; stops polling once every run ended. */
  async refresh(): Promise<void> {
    await this.load();
    if (this.answers.length && this.answers.every(a => ENDED.has(a.run.status))) {
      this.poll.dispose();
    }
  }

  dispose(): void {
    if (this.plotly) {
      this.charts.purge(this.plotly);
    }
    super.dispose();
  }

  private controls(): HTMLElement {
    const node = el('div', 'jp-pscluster-controls');
    const x = el('select', 'jp-pscluster-xmode');
    for (const mode of Object.keys(X_TITLES) as XMode[]) {
      x.append(new Option(X_TITLES[mode], mode));
    }
    x.onchange = () => {
      this.xMode = x.value as XMode;
      this.zoom = null;
      void this.load();
    };
    const log = el('input', 'jp-pscluster-log');
    log.type = 'checkbox';
    log.onchange = () => {
      this.log = log.checked;
      void this.draw();
    };
    const slider = el('input', 'jp-pscluster-smoothing');
    Object.assign(slider, { type: 'range', min: '0', max: '0.999', step: '0.001', value: String(this.weight) });
    const shown = el('span', 'jp-pscluster-smoothing-value', String(this.weight));
    slider.oninput = () => {
      this.weight = Number(slider.value);
      shown.textContent = slider.value;
      void this.draw();
    };
    const label = (text: string, ...children: HTMLElement[]) => {
      const node = el('label', '', text);
      node.append(...children);
      return node;
    };
    node.append(label('x axis ', x), label('log loss ', log), label('smoothing ', slider, shown));
    return node;
  }

  private showStatus(text: string, error = false): void {
    this.status.textContent = text;
    this.status.className = error ? 'jp-pscluster-error' : 'jp-pscluster-loading';
    this.status.hidden = !text;
  }

  /** Server x (global step, or seconds since the epoch) to the x drawn for `run`. */
  private toX(run: RunInfo): (v: number) => number {
    return { step: (v: number) => v, wall: (v: number) => v * 1000 - TZ_MS, relative: (v: number) => v - run.started }[
      this.xMode
    ];
  }

  /** A drawn x of `run` (a number, or plotly's date text) back to server x. */
  private fromX(run: RunInfo, value: unknown): number {
    if (this.xMode === 'wall') {
      return (Date.parse(String(value).slice(0, 23).replace(' ', 'T') + 'Z') + TZ_MS) / 1000;
    }
    return Number(value) + (this.xMode === 'relative' ? run.started : 0);
  }

  private async load(): Promise<void> {
    const request = ++this.requests;
    const params: Record<string, string> = { x: this.xMode === 'step' ? 'step' : 'time', points: String(POINTS) };
    if (this.runs.length > 1) {
      params.names = 'loss';
    }
    const zoomed = (run: RunInfo) => {
      const [start, stop] = this.zoom?.map(v => String(this.fromX(run, v))) ?? [];
      return this.zoom ? { ...params, start, stop } : params;
    };
    let answers: SeriesData[];
    try {
      [this.plotly, ...answers] = await Promise.all([
        loadPlotly(),
        ...this.runs.map(run => requestAPI<SeriesData>(runPath(run, 'series', zoomed(run))))
      ]);
    } catch (error) {
      this.showStatus((error as ApiError).message, true);
      return;
    }
    if (request === this.requests && !this.isDisposed) {
      this.answers = answers; // a zoom asked after this request answers instead
      await this.draw();
    }
  }

  private async draw(): Promise<void> {
    if (!this.plotly || !this.answers.length) {
      return;
    }
    this.answers.forEach((a, i) => headerLine(a.run, this.headers[i]));
    this.showStatus(this.answers.some(a => a.workers.length) ? '' : 'No metrics yet: no step reported.');
    let specs: ChartSpec[];
    if (this.answers.length > 1) {
      const lines = this.answers.map(a => runLine(a, 'loss', this.toX(a.run)));
      specs = [{ key: 'loss', title: 'loss', lines, log: this.log, smoothed: true }];
    } else {
      const [data] = this.answers;
      const toX = this.toX(data.run);
      const band = (c: Columns, key: string) => (data.resolution > 0 ? c[key] : undefined);
      specs = data.names.map(name => ({
        key: name,
        title: name,
        log: name === 'loss' && this.log,
        smoothed: true,
        lines: data.workers.map(({ worker, columns: c }) => ({
          name: `worker ${worker}`,
          x: c.x.map(v => toX(v!)),
          y: c[`${name}_mean`],
          lo: band(c, `${name}_min`),
          hi: band(c, `${name}_max`)
        }))
      }));
      specs.push({
        key: 'speed',
        title: 'local steps/s per worker',
        zero: true,
        lines: data.workers.map(w => speedLine(w.worker, w.columns, toX))
      });
    }
    const xaxis: Record<string, unknown> = {
      title: { text: X_TITLES[this.xMode] },
      type: this.xMode === 'wall' ? 'date' : 'linear',
      uirevision: this.xMode
    };
    if (this.zoom) {
      xaxis.range = this.zoom;
    } else {
      xaxis.autorange = true;
    }
    await this.charts.draw(this.plotly, specs, xaxis, this.weight);
  }

  private readonly headers: HTMLElement[];
  private readonly status = el('div', 'jp-pscluster-loading');
  private readonly charts = new Charts(el('div', 'jp-pscluster-charts'), range => {
    this.zoom = range;
    void this.load();
  });
  private plotly: PlotlyStatic | null = null;
  private answers: SeriesData[] = [];
  private requests = 0;
  private xMode: XMode = 'step';
  private zoom: [unknown, unknown] | null = null; // the x range drawn, as plotly gives it
  private log = false;
  private weight = 0.6;
}
