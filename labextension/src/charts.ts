/** Small SVG charts: a sparkline for the run list, line charts for the run view. */

const SVG = 'http://www.w3.org/2000/svg';

function element(tag: string, attributes: Record<string, string | number>): SVGElement {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) {
    node.setAttribute(key, String(value));
  }
  return node;
}

/** A series of a line chart: its label and its points. */
export interface Series {
  label: string;
  x: number[];
  y: number[];
}

const COLORS = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f'];

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

/** A line chart with axes' ranges, a title and a legend. */
export function lineChart(title: string, xLabel: string, series: Series[], width = 520, height = 260): SVGElement {
  const m = { left: 56, right: 12, top: 24, bottom: 34 };
  const svg = element('svg', { width, height, class: 'jp-pscluster-chart' });
  const [x0, x1] = extent(series.flatMap(s => s.x));
  const [y0, y1] = extent(series.flatMap(s => s.y));
  const sx = (v: number) => m.left + ((v - x0) / (x1 - x0)) * (width - m.left - m.right);
  const sy = (v: number) => height - m.bottom - ((v - y0) / (y1 - y0)) * (height - m.top - m.bottom);
  const text = (x: number, y: number, content: string, anchor = 'start') => {
    const node = element('text', { x, y, 'text-anchor': anchor, class: 'jp-pscluster-chart-text' });
    node.textContent = content;
    svg.appendChild(node);
  };
  svg.appendChild(
    element('rect', {
      x: m.left,
      y: m.top,
      width: width - m.left - m.right,
      height: height - m.top - m.bottom,
      class: 'jp-pscluster-chart-frame'
    })
  );
  text(m.left, 16, title);
  text(width - m.right, height - 6, xLabel, 'end');
  text(m.left, height - m.bottom + 14, x0.toPrecision(3));
  text(width - m.right, height - m.bottom + 14, x1.toPrecision(3), 'end');
  text(m.left - 4, m.top + 10, y1.toPrecision(3), 'end');
  text(m.left - 4, height - m.bottom, y0.toPrecision(3), 'end');
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    svg.appendChild(element('path', { d: path(s.x, s.y, sx, sy), fill: 'none', stroke: color, 'stroke-width': 1.5 }));
    const legend = element('text', { x: width - m.right - 4, y: m.top + 14 + 14 * i, 'text-anchor': 'end', fill: color });
    legend.textContent = s.label;
    svg.appendChild(legend);
  });
  return svg;
}
