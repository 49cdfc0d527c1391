/**
 * The run list's sparkline of a run's loss: the line the server drew (`RunInfo.sparkline_path`, in the unit square),
 * stretched over a small SVG. The run view's figures are the notebook's (`runview.ts`).
 */

const SVG = 'http://www.w3.org/2000/svg';

/** A `width` x `height` pixel SVG of `path` (a path in the unit square). */
export function sparkline(path: string, width = 80, height = 18): SVGElement {
  const svg = document.createElementNS(SVG, 'svg');
  const attributes = { width, height, viewBox: '-0.02 -0.1 1.04 1.2', preserveAspectRatio: 'none' };
  Object.entries(attributes).forEach(([k, v]) => svg.setAttribute(k, String(v)));
  svg.setAttribute('class', 'jp-pscluster-sparkline');
  if (path) {
    const line = document.createElementNS(SVG, 'path');
    const stroke = { d: path, fill: 'none', stroke: 'currentColor', 'stroke-width': 1.2 };
    Object.entries(stroke).forEach(([k, v]) => line.setAttribute(k, String(v)));
    line.setAttribute('vector-effect', 'non-scaling-stroke');
    svg.appendChild(line);
  }
  return svg;
}
