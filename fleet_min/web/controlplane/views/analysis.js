// The analysis screens: history analytics, the simulation form and its comparison, the
// next-hour forecast, and the federation hosts with autoscale and admission decisions.
// Endpoints a daemon does not offer (404) show a clear "not available" note instead.
import { html, useState, useEffect } from "../js/html.js";
import { state } from "../js/store.js";
import { postJSON, isMissing } from "../js/api.js";
import { Panel, Badge, Empty, Loaded, NotAvailable, Failed, AutoTable, AutoView, useFetch } from "../js/ui.js";
import { BarChart, LineChart } from "../js/chart.js";
import { rowsOf, labelOf, numericColumns, isDuration, isRate, msToS } from "../js/shape.js";
import { dur, num, any, DASH } from "../js/format.js";

function knownRepos() {
  const repos = new Set((state.snap?.runners || []).map((r) => r.repo).filter(Boolean));
  for (const q of state.snap?.queue_causes || []) repos.add(q.repo);
  return [...repos].sort();
}

function RepoBars({ rows, pick, label, unit, convert = (k, v) => v }) {
  const cols = numericColumns(rows, pick).slice(0, 3);
  if (!rows.length || !cols.length) return null;
  return html`<${BarChart} label=${label} unit=${unit} categories=${rows.map((r) => labelOf(r))}
    series=${cols.map((c) => ({ label: c.replaceAll("_", " "), values: rows.map((r) => convert(c, r[c]) ?? null) }))} />`;
}

function RepoDetail({ repo }) {
  const path = `/api/repo?name=${encodeURIComponent(repo)}`;
  const res = useFetch(repo ? path : null, repo);
  if (!repo) return null;
  return html`<${Panel} id="repo-detail" title=${`Repository ${repo}`}>
    <${Loaded} res=${res} what="Repository detail" path="/api/repo">${(d) => html`<${AutoView} data=${d} />`}<//>
  <//>`;
}

export function Analytics() {
  const [days, setDays] = useState(30);
  const [repo, setRepo] = useState("");
  const path = `/api/analytics?days=${days}`;
  const res = useFetch(path, days);
  const picker = html`<label class="inline">Window <select value=${days} onChange=${(e) => setDays(Number(e.currentTarget.value))}>
    ${[7, 30, 90, 365].map((d) => html`<option value=${d}>${d} days</option>`)}</select></label>`;
  return html`<div class="grid">
    <${Panel} id="analytics" wide title="Job history by repository" tools=${picker}>
      <${Loaded} res=${res} what="Analytics" path="/api/analytics">${(data) => {
        const rows = rowsOf(data, ["repos", "repositories", "per_repo", "by_repo"]);
        const rest = Object.fromEntries(Object.entries(data).filter(([k, v]) => k !== "browser_test" && !(Array.isArray(v) || (v && typeof v === "object" && rowsOf({ [k]: v }, [k]).length))));
        return html`
          ${rows.length ? html`
            <${RepoBars} rows=${rows} pick=${isDuration} label="Job duration by repository" unit=" s" convert=${msToS} />
            <${RepoBars} rows=${rows} pick=${isRate} label="Failure rate by repository"
              unit=${numericColumns(rows, isRate).some((k) => /pct|percent/i.test(k)) ? "%" : ""} />
            <${AutoTable} rows=${rows} />
            <p class="muted small">Pick a repository for its 30-day detail:
              ${rows.map((r) => html` <button type="button" class="link" onClick=${() => setRepo(labelOf(r))}>${labelOf(r)}</button>`)}</p>`
            : html`<${Empty}>No job finished in the last ${days} days.<//>`}
          ${Object.keys(rest).length ? html`<${AutoView} data=${rest} />` : null}
          ${data.browser_test ? html`<h3>Browser tests</h3><${AutoView} data=${data.browser_test} />` : null}`;
      }}<//>
    <//>
    <${RepoDetail} repo=${repo} />
    <${SimplePanel} id="concurrency" title="Concurrency findings" what="Concurrency findings" path="/api/concurrency" />
    <${SimplePanel} id="billing" title="Billing" what="Billing snapshot" path="/api/billing" />
  </div>`;
}

function SimplePanel({ id, title, what, path, wide }) {
  const res = useFetch(path, path);
  return html`<${Panel} id=${id} title=${title} wide=${wide}>
    <${Loaded} res=${res} what=${what} path=${path.split("?")[0]}>${(d) => html`<${AutoView} data=${d} />`}<//>
  <//>`;
}

function parseCounts(text) {
  const counts = text.split(/[\s,]+/).filter(Boolean).map(Number);
  if (!counts.length || counts.some((n) => !Number.isInteger(n) || n < 0 || n > 256)) return null;
  return [...new Set(counts)].sort((a, b) => a - b);
}

function Comparison({ result }) {
  const rows = rowsOf(result, ["results", "comparison", "scenarios", "runs", "counts"]);
  if (!rows.length) return html`<${AutoView} data=${result} />`;
  const xKey = Object.keys(rows[0]).find((k) => /runner|count/i.test(k) && typeof rows[0][k] === "number");
  const series = numericColumns(rows, (k) => k !== xKey && isDuration(k)).slice(0, 4);
  const other = Object.fromEntries(Object.entries(result).filter(([, v]) => !Array.isArray(v)));
  return html`
    ${xKey && series.length ? html`<${LineChart} label="Queue time by runner count" xLabel="runners" unit=" s"
      x=${rows.map((r) => r[xKey])} series=${series.map((c) => ({ label: c.replaceAll("_", " "), values: rows.map((r) => msToS(c, r[c])) }))} />` : null}
    <${AutoTable} rows=${rows} />
    ${Object.keys(other).length ? html`<${AutoView} data=${other} />` : null}`;
}

export function Simulate() {
  const repos = knownRepos();
  const [form, setForm] = useState({ repo: repos[0] || "", counts: "1, 2, 3, 4", slo: "300" });
  const [run, setRun] = useState({ busy: false, result: null, error: null });
  useEffect(() => { // the snapshot may arrive after the form: offer its first repository then
    if (!form.repo && repos.length) setForm((f) => ({ ...f, repo: repos[0] }));
  }, [repos.join(",")]);
  const counts = parseCounts(form.counts);
  const slo = Number(form.slo);
  const valid = /^[\w.-]+\/[\w.-]+$/.test(form.repo) && counts && Number.isInteger(slo) && slo > 0;
  const submit = async (event) => {
    event.preventDefault();
    if (!valid) return;
    setRun({ busy: true, result: null, error: null });
    try {
      const result = await postJSON("/api/simulate", { repo: form.repo, runnerCounts: counts, sloSec: slo }, state.token);
      setRun({ busy: false, result, error: null });
    } catch (error) {
      setRun({ busy: false, result: null, error });
    }
  };
  const field = (key) => (e) => setForm({ ...form, [key]: e.currentTarget.value });
  return html`<div class="split">
    <${Panel} id="simulate" title="Replay history with other runner counts">
      <form class="form" onSubmit=${submit}>
        <label class="field">Repository
          <input name="repo" list="sim-repos" required placeholder="owner/project" value=${form.repo} onInput=${field("repo")} /></label>
        <datalist id="sim-repos">${repos.map((r) => html`<option value=${r}></option>`)}</datalist>
        <label class="field">Runner counts to compare
          <input name="counts" inputmode="numeric" required value=${form.counts} onInput=${field("counts")}
            aria-invalid=${counts ? "false" : "true"} aria-describedby="counts-help" />
          <span id="counts-help" class="help">Whole numbers from 0 to 256, separated by commas.</span></label>
        <label class="field">Queue-time objective (seconds)
          <input name="slo" type="number" min="1" step="1" required value=${form.slo} onInput=${field("slo")} /></label>
        <button type="submit" class="primary" disabled=${!valid || run.busy}>${run.busy ? "Simulating…" : "Simulate"}</button>
      </form>
    <//>
    <${Panel} id="simulation" title="Comparison">
      ${run.error ? (isMissing(run.error) ? html`<${NotAvailable} what="Simulation" path="/api/simulate" />` : html`<${Failed} error=${run.error} />`)
        : run.result ? html`<${Comparison} result=${run.result} />`
          : html`<${Empty}>Pick a repository and the runner counts, then Simulate: the daemon replays its recorded jobs against each count.<//>`}
    <//>
  </div>`;
}

export function Forecast() {
  const res = useFetch("/api/forecast", "forecast");
  return html`<div class="grid"><${Panel} id="forecast" wide title="Next hour's demand">
    <${Loaded} res=${res} what="Forecast" path="/api/forecast">${(data) => {
      const rows = rowsOf(data, ["repos", "forecast", "per_repo", "by_repo"]);
      const other = Object.fromEntries(Object.entries(data).filter(([, v]) => v === null || typeof v !== "object"));
      return rows.length ? html`
        <${RepoBars} rows=${rows} pick=${(k) => !/(_at|time|hour|weekday)$/i.test(k)} label="Expected demand per repository" />
        <${AutoTable} rows=${rows} />
        ${Object.keys(other).length ? html`<${AutoView} data=${other} />` : null}`
        : html`<${AutoView} data=${data} />`;
    }}<//>
  <//></div>`;
}

function HostsTable({ hosts }) {
  return html`<div class="table-wrap"><table class="compact">
    <thead><tr><th scope="col">Host</th><th scope="col">Role</th><th scope="col">Runners</th><th scope="col">Busy / ceiling</th>
      <th scope="col">Load</th><th scope="col">Heartbeat</th><th scope="col">Waiting commands</th></tr></thead>
    <tbody>${hosts.map((h) => {
      const runners = Array.isArray(h.runners) ? h.runners.length : h.runners;
      const cap = h.capacity || {};
      const stale = h.stale ?? h.heartbeat_age_s > 120;
      return html`<tr data-host=${h.host}>
        <th scope="row">${h.host}</th><td><${Badge} kind=${h.role === "coordinator" ? "info" : ""}>${h.role || "agent"}<//></td>
        <td>${runners ?? DASH}</td><td class="nowrap">${cap.busy ?? DASH} / ${cap.ceiling ?? DASH}</td>
        <td class="nowrap">${Array.isArray(h.load) ? h.load.map((x) => num(x)).join(" / ") : any(h.load)}</td>
        <td class="nowrap">${h.local ? "this host" : html`<${Badge} kind=${stale ? "bad" : "ok"}>${dur(h.heartbeat_age_s)} ago<//>`}</td>
        <td>${h.pending_commands ? h.pending_commands : DASH}</td>
      </tr>`;
    })}</tbody></table></div>`;
}

// A panel whose content may grow without bound (decision logs): its body scrolls inside a
// fixed height, so the screen stays one laptop screen tall however many decisions there are.
function CappedPanel({ id, title, what, path }) {
  const res = useFetch(path, `${path}-${Math.floor(Date.now() / 10000)}`);
  return html`<${Panel} id=${id} title=${title}>
    <div class="capped" tabindex="0" role="region" aria-label=${title}>
      <${Loaded} res=${res} what=${what} path=${path.split("?")[0]}>${(d) => html`<${AutoView} data=${d} />`}<//>
    </div>
  <//>`;
}

export function Hosts() {
  const res = useFetch("/api/hosts", `hosts-${Math.floor(Date.now() / 10000)}`);
  const count = res.data ? rowsOf(res.data, ["hosts"], "host").length : null;
  return html`<div class="hosts-layout">
    <${Panel} id="hosts" title=${count ? `Hosts (${count})` : "Hosts"}>
      <${Loaded} res=${res} what="Hosts" path="/api/hosts">${(data) => {
        const hosts = rowsOf(data, ["hosts"], "host");
        return hosts.length ? html`<${HostsTable} hosts=${hosts} />` : html`<${Empty}>No host has reported.<//>`;
      }}<//>
    <//>
    <div class="stack">
      <${CappedPanel} id="autoscale" title="Autoscale decisions" what="Autoscale" path="/api/autoscale" />
      <${CappedPanel} id="admission" title="Admission decisions" what="Admission" path="/api/admission?limit=60" />
    </div>
  </div>`;
}
