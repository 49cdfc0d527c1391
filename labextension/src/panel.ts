/**
 * The left side panel: running clusters with their tasks, and a table of every run of the stores. A run's row
 * shows its status (with ⚠ when its loss diverges) and global step; its divergence's words, its step target,
 * epochs, loss (and its sparkline, as the server draws it), steps/s, wall time and hyperparameters show when the
 * panel is wide enough (CSS container queries), and always in its details, which its disclosure button opens under
 * it. Runs checked there open compared. It refreshes while it is visible only.
 */
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import { LabIcon, caretRightIcon, refreshIcon, stopIcon } from '@jupyterlab/ui-components';

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
import { failureWhere, keptFailureNode } from './failure';
import { duration, finals, settings, sig } from './format';
import { loadPlotly } from './plotly';
import { PollingWidget } from './polling';

/** The statuses of a run that can still be stopped. */
const LIVE = new Set(['starting', 'training']);

/** The run table's columns: the suffix of their cells' class, their header, and the header's accessible name
 * where the header shows no text. */
const RUN_COLUMNS: [string, string, string?][] = [
  ['toggle', '', 'details'],
  ['check', '', 'compare'],
  ['name', 'run'],
  ['status', 'status'],
  ['step', 'step'],
  ['speed', 'steps/s'],
  ['loss', 'loss'],
  ['wall', 'wall'],
  ['settings', 'hyperparameters'],
  ['actions', '', 'stop']
];

/** What the details of `run` say, by label: all that its row may leave out. */
function runFacts(run: RunInfo): [string, string][] {
  return [
    ['step', run.steps ? `${run.global_step} of ${run.steps}` : String(run.global_step)],
    ['epoch', run.epochs_text || '–'],
    ['divergence', run.divergence?.line ?? '–'],
    ['steps/s', sig(run.steps_per_s, 3)],
    ['final', finals(run.final).join(', ') || '–'],
    ['wall', duration(run.wall_s)],
    ['hyperparameters', settings(run.hyperparameters) || '–'],
    ['cluster', `${run.cluster} (${run.mode})`]
  ];
}

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

/** The rows of one run, in a `<tbody>` of their own: the run, its failure (if it failed), its details. */
interface RunGroup {
  body: HTMLTableSectionElement;
  row: HTMLTableRowElement;
  facts: Map<string, HTMLElement>; // by label: the values of the details
  failure: HTMLTableRowElement | null;
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
    this.compareButton.title = 'Compare the checked runs: any metric, and the hyperparameters that differ';
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
    for (const name of ['task', 'state', 'device', 'host']) {
      header.append(el('th', `jp-pscluster-task-${name}`, name));
    }
    header.append(this.labelledHeader('', 'restart'));
    const body = table.createTBody();
    for (const t of cluster.tasks) {
      const row = body.insertRow();
      row.className = `jp-pscluster-task jp-pscluster-role-${t.role}`;
      const task = `${t.role} ${t.task}`;
      for (const [name, value] of [['task', task], ['state', t.state], ['device', t.device], ['host', t.host]]) {
        row.append(el('td', `jp-pscluster-task-${name}`, value));
      }
      row.cells[3].title = t.host; // the whole name where it is cut short
      const actions = row.insertCell();
      actions.className = 'jp-pscluster-task-actions';
      if (running) {
        actions.append(
          this.actionButton(
            `Restart ${task}`,
            'jp-pscluster-restart',
            `Restart ${task} on a new engine`,
            () =>
              confirmAndPost(
                `Restart ${task} of ${cluster.name}?`,
                `Kills the engine of ${task} (pid ${t.pid}) and starts a new one. During a run, the run ` +
                  'recovers it as a lost task: a worker rejoins, a ps rolls back to the latest checkpoint.',
                `clusters/${cluster.name}/tasks/${t.role}/${t.task}/restart`,
                'Restart'
              ),
            refreshIcon
          )
        );
      }
    }
    node.append(head, table);
    return node;
  }

  /** A column header that shows `text`, or says `label` to screen readers only. */
  private labelledHeader(text: string, label?: string, className = ''): HTMLTableCellElement {
    const th = el('th', className, text);
    if (label) {
      th.append(el('span', 'jp-pscluster-unseen', label));
    }
    return th;
  }

  private headerRow(): HTMLTableRowElement {
    const row = document.createElement('tr');
    for (const [cell, header, label] of RUN_COLUMNS) {
      row.append(this.labelledHeader(header, label, `jp-pscluster-run-${cell}`));
    }
    return row;
  }

  private showRuns(list: RunList): void {
    this.showMessage(list.message ?? (list.runs.length ? '' : 'No runs yet: train one on a cluster.'));
    const seen = new Set<string>();
    let previous: Element = this.runsTable.tHead!;
    for (const run of list.runs) {
      const key = runKey(run);
      seen.add(key);
      this.runs.set(key, run);
      let group = this.runGroups.get(key);
      if (!group) {
        group = this.runGroup(run);
        this.runGroups.set(key, group);
      }
      this.updateRun(group, run);
      this.showFailure(group, run);
      // the server's order, newest first; a run's rows move only when out of place (a moved row loses the focus)
      if (previous.nextElementSibling !== group.body) {
        previous.after(group.body);
      }
      previous = group.body;
    }
    for (const [key, group] of this.runGroups) {
      if (!seen.has(key)) {
        group.body.remove();
        this.runGroups.delete(key);
        this.runs.delete(key);
        this.checked.delete(key);
      }
    }
    this.updateCompare();
  }

  /** Under the row of a run that failed, a row as wide as the table with its cause: on one line (the whole of
   * it on hover), whole while the run's details are open. */
  private showFailure(group: RunGroup, run: RunInfo): void {
    if (!run.failure) {
      group.failure?.remove();
      group.failure = null;
      return;
    }
    if (!group.failure) {
      group.failure = this.fullWidthRow('jp-pscluster-run-failure', run);
      group.failure.onclick = () => this.openRuns([run]);
      group.row.after(group.failure);
    }
    const cell = group.failure.cells[0];
    cell.replaceChildren(keptFailureNode(cell, run.failure, false));
    group.failure.title = `${failureWhere(run.failure)}: ${run.failure.cause}`;
  }

  private fullWidthRow(className: string, run: RunInfo): HTMLTableRowElement {
    const row = el('tr', className);
    row.dataset.runId = String(run.id);
    row.dataset.store = run.store;
    row.append(el('td'));
    row.cells[0].colSpan = RUN_COLUMNS.length;
    return row;
  }

  private updateCompare(): void {
    this.compareButton.disabled = this.checked.size < 2;
    this.compareButton.textContent = this.checked.size ? `Compare ${this.checked.size} runs` : 'Compare checked runs';
  }

  private runGroup(run: RunInfo): RunGroup {
    const body = el('tbody', 'jp-pscluster-run-group');
    const row = this.runRow(run);
    const details = this.fullWidthRow('jp-pscluster-run-details', run);
    details.cells[0].id = `pscluster-run-details-${++this.detailsCount}`;
    const facts = new Map(runFacts(run).map(([label]) => [label, el('dd')]));
    const list = el('dl', 'jp-pscluster-run-facts');
    for (const [label, value] of facts) {
      const line = ['hyperparameters', 'divergence'].includes(label) ? 'jp-pscluster-fact-line' : ''; // too long
      list.append(el('dt', line, label), value);
      value.className = line;
    }
    const csv = el('a', 'jp-pscluster-download', 'CSV');
    csv.href = apiUrl(runPath(run, 'metrics.csv'));
    csv.title = `Download the metrics of ${run.name} (raw rows)`;
    details.cells[0].append(list, csv);
    body.append(row, details);
    row.cells[0].append(this.detailsToggle(run, body, details.cells[0].id));
    return { body, row, facts, failure: null };
  }

  /** The button that opens and closes the details of `run` (the rows of `body`; `controls`: their cell's id). */
  private detailsToggle(run: RunInfo, body: HTMLTableSectionElement, controls: string): HTMLButtonElement {
    const toggle = el('button', 'jp-pscluster-icon-button jp-pscluster-run-toggle');
    toggle.append(caretRightIcon.element({ tag: 'span' }));
    toggle.setAttribute('aria-label', `Details of ${run.name}`);
    toggle.setAttribute('aria-controls', controls);
    toggle.setAttribute('aria-expanded', 'false');
    toggle.title = 'Show or hide what the row leaves out';
    toggle.onclick = event => {
      event.stopPropagation(); // a run row opens its view on click
      const open = body.classList.toggle('jp-mod-expanded');
      toggle.setAttribute('aria-expanded', String(open));
    };
    return toggle;
  }

  private runRow(run: RunInfo): HTMLTableRowElement {
    const row = el('tr', 'jp-pscluster-run');
    row.dataset.runId = String(run.id);
    row.dataset.store = run.store;
    row.tabIndex = 0; // reached by Tab; Enter opens the run as a click does
    row.onkeydown = event => {
      if (event.key === 'Enter' && event.target === row) {
        row.click();
      }
    };
    for (const [cell] of RUN_COLUMNS) {
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
    row.cells[1].append(check);
    return row;
  }

  private updateRun(group: RunGroup, run: RunInfo): void {
    const [, , name, status, step, speed, loss, wall, config, actions] = Array.from(group.row.cells);
    name.textContent = run.name;
    name.title = `${run.name} on ${run.cluster} (${run.mode}): open its plots`;
    const diverging = run.divergence ? `, ${run.divergence.words}` : '';
    group.row.setAttribute('aria-label', `${run.name}, ${run.status}${diverging}: Enter opens its plots`);
    // rebuilt only when it changes: a refresh leaves the nodes a reader (or a screen reader) is on in place
    const shown = `${run.status}\n${run.divergence?.words ?? ''}`;
    if (status.dataset.shown !== shown) {
      status.dataset.shown = shown;
      status.replaceChildren(run.status);
      if (run.divergence) {
        const warning = el('span', 'jp-pscluster-diverging', ' ⚠');
        warning.append(el('span', 'jp-pscluster-diverging-words', ` ${run.divergence.words}`));
        status.append(warning);
      }
    }
    status.className = `jp-pscluster-run-status jp-pscluster-status-${run.status}`;
    status.title = run.divergence?.line ?? '';
    step.replaceChildren(String(run.global_step));
    if (run.steps) {
      step.append(el('span', 'jp-pscluster-step-total', `/${run.steps}`));
    }
    if (run.epochs_text) {
      step.append(el('span', 'jp-pscluster-step-epoch', ` · ${run.epochs_text}`));
    }
    step.title = run.epochs_text;
    speed.textContent = sig(run.steps_per_s, 3);
    loss.replaceChildren(el('span', 'jp-pscluster-run-final', sig(run.loss)), sparkline(run.sparkline_path));
    loss.title = `final ${finals(run.final, 6).join(', ')}`;
    wall.textContent = duration(run.wall_s);
    config.textContent = settings(run.hyperparameters);
    config.title = config.textContent;
    group.row.onclick = () => this.openRuns([run]);
    this.updateDetails(group.facts, run);
    const live = LIVE.has(run.status);
    if (live && !actions.querySelector('.jp-pscluster-stop-run')) {
      const title = `Stop ${run.name} at the next step of every worker`;
      actions.append(
        this.actionButton(
          `Stop ${run.name}`,
          'jp-pscluster-stop-run',
          title,
          () =>
            confirmAndPost(
              `Stop run ${run.name}?`,
              `Ends ${run.name} at the next step; what it trained stays on its cluster.`,
              runPath(run, 'stop')
            ),
          stopIcon
        )
      );
    } else if (!live) {
      actions.querySelector('.jp-pscluster-stop-run')?.remove();
    }
  }

  private updateDetails(facts: Map<string, HTMLElement>, run: RunInfo): void {
    for (const [label, text] of runFacts(run)) {
      facts.get(label)!.textContent = text;
    }
    facts.get('final')!.append(sparkline(run.sparkline_path));
  }

  /** A button that runs `action` (a confirmed request) and refreshes the panel after it. It shows `label`, or
   * `icon` named `label` for screen readers. */
  private actionButton(
    label: string,
    className: string,
    title: string,
    action: () => Promise<ActionResult | null>,
    icon?: LabIcon
  ): HTMLButtonElement {
    const button = icon
      ? el('button', `jp-pscluster-icon-button ${className}`)
      : el('button', `jp-Button jp-mod-styled jp-mod-warn ${className}`, label);
    if (icon) {
      button.append(icon.element({ tag: 'span' }));
      button.setAttribute('aria-label', label);
    }
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
  private readonly runGroups = new Map<string, RunGroup>(); // by runKey
  private readonly runs = new Map<string, RunInfo>(); // by runKey: the latest listed
  private readonly checked = new Set<string>(); // runKeys
  private readonly compareButton = el('button', 'jp-Button jp-mod-styled jp-mod-accept jp-pscluster-compare');
  private clustersSignature = '';
  private detailsCount = 0; // numbers the ids of the details' cells
}
