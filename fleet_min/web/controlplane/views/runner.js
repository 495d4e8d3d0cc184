// Runner detail: what the snapshot says (live), plus GET /api/runner?name= for its events,
// recent jobs, utilisation and the redacted tail of its diagnostic log.
import { html } from "../js/html.js";
import { state, readOnly, toast } from "../js/store.js";
import { download } from "../js/api.js";
import { Panel, Badge, StateBadge, Chips, KV, Meter, Empty, Loaded, Time, useFetch, SEVERITY_KIND, runnerOf } from "../js/ui.js";
import { RunnerActions } from "../js/actions.js";
import { driftOf } from "./overview.js";
import { dur, kb, bytes, pct, DASH } from "../js/format.js";

const REFRESH_MS = 15000;

function BundleButton({ name }) {
  if (readOnly()) return null;
  const save = () => download(`/api/runner/bundle?name=${encodeURIComponent(name)}`, state.token, `runner-${name}-bundle.txt`)
    .catch((err) => toast("bad", "Bundle refused", { error: err.message }));
  return html`<button type="button" disabled=${!state.token} onClick=${save}
    title=${state.token ? "A text file of the runner's state and files, every secret redacted" : "Enter the control token to download"}>Download bundle</button>`;
}

function registration(r) {
  if (r.registration !== "registered") return r.registration || DASH;
  const reg = r.registered || {};
  const id = reg.id !== undefined && reg.id !== null ? ` as #${reg.id}` : "";
  return `registered${id}${reg.status ? `, ${reg.status}` : ""}${reg.busy ? ", busy" : ""}`;
}

function Facts({ r }) {
  return html`<${Panel} id="facts" title="Runner">
    <${KV} rows=${[
      ["Repository", r.url ? html`<a href=${r.url} rel="noopener noreferrer" target="_blank">${r.repo || r.url}</a>` : r.repo],
      ["Directory", r.dir ? html`<code>${r.dir}</code>` : DASH],
      ["Version", `${r.version || DASH}${r.staged_versions?.length ? ` (staged: ${r.staged_versions.join(", ")})` : ""}`],
      ["Labels", html`<${Chips} items=${r.labels} />`],
      ["Host", r.remote ? `${r.host} (agent host${r.stale ? ", no recent report" : ""})` : r.host],
      ["GitHub", registration(r)],
      ["Draining", r.draining ? (r.draining_since ? html`<${Time} at=${r.draining_since} prefix="since " />` : "yes") : "no"],
    ]} />
  <//>`;
}

function Service({ r }) {
  const s = r.service || {};
  return html`<${Panel} id="service" title="Service and processes">
    <${KV} rows=${[
      ["Unit", html`<code>${s.unit || DASH}</code>`],
      ["Scope", s.scope],
      ["State", `${s.loaded ? "loaded" : "not loaded"}, ${s.active || "?"}${s.sub ? ` (${s.sub})` : ""}`],
      ["Main PID", s.main_pid || DASH],
      ["Listener", r.listener ? `pid ${r.listener.pid}, ${kb(r.listener.rss_kb)}, up ${dur(r.listener.uptime_s)}` : "not running"],
      ["Job workers", r.workers?.length ? r.workers.map((w) => `pid ${w.pid}, ${kb(w.rss_kb)}, up ${dur(w.uptime_s)}`).join("; ") : "none"],
    ]} />
  <//>`;
}

function Usage({ u }) {
  return html`<${Panel} id="usage" title="Utilisation">
    <${KV} rows=${[
      ["Busy now", u.busy_now ? "yes" : "no"],
      ["Last 24 h", html`<${Meter} value=${u.busy_24h_pct} label="busy share of the last 24 hours" /> ${pct(u.busy_24h_pct, 1)}`],
      ["Last 7 days", html`<${Meter} value=${u.busy_7d_pct} label="busy share of the last 7 days" /> ${pct(u.busy_7d_pct, 1)}`],
    ]} />
  <//>`;
}

function Jobs({ jobs }) {
  return html`<${Panel} id="jobs" title="Recent jobs" wide>
    ${jobs.length ? html`<div class="table-wrap"><table>
      <thead><tr><th scope="col">Job</th><th scope="col">Workflow</th><th scope="col">Outcome</th><th scope="col">Started</th><th scope="col">Took</th></tr></thead>
      <tbody>${jobs.map((j) => html`<tr>
        <td>${j.name} <span class="muted small">#${j.run_id}</span></td><td>${j.workflow || DASH}</td>
        <td><${Badge} kind=${j.conclusion === "success" ? "ok" : j.conclusion ? "bad" : "busy"}>${(j.conclusion || j.status || "unknown").replaceAll("_", " ")}<//></td>
        <td><${Time} at=${j.started_at} /></td><td>${dur(j.duration_s)}</td></tr>`)}</tbody>
    </table></div>` : html`<${Empty}>No job recorded for this runner yet.<//>`}
  <//>`;
}

function Events({ events }) {
  return html`<${Panel} id="events" title="Events">
    ${events.length ? html`<ul class="list compact">${events.map((e) => html`<li>
      <${Time} at=${e.at} /> <${Badge}>${e.kind}<//> <span>${e.message}</span></li>`)}</ul>`
      : html`<${Empty}>No event recorded yet.<//>`}
  <//>`;
}

function Diag({ d }) {
  return html`<${Panel} id="diag" title="Diagnostic log" wide>
    <${KV} rows=${[
      ["Files", `${d.files ?? 0}${d.total_bytes ? ` (${bytes(d.total_bytes)})` : ""}${
        d.more_entries ? `, in the first ${d.entries_examined} entries of a larger folder` : ""}`],
      ["Latest", d.latest ? html`${d.latest.name}, written <${Time} at=${d.latest.modified_at} />` : DASH],
      ["Errors / warnings", `${d.errors ?? 0} / ${d.warnings ?? 0}`],
      d.last_error ? ["Last error", html`<code class="wrap">${d.last_error}</code>`] : null,
    ]} />
    ${d.tail?.length ? html`<h3>Tail <span class="muted small">(secrets shown as ${"<redacted>"})</span></h3>
      <pre class="log" tabindex="0" aria-label="last lines of the runner log">${d.tail.join("\n")}</pre>`
      : html`<${Empty}>No diagnostic log in the runner's _diag folder.<//>`}
  <//>`;
}

export function RunnerView({ name }) {
  const snap = state.snap;
  const r = runnerOf(snap?.runners, name);
  const key = r ? `${r.state}|${r.draining}|${r.registration}|${Math.floor(Date.now() / REFRESH_MS)}` : "gone";
  const path = `/api/runner?name=${encodeURIComponent(r ? r.name : name)}`;
  const res = useFetch(r && !r.remote ? path : null, key);
  if (!snap) return html`<p class="muted" aria-busy="true">Waiting for the first snapshot…</p>`;
  if (!r) {
    return html`<div class="page-head"><a href="#/">← All runners</a></div>
      <${Empty}>No runner named <strong>${name}</strong> on this host now (deregistered or moved).<//>`;
  }
  if (r.remote) return html`<${RemoteRunner} r=${r} />`;
  const drift = driftOf(snap, r.name);
  return html`<div class="page-head">
      <a href="#/">← All runners</a>
      <h2 class="title" id="runner-title">${r.name} <${StateBadge} state=${r.state} /></h2>
      <div class="tools"><${RunnerActions} runner=${r} /><${BundleButton} name=${r.name} /></div>
    </div>
    ${drift.length ? html`<ul class="list drift">${drift.map((d) => html`<li><${Badge} kind=${SEVERITY_KIND[d.severity]}>${d.kind}<//><span>${d.message}</span></li>`)}</ul>` : null}
    <div class="grid">
      <${Facts} r=${r} />
      <${Service} r=${r} />
      <${Loaded} res=${res} what="Runner detail" path=${path}>${(detail) => html`
        <${Usage} u=${detail.utilization || {}} />
        <${Events} events=${detail.events || []} />
        <${Diag} d=${detail.diag || {}} />
        <${Jobs} jobs=${detail.jobs || []} />`}<//>
    </div>`;
}

// A runner an agent host reports: what its report says, and the actions (forwarded to that
// host). Its service, processes, events, jobs, log and bundle are on the agent's own daemon.
function RemoteRunner({ r }) {
  return html`<div class="page-head">
      <a href="#/">← All runners</a>
      <h2 class="title" id="runner-title">${r.name} <${StateBadge} state=${r.state} /></h2>
      <div class="tools"><${RunnerActions} runner=${r} /></div>
    </div>
    <div class="grid">
      <${Facts} r=${r} />
      <${Panel} id="remote" title=${`On ${r.host}`}>
        <p>${r.name} runs on the agent host <strong>${r.host}</strong>. Actions taken here are sent to it
          and run there, in the order they were sent; their outcome shows here when it reports back.</p>
        <p class="muted">Its service, processes, events, jobs, diagnostic log and bundle are on ${r.host}'s own
          control plane.</p>
      <//>
    </div>`;
}

