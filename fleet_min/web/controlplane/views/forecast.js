// The next hour's demand (GET /api/forecast): how many jobs of each repository are expected to
// want a runner at once, from the same hour in past weeks and from the workflows' schedules,
// with the scheduled runs due and how good past forecasts turned out.
import { html } from "../js/html.js";
import { Panel, Badge, Empty, Loaded, Table, Time, useFetch } from "../js/ui.js";
import { BarChart } from "../js/chart.js";
import { num, pct, plural, clock, sentence } from "../js/format.js";

const CONFIDENCE_KIND = { high: "ok", medium: "info", low: "warn" };
const source = (entry, name) => (entry.predictions || []).find((p) => p?.source === name) || {};
const jobsAtOnce = (v) => (typeof v === "number" ? plural(v, "job") : "–");

function Confidence({ value }) {
  return value ? html`<${Badge} kind=${CONFIDENCE_KIND[value] || ""}>${value}<//>` : html`<span class="muted">none</span>`;
}

function FromHistory({ p }) {
  if (typeof p.value !== "number") return html`<span class="muted">${sentence(p.reason) || "No usable history."}</span>`;
  return html`${jobsAtOnce(p.value)} <span class="muted small">(${plural(p.weeks || 0, "week")})</span>`;
}

function FromSchedule({ p }) {
  const runs = p.runs || [];
  if (!runs.length) return html`<span class="muted">nothing due</span>`;
  return html`${jobsAtOnce(p.value)} <span class="muted small">(${plural(runs.length, "run")} due)</span>`;
}

function DemandTable({ repos }) {
  const columns = [
    { label: "Repository", cell: (e) => e.repo },
    { label: "Expected at once", num: true, cell: (e) => jobsAtOnce(e.expected?.value) },
    { label: "Confidence", cell: (e) => html`<${Confidence} value=${e.expected?.confidence} />` },
    { label: "From past weeks", prose: true, cell: (e) => html`<${FromHistory} p=${source(e, "history")} />` },
    { label: "From schedules", cell: (e) => html`<${FromSchedule} p=${source(e, "schedule")} />` },
    { label: "Why", prose: true, cell: (e) => sentence(e.expected?.reason) },
  ];
  return html`<${Table} label="Expected demand by repository" columns=${columns} rows=${repos} rowKey=${(e) => e.repo}
    rowAttrs=${(e) => ({ "data-repo": e.repo })} />`;
}

function DueRuns({ repos }) {
  const runs = repos.flatMap((e) => (source(e, "schedule").runs || []).map((r) => ({ ...r, repo: e.repo })));
  if (!runs.length) return html`<${Empty}>No scheduled workflow is due in that hour.<//>`;
  return html`<ul class="list compact">${runs.map((r) => html`<li>
    <${Time} at=${r.due_at} /><span><strong>${r.workflow || r.file}</strong> <span class="muted small">${r.repo}</span>:${" "}
      ${plural(r.jobs || 0, "self-hosted job")}, <code>${r.cron}</code> (${r.timezone})</span></li>`)}</ul>`;
}

function Scores({ scores }) {
  const scored = scores.filter((s) => s.scored);
  if (!scored.length) {
    return html`<${Empty}>No forecast has been scored yet: an hour is scored two hours after it ends, once the history covers it.<//>`;
  }
  const columns = [
    { label: "Repository", cell: (s) => s.repo },
    { label: "Hours scored", num: true, cell: (s) => num(s.scored) },
    { label: "Mean error", num: true, title: "mean absolute difference, in jobs at once", cell: (s) => `${num(s.mae)} jobs` },
    { label: "Bias", num: true, title: "positive: forecasts were too high", cell: (s) => `${s.bias > 0 ? "+" : ""}${num(s.bias)} jobs` },
    { label: "Within one job", num: true, cell: (s) => pct(s.within_one_pct, 0) },
  ];
  return html`<${Table} label="Forecast scores" columns=${columns} rows=${scored} rowKey=${(s) => s.repo} />`;
}

export function Forecast() {
  const res = useFetch("/api/forecast", "forecast");
  const d = res.data;
  const title = d?.hour_start ? `Next hour's demand, ${clock(d.hour_start)}–${clock(d.hour_end)}` : "Next hour's demand";
  return html`<div class="grid">
    <${Panel} id="forecast" wide title=${title}>
      <${Loaded} res=${res} what="Forecast" path="/api/forecast">${() => {
        const repos = (d.repos || []).filter((e) => e && e.repo);
        if (!repos.length) return html`<${Empty}>No repository is watched yet, so there is nothing to forecast.<//>`;
        // A chart of nothing but zeros says less than the table: drawn only when some job is expected.
        const charted = repos.filter((e) => [e.expected, source(e, "history"), source(e, "schedule")].some((p) => p?.value > 0));
        return html`
          <p class="muted small">How many jobs of each repository should want a runner at the same time in that hour, from the
            same hour in past weeks and from the workflows' schedules; worked out <${Time} at=${d.generated_at} />.</p>
          ${charted.length ? html`<${BarChart} label="Jobs expected at once next hour" format=${jobsAtOnce}
            categories=${charted.map((e) => e.repo)}
            series=${[{ label: "expected", values: charted.map((e) => e.expected.value) },
              { label: "from past weeks", values: charted.map((e) => source(e, "history").value ?? null) },
              { label: "from schedules", values: charted.map((e) => source(e, "schedule").value ?? null) }]} />` : null}
          <${DemandTable} repos=${repos} />`;
      }}<//>
    <//>
    ${d && !res.error ? html`
      <${Panel} id="forecast-due" title="Scheduled runs due"><${DueRuns} repos=${d.repos || []} /><//>
      <${Panel} id="forecast-scores" title="How past forecasts did"><${Scores} scores=${d.scores || []} /><//>` : null}
  </div>`;
}
