// Devices: the list (status, battery, thermal, pools, capabilities) and one device's detail
// (beacon charts, edit name/notes/pools, forget).
import { html, useState, useMemo } from "../lib/core.js";
import { get, post, patch, del, seg, currentPeer } from "../lib/api.js";
import { useResource, useTick, useAction } from "../lib/hooks.js";
import { navigate, href, setQuery } from "../lib/router.js";
import { notify } from "../lib/notify.js";
import { parseTime } from "../lib/format.js";
import { Chart } from "../lib/chart.js";
import {
  Page, Section, Loaded, Table, Pill, Ago, JobLink, DeviceLink, Fields, Chips, Battery, Thermal,
  ConfirmButton, Empty, Link,
} from "../lib/ui.js";

// The Devices list offers to forget, in one go, every device silent this long (a shelf cleared
// out, or a registry a flood filled); POST /api/devices/forget decides by the same horizon.
const SILENT_S = 7 * 86400;
// A shelf is tens or hundreds of devices; a registry a flood filled (up to FLEET_MAX_DEVICES) is
// listed as the devices seen last, and the count line says how many more there are.
const LISTED = 2000;

function matches(d, text, status) {
  if (status && d.status !== status) return false;
  if (!text) return true;
  const hay = [d.device_id, d.name, d.platform, d.kind, d.descriptor?.model, d.descriptor?.os,
    ...(d.pools || []), ...(d.capabilities || [])].join(" ").toLowerCase();
  return hay.includes(text.toLowerCase());
}

export function Devices({ query }) {
  useTick();
  const [text, setText] = useState(query.get("q") || "");
  const [status, setStatus] = useState(query.get("status") || "");
  const [expired, setExpired] = useState(query.get("expired") === "1");
  // Every agent beacons about once a minute: a large shelf reloads this list at most every 2 s.
  const res = useResource(() => get("/api/devices", { expired: expired ? "1" : "", limit: LISTED }), [expired],
    (e) => e.type === "device" || e.type === "beacon", 2000);
  const update = (next) => setQuery({ q: text, status, expired: expired ? "1" : "", ...next });
  const [run] = useAction(notify);
  const forgetSilent = () => run(() => post("/api/devices/forget", { silent_for_s: SILENT_S }),
    (r) => `Forgot ${r.forgotten.length} devices.` + (r.kept.length ? ` ${r.kept.length} locked by a running job stayed.` : ""));
  return html`<${Page} title="Devices" subtitle="Everything that registered: agents on devices and browser runners."
    actions=${currentPeer() ? null : html`<${Link} to="/devices/new" class="btn primary" id="add-device">Add a device<//>`}>
    <form class="filters" onSubmit=${(e) => e.preventDefault()} role="search">
      <label>Search <input type="search" value=${text} placeholder="id, name, model, pool…"
        onInput=${(e) => { setText(e.target.value); update({ q: e.target.value }); }} /></label>
      <label>Status <select value=${status} onChange=${(e) => { setStatus(e.target.value); update({ status: e.target.value }); }}>
        <option value="">any</option><option>online</option><option>stale</option><option>offline</option></select></label>
      <label class="check"><input type="checkbox" checked=${expired}
        onChange=${(e) => { setExpired(e.target.checked); update({ expired: e.target.checked ? "1" : "" }); }} /> include expired browser devices</label>
    </form>
    <${Loaded} res=${res}>${(d) => {
      const shown = d.devices.filter((x) => matches(x, text, status));
      const silent = d.devices.filter((x) => Date.now() - (parseTime(x.last_seen) ?? Date.now()) > SILENT_S * 1000).length;
      const hidden = d.expired_hidden || 0;
      const cut = d.cut ? ` (the ${d.devices.length} seen last of ${d.devices_total}; search covers these)` : "";
      return html`<p class="muted count-line">${shown.length} of ${d.devices.length} devices${cut}${hidden ? ` (${hidden} expired browser ${hidden === 1 ? "device" : "devices"} not listed)` : ""}
        ${silent ? html` <span id="forget-silent"><${ConfirmButton} small label=${`Forget ${silent} not seen for a week`}
          question=${`Forget the ${silent} devices not seen for 7 days? Their results are kept; one a running job holds locked stays.`}
          confirmLabel="Forget them" onConfirm=${forgetSilent} /></span>` : null}</p>
      <${Table} label="Devices" empty="No device matches." className="devices"
        head=${["Device", "Status", "Platform", "Model", "Battery", "Thermal", "Pools", "Capabilities", "Last seen"]}
        rows=${shown.map((x) => html`<tr>
          <td><${DeviceLink} id=${x.device_id} name=${x.name} />${x.name ? html`<div class="muted mono small">${x.device_id}</div>` : null}
            ${x.temporary ? html` <span class="chip" title=${`leaves after ${x.ttl_s} s of silence`}>temporary</span>` : null}</td>
          <td><${Pill} status=${x.status} /></td>
          <td>${x.platform || "–"}${x.kind ? html` <span class="muted">· ${x.kind}</span>` : null}</td>
          <td>${x.descriptor?.model || "–"}</td>
          <td><${Battery} beacon=${x.last_beacon} /></td>
          <td><${Thermal} value=${x.last_beacon?.thermal} /></td>
          <td><${Chips} items=${x.pools} /></td>
          <td><${Chips} items=${x.capabilities} empty="any workload" /></td>
          <td><${Ago} iso=${x.last_seen} /></td></tr>`)} />`;
    }}<//>
  <//>`;
}

function EditDevice({ device, onSaved }) {
  const [name, setName] = useState(device.name || "");
  const [notes, setNotes] = useState(device.notes || "");
  const [pools, setPools] = useState((device.pools_override ?? device.pools ?? []).join(", "));
  const [run, busy] = useAction(notify);
  const submit = async (e) => {
    e.preventDefault();
    const list = pools.split(",").map((p) => p.trim()).filter(Boolean);
    const body = { name: name.trim() || null, notes: notes.trim() || null };
    // Pools are sent only when changed: sending them sets an operator override.
    if (device.pools_override || list.join(",") !== (device.pools || []).join(",")) body.pools = list;
    const saved = await run(() => patch(`/api/devices/${seg(device.device_id)}`, body), "Device saved.");
    if (saved) onSaved();
  };
  const reset = async () => {
    const saved = await run(() => patch(`/api/devices/${seg(device.device_id)}`, { pools: null }),
      "Pools reset to what the device reports.");
    if (saved) onSaved();
  };
  return html`<form class="form" onSubmit=${submit}>
    <label>Name <input value=${name} maxlength="200" onInput=${(e) => setName(e.target.value)} placeholder="e.g. Pixel on the shelf" /></label>
    <label>Notes <textarea rows="2" maxlength="2000" onInput=${(e) => setNotes(e.target.value)}>${notes}</textarea></label>
    <label>Pools <input value=${pools} onInput=${(e) => setPools(e.target.value)} placeholder="comma-separated" />
      <span class="hint">Reported by the device: ${(device.reported_pools || []).join(", ") || "none"}.
      ${device.pools_override ? " An operator override is in force." : ""}</span></label>
    <div class="row">
      <button type="submit" class="btn primary" disabled=${busy}>Save</button>
      ${device.pools_override ? html`<button type="button" class="btn" disabled=${busy} onClick=${reset}>Use reported pools</button>` : null}
    </div>
  </form>`;
}

function BeaconCharts({ beacons }) {
  const series = useMemo(() => {
    const xs = beacons.map((b) => parseTime(b.at) / 1000);
    const num = (v) => (typeof v === "number" ? v : null);
    const pick = (k) => beacons.map((b) => num(b[k]));
    // load_1m as the agents in the field name it; load is its earlier name.
    const load = beacons.map((b) => num(b.load_1m) ?? num(b.load));
    return { xs, battery: pick("battery_pct"), mem: pick("mem_mb"), load };
  }, [beacons]);
  if (!beacons.length) return html`<${Empty}>No beacons yet.<//>`;
  const charts = [];
  if (series.battery.some((v) => v !== null)) charts.push(html`<${Chart} title="Battery %" yLabel="%" series=${[{ label: "battery %" }]} data=${[series.xs, series.battery]} />`);
  if (series.mem.some((v) => v !== null)) charts.push(html`<${Chart} title="Memory (MB)" yLabel="MB" series=${[{ label: "mem MB", color: "#2b9a66" }]} data=${[series.xs, series.mem]} />`);
  if (series.load.some((v) => v !== null)) charts.push(html`<${Chart} title="Load (1 min)" series=${[{ label: "load", color: "#e8590c" }]} data=${[series.xs, series.load]} />`);
  // Thermal state as its changes: a run of equal readings shows once, from its first beacon.
  const thermal = beacons.filter((b) => b.thermal)
    .filter((b, i, all) => i === 0 || all[i - 1].thermal !== b.thermal).slice(-12).reverse();
  return html`<div class="grid two">${charts}</div>
    ${thermal.length ? html`<h3>Thermal state changes (latest first)</h3><ul class="plain thermal">${thermal.map((b) => html`<li><${Ago} iso=${b.at} />: <${Thermal} value=${b.thermal} /></li>`)}</ul>` : null}
    ${charts.length ? null : html`<${Empty}>Beacons carry no battery, memory or load figures.<//>`}`;
}

function Beacons({ id }) {
  const since = useMemo(() => new Date(Date.now() - 24 * 3600 * 1000).toISOString(), [id]);
  const res = useResource(() => get(`/api/devices/${seg(id)}/beacons`, { since }), [id],
    (e) => e.type === "beacon" && e.device_id === id);
  if (currentPeer()) return html`<${Empty}>Beacon history is not read through a peer's view.<//>`;
  return html`<${Loaded} res=${res}>${(d) => html`<${BeaconCharts} beacons=${d.beacons} />`}<//>`;
}

export function DeviceDetail({ id }) {
  useTick();
  const res = useResource(async () => {
    const [device, jobs] = await Promise.all([get(`/api/devices/${seg(id)}`), get("/api/jobs", { device: id })]);
    return { device, jobs: jobs.jobs };
  }, [id], (e) => (e.type === "device" || e.type === "beacon") && e.device_id === id
    || (e.type === "job" && (e.claimed_by === id)));
  const [run] = useAction(notify);
  const forget = async () => {
    const ok = await run(() => del(`/api/devices/${seg(id)}`), `Forgot ${id}.`);
    if (ok) navigate(href("/devices"));
  };
  return html`<${Page} title=${res.data?.device?.name || id} subtitle=${res.data?.device?.name ? id : "Device"}
    actions=${html`<${ConfirmButton} label="Forget device" question=${`Forget ${id}? Its results are kept.`} confirmLabel="Forget" onConfirm=${forget} />`}>
    <${Loaded} res=${res}>${({ device: d, jobs }) => html`
      <div class="grid two">
        <${Section} title="Device" id="dev-info">
          <${Fields} pairs=${[
            ["Status", html`<${Pill} status=${d.status} /> <span class="muted">last seen <${Ago} iso=${d.last_seen} /></span>`],
            ["Platform", [d.platform, d.kind].filter(Boolean).join(" · ") || null],
            ["Model", d.descriptor?.model], ["OS", d.descriptor?.os], ["SoC", d.descriptor?.soc],
            ["RAM", d.descriptor?.ram_mb ? `${d.descriptor.ram_mb} MB` : null],
            ["Battery", html`<${Battery} beacon=${d.last_beacon} />`],
            ["Thermal", html`<${Thermal} value=${d.last_beacon?.thermal} />`],
            ["Pools", html`<${Chips} items=${d.pools} />`],
            ["Capabilities", html`<${Chips} items=${d.capabilities} empty="any workload (none declared)" />`],
            d.temporary ? ["Temporary", `leaves after ${d.ttl_s} s of silence${d.expired ? " (expired)" : ""}`] : null,
            d.busy ? ["Busy elsewhere", `${d.busy.job_id} on ${d.busy.collector}`] : null,
            ["Notes", d.notes], ["Address", d.address], ["First seen", html`<${Ago} iso=${d.first_seen} />`],
          ]} />
        <//>
        ${currentPeer() ? null : html`<${Section} title="Edit" id="dev-edit"><${EditDevice} device=${d} onSaved=${res.reload} /><//>`}
      </div>
      <${Section} title="Beacons (last 24 h)" id="dev-beacons"><${Beacons} id=${id} /><//>
      <${Section} title="Jobs" id="dev-jobs" actions=${html`<${Link} to=${`/results?device=${encodeURIComponent(id)}`}>Results of this device<//>`}>
        <${Table} label="Jobs of this device" empty="No jobs for this device yet." head=${["Job", "Status", "Workload", "Attempts", "Created", "Last error"]}
          rows=${jobs.map((j) => html`<tr><td><${JobLink} id=${j.job_id} /></td><td><${Pill} status=${j.status} /></td>
            <td>${j.workload}</td><td>${j.attempts}/${j.max_attempts}</td><td><${Ago} iso=${j.created_at} /></td>
            <td class="error-text">${j.last_error}</td></tr>`)} />
      <//>`}<//>
  <//>`;
}
