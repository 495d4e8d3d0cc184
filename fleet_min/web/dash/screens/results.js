// Results: benchmark charts per device and model (medians with min and max), UI test outcomes,
// and the latest result rows.
import { html, useState, useEffect, useMemo } from "../lib/core.js";
import { get } from "../lib/api.js";
import { useResource, useTick } from "../lib/hooks.js";
import { setQuery } from "../lib/router.js";
import { num, metricText, plural } from "../lib/format.js";
import { Bars } from "../lib/bars.js";
import { Page, Section, Loaded, Table, Pill, Ago, JobLink, DeviceLink, Pager, Empty } from "../lib/ui.js";

const LABELS = {
  decode_tok_s: "decode tokens/s", prefill_tok_s: "prefill tokens/s", ttft_ms: "time to first token (ms)",
  peak_mem_mb: "peak memory (MB)",
};

function Stat({ cell }) {
  if (!cell || cell.median === null || cell.median === undefined) return html`<span class="muted">–</span>`;
  return html`<span title=${`min ${num(cell.min, 3)}, max ${num(cell.max, 3)}, ${plural(cell.n, "sample")}`}>${num(cell.median, 2)}
    <span class="muted small nowrap">${num(cell.min, 1)}–${num(cell.max, 1)}</span></span>`;
}

const NO_MODEL = "no model named";

// One group of bars per model, devices ranked by their median: comparing devices on one model
// is what the chart is for. The label is the device's name; the group heading is the model.
function benchGroups(rows, metric) {
  const byModel = new Map();
  for (const r of rows) {
    const model = r.model || NO_MODEL;
    if (!byModel.has(model)) byModel.set(model, []);
    const cell = r[metric];
    const device = r.device_name || r.device_id;
    byModel.get(model).push({
      key: `${r.device_id}|${model}`, median: cell.median, min: cell.min, max: cell.max,
      label: html`<${DeviceLink} id=${r.device_id} name=${r.device_name} />`,
      detail: `${device} · ${model}: median ${num(cell.median, 2)}, min ${num(cell.min, 2)}, max ${num(cell.max, 2)} (${plural(cell.n, "sample")})`,
    });
  }
  return [...byModel.entries()].sort(([a], [b]) => a.localeCompare(b))
    .map(([model, items]) => ({ title: model, rows: items.sort((a, b) => b.median - a.median) }));
}

function BenchChart({ rows, metric }) {
  const shown = rows.filter((r) => r[metric] && typeof r[metric].median === "number");
  if (!shown.length) return html`<${Empty}>No run reported ${LABELS[metric] || metric}.<//>`;
  return html`<${Bars} title=${`${LABELS[metric] || metric}: median per device, grouped by model; the line spans min to max`}
    groups=${benchGroups(shown, metric)} />`;
}

function Bench({ filters }) {
  const [metric, setMetric] = useState("decode_tok_s");
  const res = useResource(() => get("/api/results/bench", filters), [JSON.stringify(filters)],
    (e) => e.type === "result" && e.final);
  const filtered = Boolean(filters.device || filters.model || filters.workload !== "benchmark");
  return html`<${Loaded} res=${res}>${(d) => (!d.rows.length
    ? html`<${Empty}>${filtered ? "No benchmark results match these filters."
      : "No benchmark results yet: they appear here when a device finishes a benchmark job."}<//>`
    : html`
    <div class="row">
      <label>Chart <select value=${metric} onChange=${(e) => setMetric(e.target.value)}>
        ${d.metrics.map((m) => html`<option value=${m}>${LABELS[m] || m}</option>`)}</select></label>
      ${d.truncated ? html`<span class="bad small">Only the newest rows were read; narrow the filters.</span>` : null}
    </div>
    <${BenchChart} rows=${d.rows} metric=${metric} />
    <${Table} label="Benchmarks" empty="No benchmark results match." className="bench"
      head=${["Device · model", "Backends", "Memory method", "Runs", ...d.metrics.map((m) => LABELS[m] || m), "Latest"]}
      rows=${d.rows.map((r) => html`<tr><td><${DeviceLink} id=${r.device_id} name=${r.device_name} />
        <div class="muted small">${r.model || NO_MODEL}</div></td>
        <td>${(r.backends || []).join(", ") || "–"}</td><td class="small">${r.mem_method || "–"}</td><td class="num">${r.runs}</td>
        ${d.metrics.map((m) => html`<td><${Stat} cell=${r[m]} /></td>`)}<td><${Ago} iso=${r.last_at} /></td></tr>`)} />`)}<//>`;
}

function Ui({ filters }) {
  const [page, setPage] = useState(1);
  const res = useResource(() => get("/api/results/ui", { device: filters.device, page }), [filters.device, page],
    (e) => e.type === "result" || (e.type === "job" && e.workload === "ui-test"));
  return html`<${Loaded} res=${res}>${(d) => html`
    <${Table} label="UI tests" empty="No UI test jobs yet." className="ui"
      head=${["Job", "Status", "App", "Pass", "Fail", "Flows", "Created"]}
      rows=${d.jobs.map((j) => html`<tr><td><${JobLink} id=${j.job_id} /></td><td><${Pill} status=${j.status} /></td>
        <td>${typeof j.app === "object" && j.app ? [j.app.name, j.app.build].filter(Boolean).join(" ") : j.app || "–"}</td>
        <td class="good">${j.pass}</td><td class=${j.fail ? "bad" : ""}>${j.fail}</td>
        <td><ul class="plain flows">${j.flows.map((f) => html`<li>
          <${Pill} status=${f.fail ? "failed" : "done"} label=${f.flow} /> ${f.pass}/${f.runs}
          ${f.latest_error ? html`<span class="error-text small"> ${f.latest_error}</span>` : null}</li>`)}</ul></td>
        <td><${Ago} iso=${j.created_at} /></td></tr>`)} />
    <${Pager} data=${d} onPage=${setPage} />`}<//>`;
}

function Rows({ filters }) {
  const [page, setPage] = useState(1);
  const res = useResource(() => get("/api/results", { device: filters.device, workload: filters.workload, page }),
    [filters.device, filters.workload, page], (e) => e.type === "result");
  return html`<${Loaded} res=${res}>${(d) => html`
    <${Table} label="Result rows" empty="No result rows." className="results"
      head=${["Job", "Attempt", "Device", "Iter", "OK", "Metrics", "Error", "Stored"]}
      rows=${d.results.map((r) => html`<tr class=${r.ok === false ? "row-bad" : ""}><td><${JobLink} id=${r.job_id} /></td>
        <td>${r.attempt}</td><td><${DeviceLink} id=${r.device_id} /></td><td>${r.iter === 0 ? "summary" : r.iter}</td>
        <td>${r.ok === null ? "–" : r.ok ? "yes" : "no"}</td><td class="metrics">${metricText(r.metrics)}</td>
        <td class="error-text">${r.error}</td><td><${Ago} iso=${r.created_at} /></td></tr>`)} />
    <${Pager} data=${d} onPage=${setPage} />`}<//>`;
}

export function Results({ query }) {
  useTick();
  const [filters, setFilters] = useState({
    device: query.get("device") || "", model: query.get("model") || "", workload: query.get("workload") || "",
  });
  const [settled, setSettled] = useState(filters);
  useEffect(() => {
    const t = setTimeout(() => { setSettled(filters); setQuery(filters); }, 300);
    return () => clearTimeout(t);
  }, [filters]);
  const bench = useMemo(() => ({ ...settled, workload: settled.workload || "benchmark" }), [settled]);
  const field = (k) => (e) => setFilters({ ...filters, [k]: e.target.value });
  return html`<${Page} title="Results">
    <form class="filters" role="search" onSubmit=${(e) => e.preventDefault()}>
      <label>Device <input value=${filters.device} onInput=${field("device")} placeholder="device id" /></label>
      <label>Model <input value=${filters.model} onInput=${field("model")} placeholder="model or backend" /></label>
      <label>Workload <input value=${filters.workload} onInput=${field("workload")} placeholder="benchmark" /></label>
    </form>
    <${Section} title="Benchmarks" id="res-bench"><${Bench} filters=${bench} /><//>
    <${Section} title="UI tests" id="res-ui"><${Ui} filters=${settled} /><//>
    <${Section} title="Latest result rows" id="res-rows"><${Rows} filters=${settled} /><//>
  <//>`;
}
