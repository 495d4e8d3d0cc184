// History analytics (GET /api/analytics?days=): jobs, durations, queue times and outcomes per
// repository as plain figures and a duration chart; the browser-test figures; how far the
// history collection has come; and one repository's 30-day detail (GET /api/repo?name=).
import { html, useState } from "../js/html.js";
import { Panel, Badge, Empty, Loaded, Table, Figures, KV, Time, useFetch, runnerHref } from "../js/ui.js";
import { state } from "../js/store.js";
import { BarChart } from "../js/chart.js";
import { dur, share, num, plural, clock, DASH } from "../js/format.js";

export const repoHref = (repo) => `#/repo/${encodeURIComponent(repo)}`;

// The percentile keys an answer carries, in order: ["p50", "p90", "p95"].
export function pctKeys(rows, field) {
  const keys = new Set();
  for (const row of rows) for (const k of Object.keys(row?.[field] || {})) if (/^p\d+$/.test(k)) keys.add(k);
  return [...keys].sort((a, b) => Number(a.slice(1)) - Number(b.slice(1)));
}

// Outcomes as counts with their share: "2,255 success (91.8 %)", the largest first.
export function Outcomes({ counts }) {
  const entries = Object.entries(counts || {}).filter(([, n]) => typeof n === "number").sort((a, b) => b[1] - a[1]);
  const total = entries.reduce((sum, [, n]) => sum + n, 0);
  if (!total) return html`<span class="muted">none</span>`;
  const kind = (c) => (c === "success" ? "ok" : c === "failure" || c === "timed_out" ? "bad" : "");
  return html`<ul class="outcomes">${entries.map(([c, n]) => html`<li>
    <${Badge} kind=${kind(c)}>${c.replaceAll("_", " ")}<//> ${num(n)} <span class="muted">(${share(n / total)})</span></li>`)}</ul>`;
}

// Columns of percentiles of one field, e.g. "Duration p50", "Duration p90".
function pctColumns(rows, field, title) {
  return pctKeys(rows, field).map((k) => ({ label: `${title} ${k}`, num: true, cell: (r) => dur(r[field]?.[k]) }));
}

function RepoTable({ repos }) {
  const columns = [
    { label: "Repository", cell: (r) => html`<a href=${repoHref(r.repo)}>${r.repo}</a>` },
    { label: "Jobs", num: true, cell: (r) => num(r.jobs) },
    ...pctColumns(repos, "duration_s", "Duration"),
    { label: "Mean", num: true, cell: (r) => dur(r.duration_s?.mean) },
    ...pctColumns(repos, "queue_s", "Queue"),
    { label: "Failure rate", num: true, title: "failed of the jobs that succeeded or failed", cell: (r) => share(r.failure_rate) },
    { label: "Outcomes", cell: (r) => html`<${Outcomes} counts=${r.conclusions} />` },
  ];
  return html`<${Table} label="Job history by repository" columns=${columns} rows=${repos} rowKey=${(r) => r.repo}
    rowAttrs=${(r) => ({ "data-repo": r.repo })} />`;
}

function DurationChart({ repos }) {
  const keys = pctKeys(repos, "duration_s");
  if (!repos.length || !keys.length) return null;
  return html`<${BarChart} label="Job duration by repository" unit=" s" format=${dur}
    categories=${repos.map((r) => r.repo)}
    series=${keys.map((k) => ({ label: `duration ${k}`, values: repos.map((r) => r.duration_s?.[k] ?? null) }))} />`;
}

function FailureChart({ repos }) {
  if (!repos.some((r) => typeof r.failure_rate === "number")) return null;
  return html`<${BarChart} label="Failure rate by repository" unit="%" format=${(v) => `${v.toFixed(1)} %`}
    categories=${repos.map((r) => r.repo)}
    series=${[{ label: "failure rate", values: repos.map((r) => (typeof r.failure_rate === "number" ? 100 * r.failure_rate : null)) }]} />`;
}

function HistoryTable({ history }) {
  if (!history?.length) return html`<${Empty}>No repository is watched yet: the history is collected for the repositories this host's runners serve.<//>`;
  const columns = [
    { label: "Repository", cell: (h) => h.repo },
    { label: "Collected", cell: (h) => (h.backfill_complete ? html`<${Badge} kind="ok">complete<//>` : html`<${Badge} kind="warn">backfilling<//>`) },
    { label: "From", cell: (h) => html`<${Time} at=${h.backfill_since} />` },
    { label: "Runs", num: true, cell: (h) => num(h.runs_fetched) },
    { label: "Jobs", num: true, cell: (h) => num(h.jobs_fetched) },
    { label: "Last round", cell: (h) => html`<${Time} at=${h.last_round_at} />` },
    { label: "Problem", prose: true, cell: (h) => (h.error ? html`<span class="bad-text">${h.error}</span>` : html`<span class="muted">none</span>`) },
  ];
  return html`<${Table} label="History collection" columns=${columns} rows=${history} rowKey=${(h) => h.repo} />`;
}

function BrowserTests({ data }) {
  const install = data?.install_steps || {};
  const e2e = data?.e2e_jobs || {};
  if (!install.count && !e2e.jobs) {
    return html`<${Empty}>No browser install step and no end-to-end job in this window.<//>`;
  }
  const stepColumns = [
    { label: "Step", cell: (s) => s.name },
    { label: "Runs", num: true, cell: (s) => num(s.count) },
    ...pctColumns(install.by_name || [], "duration_s", "Took"),
  ];
  const jobColumns = [
    { label: "Job", cell: (j) => html`${j.name} <span class="muted small">${j.repo}${j.workflow ? ` · ${j.workflow}` : ""}</span>` },
    { label: "Jobs", num: true, cell: (j) => num(j.jobs) },
    { label: "Duration p50", num: true, cell: (j) => dur(j.duration_p50_s) },
    { label: "Queue p50", num: true, cell: (j) => dur(j.queue_p50_s) },
    { label: "Failure rate", num: true, cell: (j) => share(j.failure_rate) },
  ];
  return html`
    <h3>Installing browsers</h3>
    <${Figures} items=${[
      ["Install steps", num(install.count), `in ${plural(install.jobs || 0, "job")}`],
      ["Typical install", dur(install.duration_s?.p50), `p90 ${dur(install.duration_s?.p90)}`],
      ["Time spent installing", dur(install.total_s), install.share_of_job_time_pct != null ? `${num(install.share_of_job_time_pct, 1)} % of those jobs' time` : null],
      ["Failed installs", num(install.failed)],
    ]} />
    ${install.by_name?.length ? html`<${Table} label="Browser install steps" columns=${stepColumns} rows=${install.by_name} />` : null}
    <h3>End-to-end jobs</h3>
    <${Figures} items=${[
      ["Jobs", num(e2e.jobs)],
      ["Typical duration", dur(e2e.duration_s?.p50), `p90 ${dur(e2e.duration_s?.p90)}`],
      ["Typical queue", dur(e2e.queue_s?.p50), `p95 ${dur(e2e.queue_s?.p95)}`],
      ["Succeeded", share(e2e.success_rate), `${plural(e2e.failures || 0, "failure")}`],
    ]} />
    ${e2e.by_job?.length ? html`<${Table} label="End-to-end jobs" columns=${jobColumns} rows=${e2e.by_job} />` : null}
    ${data.rules ? html`<details class="rules"><summary>How these jobs and steps are recognised</summary>
      <${KV} rows=${Object.entries(data.rules).map(([k, v]) => [k.replaceAll("_", " "), html`<code class="wrap">${v}</code>`])} /></details>` : null}`;
}

function Window({ data }) {
  return data.since && data.until ? html`<p class="muted small">Jobs that finished from ${clock(data.since)} to ${clock(data.until)} (the last ${plural(data.days, "day")}), figured <${Time} at=${data.generated_at} />.</p>` : null;
}

export function Analytics() {
  const [days, setDays] = useState(30);
  const res = useFetch(`/api/analytics?days=${days}`, days);
  const picker = html`<label class="inline">Window <select value=${days} onChange=${(e) => setDays(Number(e.currentTarget.value))}>
    ${[7, 30, 90, 365].map((d) => html`<option value=${d}>${d} days</option>`)}</select></label>`;
  const data = res.data;
  return html`<div class="grid">
    <${Panel} id="analytics" wide title="Job history by repository" tools=${picker}>
      <${Loaded} res=${res} what="Analytics" path="/api/analytics">${() => {
        const repos = (data.repos || []).filter((r) => r && r.repo);
        return repos.length ? html`
          <${Window} data=${data} />
          <${DurationChart} repos=${repos} />
          <${RepoTable} repos=${repos} />
          <${FailureChart} repos=${repos} />
          <p class="muted small">Each repository's name opens its 30-day detail.</p>`
          : html`<${Empty}>No job finished in the last ${plural(days, "day")}${data.history?.length ? "" : ", and no repository is watched yet"}.<//>`;
      }}<//>
    <//>
    ${data && !res.error ? html`
      <${Panel} id="browser-tests" title="Browser tests"><${BrowserTests} data=${data.browser_test} /><//>
      <${Panel} id="history" title="History collection"><${HistoryTable} history=${data.history} /><//>` : null}
  </div>`;
}

// --- one repository ---------------------------------------------------------------------------

function RepoFigures({ d }) {
  const peak = d.concurrency_peak || {};
  return html`<${Figures} items=${[
    ["Jobs", num(d.jobs), `${plural(d.failures || 0, "failure")}`],
    ["Duration", dur(d.duration_s?.p50), `p50; p90 ${dur(d.duration_s?.p90)}, p95 ${dur(d.duration_s?.p95)}`],
    ["Queue", dur(d.queue_s?.p50), `p50; p95 ${dur(d.queue_s?.p95)}`],
    ["Failure rate", share(d.failure_rate)],
    ["Most at once", peak.jobs ? plural(peak.jobs, "job") : DASH, peak.at ? html`<${Time} at=${peak.at} />` : null],
  ]} />
  <h3>Outcomes</h3>
  <${Outcomes} counts=${d.conclusions} />`;
}

function Workflows({ rows }) {
  if (!rows?.length) return html`<${Empty}>No workflow ran in these 30 days.<//>`;
  const columns = [
    { label: "Workflow", cell: (w) => w.workflow },
    { label: "Jobs", num: true, cell: (w) => num(w.jobs) },
    { label: "Duration p50", num: true, cell: (w) => dur(w.duration_p50_s) },
    { label: "Queue p50", num: true, cell: (w) => dur(w.queue_p50_s) },
    { label: "Failure rate", num: true, cell: (w) => share(w.failure_rate) },
  ];
  return html`<${Table} label="Workflows" columns=${columns} rows=${rows} rowKey=${(w) => w.workflow} />`;
}

function RepoRunners({ d }) {
  const registered = Array.isArray(d.registered) ? d.registered : null;
  return html`${d.runners?.length ? html`<ul class="list compact">${d.runners.map((r) => html`<li>
      <${Badge} kind=${r.busy ? "busy" : r.state === "idle" ? "ok" : ""}>${r.state || "unknown"}<//>
      <span><a href=${runnerHref({ ...r, remote: r.host !== state.snap?.host?.name })}>${r.name}</a> <span class="muted small">on ${r.host}</span></span></li>`)}</ul>`
    : html`<${Empty}>No runner of this fleet serves it now.<//>`}
    <p class="muted small">${registered ? `${plural(registered.length, "runner")} registered with GitHub.`
      : "GitHub's list of its runners is not known (no token, or the token may not read it)."}</p>`;
}

export function RepoView({ name }) {
  const res = useFetch(`/api/repo?name=${encodeURIComponent(name)}`, name);
  const d = res.data;
  return html`<div class="page-head">
      <a href="#/analytics">← Analytics</a>
      <h2 class="title" id="repo-title">${name}</h2>
      <span class="muted">the last 30 days</span>
    </div>
    <div class="grid">
      <${Panel} id="repo-detail" title="Jobs">
        <${Loaded} res=${res} what="Repository detail" path="/api/repo">${() => html`<${RepoFigures} d=${d} />`}<//>
      <//>
      ${d && !res.error ? html`
        <${Panel} id="repo-runners" title="Runners"><${RepoRunners} d=${d} /><//>
        <${Panel} id="repo-workflows" title="Workflows" wide><${Workflows} rows=${d.workflows} /><//>` : null}
    </div>`;
}
