// Jobs: the filtered list, and one job's detail (spec, attempts, timeline, result rows,
// artifacts, children and chain) with cancel, retry and priority.
import { html, useState, useEffect, useRef } from "../lib/core.js";
import { get, post, patch, seg, currentPeer } from "../lib/api.js";
import { useResource, useTick, useAction } from "../lib/hooks.js";
import { navigate, href, setQuery } from "../lib/router.js";
import { notify } from "../lib/notify.js";
import { WorkloadList } from "../lib/workloads.js";
import { metricText, parseTime, shortSha } from "../lib/format.js";
import {
  Page, Section, Loaded, Table, Pill, Ago, JobLink, DeviceLink, Fields, Json, ConfirmButton,
  Action, Pager, Link, Empty, ClaimantLink,
} from "../lib/ui.js";

const STATUSES = ["queued", "waiting", "claimed", "done", "failed", "cancelled"];
const OPEN = ["queued", "waiting", "claimed"];
const FILTERS = ["status", "workload", "executor", "pool", "device", "q", "from", "to"];

function useDebounced(value, ms) {
  const [settled, setSettled] = useState(value);
  useEffect(() => {
    const t = setTimeout(() => setSettled(value), ms);
    return () => clearTimeout(t);
  }, [value, ms]);
  return settled;
}

function target(spec) {
  const t = spec?.targets || {};
  if (t.device_id) return html`<${DeviceLink} id=${t.device_id} />`;
  const parts = [t.pool && `pool ${t.pool}`, t.match && `match ${t.match}`, t.executor && `executor ${t.executor}`].filter(Boolean);
  return parts.length ? html`<span class="mono small">${parts.join(" · ")}</span>` : html`<span class="muted">any</span>`;
}

export function Jobs({ query }) {
  useTick();
  const initial = Object.fromEntries(FILTERS.map((k) => [k, query.get(k) || ""]));
  const [filters, setFilters] = useState(initial);
  const [page, setPage] = useState(Number(query.get("page")) || 1);
  const settled = useDebounced(filters, 250);
  useEffect(() => { setQuery({ ...settled, page: page > 1 ? page : "" }); }, [settled, page]);
  const res = useResource(() => get("/api/jobs", { ...settled, page }), [JSON.stringify(settled), page],
    (e) => e.type === "job");
  const field = (k) => (e) => { setFilters({ ...filters, [k]: e.target.value }); setPage(1); };
  return html`<${Page} title="Jobs" actions=${currentPeer() ? null : html`<a class="btn primary" href=${href("/jobs/new")}>Enqueue a job</a>`}>
    <form class="filters" role="search" onSubmit=${(e) => e.preventDefault()}>
      <${WorkloadList} />
      <label>Search <input type="search" value=${filters.q} onInput=${field("q")} placeholder="job id or error text" /></label>
      <label>Status <select value=${filters.status} onChange=${field("status")}>
        <option value="">any</option><option value=${OPEN.join(",")}>open (queued, waiting, claimed)</option>
        ${STATUSES.map((s) => html`<option value=${s}>${s}</option>`)}</select></label>
      <label>Workload <input value=${filters.workload} onInput=${field("workload")} list="workloads" size="12" /></label>
      <label>Executor <select value=${filters.executor} onChange=${field("executor")}>
        <option value="">any</option><option>device</option><option>host</option></select></label>
      <label>Pool <input value=${filters.pool} onInput=${field("pool")} size="10" /></label>
      <label>Device <input value=${filters.device} onInput=${field("device")} size="12" /></label>
    </form>
    <${Loaded} res=${res}>${(d) => html`
      <p class="muted count-line">${d.total} job${d.total === 1 ? "" : "s"}</p>
      <${Table} label="Jobs" empty="No job matches these filters." className="jobs"
        head=${["Job", "Status", "Workload", "Target", "Claimed by", "Attempts", "Priority", "Created", "Last error"]}
        rows=${d.jobs.map((j) => html`<tr>
          <td><${JobLink} id=${j.job_id} />${j.fanout_parent ? html` <span class="chip">fan-out</span>` : null}</td>
          <td><${Pill} status=${j.status} /></td>
          <td>${j.workload}${j.backend ? html`<span class="muted"> · ${j.backend}</span>` : null}</td>
          <td>${target(j.spec)}</td>
          <td><${ClaimantLink} job=${j} id=${j.claimed_by} /></td>
          <td>${j.attempts}/${j.max_attempts}</td><td>${j.priority}</td>
          <td><${Ago} iso=${j.created_at} /></td>
          <td class="error-text">${j.last_error}</td></tr>`)} />
      <${Pager} data=${d} onPage=${setPage} />`}<//>
  <//>`;
}

function timeline(j) {
  const items = [{ at: j.created_at, text: `enqueued (${j.status === "waiting" ? "waiting for dependencies" : "queued"})` }];
  for (const a of j.attempts) {
    items.push({ at: a.claimed_at, text: `attempt ${a.attempt} claimed by ${a.claimed_by}` });
    if (a.ended_at) items.push({ at: a.ended_at, text: `attempt ${a.attempt}: ${a.outcome}${a.error ? ` — ${a.error}` : ""}`, bad: a.outcome !== "done" });
  }
  const rows = j.results.filter((r) => r.iter > 0);
  if (rows.length) {
    items.push({ at: rows.reduce((m, r) => (r.created_at < m ? r.created_at : m), rows[0].created_at), text: "first result row" });
  }
  if (j.finished_at) items.push({ at: j.finished_at, text: `${j.status}${j.last_error ? `: ${j.last_error}` : ""}`, bad: j.status !== "done" });
  return items.filter((i) => i.at).sort((a, b) => parseTime(a.at) - parseTime(b.at));
}

function Timeline({ job }) {
  return html`<ol class="timeline">${timeline(job).map((i) => html`<li class=${i.bad ? "bad" : ""}>
    <${Ago} iso=${i.at} /><span>${i.text}</span></li>`)}</ol>`;
}

function Results({ rows }) {
  return html`<${Table} label="Result rows" empty="No result rows yet." className="results"
    head=${["Attempt", "Device", "Iter", "OK", "Final", "Metrics", "Error", "Stored"]}
    rows=${rows.map((r) => html`<tr class=${r.ok === false ? "row-bad" : ""}>
      <td>${r.attempt}</td><td><${DeviceLink} id=${r.device_id} /></td><td>${r.iter === 0 ? "summary" : r.iter}</td>
      <td>${r.ok === null ? "–" : r.ok ? "yes" : "no"}</td><td>${r.final ? (r.preempted ? "handed back" : "yes") : ""}</td>
      <td class="metrics">${metricText(r.metrics)}${r.trimmed && r.trimmed.length ? html` <a class="small"
        href=${`/api/results/${r.id}`} title=${`Cut down here: ${r.trimmed.join(", ")}`}>whole row</a>` : null}</td><td class="error-text">${r.error}</td>
      <td><${Ago} iso=${r.created_at} /></td></tr>`)} />`;
}

function Chain({ job }) {
  const rows = [
    ...job.dependencies.map((d) => ({ ...d, rel: "depends on" })),
    ...job.dependents.map((d) => ({ ...d, rel: "waits for this job" })),
    ...(job.parent_job_id ? [{ job_id: job.parent_job_id, status: "", rel: "fan-out parent" }] : []),
    ...job.children.map((c) => ({ ...c, rel: `fan-out child${c.target_device ? ` for ${c.target_device}` : ""}` })),
  ];
  return html`<${Table} label="Chain and children" empty="No dependencies, dependents or children."
    head=${["Job", "Status", "Relation", "Last error"]}
    rows=${rows.map((r) => html`<tr><td><${JobLink} id=${r.job_id} /></td>
      <td>${r.status ? html`<${Pill} status=${r.status} />` : "–"}</td><td>${r.rel}</td>
      <td class="error-text">${r.last_error}</td></tr>`)} />`;
}

function Priority({ job, run, reload }) {
  const [value, setValue] = useState(String(job.priority));
  useEffect(() => setValue(String(job.priority)), [job.priority]);
  const submit = async (e) => {
    e.preventDefault();
    const done = await run(() => patch(`/api/jobs/${seg(job.job_id)}`, { priority: Number(value) }),
      `Priority of ${job.job_id} set to ${value}.`);
    if (done) reload();
  };
  return html`<form class="inline" onSubmit=${submit}>
    <label>Priority <input type="number" min="-1000" max="1000" step="1" value=${value} size="5"
      onInput=${(e) => setValue(e.target.value)} /></label>
    <button type="submit" class="btn" disabled=${value === String(job.priority)}>Set</button></form>`;
}

function JobActions({ job, reload }) {
  const [run, busy] = useAction(notify);
  if (currentPeer()) return null;
  const open = OPEN.includes(job.status);
  const cancel = async () => {
    // No reload here: the stream's job event updates the page (and shows that it is live).
    await run(() => post(`/api/jobs/${seg(job.job_id)}/cancel`), (r) => `Cancelled ${r.job_id} (was ${r.was})${r.cascaded?.length ? `; also ${r.cascaded.join(", ")}` : ""}.`);
  };
  const retry = async () => {
    const r = await run(() => post(`/api/jobs/${seg(job.job_id)}/retry`), (x) => `Retrying as ${x.job_id}.`);
    if (r) navigate(href(`/jobs/${seg(r.job_id)}`));
  };
  return html`<div class="actions">
    ${open ? html`<${Priority} job=${job} run=${run} reload=${reload} />` : null}
    ${open ? html`<${ConfirmButton} label="Cancel job" question="Cancel this job? Work in flight finishes." confirmLabel="Yes, cancel" onConfirm=${cancel} disabled=${busy} />` : null}
    ${["failed", "cancelled"].includes(job.status) ? html`<${Action} kind="primary" onClick=${retry} disabled=${busy}>Retry<//>` : null}
  </div>`;
}

export function JobDetail({ id }) {
  useTick();
  const related = useRef(new Set([id]));
  const res = useResource(() => get(`/api/jobs/${seg(id)}`), [id], (e) => {
    if (!e.job_id) return false;
    return related.current.has(e.job_id) || e.job_id.startsWith(`${id}--`);
  });
  const j = res.data;
  if (j) related.current = new Set([id, ...j.children.map((c) => c.job_id), ...j.dependencies.map((d) => d.job_id), ...j.dependents.map((d) => d.job_id)]);
  return html`<${Page} title=${id} subtitle=${j ? html`<span class="status-line"><${Pill} status=${j.status} /> <span>${j.workload}${j.backend ? ` · ${j.backend}` : ""} · ${j.executor}</span></span>` : "Job"}
    actions=${j ? html`<${JobActions} job=${j} reload=${res.reload} />` : null}>
    <${Loaded} res=${res}>${(job) => html`
      <div class="grid two">
        <${Section} title="Job" id="job-info">
          <${Fields} pairs=${[
            ["Status", html`<span id="job-status"><${Pill} status=${job.status} /></span>`],
            ["Last error", job.last_error ? html`<span class="error-text">${job.last_error}</span>` : null],
            ["Target", target(job.spec)],
            [job.executor === "host" ? "Executor" : "Claimed by", html`<span id="job-claimant"><${ClaimantLink} job=${job} id=${job.claimed_by} /></span>`],
            // In the detail, attempts is the list of attempts (the list view has the count).
            ["Attempts", `${job.attempts.length} of ${job.max_attempts}`],
            ["Lease", job.status === "claimed" && job.lease_deadline
              ? html`${job.lease_ttl_s} s; ends <${Ago} iso=${job.lease_deadline} /> unless renewed` : `${job.lease_ttl_s} s`],
            ["Priority", job.priority],
            job.template_id ? ["Schedule", html`<${Link} to=${`/schedules/${encodeURIComponent(job.template_id)}`}>${job.template_id}<//>`] : null,
            ["Created", html`<${Ago} iso=${job.created_at} />`],
            ["Finished", job.finished_at ? html`<${Ago} iso=${job.finished_at} />` : null],
          ]} />
        <//>
        <${Section} title="Timeline" id="job-timeline"><${Timeline} job=${job} /><//>
      </div>
      ${job.executor === "host" && job.status === "claimed" && !currentPeer() ? html`<${Section} title="Live mirror" id="job-mirror">
        <p class="muted small">The newest screen frame its executor sends, while the job runs.</p>
        <img class="mirror" id="mirror-frame" src=${`/api/jobs/${seg(job.job_id)}/mirror`}
          alt=${`Live screen of job ${job.job_id}, as its executor sends it`} />
      <//>` : null}
      <${Section} title=${`Result rows (${job.results.length})`} id="job-results">
        ${job.results_total > job.results.length ? html`<p class="muted small" id="job-results-cut">
          ${job.results.length} of ${job.results_total} rows: the final rows and the newest others, large fields cut down.
          <a href=${`/api/results?job=${encodeURIComponent(job.job_id)}`}>All of them, a page at a time</a>.</p>` : null}
        <${Results} rows=${job.results} />
      <//>
      <div class="grid two">
        <${Section} title="Chain and children" id="job-chain"><${Chain} job=${job} /><//>
        <${Section} title="Artifacts" id="job-artifacts">
          ${job.artifacts.length ? html`<ul class="plain">${job.artifacts.map((a) => html`<li>
            <span class="badge">${a.role}</span> <${Link} to=${`/artifacts/${a.sha256}`} title=${a.sha256} class="mono">${a.name || `${shortSha(a.sha256)}…`}<//>
            ${a.in_store ? html` · <a href=${`/artifacts/${a.sha256}`} download>download</a>` : html` · <span class="muted">not in this store</span>`}</li>`)}</ul>`
            : html`<${Empty}>No artifacts named by the spec or the result rows.<//>`}
        <//>
      </div>
      <${Section} title="Attempts" id="job-attempts">
        <${Table} label="Attempts" empty="Not claimed yet." head=${["Attempt", "Claimed by", "Claimed", "Ended", "Outcome", "Error"]}
          rows=${job.attempts.map((a) => html`<tr><td>${a.attempt}</td><td><${ClaimantLink} job=${job} id=${a.claimed_by} /></td>
            <td><${Ago} iso=${a.claimed_at} /></td><td><${Ago} iso=${a.ended_at} /></td><td>${a.outcome || "running"}</td>
            <td class="error-text">${a.error}</td></tr>`)} />
      <//>
      <${Section} title="Spec" id="job-spec"><${Json} value=${job.spec} /><//>`}<//>
  <//>`;
}
