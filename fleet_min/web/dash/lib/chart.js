// uPlot in a component: sized to its box, colours from the page's theme (light or dark).
import uPlot from "../../vendor/uplot/uPlot.esm.js";
import { html, useEffect, useRef } from "./core.js";

export const PALETTE = ["#2f7de1", "#e8590c", "#2b9a66", "#b44dc9", "#c9a227", "#d6336c", "#1098ad"];

function themed() {
  const css = getComputedStyle(document.documentElement);
  return {
    fg: css.getPropertyValue("--muted").trim() || "#777",
    grid: css.getPropertyValue("--line").trim() || "#ddd",
  };
}

function axis(theme, extra = {}) {
  return { stroke: theme.fg, grid: { stroke: theme.grid, width: 1 }, ticks: { stroke: theme.grid }, ...extra };
}

// series: [{label, color?, bars?}], data: [xs, ys1, ys2, ...]; time: x values are unix seconds.
export function Chart({ title, series, data, time = true, xLabels, height = 220, yLabel }) {
  const box = useRef(null);
  const plot = useRef(null);

  useEffect(() => {
    const el = box.current;
    if (!el) return undefined;
    const theme = themed();
    const opts = {
      width: Math.max(200, el.clientWidth),
      height,
      scales: { x: { time } },
      axes: [
        axis(theme, xLabels ? { values: (u, splits) => splits.map((i) => xLabels[i] ?? ""), space: 40 } : {}),
        axis(theme, { label: yLabel, size: 60 }),
      ],
      legend: { live: true },
      series: [{ label: time ? "time" : "" }, ...series.map((s, i) => ({
        label: s.label,
        stroke: s.color || PALETTE[i % PALETTE.length],
        fill: s.bars ? `${s.color || PALETTE[i % PALETTE.length]}99` : undefined,
        width: 2,
        spanGaps: false,
        points: { show: !s.bars, size: s.pointsOnly ? 8 : 5 },
        paths: s.bars ? uPlot.paths.bars({ size: [0.6, 80] }) : s.pointsOnly ? () => null : undefined,
      }))],
    };
    if (xLabels) opts.scales.x = { time: false, range: (u, min, max) => [min - 0.5, max + 0.5] };
    // Bars measure from zero; a range that starts elsewhere would exaggerate differences.
    if (series.some((s) => s.bars)) opts.scales.y = { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] };
    plot.current = new uPlot(opts, data, el);
    const resize = new ResizeObserver(() => {
      if (plot.current) plot.current.setSize({ width: Math.max(200, el.clientWidth), height });
    });
    resize.observe(el);
    return () => { resize.disconnect(); plot.current.destroy(); plot.current = null; };
  }, [JSON.stringify(series), JSON.stringify(xLabels), time, height, yLabel]);

  useEffect(() => { if (plot.current) plot.current.setData(data); }, [data]);

  return html`<figure class="chart"><figcaption>${title}</figcaption><div ref=${box} class="chart-box"
    role="img" aria-label=${title}></div></figure>`;
}
