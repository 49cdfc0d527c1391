/**
 * The left side panel: running clusters with their tasks, and a table of every run of the stores with its
 * status, global step, steps/s, final loss (and sparkline), wall time and hyperparameters; runs checked
 * there open compared. It refreshes while it is visible only.
 */
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';

import {
  ActionResult,
  ApiError,
  ClusterInfo,
  ClusterList,
  RunInfo,
  RunList,
  apiUrl,
  requestAPI,
  runKey,
  runPath
} from './api';
import { sparkline } from './charts';
import { failureNode, failureWhere } from './failure';
import { duration, settings, sig } from './format';
import { loadPlotly } from './plotly';
import { PollingWidget } from './polling';

/** The statuses of a run that can still be stopped. */
const LIVE = new Set(['starting', 'training']);

function el<K extends keyof HTMLElementTagNameMap>(tag: K, className = '', text = ''): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = className;
  node.textContent = text;
  return node;
}

/** Ask for confirmation (the accept button says `label`), then POST `path`; errors are shown, never thrown. */
export async function confirmAndPost(
  title: string,
  body: string,
  path: string,
  label = 'Stop'
): Promise<ActionResult | null> {
  const answer = await showDialog({
    title,
    body,
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label })]
  });
  if (!answer.button.accept) {
    return null;
  }
  try {
    return await requestAPI<ActionResult>(path, { method: 'POST' });
  } catch (error) {
    await showErrorMessage(title, (error as Error).message);
    return null;
  }
}

export class ClusterPanel extends PollingWidget {
  /** `openRuns` opens the view of one run, or the comparison of several. */
  constructor(private readonly openRuns: (runs: RunInfo[]) => void) {
    super();
    this.id = 'pscluster-panel';
    this.addClass('jp-pscluster-panel');
    this.title.caption = 'pscluster: clusters and runs';
    this.node.append(
      el('h2', 'jp-pscluster-heading', 'Clusters'),
      this.clustersNode,
      el('h2', 'jp-pscluster-heading', 'Runs'),
      this.compareButton,
      this.runsMessage,
      this.runsTable
    );
    this.runsTable.createTHead().append(this.headerRow());
    this.runsTable.append(this.runsBody);
    this.compareButton.title = 'Overlay the loss curves of the checked runs';
    this.compareButton.onclick = () => this.openRuns([...this.checked].map(key => this.runs.get(key)!));
    this.updateCompare();
  }

  /** Ask the server for the clusters and the runs and show them (or why not). */
  async refresh(): Promise<void> {
    const [clusters, runs] = await Promise.allSettled([
      requestAPI<ClusterList>('clusters'),
      requestAPI<RunList>('runs')
    ]);
    if (clusters.status === 'fulfilled') {
      this.showClusters(clusters.value);
    } else {
      this.clustersSignature = ''; // redraw the list once the server answers again
      this.clustersNode.replaceChildren(el('div', 'jp-pscluster-error', (clusters.reason as ApiError).message));
    }
    if (runs.status === 'fulfilled') {
      this.showRuns(runs.value);
    } else {
      this.showMessage((runs.reason as ApiError).message, true);
    }
  }

  protected onAfterShow(): void {
    void loadPlotly().catch(() => undefined); // now, so that a run view opens drawn (a view shows the error)
    super.onAfterShow();
  }

  private showMessage(text: string, error = false): void {
    this.runsMessage.textContent = text;
    this.runsMessage.className = error ? 'jp-pscluster-error' : 'jp-pscluster-message';
    this.runsMessage.hidden = !text;
  }

  private showClusters(list: ClusterList): void {
    const signature = JSON.stringify(list);
    if (signature === this.clustersSignature) {
      return;
    }
    this.clustersSignature = signature;
    const nodes: HTMLElement[] = list.clusters.map(c => this.clusterNode(c));
    if (!list.clusters.length) {
      nodes.push(
        el('div', 'jp-pscluster-message', 'No cluster running. Start one with %pscluster start in a notebook.')
      );
    }
    for (const skipped of list.skipped) {
      nodes.push(el('div', 'jp-pscluster-note', `${skipped.name}: ${skipped.reason}`));
    }
    this.clustersNode.replaceChildren(...nodes);
  }

  private clusterNode(cluster: ClusterInfo): HTMLElement {
    const node = el('div', 'jp-pscluster-cluster');
    node.dataset.name = cluster.name;
    const head = el('div', 'jp-pscluster-cluster-head');
    head.append(
      el('span', 'jp-pscluster-cluster-name', cluster.name),
      el('span', `jp-pscluster-state jp-pscluster-state-${cluster.state}`, cluster.state)
    );
    const running = cluster.state === 'running';
    if (running) {
      head.append(
        this.actionButton('Stop', 'jp-pscluster-stop', `Stop cluster ${cluster.name} and its engines`, () =>
          confirmAndPost(
            `Stop cluster ${cluster.name}?`,
            `Stops every engine of ${cluster.name} (and its run, if one is training).`,
            `clusters/${cluster.name}/stop`
          )
        )
      );
    }
    const table = el('table', 'jp-pscluster-tasks');
    const header = table.createTHead().insertRow();
    for (const name of ['role', 'task', 'host', 'device', 'state', '']) {
      header.append(el('th', '', name));
    }
    const body = table.createTBody();
    for (const t of cluster.tasks) {
      const row = body.insertRow();
      row.className = `jp-pscluster-task jp-pscluster-role-${t.role}`;
      for (const value of [t.role, String(t.task), t.host, t.device, t.state]) {
        row.append(el('td', '', value));
      }
      const actions = row.insertCell();
      actions.className = 'jp-pscluster-task-actions';
      if (running) {
        const task = `${t.role} ${t.task}`;
        actions.append(
          this.actionButton('Restart', 'jp-pscluster-restart', `Restart ${task} on a new engine`, () =>
            confirmAndPost(
              `Restart ${task} of ${cluster.name}?`,
              `Kills the engine of ${task} (pid ${t.pid}) and starts a new one. During a run, the run ` +
                'recovers it as a lost task: a worker rejoins, a ps rolls back to the latest checkpoint.',
              `clusters/${cluster.name}/tasks/${t.role}/${t.task}/restart`,
              'Restart'
            ),
            'jp-mod-reject'
          )
        );
      }
    }
    node.append(head, table);
    return node;
  }

  private headerRow(): HTMLTableRowElement {
    const row = document.createElement('tr');
    for (const name of ['', 'run', 'status', 'step', 'steps/s', 'loss', 'wall', 'hyperparameters', '']) {
      row.append(el('th', '', name));
    }
    return row;
  }

  private showRuns(list: RunList): void {
    this.showMessage(list.message ?? (list.runs.length ? '' : 'No runs yet: train one on a cluster.'));
    const seen = new Set<string>();
    for (const run of list.runs) {
      const key = runKey(run);
      seen.add(key);
      this.runs.set(key, run);
      let row = this.runRows.get(key);
      if (!row) {
        row = this.runRow(run);
        this.runRows.set(key, row);
      }
      this.updateRun(row, run);
      this.runsBody.append(row); // keeps the server's order: newest first
      this.showFailure(key, run);
    }
    for (const [key, row] of this.runRows) {
      if (!seen.has(key)) {
        row.remove();
        this.failureRows.get(key)?.remove();
        this.failureRows.delete(key);
        this.runRows.delete(key);
        this.runs.delete(key);
        this.checked.delete(key);
      }
    }
    this.updateCompare();
  }

  /** Under the row of a run that failed, a row as wide as the table with its cause (the whole cause on hover). */
  private showFailure(key: string, run: RunInfo): void {
    let row = this.failureRows.get(key);
    if (!run.failure) {
      row?.remove();
      this.failureRows.delete(key);
      return;
    }
    if (!row) {
      row = document.createElement('tr');
      row.className = 'jp-pscluster-run-failure';
      row.dataset.runId = String(run.id);
      row.dataset.store = run.store;
      const cell = el('td');
      cell.colSpan = this.runRows.get(key)!.cells.length;
      row.append(cell);
      this.failureRows.set(key, row);
    }
    row.cells[0].replaceChildren(failureNode(run.failure, false));
    row.title = `${failureWhere(run.failure)}: ${run.failure.cause}`;
    row.onclick = () => this.openRuns([run]);
    this.runsBody.append(row);
  }

  private updateCompare(): void {
    this.compareButton.disabled = this.checked.size < 2;
    this.compareButton.textContent = this.checked.size ? `Compare ${this.checked.size} runs` : 'Compare checked runs';
  }

  private runRow(run: RunInfo): HTMLTableRowElement {
    const row = document.createElement('tr');
    row.className = 'jp-pscluster-run';
    row.dataset.runId = String(run.id);
    row.dataset.store = run.store;
    row.tabIndex = 0; // reached by Tab; Enter opens the run as a click does
    row.onkeydown = event => {
      if (event.key === 'Enter' && event.target === row) {
        row.click();
      }
    };
    for (const cell of ['check', 'name', 'status', 'step', 'speed', 'loss', 'wall', 'settings', 'actions']) {
      row.append(el('td', `jp-pscluster-run-${cell}`));
    }
    const check = el('input', 'jp-pscluster-run-checkbox');
    check.type = 'checkbox';
    check.title = 'Check two or more runs to compare them';
    check.setAttribute('aria-label', `Compare ${run.name}`);
    check.onclick = event => event.stopPropagation(); // a run row opens its view on click
    check.onchange = () => {
      const key = runKey(run);
      check.checked ? this.checked.add(key) : this.checked.delete(key);
      this.updateCompare();
    };
    row.cells[0].append(check);
    const csv = el('a', 'jp-pscluster-download', 'CSV');
    csv.href = apiUrl(runPath(run, 'metrics.csv'));
    csv.title = `Download the metrics of ${run.name} (raw rows)`;
    csv.onclick = event => event.stopPropagation();
    row.cells[8].append(csv);
    return row;
  }

  private updateRun(row: HTMLTableRowElement, run: RunInfo): void {
    const [, name, status, step, speed, loss, wall, config, actions] = Array.from(row.cells);
    name.textContent = run.name;
    name.title = `${run.name} on ${run.cluster} (${run.mode}): open its plots`;
    row.setAttribute('aria-label', `${run.name}, ${run.status}: Enter opens its plots`);
    status.textContent = run.status;
    status.className = `jp-pscluster-run-status jp-pscluster-status-${run.status}`;
    step.textContent = run.steps ? `${run.global_step}/${run.steps}` : String(run.global_step);
    speed.textContent = sig(run.steps_per_s, 3);
    loss.replaceChildren(el('span', 'jp-pscluster-run-final', sig(run.loss)), sparkline(run.sparkline));
    loss.title = Object.entries(run.final)
      .map(([k, v]) => `final ${k} ${sig(v, 6)}`)
      .join('\n');
    wall.textContent = duration(run.wall_s);
    config.textContent = settings(run.hyperparameters);
    config.title = config.textContent;
    row.onclick = () => this.openRuns([run]);
    const live = LIVE.has(run.status);
    if (live && !actions.querySelector('.jp-pscluster-stop-run')) {
      const title = `Stop ${run.name} at the next step of every worker`;
      actions.append(
        this.actionButton('Stop', 'jp-pscluster-stop-run', title, () =>
          confirmAndPost(
            `Stop run ${run.name}?`,
            `Ends ${run.name} at the next step; what it trained stays on its cluster.`,
            runPath(run, 'stop')
          )
        )
      );
    } else if (!live) {
      actions.querySelector('.jp-pscluster-stop-run')?.remove();
    }
  }

  /** A button that runs `action` (a confirmed request) and refreshes the panel after it; `mod` is its style. */
  private actionButton(
    label: string,
    className: string,
    title: string,
    action: () => Promise<ActionResult | null>,
    mod = 'jp-mod-warn'
  ): HTMLButtonElement {
    const button = el('button', `jp-Button jp-mod-styled ${mod} ${className}`, label);
    button.title = title;
    button.onclick = async event => {
      event.stopPropagation(); // a run row opens its view on click
      if (await action()) {
        void this.poll.refresh();
      }
    };
    return button;
  }

  private readonly clustersNode = el('div', 'jp-pscluster-clusters');
  private readonly runsMessage = el('div', 'jp-pscluster-message');
  private readonly runsTable = el('table', 'jp-pscluster-runs');
  private readonly runsBody = document.createElement('tbody');
  private readonly runRows = new Map<string, HTMLTableRowElement>();
  private readonly failureRows = new Map<string, HTMLTableRowElement>(); // by runKey: of the runs that failed
  private readonly runs = new Map<string, RunInfo>(); // by runKey: the latest listed
  private readonly checked = new Set<string>(); // runKeys
  private readonly compareButton = el('button', 'jp-Button jp-mod-styled jp-mod-accept jp-pscluster-compare');
  private clustersSignature = '';
}
