// Shared pieces of the screens: panels, badges, tables, times, the "not available" note and
// the fetch hook with its four faces (loading, not offered, failed, loaded).
import { html, useState, useEffect, useCallback, useRef } from "./html.js";
import { getJSON, isMissing } from "./api.js";
import { ago, when, sentence, DASH } from "./format.js";

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

export const SEVERITY_KIND = { critical: "bad", error: "bad", warning: "warn", info: "info" };

export function Chips({ items, empty = DASH }) {
  if (!items || !items.length) return html`<span class="muted">${empty}</span>`;
  return html`<span class="chips">${items.map((x) => html`<span class="chip">${x}</span>`)}</span>`;
}

export function KV({ rows }) {
  return html`<dl class="kv">${rows.filter(Boolean).map(([k, v]) => html`<div><dt>${k}</dt><dd>${v ?? DASH}</dd></div>`)}</dl>`;
}

// Headline figures: a few big numbers with what they are, side by side.
export function Figures({ items }) {
  return html`<dl class="figures">${items.filter(Boolean).map(([k, v, sub]) => html`<div class="figure">
    <dt>${k}</dt><dd>${v ?? DASH}${sub ? html`<span class="figure-sub">${sub}</span>` : null}</dd></div>`)}</dl>`;
}

export function Meter({ value, max = 100, low, high, label }) {
  if (value === null || value === undefined) return html`<span class="muted">${DASH}</span>`;
  return html`<meter min="0" max=${max} low=${low} high=${high} optimum="0" value=${value} aria-label=${label}></meter>`;
}

// An instant as "3 min ago" (or "in 20 min"), its exact local time on hover.
export function Time({ at, prefix = "" }) {
  if (at === null || at === undefined || at === "") return html`<span class="muted">${DASH}</span>`;
  const iso = typeof at === "number" ? new Date(at * 1000).toISOString() : at;
  return html`<time datetime=${iso} title=${when(at)}>${prefix}${ago(at)}</time>`;
}

export function Empty({ children }) {
  return html`<p class="empty">${children}</p>`;
}

export function NotAvailable({ what, path }) {
  return html`<div class="unavailable" role="note">
    <strong>${what}: not available on this daemon.</strong>
    <span> It does not answer <code>${path}</code>. The screen fills in by itself once the daemon offers it.</span>
  </div>`;
}

// The daemon's own sentence (or why no answer came), and a way to ask again.
export function Failed({ error, retry, what }) {
  return html`<div class="failed" role="alert">${what ? `${what}: ` : ""}${sentence(error?.message) || "The daemon's answer could not be read."}
    ${retry ? html` <button type="button" class="link" onClick=${retry}>Try again</button>` : null}</div>`;
}

// GET a path when the screen shows, again when `key` changes (a refresh) or reload() is called.
// A refresh while the last request is still on its way waits for that one rather than
// cancelling it (on a slow host every refresh would otherwise cancel the one before); only a
// new path or leaving the screen cancels a request.
export function useFetch(path, key) {
  const [result, setResult] = useState({ loading: true, data: null, error: null, missing: false });
  const [nonce, setNonce] = useState(0);
  const inflight = useRef(null);
  useEffect(() => () => inflight.current?.abort.abort(), []);
  useEffect(() => {
    if (!path || inflight.current?.path === path) return;
    inflight.current?.abort.abort();
    const mine = { path, abort: new AbortController() };
    inflight.current = mine;
    setResult((r) => ({ ...r, loading: true }));
    getJSON(path, { signal: mine.abort.signal })
      .then((data) => setResult({ loading: false, data: data ?? {}, error: null, missing: false }))
      .catch((error) => {
        if (error.name === "AbortError") return;
        setResult({ loading: false, data: null, error, missing: isMissing(error) });
      })
      .finally(() => {
        if (inflight.current === mine) inflight.current = null;
      });
  }, [path, key, nonce]);
  const reload = useCallback(() => setNonce((n) => n + 1), []);
  return { ...result, reload };
}

// Loading / not offered / error / content, the four faces of every fetched panel.
export function Loaded({ res, what, path, children }) {
  if (res.missing) return html`<${NotAvailable} what=${what} path=${path} />`;
  if (res.error) return html`<${Failed} error=${res.error} retry=${res.reload} />`;
  if (!res.data) return html`<p class="muted" aria-busy="true">Loading ${what.toLowerCase()}…</p>`;
  return children(res.data);
}

const cellClass = (c) => (c.num ? "num" : c.prose ? "prose" : undefined);

// A table of known columns: [{label, cell(row), num?, prose?, title?}] (num: figures, right-aligned;
// prose: sentences, given room to read rather than a word per line). The first column names the
// row (a <th>), stays in view when the table scrolls sideways in its own box, and the box can
// be scrolled from the keyboard.
export function Table({ columns, rows, label, rowKey, rowAttrs, cls = "", limit = 500 }) {
  const shown = rows.slice(0, limit);
  return html`<div class="table-wrap" tabindex="0" role="region" aria-label=${label}>
    <table class=${cls}>
      <thead><tr>${columns.map((c) => html`<th scope="col" class=${cellClass(c)} title=${c.title}>${c.label}</th>`)}</tr></thead>
      <tbody>${shown.map((row, i) => html`<tr key=${rowKey ? rowKey(row) : i} ...${rowAttrs ? rowAttrs(row) : {}}>
        ${columns.map((c, j) => (j === 0
    ? html`<th scope="row" data-label=${c.label}>${c.cell(row)}</th>`
    : html`<td class=${cellClass(c)} data-label=${c.label}>${c.cell(row)}</td>`))}
      </tr>`)}</tbody>
    </table>
  </div>
  ${rows.length > shown.length ? html`<p class="muted small">The first ${shown.length} of ${rows.length} are shown.</p>` : null}`;
}

// A runner's page. An agent host's runner is named with its host (#/runner/<name>@<host>): one
// may share its name with a runner of this host (cloned images), and a link by name alone
// opened this host's. Runner names and host names hold no "@".
export function runnerHref(r) {
  return `#/runner/${encodeURIComponent(r.name)}${r.remote ? `@${encodeURIComponent(r.host)}` : ""}`;
}

// The runner a #/runner/ argument names: <name>@<host> an agent's, <name> this host's (or, when
// this host has none of that name, the one runner an agent reports by it).
export function runnerOf(runners, arg) {
  const at = arg.lastIndexOf("@");
  const name = at < 0 ? arg : arg.slice(0, at);
  const host = at < 0 ? null : arg.slice(at + 1);
  const named = (runners || []).filter((r) => r.name === name);
  if (host !== null) return named.find((r) => r.remote && r.host === host);
  return named.find((r) => !r.remote) || (named.length === 1 ? named[0] : undefined);
}

// Where a row of runners is kept: a runner is its host's and its name's.
export function runnerKey(r) {
  return `${r.host}\u0000${r.name}`;
}

