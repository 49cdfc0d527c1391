/** Why a run failed, as the panel's row and the run view show it. */
import { Failure } from './api';

/** "failed on worker:1 at global step 37": where `failure` happened, as far as it is known. */
export function failureWhere(failure: Failure): string {
  const task = failure.task ? ` on ${failure.task}` : '';
  const step = failure.step !== null ? ` at global step ${failure.step}` : '';
  return `failed${task}${step}`;
}

/** The cause in one line under where it happened; with `traceback`, the whole traceback folded under it. */
function failureNode(failure: Failure, traceback: boolean): HTMLElement {
  const node = document.createElement('div');
  node.className = 'jp-pscluster-failure';
  node.dataset.failure = JSON.stringify(failure);
  const where = document.createElement('b');
  where.textContent = `${failureWhere(failure)}: `;
  const cause = document.createElement('span');
  cause.className = 'jp-pscluster-failure-cause';
  cause.textContent = failure.cause;
  node.append(where, cause);
  if (traceback && failure.traceback) {
    const details = document.createElement('details');
    const summary = document.createElement('summary');
    summary.textContent = 'traceback';
    const pre = document.createElement('pre');
    pre.textContent = failure.traceback;
    details.append(summary, pre);
    node.append(details);
  }
  return node;
}

/** The failure node in `within` when it shows `failure` already, else a new one: a view that refreshes keeps its
 * node (a traceback the reader unfolded stays unfolded, a reader of its text keeps it attached). */
export function keptFailureNode(within: HTMLElement, failure: Failure, traceback: boolean): HTMLElement {
  const shown = within.querySelector<HTMLElement>(':scope > .jp-pscluster-failure');
  return shown?.dataset.failure === JSON.stringify(failure) ? shown : failureNode(failure, traceback);
}
