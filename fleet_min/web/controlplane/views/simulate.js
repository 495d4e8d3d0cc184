// Simulation (POST /api/simulate): replay a repository's recorded jobs with other runner counts
// and compare how long jobs would have waited, as a chart of queue time by runner count and a
// table of plain figures, with what really happened as the first row.
import { html, useState, useEffect } from "../js/html.js";
import { state } from "../js/store.js";
import { postJSON, isMissing } from "../js/api.js";
import { Panel, Empty, NotAvailable, Failed, Table, Time } from "../js/ui.js";
import { LineChart } from "../js/chart.js";
import { dur, num, pct, plural, clock } from "../js/format.js";
import { pctKeys } from "./analytics.js";

function knownRepos() {
  const repos = new Set((state.snap?.runners || []).map((r) => r.repo).filter(Boolean));
  for (const q of state.snap?.queue_causes || []) repos.add(q.repo);
  return [...repos].sort();
}

function parseCounts(text) {
  const counts = text.split(/[\s,]+/).filter(Boolean).map(Number);
  if (!counts.length || counts.some((n) => !Number.isInteger(n) || n < 0 || n > 256)) return null;
  return [...new Set(counts)].sort((a, b) => a - b);
}

function overSlo(r, total) {
  if (typeof r.over_slo !== "number") return "–";
  if (!r.over_slo) return "none";
  return `${num(r.over_slo)} of ${num(total)} (${pct(r.over_slo_pct, 1)})`;
}

function Summary({ result }) {
  const met = (result.results || []).find((r) => r.runners > 0 && r.over_slo === 0);
  return html`<p>Replayed ${plural(result.jobs || 0, result.self_hosted_only ? "self-hosted job" : "job")} of <strong>${result.repo}</strong>${" "}
    that finished since ${clock(result.since)} (the last ${plural(result.days, "day")});
    at most ${plural(result.demand_peak || 0, "job")} wanted a runner at once.${" "}
    ${met ? html`<strong>${plural(met.runners, "runner")}</strong> would have started every job within the objective of ${dur(result.slo_s)}.`
      : `No count tried starts every job within the objective of ${dur(result.slo_s)}.`}</p>`;
}

function Comparison({ result }) {
  const results = (result.results || []).filter((r) => typeof r.runners === "number");
  if (!results.length) return html`<${Empty}>The daemon replayed no runner count.<//>`;
  const keys = pctKeys(results, "wait_s");
  const rows = [{ recorded: true, runners: "recorded", ...(result.recorded || {}) }, ...results];
  const columns = [
    { label: "Runners", cell: (r) => (r.recorded ? html`<span class="nowrap" title="what really happened">as recorded</span>` : num(r.runners)) },
    ...keys.map((k) => ({ label: `Wait ${k}`, num: true, cell: (r) => (r.runners === 0 ? "never starts" : dur(r.wait_s?.[k])) })),
    { label: "Longest", num: true, title: "the longest wait", cell: (r) => (r.runners === 0 ? "never starts" : dur(r.wait_s?.max)) },
    { label: `Over ${dur(result.slo_s)}`, num: true, title: "jobs that waited longer than the objective", cell: (r) => overSlo(r, result.jobs) },
    { label: "Busy", num: true, title: "share of the runners' time spent on jobs", cell: (r) => (r.recorded ? "–" : pct(r.utilization_pct, 1)) },
    { label: "Runner-hours", num: true, title: "busy / provisioned", cell: (r) => (r.recorded ? "–" : `${num(r.busy_runner_hours, 1)} / ${num(r.provisioned_runner_hours, 1)}`) },
  ];
  const charted = results.filter((r) => r.runners > 0);
  return html`
    <${Summary} result=${result} />
    ${charted.length ? html`<${LineChart} label="Queue time by runner count" xLabel="runners" unit=" s" format=${dur}
      x=${charted.map((r) => r.runners)}
      series=${keys.map((k) => ({ label: `wait ${k}`, values: charted.map((r) => r.wait_s?.[k] ?? null) }))} />` : null}
    <${Table} label="Comparison by runner count" columns=${columns} rows=${rows} rowKey=${(r) => String(r.runners)}
      rowAttrs=${(r) => ({ "data-runners": String(r.runners) })} />
    <p class="muted small">Worked out <${Time} at=${result.generated_at} />. A count of 0 leaves every job waiting.</p>`;
}

function Form({ form, setForm, busy, onSubmit, repos }) {
  const counts = parseCounts(form.counts);
  const field = (key) => (e) => setForm({ ...form, [key]: e.currentTarget.value });
  return html`<form class="form" onSubmit=${onSubmit}>
    <label class="field">Repository
      <input name="repo" list="sim-repos" required placeholder="owner/project" value=${form.repo} onInput=${field("repo")} /></label>
    <datalist id="sim-repos">${repos.map((r) => html`<option value=${r}></option>`)}</datalist>
    <label class="field">Runner counts to compare
      <input name="counts" inputmode="numeric" required value=${form.counts} onInput=${field("counts")}
        aria-invalid=${counts ? "false" : "true"} aria-describedby="counts-help" />
      <span id="counts-help" class="help">Whole numbers from 0 to 256, separated by commas.</span></label>
    <label class="field">Queue-time objective (seconds)
      <input name="slo" type="number" min="1" step="1" required value=${form.slo} onInput=${field("slo")} /></label>
    <button type="submit" class="primary" disabled=${busy}>${busy ? "Simulating…" : "Simulate"}</button>
  </form>`;
}

export function Simulate() {
  const repos = knownRepos();
  const [form, setForm] = useState({ repo: repos[0] || "", counts: "1, 2, 3, 4", slo: "300" });
  const [run, setRun] = useState({ busy: false, result: null, error: null });
  useEffect(() => { // the snapshot may arrive after the form: offer its first repository then
    if (!form.repo && repos.length) setForm((f) => ({ ...f, repo: repos[0] }));
  }, [repos.join(",")]);
  const submit = async (event) => {
    event.preventDefault();
    const counts = parseCounts(form.counts);
    const slo = Number(form.slo);
    // Checked here only for what the browser cannot send; the daemon's refusals are shown as they are.
    if (!counts) return setRun({ busy: false, result: null, error: new Error("Runner counts must be whole numbers from 0 to 256, separated by commas.") });
    setRun({ busy: true, result: null, error: null });
    try {
      const result = await postJSON("/api/simulate", { repo: form.repo.trim(), runnerCounts: counts, sloSec: slo }, state.token);
      setRun({ busy: false, result, error: null });
    } catch (error) {
      setRun({ busy: false, result: null, error });
    }
    return undefined;
  };
  return html`<div class="split">
    <${Panel} id="simulate" title="Replay history with other runner counts">
      <${Form} form=${form} setForm=${setForm} busy=${run.busy} onSubmit=${submit} repos=${repos} />
    <//>
    <${Panel} id="simulation" title="Comparison">
      ${run.error ? (isMissing(run.error) ? html`<${NotAvailable} what="Simulation" path="/api/simulate" />` : html`<${Failed} error=${run.error} />`)
        : run.result ? html`<${Comparison} result=${run.result} />`
          : run.busy ? html`<p class="muted" aria-busy="true">Replaying the recorded jobs…</p>`
            : html`<${Empty}>Pick a repository and the runner counts, then Simulate: the daemon replays the jobs it recorded in the last 30 days against each count.<//>`}
    <//>
  </div>`;
}
