// Enqueue a job: a form that builds the job spec, with a live count of matching devices
// (POST /api/jobs/preview-targets) as targets change, and the saved job templates (/api/templates):
// load one into the form, enqueue one as it is, save the form's spec as one.
import { html, useState, useEffect, useMemo } from "../lib/core.js";
import { get, post, del, seg, currentPeer } from "../lib/api.js";
import { navigate, href } from "../lib/router.js";
import { notify } from "../lib/notify.js";
import { useAction, useResource } from "../lib/hooks.js";
import { Page, Section, Json, DeviceLink, Empty, Loaded, Action, ConfirmButton } from "../lib/ui.js";
import { WorkloadList, HOST_WORKLOADS } from "../lib/workloads.js";

const BENCH_PARAMS = [["prompt_tokens", 128], ["gen_tokens", 32], ["warmup_iters", 1], ["measure_iters", 3]];

function newId() {
  const t = new Date().toISOString().replace(/[-:T]/g, "").slice(0, 14);
  return `dash-${t}-${Math.random().toString(16).slice(2, 6)}`;
}

function initialForm() {
  return {
    job_id: newId(), workload: "benchmark", executor: "device", backend: "synthetic",
    match: "", device_id: "", pool: "", fanout: false, priority: "0", ttl_s: "", max_attempts: "",
    preemptible: false, params: Object.fromEntries(BENCH_PARAMS.map(([k, v]) => [k, String(v)])),
    paramsJson: "{}", extra: {},
  };
}

// A saved spec back into the form; the fields the form has no input for (app, suite, model,
// constraints, other targets) ride along in `extra` and come back out in buildSpec.
function specToForm(spec) {
  const { schema: _s, job_id: _j, workload, executor, backend, targets, params, fanout, priority,
    lease, preemptible, ...rest } = spec;
  const f = { ...initialForm(), workload: workload || "", executor: executor || "device", backend: backend || "",
    priority: String(priority ?? 0), preemptible: preemptible === true, extra: rest };
  const { match, device_id: deviceId, pool, ...otherTargets } = targets || {};
  Object.assign(f, { match: match || "", device_id: deviceId || "", pool: pool || "" });
  if (Object.keys(otherTargets).length) f.extra.targets = otherTargets;
  if (fanout === true) f.fanout = true;
  else if (fanout !== undefined && fanout !== false) f.extra.fanout = fanout;
  const { ttl_s: ttl, max_attempts: attempts, ...otherLease } = lease || {};
  Object.assign(f, { ttl_s: ttl === undefined ? "" : String(ttl), max_attempts: attempts === undefined ? "" : String(attempts) });
  if (Object.keys(otherLease).length) f.extra.lease = otherLease;
  if (f.workload === "benchmark") {
    const known = Object.fromEntries(BENCH_PARAMS.map(([k]) => [k, params?.[k] === undefined ? "" : String(params[k])]));
    const others = Object.fromEntries(Object.entries(params || {}).filter(([k]) => !(k in known)));
    f.params = known;
    if (Object.keys(others).length) f.extra.params = others;
  } else {
    f.paramsJson = JSON.stringify(params || {}, null, 2);
  }
  return f;
}

function buildSpec(f) {
  const { targets: extraTargets, lease: extraLease, params: extraParams, ...extra } = f.extra || {};
  const spec = { ...extra, schema: 1, job_id: f.job_id.trim(), workload: f.workload.trim(), executor: f.executor };
  if (f.backend.trim()) spec.backend = f.backend.trim();
  const targets = { ...extraTargets };
  if (f.match.trim()) targets.match = f.match.trim();
  if (f.device_id.trim()) targets.device_id = f.device_id.trim();
  if (f.pool.trim()) targets.pool = f.pool.trim();
  if (Object.keys(targets).length) spec.targets = targets;
  if (f.workload.trim() === "benchmark") {
    spec.params = { ...extraParams, ...Object.fromEntries(Object.entries(f.params).filter(([, v]) => v !== "").map(([k, v]) => [k, Number(v)])) };
  } else {
    let params;
    try { params = JSON.parse(f.paramsJson || "{}"); } catch { throw new Error("params is not valid JSON"); }
    if (params && typeof params === "object" && !Array.isArray(params) && Object.keys(params).length) spec.params = params;
  }
  if (f.fanout) spec.fanout = true;
  if (f.priority !== "" && Number(f.priority) !== 0) spec.priority = Number(f.priority);
  const lease = { ...extraLease };
  if (f.ttl_s !== "") lease.ttl_s = Number(f.ttl_s);
  if (f.max_attempts !== "") lease.max_attempts = Number(f.max_attempts);
  if (Object.keys(lease).length) spec.lease = lease;
  if (f.preemptible) spec.preemptible = true;
  return spec;
}

// The live count: asks the collector which devices this target would reach.
function useMatchCount(spec) {
  const [state, setState] = useState({ loading: true });
  const key = JSON.stringify(spec && [spec.workload, spec.backend, spec.executor, spec.targets, spec.fanout]);
  useEffect(() => {
    if (!spec || !spec.workload) { setState({ error: "name a workload to see matching devices" }); return undefined; }
    let gone = false;
    setState((s) => ({ ...s, loading: true }));
    const t = setTimeout(async () => {
      const body = { workload: spec.workload, executor: spec.executor };
      for (const k of ["backend", "targets", "fanout"]) if (spec[k] !== undefined) body[k] = spec[k];
      try {
        const r = await post("/api/jobs/preview-targets", body);
        if (!gone) setState({ count: r.count, devices: r.devices });
      } catch (err) {
        if (!gone) setState({ error: err.message });
      }
    }, 250);
    return () => { gone = true; clearTimeout(t); };
  }, [key]);
  return state;
}

function MatchCount({ state, spec }) {
  let text;
  if (state.error) text = html`<span class="bad">${state.error}</span>`;
  else if (state.count === undefined) text = "counting…";
  else text = html`<strong data-count=${state.count}>${state.count}</strong> matching device${state.count === 1 ? "" : "s"}${spec?.fanout ? ` (one child job each)` : ""}`;
  return html`<div class="match-count" id="match-count" aria-live="polite" aria-busy=${state.loading ? "true" : "false"}>
    <p>${text}</p>
    ${state.devices?.length ? html`<ul class="plain small">${state.devices.slice(0, 12).map((d) => html`<li>
      <${DeviceLink} id=${d.device_id} /> <span class="muted">${[d.platform, d.model].filter(Boolean).join(" · ")}</span></li>`)}
      ${state.devices.length > 12 ? html`<li class="muted">and ${state.devices.length - 12} more</li>` : null}</ul>` : null}
    ${state.count === 0 && !state.error ? html`<p class="muted small">The job would wait in the queue until a device that declares <code>${spec.workload}${spec.backend ? `:${spec.backend}` : ""}</code> and matches the target polls.</p>` : null}
  </div>`;
}

function withoutJobId(spec) {
  const { job_id: _drop, ...template } = spec;
  return template;
}

// The saved templates: load one into the form, enqueue one as saved, delete one; and save the
// form's spec (without its job id) under an id.
function Templates({ spec, onLoad }) {
  const res = useResource(() => get("/api/templates", null, { local: true }), [], (e) => e.type === "template");
  const [run, busy] = useAction(notify);
  const [id, setId] = useState("");
  const [name, setName] = useState("");
  const save = async (e) => {
    e.preventDefault();
    const r = await run(() => post("/api/templates", { id: id.trim(), name: name.trim() || null, spec: withoutJobId(spec) }),
      (x) => `Saved the template ${x.id}.`);
    if (r) { setId(""); setName(""); res.reload(); }
  };
  const enqueue = async (t) => {
    const r = await run(() => post(`/api/templates/${seg(t.id)}/enqueue`), (x) => `Enqueued ${x.job_id} (${x.status}).`);
    if (r) navigate(href(`/jobs/${seg(r.job_id)}`));
  };
  const remove = (t) => run(() => del(`/api/templates/${seg(t.id)}`), `Deleted the template ${t.id}; its jobs are kept.`)
    .then((r) => r && res.reload());
  return html`<${Loaded} res=${res}>${(d) => html`
    ${d.templates.length ? html`<ul class="plain template-list" aria-label="Saved templates">${d.templates.map((t) => html`<li data-template=${t.id}>
      <span class="grow"><strong>${t.name || t.id}</strong> <span class="muted small">${t.name ? `${t.id} · ` : ""}${t.workload} · ${t.executor}</span></span>
      <${Action} onClick=${() => onLoad(t)} disabled=${busy}>Load<//>
      <${Action} onClick=${() => enqueue(t)} disabled=${busy}>Enqueue<//>
      <${ConfirmButton} small label="Delete" question=${`Delete the template ${t.id}?`} onConfirm=${() => remove(t)} />
    </li>`)}</ul>` : html`<${Empty}>No saved templates yet: save the form's spec below to reuse it.<//>`}
    <form class="form inline-form" onSubmit=${save} aria-label="Save as template" id="save-template">
      <div class="grid two tight">
        <label>Template id <input name="template_id" required value=${id} onInput=${(e) => setId(e.target.value)}
          placeholder="nightly-pi-bench" /></label>
        <label>Name <input name="template_name" value=${name} onInput=${(e) => setName(e.target.value)} placeholder="optional" /></label>
      </div>
      <p class="hint">Saves the spec on the right without its job id; saving an existing id replaces it.</p>
      <button type="submit" class="btn" disabled=${busy || !spec}>Save as template</button>
    </form>`}<//>`;
}

export function Enqueue({ query }) {
  const [f, setF] = useState(initialForm);
  const [run, busy] = useAction(notify);
  const { spec, problem } = useMemo(() => {
    try { return { spec: buildSpec(f), problem: null }; } catch (err) { return { spec: null, problem: err.message }; }
  }, [f]);
  const count = useMatchCount(spec);
  const set = (k) => (e) => {
    const v = e.target.type === "checkbox" ? e.target.checked : e.target.value;
    setF((old) => {
      const next = { ...old, [k]: v };
      if (k === "workload" && HOST_WORKLOADS.includes(v)) next.executor = "host";
      if (k === "workload" && v !== "benchmark" && old.backend === "synthetic") next.backend = "";
      return next;
    });
  };
  const setParam = (k) => (e) => setF((old) => ({ ...old, params: { ...old.params, [k]: e.target.value } }));
  const load = (t) => { setF(specToForm(t.spec)); notify(`Loaded the template ${t.id} into the form.`, "ok"); };
  const wanted = query?.get("template");
  useEffect(() => {
    if (!wanted || currentPeer()) return;
    get(`/api/templates/${seg(wanted)}`, null, { local: true }).then((t) => setF(specToForm(t.spec)))
      .catch((err) => notify(err.message, "error", err.status));
  }, [wanted]);
  const submit = async (e) => {
    e.preventDefault();
    if (!spec) return;
    const r = await run(() => post("/jobs", spec), (x) => `Enqueued ${x.job_id} (${x.status}).`);
    if (r) navigate(href(`/jobs/${seg(r.job_id)}`));
  };
  if (currentPeer()) return html`<${Page} title="Enqueue a job"><${Empty}>A peer's view is read-only.<//><//>`;
  return html`<${Page} title="Enqueue a job" subtitle="Builds a job spec and posts it to /jobs.">
    <div class="grid enqueue">
      <form class="form card" onSubmit=${submit} id="enqueue-form" aria-label="Job spec">
        <${WorkloadList} />
        <div class="grid two tight">
          <label>Job id <input name="job_id" required value=${f.job_id} onInput=${set("job_id")} /></label>
          <label>Workload <input name="workload" required list="workloads" value=${f.workload} onInput=${set("workload")} /></label>
          <label>Executor <select name="executor" value=${f.executor} onChange=${set("executor")}>
            <option value="device">device (the agent on the device)</option><option value="host">host (an executor drives devices)</option></select></label>
          <label>Backend <input name="backend" list="backends" value=${f.backend} onInput=${set("backend")} placeholder="optional" /></label>
        </div>
        <fieldset><legend>Targets</legend>
          <label>Match expression <input name="match" value=${f.match} onInput=${set("match")} class="mono"
            placeholder="e.g. ram_mb >= 4096 && platform == 'android'" /></label>
          <div class="grid two tight">
            <label>Device id <input name="device_id" value=${f.device_id} onInput=${set("device_id")} placeholder="pin one device" /></label>
            <label>Pool <input name="pool" value=${f.pool} onInput=${set("pool")} /></label>
          </div>
          <label class="check"><input type="checkbox" name="fanout" checked=${f.fanout} onChange=${set("fanout")} /> Fan out: one job per matching device</label>
        </fieldset>
        <fieldset><legend>Parameters</legend>
          ${f.workload.trim() === "benchmark" ? html`<div class="grid four tight">${BENCH_PARAMS.map(([k]) => html`<label>${k}
              <input type="number" min="0" name=${k} value=${f.params[k]} onInput=${setParam(k)} /></label>`)}</div>`
            : html`<label>params (JSON object) <textarea name="params" rows="4" class="mono" onInput=${set("paramsJson")}>${f.paramsJson}</textarea></label>`}
        </fieldset>
        <fieldset><legend>Queue</legend>
          <div class="grid three tight">
            <label>Priority <input type="number" name="priority" min="-1000" max="1000" value=${f.priority} onInput=${set("priority")} /></label>
            <label>Lease ttl (s) <input type="number" name="ttl_s" min="1" value=${f.ttl_s} onInput=${set("ttl_s")} placeholder="600" /></label>
            <label>Max attempts <input type="number" name="max_attempts" min="1" value=${f.max_attempts} onInput=${set("max_attempts")} placeholder="3" /></label>
          </div>
          <label class="check"><input type="checkbox" checked=${f.preemptible} onChange=${set("preemptible")} /> Preemptible</label>
        </fieldset>
        ${problem ? html`<p class="bad" role="alert">${problem}</p>` : null}
        <div class="row"><button type="submit" class="btn primary" disabled=${busy || !spec}>Enqueue</button>
          <button type="button" class="btn" onClick=${() => setF(initialForm())}>Reset</button></div>
      </form>
      <div class="stack">
        <${Section} title="Matching devices" id="enq-count"><${MatchCount} state=${count} spec=${spec} /><//>
        <${Section} title="Saved templates" id="enq-templates"><${Templates} spec=${spec} onLoad=${load} /><//>
        <${Section} title="Spec" id="enq-spec">${spec ? html`<${Json} value=${spec} />` : null}<//>
      </div>
    </div>
  <//>`;
}
