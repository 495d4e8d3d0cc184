// System: what the collector is and holds (sizes, tables, retention), and the dashboard token
// for guarded collectors (kept in this browser's localStorage only).
import { html, useState } from "../lib/core.js";
import { get, post, getToken, setToken, currentPeer } from "../lib/api.js";
import { useResource, useTick, useAction } from "../lib/hooks.js";
import { notify } from "../lib/notify.js";
import { bytes, duration, num } from "../lib/format.js";
import { Page, Section, Loaded, Fields, Table, Ago, ConfirmButton, Action } from "../lib/ui.js";

function TokenEntry({ guarded }) {
  const [value, setValue] = useState("");
  const [stored, setStored] = useState(Boolean(getToken()));
  const [check, setCheck] = useState(null);
  const [run, busy] = useAction(notify);
  const save = (e) => {
    e.preventDefault();
    setToken(value.trim());
    setStored(Boolean(value.trim()));
    setValue("");
    setCheck(null);
    notify(value.trim() ? "Token stored in this browser." : "Token removed.", "ok");
  };
  const forget = () => { setToken(""); setStored(false); setCheck(null); notify("Token removed from this browser.", "ok"); };
  // A retention dry run is guarded and changes nothing: a safe way to try the token.
  const test = async () => {
    const r = await run(() => post("/api/system/retention", { apply: false }));
    setCheck(r ? "accepted" : "refused");
  };
  return html`<form class="form" onSubmit=${save} aria-label="Dashboard token">
    <p>${guarded
      ? "This collector guards dashboard changes (cancel, retry, schedules, alerts, artifacts, devices) with FLEET_DASH_TOKEN."
      : "This collector does not ask for a token (FLEET_DASH_TOKEN is unset): dashboard changes are open."}${" "}
      The token is kept in this browser's local storage and sent as <code>X-Fleet-Token</code>; it never leaves for another site.</p>
    <label>Token <input type="password" autocomplete="off" name="token" value=${value} onInput=${(e) => setValue(e.target.value)}
      placeholder=${stored ? "a token is stored; type to replace it" : "paste the dashboard token"} /></label>
    <div class="row">
      <button type="submit" class="btn primary" disabled=${!value.trim()}>Save token</button>
      ${stored ? html`<button type="button" class="btn" onClick=${forget}>Forget token</button>` : null}
      <button type="button" class="btn" onClick=${test} disabled=${busy}>Test</button>
      <span role="status" class=${check === "refused" ? "bad" : "good"}>${stored ? "A token is stored." : "No token stored."}
        ${check ? ` The collector ${check} it.` : ""}</span>
    </div>
  </form>`;
}

function Retention({ retention }) {
  const [run, busy] = useAction(notify);
  const [outcome, setOutcome] = useState(null);
  const go = async (apply) => {
    const r = await run(() => post("/api/system/retention", { apply }), apply ? "Retention applied." : null);
    if (r) setOutcome(r);
  };
  const tables = outcome?.tables ? Object.entries(outcome.tables) : [];
  return html`<${Fields} pairs=${[
      ["Beacons kept", retention.beacons_days ? `${retention.beacons_days} days` : "forever"],
      ["Topic events kept", retention.events_days ? `${retention.events_days} days` : "forever"],
      ["Resolved alerts kept", retention.alerts_days ? `${retention.alerts_days} days` : "forever"],
      ["Automatic", retention.auto ? html`daily; next <${Ago} iso=${retention.next_run} />` : "off (FLEET_RETENTION_AUTO)"],
      ["Last run", retention.last_run ? html`<${Ago} iso=${retention.last_run.at} />` : null],
    ]} />
    ${currentPeer() ? null : html`<div class="row">
      <${Action} onClick=${() => go(false)} disabled=${busy}>Dry run<//>
      <${ConfirmButton} label="Prune now" question="Delete rows older than the policy?" confirmLabel="Prune" onConfirm=${() => go(true)} />
    </div>`}
    ${tables.length ? html`<${Table} label="Retention outcome" head=${["Table", "Kept for", "Older than", outcome.apply ? "Deleted" : "Would delete"]}
      rows=${tables.map(([name, t]) => html`<tr><td>${name}</td><td>${t.retain_days ? `${t.retain_days} d` : "forever"}</td>
        <td><${Ago} iso=${t.older_than} /></td><td>${num(outcome.apply ? t.deleted : t.would_delete)}</td></tr>`)} />` : null}`;
}

export function System() {
  useTick();
  const res = useResource(async () => {
    const [health, system] = await Promise.all([get("/api/health"), get("/api/system")]);
    return { health, system };
  }, []);
  return html`<${Page} title="System">
    <${Loaded} res=${res}>${({ health: h, system: s }) => html`
      <div class="grid two">
        <${Section} title="Collector" id="sys-collector"><${Fields} pairs=${[
          ["Name", h.name], ["Id", html`<span class="mono">${h.collector}</span>`], ["Up for", duration(h.uptime_s)],
          ["Started", html`<${Ago} iso=${h.started_at} />`], ["Runtime", h.node], ["Process", h.pid],
          ["Live clients", h.stream_clients], ["Token guard", h.guard ? "on" : "off"],
          ["Scheduler time zone", h.scheduler_tz], ["mDNS", h.mdns], ["CI statuses", s.ci_status?.armed ? "armed" : "dry runs"],
        ]} /><//>
        <${Section} title="Storage" id="sys-storage"><${Fields} pairs=${[
          ["Data directory", html`<span class="mono small">${s.data_dir}</span>`],
          ["Database", `${bytes(s.database.size_bytes)} + ${bytes(s.database.wal_bytes)} write-ahead log`],
          ["Free pages", num(s.database.freelist_pages)],
          ["Artifacts", `${num(s.artifacts.count)} files, ${bytes(s.artifacts.size_bytes)}`],
          ["Log", s.log ? `${bytes(s.log.size_bytes)} (${s.log.path})` : "not a file (journal or terminal)"],
        ]} /><//>
      </div>
      ${currentPeer() ? null : html`<${Section} title="Dashboard token" id="sys-token"><${TokenEntry} guarded=${h.guard} /><//>`}
      <div class="grid two">
        <${Section} title="Retention" id="sys-retention"><${Retention} retention=${s.retention} /><//>
        <${Section} title="Rows per table" id="sys-tables">
          <${Table} label="Rows per table" head=${["Table", "Rows"]}
            rows=${Object.entries(s.tables).map(([k, v]) => html`<tr><td>${k}</td><td class="num">${num(v)}</td></tr>`)} />
        <//>
      </div>`}<//>
  <//>`;
}
