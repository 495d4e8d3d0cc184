// Executors: the host executors this collector knows (registered or polling), with what each
// declared, the devices attached to it and the jobs it holds; one that is gone (offline, holding
// no job) can be forgotten: a live one would poll on as a new name, offered every host job.
import { html, useState } from "../lib/core.js";
import { get, del, seg } from "../lib/api.js";
import { useResource, useTick, useAction } from "../lib/hooks.js";
import { setQuery } from "../lib/router.js";
import { notify } from "../lib/notify.js";
import { Page, Loaded, Table, Pill, Ago, JobLink, DeviceLink, Chips, ConfirmButton } from "../lib/ui.js";

// The pill colours of the device statuses, for the executor's own.
const TONE = { polling: "online", busy: "claimed", idle: "stale", offline: "offline" };

function matches(x, text) {
  if (!text) return true;
  const hay = [x.name, x.agent, ...(x.capabilities || []), ...x.attached.map((d) => d.device_id)]
    .join(" ").toLowerCase();
  return hay.includes(text.toLowerCase());
}

export function Executors({ query }) {
  useTick();
  const [text, setText] = useState(query.get("q") || "");
  const res = useResource(() => get("/api/executors"), [],
    (e) => e.type === "executor" || e.type === "device" || (e.type === "job" && e.executor === "host"), 2000);
  const [run] = useAction(notify);
  const forget = (name) => run(() => del(`/api/executors/${seg(name)}`), `Forgot ${name}.`);
  return html`<${Page} title="Executors" subtitle="Host executors: machines that run host jobs and drive the devices attached to them.">
    <form class="filters" onSubmit=${(e) => e.preventDefault()} role="search">
      <label>Search <input type="search" value=${text} placeholder="name, capability, device…"
        onInput=${(e) => { setText(e.target.value); setQuery({ q: e.target.value }); }} /></label>
    </form>
    <${Loaded} res=${res}>${(d) => {
      const shown = d.executors.filter((x) => matches(x, text));
      return html`<p class="muted count-line">${shown.length} of ${d.executors.length} executors</p>
      <${Table} label="Executors" className="executors"
        empty=${html`No executor matches. An executor appears once it registers or polls <code>/executor/next-job</code>.`}
        head=${["Executor", "Status", "Capabilities", "Attached devices", "Jobs", "Slots", "Last seen", ""]}
        rows=${shown.map((x) => html`<tr id=${`executor-${x.name}`}>
          <td><strong>${x.name}</strong>${x.agent ? html`<div class="muted small">${x.agent}</div>` : null}</td>
          <td><${Pill} status=${TONE[x.status] || x.status} label=${x.status} /></td>
          <td><${Chips} items=${x.capabilities} empty=${x.capabilities ? "nothing declared" : "any host workload"} /></td>
          <td>${x.attached.length ? html`<ul class="plain">${x.attached.map((a) => html`<li>
            <${DeviceLink} id=${a.device_id} /> <${Pill} status=${a.status} /></li>`)}</ul>` : html`<span class="muted">none</span>`}</td>
          <td>${x.jobs.length ? html`<ul class="plain">${x.jobs.map((j) => html`<li>
            <${JobLink} id=${j.job_id} /> <span class="muted">${j.workload}</span></li>`)}</ul>` : html`<span class="muted">none</span>`}</td>
          <td>${x.slots}</td>
          <td><${Ago} iso=${x.last_seen} /></td>
          <td>${x.status !== "offline" || x.jobs.length ? null : html`<${ConfirmButton} small label="Forget"
            question=${`Forget ${x.name}? Its jobs are kept; it reappears if it polls again.`}
            confirmLabel="Forget" onConfirm=${() => forget(x.name)} />`}</td></tr>`)} />`;
    }}<//>
  <//>`;
}
