// Shared pieces of the screens: panels, badges, tables, the "not available" note, a fetch hook.
import { html, useState, useEffect, useCallback } from "./html.js";
import { getJSON, isMissing } from "./api.js";
import { any, DASH } from "./format.js";

export function Panel({ title, id, tools, wide, children }) {
  const headingId = id ? `${id}-title` : undefined;
  return html`<section class=${`panel${wide ? " wide" : ""}`} id=${id} aria-labelledby=${headingId}>
    <header class="panel-head"><h2 id=${headingId}>${title}</h2>${tools ? html`<div class="tools">${tools}</div>` : null}</header>
    ${children}
  </section>`;
}

export function Badge({ kind, children, title }) {
  return html`<span class=${`badge ${kind || ""}`} title=${title}>${children}</span>`;
}

const STATE_KIND = {
  working: "busy", idle: "ok", draining: "warn", drained: "muted", stopped: "bad", failed: "bad",
};
export const StateBadge = ({ state }) => html`<${Badge} kind=${`state ${STATE_KIND[state] || ""}`}>${state || "unknown"}<//>`;

export const SEVERITY_KIND = { critical: "bad", warning: "warn", info: "info" };

export function Chips({ items, empty = DASH }) {
  if (!items || !items.length) return html`<span class="muted">${empty}</span>`;
  return html`<span class="chips">${items.map((x) => html`<span class="chip">${x}</span>`)}</span>`;
}

export function KV({ rows }) {
  return html`<dl class="kv">${rows.filter(Boolean).map(([k, v]) => html`<div><dt>${k}</dt><dd>${v ?? DASH}</dd></div>`)}</dl>`;
}

export function Meter({ value, max = 100, low, high, label }) {
  if (value === null || value === undefined) return html`<span class="muted">${DASH}</span>`;
  return html`<meter min="0" max=${max} low=${low} high=${high} optimum="0" value=${value} aria-label=${label}></meter>`;
}

export function Empty({ children }) {
  return html`<p class="empty">${children}</p>`;
}

export function NotAvailable({ what, path }) {
  return html`<div class="unavailable" role="note">
    <strong>${what}: not available on this daemon.</strong>
    <span> It does not answer <code>${path}</code> (404). The screen fills in by itself once the daemon offers it.</span>
  </div>`;
}

export function Failed({ error, retry }) {
  return html`<div class="failed" role="alert">Could not load: ${error.message}
    ${retry ? html` <button type="button" class="link" onClick=${retry}>Try again</button>` : null}</div>`;
}

// GET a path when the screen shows, again when `key` changes or reload() is called.
export function useFetch(path, key) {
  const [result, setResult] = useState({ loading: true, data: null, error: null, missing: false });
  const [nonce, setNonce] = useState(0);
  useEffect(() => {
    if (!path) return undefined;
    const abort = new AbortController();
    setResult((r) => ({ ...r, loading: true }));
    getJSON(path, { signal: abort.signal })
      .then((data) => setResult({ loading: false, data, error: null, missing: false }))
      .catch((error) => {
        if (error.name === "AbortError") return;
        setResult({ loading: false, data: null, error, missing: isMissing(error) });
      });
    return () => abort.abort();
  }, [path, key, nonce]);
  const reload = useCallback(() => setNonce((n) => n + 1), []);
  return { ...result, reload };
}

// Loading / 404 / error / content, the four faces of every fetched panel.
export function Loaded({ res, what, path, children }) {
  if (res.missing) return html`<${NotAvailable} what=${what} path=${path} />`;
  if (res.error) return html`<${Failed} error=${res.error} retry=${res.reload} />`;
  if (!res.data) return html`<p class="muted" aria-busy="true">Loading…</p>`;
  return children(res.data);
}

// A table of rows whose fields are not known in advance (endpoints still taking shape).
export function AutoTable({ rows, columns, caption, limit = 200 }) {
  if (!rows || !rows.length) return html`<${Empty}>Nothing recorded.<//>`;
  const cols = columns || [...new Set(rows.flatMap((r) => (r && typeof r === "object" ? Object.keys(r) : [])))].slice(0, 12);
  return html`<div class="table-wrap"><table>
    ${caption ? html`<caption>${caption}</caption>` : null}
    <thead><tr>${cols.map((c) => html`<th scope="col">${String(c).replaceAll("_", " ")}</th>`)}</tr></thead>
    <tbody>${rows.slice(0, limit).map((r) => html`<tr>${cols.map((c) => html`<td>${any(r?.[c])}</td>`)}</tr>`)}</tbody>
  </table></div>`;
}

// Any JSON value laid out for reading: scalars as a definition list, lists of objects as tables.
export function AutoView({ data, depth = 0 }) {
  if (data === null || typeof data !== "object") return html`<p>${any(data)}</p>`;
  if (Array.isArray(data)) {
    return data.every((x) => x && typeof x === "object" && !Array.isArray(x))
      ? html`<${AutoTable} rows=${data} />` : html`<p>${any(data)}</p>`;
  }
  const scalars = Object.entries(data).filter(([, v]) => v === null || typeof v !== "object" || (Array.isArray(v) && v.every((x) => typeof x !== "object")));
  const nested = Object.entries(data).filter(([k]) => !scalars.some(([s]) => s === k));
  return html`<div class="auto">
    ${scalars.length ? html`<${KV} rows=${scalars.map(([k, v]) => [k.replaceAll("_", " "), any(v)])} />` : null}
    ${nested.map(([k, v]) => html`<div class="auto-sub"><h3>${k.replaceAll("_", " ")}</h3>
      ${depth < 3 ? html`<${AutoView} data=${v} depth=${depth + 1} />` : html`<pre>${JSON.stringify(v, null, 2)}</pre>`}</div>`)}
  </div>`;
}
