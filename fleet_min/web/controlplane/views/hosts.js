// The hosts of a federation (GET /api/hosts), and beside them (below them on a phone) the
// autoscale decisions (GET /api/autoscale) and the admission hook's decisions
// (GET /api/admission), each log scrolling inside its own panel.
import { html } from "../js/html.js";
import { Panel, Badge, Empty, Loaded, Table, Time, useFetch } from "../js/ui.js";
import { dur, num, plural, DASH } from "../js/format.js";

const REFRESH_MS = 10000;
const tick = () => Math.floor(Date.now() / REFRESH_MS);

function HostsTable({ hosts }) {
  const columns = [
    { label: "Host", cell: (h) => html`<span class="nowrap">${h.host}</span>` },
    { label: "Role", cell: (h) => html`<${Badge} kind=${h.role === "coordinator" ? "info" : ""}>${h.role || "agent"}<//>` },
    { label: "Runners", num: true, cell: (h) => num(Array.isArray(h.runners) ? h.runners.length : h.runners) },
    { label: "Busy / ceiling", num: true, cell: (h) => `${num(h.capacity?.busy)} / ${num(h.capacity?.ceiling)}` },
    { label: "Load", num: true, title: "1, 5 and 15 minutes", cell: (h) => (Array.isArray(h.load) ? h.load.map((x) => num(x)).join(" / ") : DASH) },
    { label: "Last report", cell: (h) => (h.local ? "this host" : html`<${Badge} kind=${h.stale ? "bad" : "ok"}
      title=${h.stale ? "no report within the stale limit" : "reporting"}><${Time} at=${h.last_heartbeat_at} /><//>`) },
    { label: "Commands", num: true, title: "commands waiting for the host to call in", cell: (h) => (h.pending_commands ? num(h.pending_commands) : "none") },
  ];
  return html`<${Table} label="Hosts" cls="compact" columns=${columns} rows=${hosts} rowKey=${(h) => h.host}
    rowAttrs=${(h) => ({ "data-host": h.host })} />`;
}

// On an agent host: the coordinator it reports to, when it last got an answer, and why the
// last call failed (a refusal such as another agent using this host's name shows here).
function CoordinatorLink({ link }) {
  return html`<p id="coordinator-link" class="small" data-ok=${link.last_error ? "false" : "true"}>
    This host reports to <code>${link.coordinator}</code>${link.last_ok_at
      ? html`, last answered <${Time} at=${link.last_ok_at} />` : ", which has taken no report yet"}.
    ${link.last_error ? html`<br /><span class="bad-text">Last call failed: ${link.last_error}</span>` : null}</p>`;
}

export function Hosts() {
  const res = useFetch("/api/hosts", `hosts-${tick()}`);
  const hosts = (res.data?.hosts || []).filter((h) => h && h.host);
  const link = hosts.find((h) => h.local)?.coordinator;
  return html`<div class="hosts-layout">
    <${Panel} id="hosts" title=${hosts.length ? `Hosts (${hosts.length})` : "Hosts"}>
      <${Loaded} res=${res} what="Hosts" path="/api/hosts">${() => (hosts.length ? html`<${HostsTable} hosts=${hosts} />
        ${link ? html`<${CoordinatorLink} link=${link} />` : null}
        ${hosts.length === 1 && !link ? html`<p class="muted small">No agent host reports to this one. An agent started with <code>--coordinator</code> pointing here shows up as it calls in.</p>` : null}`
        : html`<${Empty}>No host has reported.<//>`)}<//>
    <//>
    <div class="stack">
      <${Autoscale} />
      <${Admission} />
    </div>
  </div>`;
}

// A panel whose content may grow without bound (decision logs): its body scrolls inside a
// fixed height, so the screen stays one laptop screen tall however many decisions there are.
function Capped({ label, children }) {
  return html`<div class="capped" tabindex="0" role="region" aria-label=${label}>${children}</div>`;
}

const DIRECTION = { up: "add a runner", down: "remove a runner" };
const OUTCOME_KIND = { proposed: "info", executed: "ok", refused: "warn", failed: "bad" };

function actionText(action) {
  if (!action) return "no action";
  const verb = { "runner.duplicate": "duplicate", "runner.deregister": "deregister" }[action.id] || action.id;
  return action.args?.name ? `${verb} ${action.args.name}` : verb;
}

function Decision({ d }) {
  return html`<li data-outcome=${d.outcome}>
    <${Time} at=${d.last_seen_at || d.at} />
    <span><strong>${d.repo}</strong>: ${DIRECTION[d.direction] || d.direction}, ${actionText(d.action)}${" "}
      <${Badge} kind=${OUTCOME_KIND[d.outcome] || ""}>${d.outcome}<//>
      ${d.seen > 1 ? html` <span class="muted small">${plural(d.seen, "time")} since <${Time} at=${d.at} /></span>` : null}
      ${d.reasons?.length ? html`<br /><span class="muted small">${d.reasons.join("; ")}</span>` : null}
      ${d.result?.error ? html`<br /><span class="bad-text small">${d.result.error}</span>` : null}</span>
  </li>`;
}

function AutoscaleBody({ d }) {
  const mode = d.mode === "execute" ? "it runs what it decides" : "dry run: it proposes and runs nothing";
  return html`<p>${d.enabled ? html`Autoscale is <strong>enabled</strong>, ${mode}.` : "Autoscale is off: no decision is made (the autoscale setting turns it on)."}
    <span class="muted small"> Cooldown ${dur(d.cooldown_s)}, a copy idle for ${dur(d.idle_s)} is removed${d.evaluated_at ? html`; last looked <${Time} at=${d.evaluated_at} />` : null}.</span></p>
    ${(d.decisions || []).length ? html`<ul class="list compact">${d.decisions.map((x) => html`<${Decision} key=${x.id} d=${x} />`)}</ul>`
      : html`<${Empty}>No decision yet: nothing has called for more or fewer runners.<//>`}`;
}

function Autoscale() {
  const res = useFetch("/api/autoscale", `autoscale-${tick()}`);
  return html`<${Panel} id="autoscale" title="Autoscale decisions">
    <${Capped} label="Autoscale decisions"><${Loaded} res=${res} what="Autoscale" path="/api/autoscale">${(d) => html`<${AutoscaleBody} d=${d} />`}<//><//>
  <//>`;
}

const DECISION_KIND = { admitted: "ok", held: "warn", released: "info", timed_out: "bad" };

function job(a) {
  return `${a.repo || "?"} ${a.workflow ? `${a.workflow} / ` : ""}${a.job || "job"}${a.run_id ? ` #${a.run_id}` : ""}`;
}

function AdmissionBody({ d }) {
  const totals = d.totals || {};
  const decisions = d.decisions || [];
  if (!decisions.length && !Object.values(totals).some(Boolean)) {
    return html`<${Empty}>No job has passed the admission hook yet. It writes to <code>${d.log || "its log"}</code>, read as it grows.<//>`;
  }
  return html`<p class="totals">${Object.entries(totals).map(([k, n]) => html`<span class="total"><strong>${num(n)}</strong> ${k.replaceAll("_", " ")}</span>`)}</p>
    ${typeof d.wait_s?.p50 === "number" ? html`<p class="small">Held jobs waited ${dur(d.wait_s.p50)} (median), ${dur(d.wait_s.p90)} (p90), at most ${dur(d.wait_s.max)}.</p>` : null}
    <ul class="list compact">${decisions.map((a) => html`<li data-decision=${a.decision}>
      <${Time} at=${a.at} />
      <span><${Badge} kind=${DECISION_KIND[a.decision] || ""}>${(a.decision || "unknown").replaceAll("_", " ")}<//> ${job(a)}${a.runner ? ` on ${a.runner}` : ""}
        ${typeof a.wait_s === "number" ? html`, waited ${dur(a.wait_s)}` : null}
        ${a.reason ? html`<br /><span class="muted small">${a.reason}</span>` : null}</span></li>`)}</ul>
    ${d.bad_lines ? html`<p class="muted small">${plural(d.bad_lines, "line")} of the log could not be read.</p>` : null}`;
}

function Admission() {
  const res = useFetch("/api/admission?limit=60", `admission-${tick()}`);
  return html`<${Panel} id="admission" title="Admission decisions">
    <${Capped} label="Admission decisions"><${Loaded} res=${res} what="Admission" path="/api/admission">${(d) => html`<${AdmissionBody} d=${d} />`}<//><//>
  <//>`;
}
