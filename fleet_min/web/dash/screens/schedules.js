// Schedules: list with enable/disable, run now and whether one is missed; create from a preset,
// a saved job template or an existing job; one schedule's cron and template edited in place, its
// history of runs and jobs.
import { html, useState } from "../lib/core.js";
import { get, post, patch, del, seg, currentPeer } from "../lib/api.js";
import { useResource, useTick, useAction } from "../lib/hooks.js";
import { navigate, href } from "../lib/router.js";
import { notify } from "../lib/notify.js";
import {
  Page, Section, Loaded, Table, Pill, Ago, JobLink, Fields, Json, Action, ConfirmButton, Link, Empty,
} from "../lib/ui.js";

const PRESETS = {
  bench: { label: "Synthetic benchmark on a pool", cron: "0 3 * * *", template: {
    schema: 1, workload: "benchmark", executor: "device", backend: "synthetic",
    params: { prompt_tokens: 128, gen_tokens: 32, warmup_iters: 1, measure_iters: 3 },
    targets: { pool: "nightly" } } },
  selfcheck: { label: "Self-check on every device (fan-out)", cron: "@daily", template: {
    schema: 1, workload: "self-check", executor: "device", fanout: true } },
  uitest: { label: "UI test of the latest build", cron: "30 2 * * 1-5", template: {
    schema: 1, workload: "ui-test", executor: "host",
    app: { name: "my-app", sha256: "latest", platform: "android" },
    suite: { kind: "flow_runner", flows: "flows/*.yaml" } } },
};

function useScheduleActions() {
  const [run, busy] = useAction(notify);
  const toggle = (s) => run(() => patch(`/api/schedules/${seg(s.id)}`, { enabled: !s.enabled }),
    `${s.id} ${s.enabled ? "disabled" : "enabled"}.`);
  const runNow = (s) => run(() => post(`/api/schedules/${seg(s.id)}/run`),
    (r) => (r.outcome === "enqueued" ? `Enqueued ${r.job_id}.` : `Skipped: ${r.reason}`));
  return { toggle, runNow, busy, run };
}

function CreateSchedule({ onCreated }) {
  const [preset, setPreset] = useState("bench");
  const [id, setId] = useState("");
  const [enabled, setEnabled] = useState(false);
  const saved = useResource(() => get("/api/templates", null, { local: true }), [], (e) => e.type === "template");
  const [cron, setCron] = useState(PRESETS.bench.cron);
  const [text, setText] = useState(JSON.stringify(PRESETS.bench.template, null, 2));
  const [fromJob, setFromJob] = useState("");
  const [problem, setProblem] = useState(null);
  const { run, busy } = useScheduleActions();
  const choose = (key) => {
    setPreset(key);
    if (PRESETS[key]) { setCron(PRESETS[key].cron); setText(JSON.stringify(PRESETS[key].template, null, 2)); }
    const template = key.startsWith("tpl:") && (saved.data?.templates || []).find((t) => `tpl:${t.id}` === key);
    if (template) setText(JSON.stringify(template.spec, null, 2));
  };
  const copyJob = async () => {
    try {
      const job = await get(`/api/jobs/${seg(fromJob.trim())}`);
      const { job_id: _drop, ...template } = job.spec;
      setText(JSON.stringify(template, null, 2));
      setProblem(null);
    } catch (err) { setProblem(err.message); }
  };
  const submit = async (e) => {
    e.preventDefault();
    let template;
    try { template = JSON.parse(text); } catch { setProblem("the template is not valid JSON"); return; }
    setProblem(null);
    const r = await run(() => post("/api/schedules", { id: id.trim(), cron: cron.trim(), template, enabled }),
      (x) => (x.enabled ? `Created ${x.id}; it first runs at ${x.next_run}.` : `Created ${x.id}; it starts disabled.`));
    if (r) { setId(""); onCreated(r); }
  };
  return html`<form class="form" onSubmit=${submit} aria-label="New schedule">
    <div class="grid three tight">
      <label>Template <select value=${preset} onChange=${(e) => choose(e.target.value)}>
        ${Object.entries(PRESETS).map(([k, p]) => html`<option value=${k}>${p.label}</option>`)}
        ${(saved.data?.templates || []).map((t) => html`<option value=${`tpl:${t.id}`}>Saved template: ${t.name || t.id}</option>`)}
        <option value="job">Copy an existing job</option></select></label>
      <label>Id <input required value=${id} onInput=${(e) => setId(e.target.value)} placeholder="nightly-bench" pattern="[A-Za-z0-9._:@][A-Za-z0-9._:@-]{0,99}" /></label>
      <label>Cron <input required class="mono" value=${cron} onInput=${(e) => setCron(e.target.value)} placeholder="0 3 * * *" /></label>
    </div>
    ${preset === "job" ? html`<div class="row"><label>Job id <input value=${fromJob} onInput=${(e) => setFromJob(e.target.value)} /></label>
      <button type="button" class="btn" onClick=${copyJob} disabled=${!fromJob.trim()}>Copy its spec</button></div>` : null}
    <label>Job template (a job spec without job_id) <textarea class="mono" rows="10" onInput=${(e) => setText(e.target.value)}>${text}</textarea></label>
    <p class="hint">Minute hour day-of-month month day-of-week, or @hourly, @daily, @weekly, @monthly.</p>
    <label class="check"><input type="checkbox" name="enabled" checked=${enabled} onChange=${(e) => setEnabled(e.target.checked)} /> Enable it at once (otherwise it starts disabled; it never fires in the minute it is enabled)</label>
    ${problem ? html`<p class="bad" role="alert">${problem}</p>` : null}
    <div class="row"><button type="submit" class="btn primary" disabled=${busy}>Create schedule</button></div>
  </form>`;
}

export function Schedules() {
  useTick();
  const res = useResource(() => get("/api/schedules"), [], (e) => e.type === "schedule");
  const { toggle, runNow, busy } = useScheduleActions();
  const [creating, setCreating] = useState(false);
  return html`<${Page} title="Schedules" actions=${currentPeer() ? null : html`<button type="button" class="btn primary" aria-expanded=${creating} onClick=${() => setCreating(!creating)}>${creating ? "Close the form" : "New schedule"}</button>`}>
    ${creating ? html`<${Section} title="New schedule" id="sch-new"><${CreateSchedule} onCreated=${() => { setCreating(false); res.reload(); }} /><//>` : null}
    <${Loaded} res=${res}>${(d) => html`<${Table} label="Schedules" empty="No schedules yet." className="schedules"
      head=${["Schedule", "Cron", "Workload", "State", "Next run", "Last run", "Last skip", ""]}
      rows=${d.schedules.map((s) => html`<tr>
        <td><${Link} to=${`/schedules/${encodeURIComponent(s.id)}`}>${s.id}<//></td><td class="mono">${s.cron}</td>
        <td>${s.template?.workload}</td><td><${Pill} status=${s.enabled ? "enabled" : "disabled"} />${s.missed ? html` <span title=${s.missed_detail}><${Pill} status="missed" /></span>` : null}</td>
        <td><${Ago} iso=${s.next_run} /></td><td><${Ago} iso=${s.last_run} /></td>
        <td class="small">${s.last_skip || ""}</td>
        <td class="actions-cell"><${Action} onClick=${() => toggle(s)} disabled=${busy}>${s.enabled ? "Disable" : "Enable"}<//>
          <${Action} onClick=${() => runNow(s)} disabled=${busy}>Run now<//></td></tr>`)} />`}<//>
  <//>`;
}

// The cron and the template, edited in place; only what changed is sent.
function EditSchedule({ schedule, run, reload }) {
  const original = JSON.stringify(schedule.template, null, 2);
  const [cron, setCron] = useState(schedule.cron);
  const [text, setText] = useState(original);
  const [problem, setProblem] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    const changes = {};
    if (cron.trim() !== schedule.cron) changes.cron = cron.trim();
    if (text !== original) {
      try { changes.template = JSON.parse(text); } catch { setProblem("the template is not valid JSON"); return; }
    }
    setProblem(null);
    if (await run(() => patch(`/api/schedules/${seg(schedule.id)}`, changes), "Schedule saved.")) reload();
  };
  const unchanged = cron.trim() === schedule.cron && text === original;
  return html`<form class="form" onSubmit=${submit} aria-label="Edit the schedule" id="edit-schedule">
    <label>Cron <input name="cron" class="mono" value=${cron} onInput=${(e) => setCron(e.target.value)} /></label>
    <label>Job template (a job spec without job_id) <textarea name="template" class="mono" rows="8"
      onInput=${(e) => setText(e.target.value)}>${text}</textarea></label>
    ${problem ? html`<p class="bad" role="alert">${problem}</p>` : null}
    <div class="row"><button type="submit" class="btn" disabled=${unchanged}>Save changes</button>
      <button type="button" class="btn" disabled=${unchanged} onClick=${() => { setCron(schedule.cron); setText(original); setProblem(null); }}>Undo</button></div>
  </form>`;
}

export function ScheduleDetail({ id }) {
  useTick();
  const res = useResource(async () => {
    const schedule = await get(`/api/schedules/${seg(id)}`).catch(async (err) => {
      if (!currentPeer()) throw err;
      // The peer proxy lists schedules but does not read one by id.
      const all = await get("/api/schedules");
      const found = all.schedules.find((s) => s.id === id);
      if (!found) throw err;
      return found;
    });
    const history = currentPeer() ? null : await get(`/api/schedules/${seg(id)}/history`);
    return { schedule, history };
  }, [id], (e) => (e.type === "schedule" && e.schedule_id === id) || (e.type === "job" && e.job_id?.startsWith(`${id}-`)));
  const { toggle, runNow, busy, run } = useScheduleActions();
  const remove = async () => {
    if (await run(() => del(`/api/schedules/${seg(id)}`), `Deleted ${id}; its jobs are kept.`)) navigate(href("/schedules"));
  };
  const s = res.data?.schedule;
  return html`<${Page} title=${id} subtitle="Schedule" actions=${s ? html`
      <${Action} onClick=${() => toggle(s)} disabled=${busy}>${s.enabled ? "Disable" : "Enable"}<//>
      <${Action} kind="primary" onClick=${() => runNow(s)} disabled=${busy}>Run now<//>
      <${ConfirmButton} label="Delete" question="Delete this schedule and its run records?" onConfirm=${remove} />` : null}>
    <${Loaded} res=${res}>${({ schedule, history }) => html`
      <div class="grid two">
        <${Section} title="Schedule" id="sch-info">
          <${Fields} pairs=${[
            ["State", html`<${Pill} status=${schedule.enabled ? "enabled" : "disabled"} />`],
            schedule.missed ? ["Missed", html`<span class="bad" id="sch-missed">${schedule.missed_detail}</span>`] : null,
            ["Cron", html`<span class="mono">${schedule.cron}</span>`],
            [schedule.enabled ? "Next run" : "Would run", html`<${Ago} iso=${schedule.next_run} />`], ["Last run", html`<${Ago} iso=${schedule.last_run} />`],
            ["Last skip", schedule.last_skip], ["Created", html`<${Ago} iso=${schedule.created_at} />`],
          ]} />
        <//>
        <${Section} title="Cron and job template" id="sch-template">${currentPeer()
          ? html`<${Json} value=${schedule.template} />`
          : html`<${EditSchedule} key=${schedule.updated_at} schedule=${schedule} run=${run} reload=${res.reload} />`}<//>
      </div>
      ${history ? html`
        <${Section} title="Runs" id="sch-runs">
          <${Table} label="Runs" empty="No runs yet." head=${["Slot", "Due", "At", "Outcome", "Job", "Job status", "Detail"]}
            rows=${history.runs.map((r) => html`<tr><td class="mono small">${r.slot}</td><td><${Ago} iso=${r.due} /></td>
              <td><${Ago} iso=${r.at} /></td><td><${Pill} status=${r.outcome} /></td><td><${JobLink} id=${r.job_id} /></td>
              <td>${r.job_status ? html`<${Pill} status=${r.job_status} />` : "–"}</td><td class="small">${r.detail}</td></tr>`)} />
        <//>
        <${Section} title="Jobs" id="sch-jobs">
          <${Table} label="Jobs of this schedule" empty="No jobs yet." head=${["Job", "Status", "Attempts", "Created", "Finished", "Last error"]}
            rows=${history.jobs.map((j) => html`<tr><td><${JobLink} id=${j.job_id} /></td><td><${Pill} status=${j.status} /></td>
              <td>${j.attempts}</td><td><${Ago} iso=${j.created_at} /></td><td><${Ago} iso=${j.finished_at} /></td>
              <td class="error-text">${j.last_error}</td></tr>`)} />
        <//>` : html`<${Empty}>The history is not read through a peer's view.<//>`}`}<//>
  <//>`;
}
