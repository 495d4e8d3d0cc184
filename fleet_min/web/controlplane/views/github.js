// What the repositories' own files and GitHub's bill say: concurrency findings from the
// workflow files (GET /api/concurrency) and the owners' Actions minutes (GET /api/billing).
import { html } from "../js/html.js";
import { Panel, Badge, Empty, Loaded, Table, Time, useFetch, SEVERITY_KIND } from "../js/ui.js";
import { num, plural } from "../js/format.js";

const SEVERITY_ORDER = { critical: 0, error: 1, warning: 2, info: 3 };

function Findings({ findings }) {
  if (!findings.length) {
    return html`<${Empty}>Nothing found: no workflow starts more jobs than its runners take at once, and every concurrency group is its own.<//>`;
  }
  const sorted = [...findings].sort((a, b) => (SEVERITY_ORDER[a.severity] ?? 9) - (SEVERITY_ORDER[b.severity] ?? 9));
  return html`<ul class="list findings">${sorted.map((f) => html`<li data-kind=${f.kind}>
    <${Badge} kind=${SEVERITY_KIND[f.severity] || ""}>${f.severity || "note"}<//>
    <span><strong>${(f.kind || "finding").replaceAll("-", " ")}</strong> <span class="muted small">${f.repo}</span><br />${f.message}</span>
  </li>`)}</ul>`;
}

function Files({ repos }) {
  if (!repos.length) return html`<${Empty}>No repository is watched yet, so no workflow file has been read.<//>`;
  const problem = (r) => {
    const parse = r.parse_errors || [];
    if (r.error) return html`<span class="bad-text">${r.error}</span>`;
    if (parse.length) return html`<span class="bad-text">${parse.map((p) => `${p.file}: ${p.error}`).join("; ")}</span>`;
    return html`<span class="muted">none</span>`;
  };
  const columns = [
    { label: "Repository", cell: (r) => r.repo },
    { label: "Branch", cell: (r) => r.default_branch || html`<span class="muted">not read yet</span>` },
    { label: "Workflow files", num: true, cell: (r) => num(r.files) },
    { label: "Read", cell: (r) => html`<${Time} at=${r.fetched_at} />` },
    { label: "Problem", prose: true, cell: problem },
  ];
  return html`<${Table} label="Workflow files" columns=${columns} rows=${repos} rowKey=${(r) => r.repo} />`;
}

export function Concurrency() {
  const res = useFetch("/api/concurrency", "concurrency");
  const d = res.data;
  return html`<div class="grid">
    <${Panel} id="concurrency" wide title=${d?.findings ? `Concurrency findings (${d.findings.length})` : "Concurrency findings"}>
      <${Loaded} res=${res} what="Concurrency findings" path="/api/concurrency">${() => html`
        <p class="muted small">What the workflow files say about how many runners their jobs take at once, read <${Time} at=${d.generated_at} />.</p>
        <${Findings} findings=${d.findings || []} />`}<//>
    <//>
    ${d && !res.error ? html`<${Panel} id="workflow-files" wide title="Workflow files read"><${Files} repos=${d.repos || []} /><//>` : null}
  </div>`;
}

const minutes = (n) => (typeof n === "number" ? `${num(n)} min` : "–");

function Owners({ owners }) {
  const columns = [
    { label: "Owner", cell: (o) => o.owner },
    { label: "Account", cell: (o) => (o.type === "Organization" ? "organisation" : o.type ? "user" : "–") },
    { label: "Used", num: true, cell: (o) => (o.available ? minutes(o.total_minutes_used) : html`<span class="muted">${o.reason || "not readable"}</span>`) },
    { label: "Included", num: true, cell: (o) => (o.available ? minutes(o.included_minutes) : "–") },
    { label: "Paid", num: true, cell: (o) => (o.available ? minutes(o.total_paid_minutes_used) : "–") },
    { label: "By runner system", cell: (o) => {
      const parts = Object.entries(o.minutes_used_breakdown || {});
      return parts.length ? parts.map(([os, n]) => `${os.toLowerCase()} ${minutes(n)}`).join(", ") : html`<span class="muted">none</span>`;
    } },
    { label: "Read", cell: (o) => html`<${Time} at=${o.fetched_at} />` },
  ];
  return html`<${Table} label="Actions minutes by owner" columns=${columns} rows=${owners} rowKey=${(o) => o.owner} />`;
}

export function Billing() {
  const res = useFetch("/api/billing", "billing");
  return html`<div class="grid"><${Panel} id="billing" wide title="GitHub Actions minutes this billing cycle">
    <${Loaded} res=${res} what="Billing" path="/api/billing">${(d) => {
      const owners = d.owners || [];
      return html`
        ${d.available === false ? html`<p class="note">${d.reason ? `Not available: ${d.reason}.` : "Not available."}</p>` : null}
        ${owners.length ? html`<${Owners} owners=${owners} />` : null}
        <p class="muted small">${d.note ? `${d.note.charAt(0).toUpperCase()}${d.note.slice(1)}.`
          : "Self-hosted runners use no Actions minutes; the figures are GitHub-hosted usage."}
          ${owners.length ? ` ${plural(owners.length, "owner")} of the watched repositories.` : ""}</p>`;
    }}<//>
  <//></div>`;
}
