// Small shared pieces of the screens.
import { html, shown, useState, useEffect, useRef } from "./core.js";
import { localTime, relative, shortSha, sentence } from "./format.js";
import { href } from "./router.js";
import { currentPeer, seg } from "./api.js";
import { notify } from "./notify.js";

export function Pill({ status, label }) {
  return html`<span class=${`pill s-${status}`}>${label ?? status}</span>`;
}

export function Ago({ iso }) {
  if (!iso) return html`<span class="muted">–</span>`;
  return html`<time datetime=${iso} title=${localTime(iso)}>${relative(iso)}</time>`;
}

// Without the asynchronous clipboard (plain http to another host is not a secure context), copy
// through a selection, which browsers still allow in answer to a click.
function copyBySelection(text) {
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  let copied = false;
  try { copied = document.execCommand("copy"); } catch { copied = false; }
  area.remove();
  return copied;
}

export function CopyButton({ value, what = "value" }) {
  const [copied, setCopied] = useState(false);
  const copy = async () => {
    let ok = false;
    try {
      await navigator.clipboard.writeText(value);
      ok = true;
    } catch {
      ok = copyBySelection(value);
    }
    notify(ok ? `Copied the ${what}.` : `This browser did not allow copying; select the ${what} instead.`, ok ? "ok" : "error");
    if (ok) { setCopied(true); setTimeout(() => setCopied(false), 2000); }
  };
  return html`<button type="button" class="btn small copy" onClick=${copy} aria-label=${`Copy the ${what}`}>${copied ? "Copied" : "Copy"}</button>`;
}

// A SHA-256: the first 12 digits with the whole value on hover, or (full) the whole value broken
// across lines wherever it must; either way with a Copy button. Never wider than its box.
export function Hash({ value, full = false, copy = true }) {
  if (!value) return html`<span class="muted">–</span>`;
  return html`<span class=${`hash ${full ? "full" : ""}`}><code title=${value}>${full ? value : `${shortSha(value)}…`}</code>${copy ? html` <${CopyButton} value=${value} what="SHA-256" />` : null}</span>`;
}

export function Link({ to, children, ...rest }) {
  return html`<a href=${href(to)} ...${rest}>${children}</a>`;
}

export function JobLink({ id }) {
  if (!id) return html`<span class="muted">–</span>`;
  return html`<${Link} to=${`/jobs/${seg(id)}`} class="mono">${id}<//>`;
}

export function DeviceLink({ id, name }) {
  if (!id) return html`<span class="muted">–</span>`;
  return html`<${Link} to=${`/devices/${seg(id)}`}>${name || id}<//>`;
}

// A host job's claimant is an executor: its row on the Executors screen.
export function ExecutorLink({ name }) {
  if (!name) return html`<span class="muted">–</span>`;
  return html`<${Link} to=${`/executors?q=${encodeURIComponent(name)}`}>${name}<//>`;
}

// Who holds (or held) a job: a device, or for a host job the executor.
export function ClaimantLink({ job, id }) {
  return job.executor === "host" ? html`<${ExecutorLink} name=${id} />` : html`<${DeviceLink} id=${id} />`;
}

export function Section({ title, actions, children, id }) {
  return html`<section class="card" aria-labelledby=${id}>
    <div class="card-head"><h2 id=${id}>${title}</h2>${actions ? html`<div class="actions">${actions}</div>` : null}</div>
    ${children}
  </section>`;
}

export function Page({ title, subtitle, actions, children }) {
  useEffect(() => { document.title = `${shown(title)} · fleet`; }, [title]);
  return html`<div class="page">
    <div class="page-head">
      <div><h1 tabindex="-1" id="page-title">${title}</h1>${subtitle ? html`<p class="muted sub">${subtitle}</p>` : null}</div>
      ${actions ? html`<div class="actions">${actions}</div>` : null}
    </div>
    ${children}
  </div>`;
}

export function Loading({ what = "Loading" }) {
  return html`<p class="muted loading" role="status">${what}…</p>`;
}

export function ErrorBox({ error, onRetry }) {
  if (!error) return null;
  // Asking again cannot find what is not there: no Retry for a 404.
  const retry = onRetry && error.status !== 404;
  return html`<div class="error-box" role="alert">
    <span>${sentence(error.message || String(error))}</span>
    ${retry ? html`<button type="button" class="btn small" onClick=${onRetry}>Retry</button>` : null}
  </div>`;
}

// Render data when loaded; a loading line the first time; the error (keeping stale data).
export function Loaded({ res, children, what }) {
  if (res.data === null && res.error) return html`<${ErrorBox} error=${res.error} onRetry=${res.reload} />`;
  if (res.data === null) return html`<${Loading} what=${what} />`;
  return html`${res.error ? html`<${ErrorBox} error=${res.error} onRetry=${res.reload} />` : null}${children(res.data)}`;
}

export function Empty({ children }) {
  return html`<p class="empty muted">${children}</p>`;
}

export function Fields({ pairs }) {
  return html`<dl class="fields">${pairs.filter(Boolean).map(([k, v]) => html`<dt>${k}</dt><dd>${v ?? html`<span class="muted">–</span>`}</dd>`)}</dl>`;
}

export function Json({ value }) {
  return html`<pre class="json" tabindex="0">${JSON.stringify(value, null, 2)}</pre>`;
}

export function Table({ head, rows, empty = "Nothing here yet.", label, className = "" }) {
  if (!rows.length) return html`<${Empty}>${empty}<//>`;
  return html`<div class="table-wrap" tabindex="0" role="region" aria-label=${label || "table"}>
    <table class=${className}>
      <thead><tr>${head.map((h) => html`<th scope="col">${h}</th>`)}</tr></thead>
      <tbody>${rows}</tbody>
    </table></div>`;
}

// A destructive action in two steps, inline (no window.confirm): keyboard and screen-reader friendly.
export function ConfirmButton({ label, question, confirmLabel, onConfirm, disabled, danger = true, small = false }) {
  const [asking, setAsking] = useState(false);
  const yes = useRef(null);
  useEffect(() => { if (asking && yes.current) yes.current.focus(); }, [asking]);
  if (currentPeer()) return null;
  if (!asking) {
    return html`<button type="button" class=${`btn ${danger ? "danger" : ""} ${small ? "small" : ""}`} disabled=${disabled}
      onClick=${() => setAsking(true)}>${label}</button>`;
  }
  return html`<span class="confirm" role="group" aria-label=${question || label}>
    <span>${question || "Sure?"}</span>
    <button type="button" ref=${yes} class=${`btn ${danger ? "danger" : "primary"} ${small ? "small" : ""}`}
      onClick=${async () => { setAsking(false); await onConfirm(); }}>${confirmLabel || label}</button>
    <button type="button" class=${`btn ${small ? "small" : ""}`} onClick=${() => setAsking(false)}>Keep</button>
  </span>`;
}

// Buttons that change something are hidden in a peer's read-only view.
export function Action({ children, onClick, disabled, kind = "", title, type = "button" }) {
  if (currentPeer()) return null;
  return html`<button type=${type} class=${`btn ${kind}`} disabled=${disabled} title=${title} onClick=${onClick}>${children}</button>`;
}

export function Chips({ items, empty = "–" }) {
  if (!items || !items.length) return html`<span class="muted">${empty}</span>`;
  return html`<span class="chips">${items.map((c) => html`<span class="chip">${c}</span>`)}</span>`;
}

export function Pager({ data, onPage }) {
  if (!data || data.pages <= 1) return null;
  return html`<nav class="pager" aria-label="Pages">
    <button type="button" class="btn small" disabled=${data.page <= 1} onClick=${() => onPage(data.page - 1)}>Previous</button>
    <span>Page ${data.page} of ${data.pages} (${data.total})</span>
    <button type="button" class="btn small" disabled=${data.page >= data.pages} onClick=${() => onPage(data.page + 1)}>Next</button>
  </nav>`;
}

export function Meter({ value, max, label }) {
  const pct = max ? Math.max(0, Math.min(100, (100 * value) / max)) : 0;
  return html`<span class="meter" role="progressbar" aria-valuemin="0" aria-valuemax=${max}
    aria-valuenow=${value} aria-label=${label}><span style=${`width:${pct}%`}></span></span>`;
}

export function Battery({ beacon }) {
  if (!beacon || beacon.battery_pct === undefined || beacon.battery_pct === null) return html`<span class="muted">–</span>`;
  const low = beacon.battery_pct < 15 && !beacon.charging;
  return html`<span class=${low ? "bad" : ""}>${beacon.battery_pct}%${beacon.charging ? html` <span title="charging" aria-label="charging">⚡</span>` : ""}</span>`;
}

const HOT = new Set(["serious", "severe", "critical", "emergency", "shutdown"]);
export function Thermal({ value }) {
  if (!value) return html`<span class="muted">–</span>`;
  return html`<span class=${HOT.has(String(value).toLowerCase()) ? "bad" : ""}>${value}</span>`;
}
