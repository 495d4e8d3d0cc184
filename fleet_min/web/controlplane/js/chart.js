// Charts with the vendored uPlot: a time chart and a grouped bar chart over categories.
// Colours come from the page's CSS variables, so a chart follows the light/dark theme; the
// chart is rebuilt when the system theme changes and resized with its box.
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { html, useEffect, useRef, useState } from "./html.js";

const PALETTE = ["--chart-1", "--chart-2", "--chart-3", "--chart-4", "--chart-5"];
const dark = window.matchMedia("(prefers-color-scheme: dark)");

function css(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

function useTheme() {
  const [, setFlip] = useState(0);
  useEffect(() => {
    const onChange = () => setFlip((n) => n + 1);
    dark.addEventListener("change", onChange);
    return () => dark.removeEventListener("change", onChange);
  }, []);
  return dark.matches ? "dark" : "light";
}

// Axis numbers that fit 50 px: seconds as 45s / 15m / 2.5h, other numbers as 1.2k.
export function tick(value, unit = "") {
  if (value === null || value === undefined) return "";
  if (unit.trim() === "s") {
    const a = Math.abs(value);
    if (a < 60) return `${+value.toFixed(1)}s`;
    if (a < 3600) return `${+(value / 60).toFixed(1)}m`;
    return `${+(value / 3600).toFixed(1)}h`;
  }
  const a = Math.abs(value);
  if (a >= 1e6) return `${+(value / 1e6).toFixed(1)}M${unit}`;
  if (a >= 1e3) return `${+(value / 1e3).toFixed(1)}k${unit}`;
  return `${+value.toFixed(2)}${unit}`;
}

// Round steps for an axis in seconds (uPlot would otherwise pick 500, 1000, ... s).
const SECOND_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
const stepsFor = (unit) => (unit.trim() === "s" ? { incrs: SECOND_STEPS } : {});

function axis(extra = {}) {
  return { stroke: css("--muted"), grid: { stroke: css("--grid"), width: 1 }, ticks: { stroke: css("--grid") }, ...extra };
}

function Plot({ build, data, label, height, caption }) {
  const box = useRef(null);
  const plot = useRef(null);
  const theme = useTheme();
  const shape = JSON.stringify([theme, data.length, build.key]);
  useEffect(() => {
    const el = box.current;
    const width = Math.max(240, el.clientWidth);
    plot.current = new uPlot({ width, height, ...build.opts(width) }, data, el);
    const resize = new ResizeObserver(() => {
      const w = Math.max(240, el.clientWidth);
      if (plot.current && Math.abs(plot.current.width - w) > 2) plot.current.setSize({ width: w, height });
    });
    resize.observe(el);
    return () => {
      resize.disconnect();
      plot.current.destroy();
      plot.current = null;
    };
  }, [shape]);
  useEffect(() => {
    if (plot.current) plot.current.setData(data);
  }, [data]);
  return html`<figure class="chart">${caption ? html`<figcaption>${label}</figcaption>` : null}<div ref=${box} role="img" aria-label=${label}></div></figure>`;
}

// series: [{label, values, unit?}], x: unix seconds.
export function TimeChart({ x, series, label, height = 180, yRange, minSpan = 600, caption = true }) {
  const build = {
    key: series.map((s) => s.label).join("|"),
    opts: () => ({
      series: [{ value: (u, v) => (v == null ? "–" : new Date(v * 1000).toLocaleTimeString()) }, ...series.map((s, i) => ({ label: s.label, stroke: css(PALETTE[i % PALETTE.length]), width: 2, scale: s.scale || "y", value: (u, v) => (v == null ? "–" : `${v.toFixed(2)}${s.unit || ""}`) }))],
      axes: [axis({ space: 70 }), axis({ scale: "y", size: 50 }), ...(series.some((s) => s.scale === "pct") ? [axis({ scale: "pct", side: 1, grid: { show: false }, values: (u, v) => v.map((n) => `${n}%`) })] : [])],
      // at least `minSpan` seconds wide, so a young history does not read in milliseconds
      scales: { x: { time: true, range: (u, lo, hi) => [Math.min(lo, hi - minSpan), hi] }, y: yRange ? { range: yRange } : {}, pct: { range: [0, 100] } },
      cursor: { drag: { x: false, y: false } },
    }),
  };
  return html`<${Plot} build=${build} data=${[x, ...series.map((s) => s.values)]} label=${label} height=${height} caption=${caption} />`;
}

// categories: names on the x axis; series: [{label, values}] drawn as grouped bars.
// format: a value as a person reads it in the legend (e.g. durations as "7 min 37 s").
export function BarChart({ categories, series, label, height = 220, unit = "", format, caption = true }) {
  const n = series.length;
  const build = {
    key: `${categories.join("|")}#${series.map((s) => s.label).join("|")}`,
    opts: (width) => ({
      legend: { live: false },
      series: [{ label: "", value: (u, i) => categories[i] ?? "" }, ...series.map((s, i) => {
        const colour = css(PALETTE[i % PALETTE.length]);
        // each category's 80 % split between the series, a bar at most 64 px wide
        const slot = Math.min(0.8 / n, 64 / Math.max(1, width / categories.length));
        const start = -(slot * n) / 2;
        return {
          label: s.label, stroke: colour, fill: colour, width: 0,
          paths: uPlot.paths.bars({ disp: {
            x0: { unit: 1, values: (u) => u.data[0].map((j) => j + start + i * slot + slot * 0.05) },
            size: { unit: 1, values: () => [slot * 0.9] },
          } }),
          points: { show: false },
          value: (u, v) => (v == null ? "–" : format ? format(v) : `${Number(v).toFixed(1)}${unit}`),
        };
      })],
      axes: [axis({ splits: () => categories.map((_, i) => i), values: () => categories.map((c) => (c.length > 18 ? `${c.slice(0, 17)}…` : c)), grid: { show: false } }),
        axis({ size: 56, ...stepsFor(unit), values: (u, v) => v.map((x) => tick(x, unit)) })],
      scales: { x: { time: false, range: [-0.5, categories.length - 0.5] }, y: { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
      cursor: { drag: { x: false, y: false }, points: { show: false } },
    }),
  };
  return html`<${Plot} build=${build} data=${[categories.map((_, i) => i), ...series.map((s) => s.values)]} label=${label} height=${height} caption=${caption} />`;
}

// x is a number (runner counts): lines of several series, for the simulation comparison.
export function LineChart({ x, series, label, height = 220, xLabel, unit = "", format, caption = true }) {
  const build = {
    key: series.map((s) => s.label).join("|"),
    opts: () => ({
      series: [{ label: xLabel || "x", value: (u, v) => (v == null ? "–" : String(v)) }, ...series.map((s, i) => ({ label: s.label, stroke: css(PALETTE[i % PALETTE.length]), width: 2, points: { show: true, size: 7 }, value: (u, v) => (v == null ? "–" : format ? format(v) : `${Number(v).toFixed(1)}${unit}`) }))],
      axes: [axis({ label: xLabel, splits: () => x }), axis({ size: 56, ...stepsFor(unit), values: (u, v) => v.map((n) => tick(n, unit)) })],
      scales: { x: { time: false, range: [Math.min(...x) - 0.5, Math.max(...x) + 0.5] }, y: { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
      cursor: { drag: { x: false, y: false } },
    }),
  };
  return html`<${Plot} build=${build} data=${[x, ...series.map((s) => s.values)]} label=${label} height=${height} caption=${caption} />`;
}
