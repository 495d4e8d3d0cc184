// Alerts: open ones first, then recent history; acknowledge and snooze.
import { html, useState } from "../lib/core.js";
import { get, post, currentPeer } from "../lib/api.js";
import { useResource, useTick, useAction } from "../lib/hooks.js";
import { setQuery } from "../lib/router.js";
import { notify } from "../lib/notify.js";
import { Page, Loaded, Table, Pill, Ago, JobLink, DeviceLink, Action, Link } from "../lib/ui.js";

const DEVICE_RULES = new Set(["device-offline", "thermal-critical", "low-battery"]);
const SNOOZES = [[3600, "1 hour"], [4 * 3600, "4 hours"], [86400, "1 day"], [7 * 86400, "1 week"]];

function Subject({ alert }) {
  if (alert.rule.startsWith("job-")) return html`<${JobLink} id=${alert.subject} />`;
  if (DEVICE_RULES.has(alert.rule)) return html`<${DeviceLink} id=${alert.subject} />`;
  if (alert.rule === "schedule-missed") return html`<${Link} to=${`/schedules/${encodeURIComponent(alert.subject)}`}>${alert.subject}<//>`;
  return html`<span>${alert.subject}</span>`;
}

function Snooze({ alert, run }) {
  const [secs, setSecs] = useState("3600");
  if (currentPeer() || alert.state !== "open") return null;
  const submit = (e) => { e.preventDefault(); run(() => post(`/api/alerts/${alert.id}/snooze`, { duration_s: Number(secs) }), `Snoozed ${alert.rule} ${alert.subject}.`); };
  return html`<form class="inline" onSubmit=${submit}>
    <label class="sr-only" for=${`snooze-${alert.id}`}>Snooze for</label>
    <select class="small" id=${`snooze-${alert.id}`} value=${secs} onChange=${(e) => setSecs(e.target.value)}>
      ${SNOOZES.map(([s, label]) => html`<option value=${s}>${label}</option>`)}</select>
    <button type="submit" class="btn small">Snooze</button></form>`;
}

function state(a) {
  if (a.state !== "open") return html`<${Pill} status="resolved" /> <${Ago} iso=${a.resolved_at} />`;
  const notes = [];
  if (a.acked_at) notes.push(html`<span class="chip">acked</span>`);
  if (a.snoozed_until) notes.push(html`<span class="chip">snoozed until <${Ago} iso=${a.snoozed_until} /></span>`);
  return html`<${Pill} status="open" /> ${notes}`;
}

export function Alerts({ query }) {
  useTick();
  const [which, setWhich] = useState(query.get("state") || "");
  const res = useResource(() => get("/api/alerts", { state: which }), [which], (e) => e.type === "alert");
  const [run, busy] = useAction(notify);
  const act = (fn, text) => run(fn, text);
  return html`<${Page} title="Alerts" subtitle="One row per rule and subject while the condition holds. Acked or snoozed alerts leave the banner.">
    <form class="filters" onSubmit=${(e) => e.preventDefault()}>
      <label>Show <select value=${which} onChange=${(e) => { setWhich(e.target.value); setQuery({ state: e.target.value }); }}>
        <option value="">open and resolved in the last day</option><option value="open">open</option>
        <option value="resolved">resolved</option><option value="all">all</option></select></label>
      <${Action} onClick=${() => run(() => post("/api/alerts/tick"), (r) => `Evaluated the rules: ${r.open} open.`)} disabled=${busy}>Evaluate now<//>
    </form>
    <${Loaded} res=${res}>${(d) => html`<${Table} label="Alerts" empty="No alerts. All quiet." className="alerts"
      head=${["Rule", "Subject", "State", "Detail", "Seen", ""]}
      rows=${d.alerts.map((a) => html`<tr class=${a.state === "open" && !a.muted ? "row-bad" : ""}>
        <td class="nowrap">${a.rule}</td><td><${Subject} alert=${a} /></td><td>${state(a)}</td>
        <td>${a.detail}</td>
        <td class="small nowrap">${a.seen_count}× since <${Ago} iso=${a.first_seen} /><br />last <${Ago} iso=${a.last_seen} /></td>
        <td class="actions-cell">${a.acked_at ? null : html`<${Action} kind="small" disabled=${busy}
            onClick=${() => act(() => post(`/api/alerts/${a.id}/ack`), `Acknowledged ${a.rule} ${a.subject}.`)}>Ack<//>`}
          <${Snooze} alert=${a} run=${act} /></td></tr>`)} />`}<//>
  <//>`;
}
