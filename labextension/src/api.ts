/**
 * The REST payloads of pscluster's server extension and the one function that asks for them.
 * Every interface here mirrors a dataclass of pscluster/labserver/models.py, field for field
 * (tests/labserver/test_models.py compares them).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface TaskInfo {
  role: string;
  task: number;
  engine: number | null;
  host: string;
  pid: number | null;
  device: string;
  state: string;
}

export interface ClusterInfo {
  name: string;
  owner_pid: number;
  owner_kernel: string | null;
  started: number;
  state: string;
  ps: number;
  workers: number;
  hosts: string[];
  devices: string[];
  tasks: TaskInfo[];
}

export interface SkippedCluster {
  name: string;
  reason: string;
}

export interface ClusterList {
  clusters: ClusterInfo[];
  skipped: SkippedCluster[];
}

export interface Failure {
  cause: string;
  task: string | null;
  step: number | null;
  traceback: string | null;
}

export interface Divergence {
  since_step: number;
  loss: number;
  reference: number;
  threshold: number;
  words: string;
  line: string;
}

export interface RunInfo {
  id: number;
  store: string;
  name: string;
  cluster: string;
  mode: string;
  status: string;
  started: number;
  ended: number | null;
  steps: number | null;
  global_step: number;
  steps_per_s: number | null;
  wall_s: number | null;
  loss: number | null;
  final: Record<string, number | null>;
  hyperparameters: Record<string, string | number | boolean>;
  sparkline: number[];
  sparkline_path: string;
  failure: Failure | null;
  epochs: Record<string, number>;
  epochs_text: string;
  divergence: Divergence | null;
}

export interface RunList {
  runs: RunInfo[];
  message: string | null;
}

/** A worker's columns of a series: `x`, `time_last`, `local_steps_per_s`, `{name}_mean`... (null for NaN). */
export type Columns = Record<string, (number | null)[]>;

export interface Evaluation {
  global_step: number;
  time: number;
  loss: number | null;
  accuracy: number | null;
}

export interface LearningRate {
  step: number;
  time: number;
  lr: number;
}

export interface SeriesData {
  run: RunInfo;
  x: string;
  start: number | null;
  stop: number | null;
  names: string[];
  available: string[];
  resolution: number;
  workers: { worker: number; columns: Columns }[];
  evaluations: Evaluation[];
  learning_rates: LearningRate[];
  speed_window_s: number;
}

/** A figure as the notebook draws it, for plotly.js: `data` (its traces) and `layout`. */
export interface Figure {
  name: string;
  data: object[];
  layout: Record<string, unknown>;
}

export interface FigureList {
  run: RunInfo;
  figures: Figure[];
}

export interface Comparison {
  runs: RunInfo[];
  metric: string;
  available: string[];
  figure: Figure;
}

export interface ActionResult {
  action: string;
  target: string;
  state: string;
}

export interface ErrorReply {
  error: string;
}

/** An answer other than 200, with the server's one-line message. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string
  ) {
    super(message);
  }
}

/** The API path of `action` on `run`: its id, and its store as the query argument `store`. */
export function runPath(run: RunInfo, action: string, params: Record<string, string> = {}): string {
  return `runs/${run.id}/${action}?${new URLSearchParams({ store: run.store, ...params })}`;
}

/** A key that names `run` among the runs of every store. */
export function runKey(run: RunInfo): string {
  return `${run.store}\n${run.id}`;
}

/** The URL of `/pscluster/api/<path>` (a download link). */
export function apiUrl(path: string): string {
  return URLExt.join(ServerConnection.makeSettings().baseUrl, 'pscluster', 'api', path);
}

/** GET (or POST with `method: 'POST'`) `/pscluster/api/<path>` and decode its JSON. */
export async function requestAPI<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = apiUrl(path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ApiError(0, `the Jupyter server does not answer (${error}): is it still running?`);
  }
  const text = await response.text();
  let data: unknown = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    throw new ApiError(response.status, `unexpected answer from the server (HTTP ${response.status})`);
  }
  if (!response.ok) {
    const message = (data as ErrorReply | null)?.error ?? `HTTP ${response.status}`;
    throw new ApiError(response.status, message);
  }
  return data as T;
}
