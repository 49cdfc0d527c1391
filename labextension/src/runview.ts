/**
 * A run in the main area, or several runs compared: a header line per run (status, epochs, global step, steps/s,
 * final loss, wall time; the divergence of its loss; hyperparameters, downloads) and plotly charts of their metrics from the series
 * endpoint, decimated whatever the runs' length. It shows the header and "Loading" at once; a zoom asks for
 * the zoomed range at a finer resolution; while a run trains it asks again every RUN_REFRESH_MS.
 *
 * One run, as TensorBoard draws it: a chart per metric (loss, accuracy when it has one) with a smoothed line
 * per worker over its faint raw line, the run's test-set evaluations marked, and each worker's local steps/s
 * by the notebook's rule (computed by the server). Several runs: the metric chosen (any the runs stored, the
 * speed, the learning rate) of each run (its workers' points averaged where they share an x), and a table of
 * the hyperparameters that differ between them.
 */

import { ApiError, RunInfo, SeriesData, apiUrl, requestAPI, runPath } from './api';
import { COLORS, ChartSpec, Charts, Line } from './charts';
import { failureNode } from './failure';
import { duration, setting, settings, sig } from './format';
import { PlotlyStatic, loadPlotly } from './plotly';
import { PollingWidget } from './polling';

const ENDED = new Set(['finished', 'failed', 'stopped', 'lost']);
const RUN_REFRESH_MS = 3000;
const POINTS = 1500; // per worker: what a chart's width can show
const TZ_MS = new Date().getTimezoneOffset() * 60_000; // plotly draws dates as UTC: shifted to show local time

type XMode = 'step' | 'wall' | 'relative';
const X_TITLES: Record<XMode, string> = { step: 'global step', wall: 'wall time', relative: 'seconds since start' };
const SPEED = 'speed'; // a compared metric besides the stored ones: local_steps_per_s of the series' columns
const LR = 'lr'; // another: the learning rate of the series' learning_rates
const EVALUATED = ['loss', 'accuracy'] as const; // the metrics a test-set evaluation has
const TEST_COLOR = '#222';

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
    ...(run.failure ? [failureNode(run.failure, true)] : [])
  );
}

/** The title of the speed chart: the window its rates count over. */
function speedTitle(data: SeriesData): string {
  return `local steps/s per worker (over ${data.speed_window_s} s)`;
}

/** The server x (of the answer's axis) of a point at global step `step` and `time`. */
function serverX(data: SeriesData, step: number, time: number): number {
  return data.x === 'step' ? step : time;
}

/** The run's test-set evaluations of `name` (loss or accuracy) as marks; none when it has no such metric. */
function evaluationMarks(data: SeriesData, name: string, toX: (v: number) => number, mark: Partial<Line>): Line[] {
  const metric = EVALUATED.find(m => m === name);
  const found = metric ? data.evaluations.filter(e => e[metric] !== null) : [];
  if (!metric || !found.length) {
    return [];
  }
  const x = found.map(e => toX(serverX(data, e.global_step, e.time)));
  return [{ name: 'test', x, y: found.map(e => e[metric]), ...mark }];
}

/** One curve of column `column` for a whole run: its workers' points, averaged where they share an x. */
function runLine(data: SeriesData, column: string, toX: (v: number) => number): Line {
  const sums = new Map<number, [number, number]>();
  for (const { columns } of data.workers) {
    columns.x.forEach((x, i) => {
      const y = columns[column]?.[i];
      if (x !== null && y !== null && y !== undefined) {
        const s = sums.get(x) ?? [0, 0];
        sums.set(x, [s[0] + y, s[1] + 1]);
      }
    });
  }
  const xs = [...sums.keys()].sort((a, b) => a - b);
  return { name: data.run.name, x: xs.map(toX), y: xs.map(x => sums.get(x)![0] / sums.get(x)![1]) };
}

/** Metric `metric` of a compared run as one curve: a stored metric, SPEED or LR. */
function compareLine(data: SeriesData, metric: string, toX: (v: number) => number): Line {
  if (metric === LR) {
    const rates = data.learning_rates;
    return { name: data.run.name, x: rates.map(r => toX(serverX(data, r.step, r.time))), y: rates.map(r => r.lr) };
  }
  return runLine(data, metric === SPEED ? 'local_steps_per_s' : `${metric}_mean`, toX);
}

/** What the compare view offers: every metric any of the runs stored, the speed, the learning rate if any has one. */
function comparable(answers: SeriesData[]): string[] {
  const stored = new Set(answers.flatMap(a => a.available));
  return [...stored, SPEED, ...(answers.some(a => a.learning_rates.length) ? [LR] : [])];
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
    const diff = runs.length > 1 ? [hyperparameterDiff(runs)] : [];
    this.node.append(...this.headers, ...diff, this.controls(), this.status, this.charts.node);
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
    const compared = this.runs.length > 1;
    this.metricChooser.onchange = () => {
      this.metric = this.metricChooser.value;
      void this.load();
    };
    node.append(
      ...(compared ? [label('metric ', this.metricChooser)] : []),
      label('x axis ', x),
      label(compared ? 'log scale ' : 'log loss ', log),
      label('smoothing ', slider, shown)
    );
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
    // a compared run stored the metric chosen (as its last answer said): ask for it; else for the default ones
    const names = (i: number): Record<string, string> =>
      this.runs.length > 1 && this.answers[i]?.available.includes(this.metric) ? { names: this.metric } : {};
    const zoomed = (run: RunInfo, i: number): Record<string, string> => {
      const [start, stop] = this.zoom?.map(v => String(this.fromX(run, v))) ?? [];
      return { ...params, ...names(i), ...(this.zoom ? { start, stop } : {}) };
    };
    let answers: SeriesData[];
    try {
      [this.plotly, ...answers] = await Promise.all([
        loadPlotly(),
        ...this.runs.map((run, i) => requestAPI<SeriesData>(runPath(run, 'series', zoomed(run, i))))
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
    const specs = this.answers.length > 1 ? [this.compareSpec()] : this.runSpecs(this.answers[0]);
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

  /** The charts of one run: a chart per metric, its test evaluations marked; each worker's speed. */
  private runSpecs(data: SeriesData): ChartSpec[] {
    const toX = this.toX(data.run);
    const workers = (column: string): Line[] =>
      data.workers.map(({ worker, columns: c }) => ({
        name: `worker ${worker}`,
        x: c.x.map(v => toX(v!)),
        y: c[column]
      }));
    const specs: ChartSpec[] = data.names.map(name => ({
      key: name,
      title: name,
      log: name === 'loss' && this.log,
      smoothed: true,
      lines: workers(`${name}_mean`),
      marks: evaluationMarks(data, name, toX, { color: TEST_COLOR })
    }));
    specs.push({ key: 'speed', title: speedTitle(data), zero: true, lines: workers('local_steps_per_s') });
    return specs;
  }

  /** The chart of the compared runs: the metric chosen, one curve per run, their test evaluations marked. */
  private compareSpec(): ChartSpec {
    const options = comparable(this.answers);
    if (options.join('\n') !== Array.from(this.metricChooser.options, o => o.value).join('\n')) {
      const titles: Record<string, string> = { [SPEED]: speedTitle(this.answers[0]), [LR]: 'learning rate' };
      this.metricChooser.replaceChildren(...options.map(m => new Option(titles[m] ?? m, m)));
    }
    this.metricChooser.value = this.metric;
    const lines: Line[] = [];
    const marks: Line[] = [];
    this.answers.forEach((a, i) => {
      const toX = this.toX(a.run);
      const color = COLORS[i % COLORS.length];
      const line = compareLine(a, this.metric, toX);
      if (line.x.length) {
        lines.push({ ...line, color });
      }
      marks.push(...evaluationMarks(a, this.metric, toX, { name: `${a.run.name} test`, color }));
    });
    return {
      key: this.metric,
      title: this.metricChooser.selectedOptions[0]?.text ?? this.metric,
      lines,
      marks,
      log: this.log,
      zero: this.metric === SPEED,
      smoothed: this.metric !== LR,
      stepped: this.metric === LR
    };
  }

  private readonly headers: HTMLElement[];
  private readonly metricChooser = el('select', 'jp-pscluster-metric');
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
  private metric = 'loss'; // the compared metric
  private log = false;
  private weight = 0.6;
}
