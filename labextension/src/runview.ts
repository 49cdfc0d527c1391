/**
 * A run in the main area: its convergence (loss by global step) and each worker's speed
 * (local steps per second), fed from the metrics endpoint by cursor while the run trains.
 */

import { ApiError, MetricRows, RunInfo, requestAPI, runPath } from './api';
import { Series, lineChart } from './charts';
import { fmt } from './panel';
import { PollingWidget } from './polling';

const ENDED = new Set(['finished', 'failed', 'stopped', 'lost']);
const MAX_POINTS = 2000; // per series drawn: longer series are thinned
const SPEED_SPAN = 5; // a worker's speed: over this many of its reported steps

interface WorkerRows {
  time: number[];
  localStep: number[];
  globalStep: number[];
  loss: number[];
}

function thin(values: number[]): number[] {
  const stride = Math.ceil(values.length / MAX_POINTS);
  return stride <= 1 ? values : values.filter((_, i) => i % stride === 0);
}

export class RunView extends PollingWidget {
  constructor(readonly run: RunInfo) {
    super();
    this.addClass('jp-pscluster-runview');
    this.node.dataset.runId = String(run.id);
    this.node.dataset.store = run.store;
    this.node.append(this.header, this.charts);
  }

  /** Fetch the rows stored since the last cursor and redraw; stops polling once the run ended. */
  async refresh(): Promise<void> {
    let page: MetricRows;
    try {
      do {
        page = await requestAPI<MetricRows>(runPath(this.run, 'metrics', { after: String(this.cursor) }));
        this.add(page);
      } while (page.more);
    } catch (error) {
      this.header.textContent = (error as ApiError).message;
      this.header.className = 'jp-pscluster-error';
      return;
    }
    this.draw(page.run);
    if (ENDED.has(page.run.status)) {
      this.poll.dispose();
    }
  }

  private add(page: MetricRows): void {
    this.cursor = page.cursor;
    page.worker.forEach((w, i) => {
      let rows = this.workers.get(w);
      if (!rows) {
        rows = { time: [], localStep: [], globalStep: [], loss: [] };
        this.workers.set(w, rows);
      }
      rows.time.push(page.time[i]);
      rows.localStep.push(page.local_step[i]);
      rows.globalStep.push(page.global_step[i]);
      rows.loss.push(page.loss[i] ?? NaN);
    });
  }

  private draw(run: RunInfo): void {
    this.title.label = run.name;
    this.header.className = 'jp-pscluster-runview-header';
    this.header.textContent =
      `${run.name} on ${run.cluster} (${run.mode}): ${run.status}, global step ${run.global_step}` +
      `${run.steps ? '/' + run.steps : ''}, ${fmt(run.steps_per_s)} steps/s, loss ${fmt(run.loss, 4)}`;
    this.header.dataset.status = run.status;
    const workers = [...this.workers.entries()].sort((a, b) => a[0] - b[0]);
    const convergence: Series[] = workers.map(([w, r]) => ({
      label: `worker ${w}`,
      x: thin(r.globalStep),
      y: thin(r.loss)
    }));
    const speed: Series[] = workers.map(([w, r]) => {
      const x: number[] = [];
      const y: number[] = [];
      for (let i = SPEED_SPAN; i < r.time.length; i++) {
        const dt = r.time[i] - r.time[i - SPEED_SPAN];
        if (dt > 0) {
          x.push(r.time[i] - run.started);
          y.push((r.localStep[i] - r.localStep[i - SPEED_SPAN]) / dt);
        }
      }
      return { label: `worker ${w}`, x: thin(x), y: thin(y) };
    });
    this.charts.replaceChildren(
      lineChart('Convergence: loss by global step', 'global step', convergence),
      lineChart('Speed: local steps/s per worker', 'seconds since start', speed)
    );
  }

  private readonly header = document.createElement('div');
  private readonly charts = document.createElement('div');
  private readonly workers = new Map<number, WorkerRows>();
  private cursor = 0;
}
