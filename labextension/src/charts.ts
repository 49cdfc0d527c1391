/**
 * Charts: an SVG sparkline for the run list; plotly.js charts (see `plotly.ts`) for the run view and the
 * comparison of runs, with TensorBoard's smoothing.
 */
import { PlotDiv, PlotlyStatic } from './plotly';

const SVG = 'http://www.w3.org/2000/svg';

function element(tag: string, attributes: Record<string, string | number>): SVGElement {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) {
    node.setAttribute(key, String(value));
  }
  return node;
}

export const COLORS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f'];

function extent(values: number[]): [number, number] {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (Number.isFinite(v)) {
      lo = Math.min(lo, v);
      hi = Math.max(hi, v);
    }
  }
  if (lo === Infinity) {
    return [0, 1];
  }
  return lo === hi ? [lo - 1, hi + 1] : [lo, hi];
}

function path(xs: number[], ys: number[], sx: (v: number) => number, sy: (v: number) => number): string {
  const parts: string[] = [];
  xs.forEach((x, i) => {
    if (Number.isFinite(ys[i])) {
      parts.push(`${parts.length ? 'L' : 'M'}${sx(x).toFixed(1)},${sy(ys[i]).toFixed(1)}`);
    }
  });
  return parts.join('');
}

/** A sparkline of `values`, `width` x `height` pixels. */
export function sparkline(values: number[], width = 80, height = 18): SVGElement {
  const svg = element('svg', { width, height, class: 'jp-pscluster-sparkline' });
  if (values.length > 1) {
    const [lo, hi] = extent(values);
    const xs = values.map((_, i) => i);
    const d = path(
      xs,
      values,
      x => (x / (values.length - 1)) * (width - 2) + 1,
      y => height - 1 - ((y - lo) / (hi - lo)) * (height - 2)
    );
    svg.appendChild(element('path', { d, fill: 'none', stroke: 'currentColor', 'stroke-width': 1.2 }));
  }
  return svg;
}


/**
 * TensorBoard's scalar smoothing: an exponential moving average of weight `weight` (0: none, up to 0.999),
 * debiased like Adam's moments so the first points are not pulled towards 0. Missing values stay missing;
 * a constant series stays as it is.
 */
export function smooth(ys: (number | null)[], weight: number): (number | null)[] {
  const finite = ys.filter((y): y is number => y !== null && Number.isFinite(y));
  if (weight <= 0 || finite.every(y => y === finite[0])) {
    return ys;
  }
  let last = 0;
  let n = 0;
  return ys.map(y => {
    if (y === null || !Number.isFinite(y)) {
      return y;
    }
    last = last * weight + (1 - weight) * y;
    n++;
    return last / (1 - Math.pow(weight, n));
  });
}

/** A curve of a chart, or its marks: its points, and a colour of its own (default: by its place). */
export interface Line {
  name: string;
  x: number[];
  y: (number | null)[];
  color?: string;
}

/**
 * A chart: `key` names its div among the charts; `log` makes its y axis logarithmic, `zero` starts it at 0;
 * `smoothed` smooths its lines, `stepped` draws them as steps (a value holds until the next); `marks` are
 * drawn as points over the lines (test-set evaluations).
 */
export interface ChartSpec {
  key: string;
  title: string;
  lines: Line[];
  marks?: Line[];
  log?: boolean;
  zero?: boolean;
  smoothed?: boolean;
  stepped?: boolean;
}

/**
 * The plotly traces of a chart, as TensorBoard draws them: per line its values, and with smoothing the values
 * faint under the smoothed ones (named `<line> (raw)`, out of the legend); then the marks.
 */
function traces(spec: ChartSpec, weight: number): object[] {
  const lines = spec.lines.flatMap((line, i) => {
    const color = line.color ?? COLORS[i % COLORS.length];
    const group = { legendgroup: line.name, x: line.x, type: 'scatter', mode: 'lines' };
    const shape = spec.stepped ? 'hv' : 'linear';
    const raw = { ...group, y: line.y, name: line.name, line: { color, width: 1.5, shape } };
    if (weight <= 0) {
      return [raw];
    }
    return [
      { ...raw, name: `${line.name} (raw)`, opacity: 0.3, showlegend: false },
      { ...group, y: smooth(line.y, weight), name: line.name, line: { color, width: 1.8 } }
    ];
  });
  const marks = (spec.marks ?? []).map((mark, i) => ({
    type: 'scatter',
    mode: 'markers',
    x: mark.x,
    y: mark.y,
    name: mark.name,
    marker: {
      symbol: 'diamond',
      size: 10,
      color: mark.color ?? COLORS[i % COLORS.length],
      line: { width: 1.5, color: '#222' }
    }
  }));
  return [...lines, ...marks];
}

/**
 * Plotly charts in `node`, one div per chart key, redrawn in place (`draw`): a zoom the user made survives a
 * redraw until `xaxis` changes it. `onZoom` gets the x range a user zoomed any chart to, or null when they
 * reset it (a double click).
 */
export class Charts {
  constructor(
    readonly node: HTMLElement,
    private readonly onZoom: (range: [unknown, unknown] | null) => void
  ) {}

  async draw(plotly: PlotlyStatic, specs: ChartSpec[], xaxis: object, weight: number): Promise<void> {
    const keep = new Set(specs.map(s => s.key));
    for (const [key, div] of this.divs) {
      if (!keep.has(key)) {
        plotly.purge(div);
        div.remove();
        this.divs.delete(key);
      }
    }
    for (const spec of specs) {
      let div = this.divs.get(spec.key);
      const fresh = !div;
      if (!div) {
        div = document.createElement('div') as PlotDiv;
        div.className = 'jp-pscluster-plot';
        div.dataset.chart = spec.key;
        this.divs.set(spec.key, div);
      }
      this.node.append(div); // in the order of specs
      const layout = {
        title: { text: spec.title, font: { size: 13 } },
        xaxis: { automargin: true, ...xaxis },
        yaxis: {
          type: spec.log ? 'log' : 'linear',
          rangemode: spec.zero ? 'tozero' : 'normal',
          exponentformat: 'power',
          automargin: true
        },
        hovermode: 'x unified',
        margin: { l: 60, r: 20, t: 36, b: 40 },
        height: 280,
        showlegend: true,
        legend: { orientation: 'h', y: -0.3 },
        uirevision: 'keep'
      };
      await plotly.react(div, traces(spec, spec.smoothed ? weight : 0), layout, {
        displaylogo: false,
        responsive: true
      });
      if (fresh) {
        div.on('plotly_relayout', event => this.relayout(event));
      }
    }
  }

  private relayout(event: Record<string, unknown>): void {
    const range = (event['xaxis.range'] as [unknown, unknown] | undefined) ?? [
      event['xaxis.range[0]'],
      event['xaxis.range[1]']
    ];
    if (event['xaxis.autorange']) {
      this.onZoom(null);
    } else if (range[0] !== undefined) {
      this.onZoom(range);
    }
  }

  /** Free plotly's resources of every chart. */
  purge(plotly: PlotlyStatic): void {
    for (const div of this.divs.values()) {
      plotly.purge(div);
    }
  }

  private readonly divs = new Map<string, PlotDiv>();
}
