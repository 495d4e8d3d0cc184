// Overview: the host (vitals, capacity, GitHub), what needs attention (drift, alerts, queued
// runs and why they wait), the runners by group with their actions, and the runs in flight.
import { html } from "../js/html.js";
import { state } from "../js/store.js";
import { Panel, Badge, StateBadge, Chips, KV, Meter, Empty, Time, SEVERITY_KIND, runnerHref, runnerKey } from "../js/ui.js";
import { RunnerActions, HostActions } from "../js/actions.js";
import { TimeChart } from "../js/chart.js";
import { dur, mb, kb, num, pct, DASH } from "../js/format.js";

const SEVERITY_ORDER = { critical: 0, warning: 1, info: 2 };

export function driftOf(snap, name) {
  return (snap.drift || []).filter((d) => d.runner === name || (d.runners || []).includes(name));
}

function Vitals({ snap }) {
  const v = snap.vitals || {};
  const cap = snap.capacity || {};
  const limits = cap.limits || {};
  const load = Array.isArray(v.load) ? v.load : [];
  const memUsed = v.mem_total_mb ? 100 * (1 - v.mem_available_mb / v.mem_total_mb) : null;
  const diskUsed = v.disk_total_gb ? 100 * (1 - v.disk_free_gb / v.disk_total_gb) : null;
  return html`<${Panel} id="host" title="Host" tools=${html`<${HostActions} />`}>
    <div class="tiles">
      <div class="tile"><span class="tile-k">Load (1/5/15 min)</span>
        <span class="tile-v">${load.map((x) => num(x)).join(" / ") || DASH}</span>
        <${Meter} value=${v.load_per_core} max=${Math.max(limits.max_load_per_core || 1, v.load_per_core || 0)} high=${(limits.max_load_per_core || 1) * 0.8} label="load per core" />
        <span class="tile-s">${num(v.load_per_core)} per core, ${v.cores ?? DASH} cores</span></div>
      <div class="tile"><span class="tile-k">Memory</span>
        <span class="tile-v">${mb(v.mem_available_mb)} free</span>
        <${Meter} value=${memUsed} high=${85} label="memory used" />
        <span class="tile-s">of ${mb(v.mem_total_mb)}; ${v.swap_total_mb ? `swap ${mb(v.swap_used_mb)} of ${mb(v.swap_total_mb)}` : "no swap"}${v.memory_pressure ? `; pressure ${pct(v.memory_pressure.some_avg10_pct, 1)}` : ""}</span></div>
      <div class="tile"><span class="tile-k">Disk</span>
        <span class="tile-v">${v.disk_free_gb != null ? `${num(v.disk_free_gb, 1)} GiB free` : DASH}</span>
        <${Meter} value=${diskUsed} high=${90} label="disk used" />
        <span class="tile-s">of ${v.disk_total_gb != null ? `${num(v.disk_total_gb, 0)} GiB` : DASH}; up ${dur(v.uptime_s)}</span></div>
      <div class="tile"><span class="tile-k">Capacity</span>
        <span class="tile-v">${cap.runners ?? DASH} of ${cap.ceiling ?? DASH} runners</span>
        <${Meter} value=${cap.runners} max=${Math.max(cap.ceiling || 1, cap.runners || 0)} high=${cap.ceiling} label="runners against the ceiling" />
        <span class="tile-s">${cap.busy ?? DASH} busy, ${cap.idle ?? DASH} idle, room for ${cap.headroom ?? DASH} more</span></div>
    </div>
    ${cap.can_add === false
      ? html`<p class="note warn">No room for another runner: ${(cap.reasons || []).join("; ")}</p>`
      : html`<p class="note ok">Room for another runner (per repository at most ${limits.max_per_repo ?? DASH}).</p>`}
    <${LoadChart} />
    <${KV} rows=${[
      ["Host", `${snap.host?.name || DASH} (${snap.host?.platform || "?"}, ${snap.host?.supervisor || "?"})`],
      ["Runner root", html`<code>${snap.host?.root || DASH}</code>`],
      ["GitHub", githubLine(snap.github)],
    ]} />
  <//>`;
}

function githubLine(gh) {
  if (!gh) return DASH;
  if (!gh.token) return "no token: registrations and queued runs are unknown";
  const rate = gh.rate_limit || {};
  const repos = Object.values(gh.repos || {});
  const failing = repos.filter((r) => r?.error).length;
  const left = typeof rate.remaining === "number" ? `${num(rate.remaining)} of ${num(rate.limit)} requests left` : "no request made yet";
  const state = !repos.length ? "no repository watched yet"
    : failing ? `${failing} of ${repos.length} repositories failing` : "every repository refreshed";
  return `${left}; ${state}`;
}

function LoadChart() {
  const points = state.history.filter((p) => p.load1 !== null);
  if (points.length < 3) return null;
  return html`<${TimeChart} label="Load and busy runners over the last minutes" height=${140}
    x=${points.map((p) => p.t)}
    series=${[{ label: "load 1 min", values: points.map((p) => p.load1) },
      { label: "busy runners", values: points.map((p) => p.busy) }]} />`;
}

function Attention({ snap }) {
  const items = [...(snap.drift || []), ...(snap.alerts || [])]
    .sort((a, b) => (SEVERITY_ORDER[a.severity] ?? 3) - (SEVERITY_ORDER[b.severity] ?? 3));
  return html`<${Panel} id="attention" title=${`Drift and alerts (${items.length})`}>
    ${items.length ? html`<ul class="list">${items.map((a) => html`<li>
        <${Badge} kind=${SEVERITY_KIND[a.severity] || ""}>${a.kind || a.severity}<//>
        <span>${a.message}${a.runner ? html` <a href=${`#/runner/${encodeURIComponent(a.runner)}`} aria-label=${`details of ${a.runner}`}>details</a>` : null}</span>
      </li>`)}</ul>` : html`<${Empty}>Nothing has drifted: disk, services and GitHub agree.<//>`}
  <//>`;
}

function Queue({ snap }) {
  const causes = snap.queue_causes || [];
  return html`<${Panel} id="queue" title=${`Queued runs (${causes.length})`}>
    ${causes.length ? html`<ul class="list">${causes.map((q) => html`<li>
        <${Badge} kind=${q.cause === "dispatching" ? "info" : "warn"}>${q.cause}<//>
        <span><strong>${q.repo}</strong> ${q.workflow || ""} #${q.run_id}, waiting ${dur(q.queued_s)}: ${q.message}</span>
      </li>`)}</ul>` : html`<${Empty}>No run is waiting for a runner.<//>`}
  <//>`;
}

function RunnerRow({ r, snap }) {
  const drift = driftOf(snap, r.name);
  const gh = r.registration === "registered" ? `${r.registered?.status || "registered"}${r.registered?.busy ? ", busy" : ""}`
    : r.registration || "not known";
  // An agent's runner: its processes are that host's to know; say where it runs instead.
  const procs = r.remote ? `on ${r.host}${r.stale ? " (no recent report)" : ""}`
    : r.listener ? `listener ${kb(r.listener.rss_kb)}, up ${dur(r.listener.uptime_s)}` : "no listener";
  return html`<tr data-runner=${r.name} data-state=${r.state} data-host=${r.host}>
    <th scope="row" data-label="Runner"><a href=${runnerHref(r)}>${r.name}</a>${r.remote
      ? html` <${Badge} kind=${r.stale ? "warn" : "info"} title=${`reported by agent host ${r.host}; actions are forwarded to it`}>${r.host}<//>` : null}</th>
    <td data-label="State"><span><${StateBadge} state=${r.state} />${r.draining && r.draining_since ? html` <span class="muted small"><${Time} at=${r.draining_since} prefix="since " /></span>` : null}</span></td>
    <td data-label="Service"><span>${r.service?.active || DASH}${r.service?.sub && r.service.sub !== r.service.active ? ` (${r.service.sub})` : ""}</span></td>
    <td data-label="GitHub"><span>${gh}</span></td>
    <td data-label="Labels"><${Chips} items=${r.custom_labels?.length ? r.custom_labels : r.labels} /></td>
    <td data-label="Processes"><span>${procs}${r.workers?.length ? `; ${r.workers.length} job` : ""}</span></td>
    <td data-label="Drift"><span>${drift.length ? drift.map((d) => html`<${Badge} kind=${SEVERITY_KIND[d.severity] || ""} title=${d.message}>${d.kind}<//> `) : html`<span class="muted">none</span>`}</span></td>
    <td data-label="Version"><span>${r.version || DASH}${r.staged_versions?.length ? html` <span class="muted small">(+${r.staged_versions.join(", ")})</span>` : null}</span></td>
    <td class="row-actions"><${RunnerActions} runner=${r} /></td>
  </tr>`;
}

function Group({ group, snap, byKey }) {
  // By host and name (members); a snapshot from an older daemon lists names alone.
  const members = (group.members || group.runners.map((name) => ({ name, host: snap.host?.name })))
    .map((m) => byKey.get(runnerKey(m))).filter(Boolean);
  const queued = (snap.queue_causes || []).filter((q) => q.repo === group.key);
  return html`<div class="group" data-group=${group.key}>
    <h3>${group.key}
      <span class="group-sub">${group.busy} of ${group.total} busy${group.draining ? `, ${group.draining} draining` : ""}${queued.length ? `, ${queued.length} queued` : ""}</span></h3>
    <div class="table-wrap"><table class="runners cards">
      <thead><tr><th scope="col">Runner</th><th scope="col">State</th><th scope="col">Service</th><th scope="col">GitHub</th>
        <th scope="col">Labels</th><th scope="col">Processes</th><th scope="col">Drift</th><th scope="col">Version</th><th scope="col"><span class="sr-only">Actions</span></th></tr></thead>
      <tbody>${members.map((r) => html`<${RunnerRow} key=${runnerKey(r)} r=${r} snap=${snap} />`)}</tbody>
    </table></div>
  </div>`;
}

function Runners({ snap }) {
  const byKey = new Map((snap.runners || []).map((r) => [runnerKey(r), r]));
  const groups = snap.groups?.length ? snap.groups
    : [{ key: "all runners", runners: [], members: [...byKey.values()], total: byKey.size, busy: 0, draining: 0 }];
  const by = snap.groups?.[0]?.by;
  return html`<${Panel} id="runners" wide title=${`Runners (${byKey.size})${by ? ` by ${by}` : ""}`}>
    ${byKey.size ? groups.map((g) => html`<${Group} key=${g.key} group=${g} snap=${snap} byKey=${byKey} />`)
      : html`<${Empty}>No runner installation found under the runner root.<//>`}
  <//>`;
}

function Runs({ snap }) {
  const runs = snap.active_runs || [];
  return html`<${Panel} id="runs" wide title=${`Runs in flight (${runs.length})`}>
    ${runs.length ? html`<div class="table-wrap"><table class="cards">
      <thead><tr><th scope="col">Run</th><th scope="col">Repository</th><th scope="col">Status</th><th scope="col">Age</th><th scope="col">Jobs</th></tr></thead>
      <tbody>${runs.map((run) => html`<tr>
        <td data-label="Run"><span><a href=${run.url} rel="noopener noreferrer" target="_blank">${run.name || "run"} #${run.id}</a>${run.branch ? html` <span class="muted small">${run.branch}</span>` : null}</span></td>
        <td data-label="Repository"><span>${run.repo}</span></td>
        <td data-label="Status"><span><${Badge} kind=${run.status === "queued" ? "warn" : "busy"}>${(run.status || "unknown").replaceAll("_", " ")}<//></span></td>
        <td data-label="Age"><span><${Time} at=${run.created_at} /></span></td>
        <td data-label="Jobs"><span>${(run.jobs || []).map((j) => html`<div>${j.name}: ${j.runner ? html`on <a href=${`#/runner/${encodeURIComponent(j.runner)}`}>${j.runner}</a>` : html`<span class="muted">wants ${(j.labels || []).join(", ")}</span>`}</div>`)}</span></td>
      </tr>`)}</tbody></table></div>` : html`<${Empty}>No run is queued or in progress.<//>`}
  <//>`;
}

export function Overview() {
  const snap = state.snap;
  if (!snap) return html`<p class="muted" aria-busy="true">Waiting for the first snapshot…</p>`;
  return html`<div class="grid">
    <${Runners} snap=${snap} />
    <${Vitals} snap=${snap} />
    <div class="stack"><${Attention} snap=${snap} /><${Queue} snap=${snap} /></div>
    <${Runs} snap=${snap} />
  </div>`;
}
