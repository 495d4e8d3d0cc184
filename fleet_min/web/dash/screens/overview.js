// Overview: devices by status, queue by status, running jobs with progress, recent failures,
// next schedules, open alerts.
import { html } from "../lib/core.js";
import { get } from "../lib/api.js";
import { useResource, useTick } from "../lib/hooks.js";
import { href } from "../lib/router.js";
import { Page, Section, Loaded, Table, Pill, Ago, JobLink, DeviceLink, Meter, Empty } from "../lib/ui.js";

const QUEUE = ["queued", "waiting", "claimed", "done", "failed", "cancelled"];

async function load() {
  const [overview, running, schedules, alerts] = await Promise.all([
    get("/api/overview"),
    get("/api/jobs", { status: "claimed" }),
    get("/api/schedules"),
    get("/api/alerts", { state: "open" }),
  ]);
  return { overview, running: running.jobs, schedules: schedules.schedules, alerts: alerts.alerts };
}

function Counts({ items, base }) {
  return html`<ul class="counts">${items.map(([label, n, status]) => html`<li>
    <a href=${href(base) + (status ? `?status=${status}` : "")} class=${`count s-${status || label}`}>
      <b>${n ?? 0}</b><span>${label}</span></a></li>`)}</ul>`;
}

function progressOf(job, row) {
  const iters = job?.spec?.params?.measure_iters;
  const done = row.progress?.last_iter || 0;
  if (iters) return html`<${Meter} value=${done} max=${iters} label=${`${done} of ${iters} iterations`} /> <span class="muted">${done}/${iters}</span>`;
  return html`<span class="muted">${row.progress?.rows || 0} rows</span>`;
}

function Running({ rows, jobs }) {
  const byId = Object.fromEntries(jobs.map((j) => [j.job_id, j]));
  return html`<${Table} label="Running jobs" empty="No job is running." head=${["Job", "Workload", "Device", "Progress", "Lease ends"]}
    rows=${rows.map((r) => html`<tr>
      <td><${JobLink} id=${r.job_id} /></td><td>${r.workload}</td>
      <td><${DeviceLink} id=${r.claimed_by} /></td><td class="progress">${progressOf(byId[r.job_id], r)}</td>
      <td><${Ago} iso=${r.lease_deadline} /></td></tr>`)} />`;
}

// Half the width of a laptop screen: the workload goes under the job id and long ids and errors
// wrap, so that every column shows without scrolling.
function Failures({ rows }) {
  return html`<${Table} label="Recent failures" empty="No job has failed." className="fit failures"
    head=${["Job", "Error", "When"]}
    rows=${rows.slice(0, 8).map((r) => html`<tr>
      <td><${JobLink} id=${r.job_id} /><div class="muted small">${r.workload}</div></td>
      <td class="error-text">${r.last_error || html`<span class="muted">no error recorded</span>`}</td>
      <td class="when"><${Ago} iso=${r.finished_at} /></td></tr>`)} />`;
}

function NextSchedules({ schedules }) {
  const next = schedules.filter((s) => s.enabled && s.next_run)
    .sort((a, b) => a.next_run.localeCompare(b.next_run)).slice(0, 6);
  if (!next.length) return html`<${Empty}>No enabled schedule.<//>`;
  return html`<ul class="plain">${next.map((s) => html`<li>
    <a href=${href(`/schedules/${encodeURIComponent(s.id)}`)}>${s.id}</a>
    <span class="muted"> ${s.template?.workload ? `${s.template.workload} · ` : ""}</span><${Ago} iso=${s.next_run} /></li>`)}</ul>`;
}

function OpenAlerts({ alerts }) {
  if (!alerts.length) return html`<${Empty}>No open alerts.<//>`;
  return html`<ul class="plain">${alerts.slice(0, 8).map((a) => html`<li class=${a.muted ? "muted" : ""}>
    <${Pill} status=${a.muted ? "muted" : "open"} label=${a.rule} /> ${a.detail}</li>`)}</ul>`;
}

export function Overview() {
  useTick();
  const res = useResource(load, [], (e) => ["job", "device", "result", "schedule", "alert"].includes(e.type));
  return html`<${Page} title="Overview">
    <${Loaded} res=${res}>${(d) => html`
      <div class="grid two">
        <${Section} title=${`Devices (${d.overview.devices.total})`} id="ov-devices">
          <${Counts} base="/devices" items=${["online", "stale", "offline"].map((s) => [s, d.overview.devices[s], s])} />
        <//>
        <${Section} title="Queue" id="ov-queue">
          <${Counts} base="/jobs" items=${QUEUE.map((s) => [s, d.overview.queue[s] ?? 0, s])} />
        <//>
      </div>
      <${Section} title="Running" id="ov-running"><${Running} rows=${d.overview.running} jobs=${d.running} /><//>
      <div class="grid two">
        <${Section} title="Recent failures" id="ov-failures"><${Failures} rows=${d.overview.recent_failures} /><//>
        <div class="stack">
          <${Section} title="Open alerts" id="ov-alerts"><${OpenAlerts} alerts=${d.alerts} /><//>
          <${Section} title="Next schedules" id="ov-schedules"><${NextSchedules} schedules=${d.schedules} /><//>
        </div>
      </div>`}<//>
  <//>`;
}
