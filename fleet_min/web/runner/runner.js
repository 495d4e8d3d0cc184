// The browser runner: enrols this browser as a temporary device, long-polls for jobs, runs
// synthetic benchmarks (jssha: SHA-256 written in the page; webcrypto: the platform digest),
// posts per-iteration rows and a summary, beacons while open, and stops claiming when hidden.

import { browserModel } from "./brand.js";

const TTL_S = 600;                // the device leaves the shelf after this much silence
const IDLE_BEACON_S = 30;
const MAX_POLL_BACKOFF_S = 30;
const HANDBACK_ITER_TOP = 1000000; // the agent's iteration numbers for hand-back rows
// decisions.md: the hex SHA-256 of a fresh synthetic block after 1,000 rounds. A backend that
// computes another digest computes SHA-256 wrongly, and its figures mean nothing.
const ATTESTATION = "d7e8b70dfb48593edebc84967a969e78429f9ac6da8d0c681a4b57a2fe078a84";
const DEFAULTS = { prompt_tokens: 512, gen_tokens: 128, warmup_iters: 1, measure_iters: 3 };

const $ = (id) => document.getElementById(id);

class Refusal extends Error {}
class Stopped extends Error {}

function deviceId() {
  const key = "fleet.runner.device";
  let id = null;
  try { id = sessionStorage.getItem(key); } catch { /* storage off: a fresh id per load */ }
  if (!id) {
    const bytes = crypto.getRandomValues(new Uint8Array(5));
    id = `browser-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
    try { sessionStorage.setItem(key, id); } catch { /* as above */ }
  }
  return id;
}

function descriptor() {
  const mem = navigator.deviceMemory;
  return {
    platform: "web", kind: "browser",
    model: browserModel(navigator.userAgentData, navigator.userAgent, navigator.platform),
    os: navigator.userAgentData?.platform || navigator.platform || null,
    cpu_cores: Number.isInteger(navigator.hardwareConcurrency) ? navigator.hardwareConcurrency : null,
    ram_mb: typeof mem === "number" ? Math.round(mem * 1024) : null,
  };
}

function capabilities() {
  const caps = ["benchmark:jssha"];
  // Only a secure context (https, or localhost) has crypto.subtle.
  if (window.isSecureContext && window.crypto?.subtle) caps.push("benchmark:webcrypto");
  return caps;
}

async function vitals() {
  const v = {};
  try {
    if (navigator.getBattery) {
      const b = await navigator.getBattery();
      v.battery_pct = Math.round(b.level * 100);
      v.charging = b.charging;
    }
  } catch { /* not offered here */ }
  if (performance.memory) v.mem_mb = Math.round(performance.memory.usedJSHeapSize / 1048576);
  v.visible = document.visibilityState === "visible";
  return v;
}

async function http(method, path, body, signal) {
  const init = { method, headers: { Accept: "application/json" }, signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  const text = await resp.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!resp.ok && resp.status !== 204) {
    const err = new Error(data?.error || `the collector answered ${resp.status}`);
    err.status = resp.status;
    throw err;
  }
  return { status: resp.status, data };
}

const sleep = (s) => new Promise((r) => setTimeout(r, s * 1000));

function intParam(params, name, fallback, low, high) {
  const v = params[name] ?? fallback;
  if (!Number.isInteger(v) || v < low || v > high) {
    throw new Refusal(`params.${name} must be a whole number from ${low} to ${high}; the job gave ${JSON.stringify(v)}`);
  }
  return v;
}

function median(values) {
  const s = [...values].sort((a, b) => a - b);
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

class Runner {
  constructor() {
    this.id = deviceId();
    this.caps = capabilities();
    this.paused = false;
    this.job = null;         // { spec, stop: null | reason }
    this.worker = null;
    this.nextMessage = 1;
    this.pending = new Map();
    this.wake = null;        // resolves the wait of a paused or hidden poll loop
    this.done = 0;
    this.handbacks = new Map();
  }

  // -- display --------------------------------------------------------------------------------

  status(text, kind = "") {
    const el = $("status");
    el.textContent = text;
    el.className = `status ${kind}`;
  }

  log(text, kind = "") {
    const li = document.createElement("li");
    if (kind) li.className = kind;
    const time = document.createElement("time");
    time.textContent = new Date().toLocaleTimeString();
    li.append(time, document.createTextNode(` ${text}`));
    const list = $("log");
    list.prepend(li);
    while (list.children.length > 60) list.lastChild.remove();
  }

  showJob(spec, iter, total, phase) {
    $("job").hidden = !spec;
    if (!spec) return;
    $("job-id").textContent = spec.job_id;
    $("job-id").href = `/dash/jobs/${encodeURIComponent(spec.job_id)}`;
    $("job-backend").textContent = spec.backend || "synthetic";
    const p = spec.params || {};
    $("job-params").textContent = `${p.prompt_tokens ?? DEFAULTS.prompt_tokens} prompt + ${p.gen_tokens ?? DEFAULTS.gen_tokens} generated tokens`;
    $("job-phase").textContent = phase;
    const bar = $("job-progress");
    bar.max = total || 1;
    bar.value = iter;
  }

  // -- collector ------------------------------------------------------------------------------

  async register() {
    const body = { device_id: this.id, descriptor: descriptor(), capabilities: this.caps, pools: ["browser"], ttl_s: TTL_S };
    const { data } = await http("POST", "/devices/register", body);
    this.registered = true;
    return data;
  }

  async beacon(jobId) {
    const body = { schema: 1, kind: "beacon", device_id: this.id, beacon: await vitals() };
    if (jobId) body.job_id = jobId;
    const { data } = await http("POST", "/results", body);
    return data || {};
  }

  summary() {
    const d = descriptor();
    return Object.fromEntries(Object.entries({ model: d.model, os: d.os }).filter(([, v]) => v));
  }

  async post(row) {
    for (let attempt = 1; ; attempt += 1) {
      try {
        const { data } = await http("POST", "/results", { schema: 1, kind: "result", device_id: this.id, device: this.summary(), ...row });
        return data || {};
      } catch (err) {
        // Rows are idempotent by (job, device, iter): posting again is safe.
        if (attempt >= 5 || (err.status && err.status < 500)) throw err;
        await sleep(Math.min(8, 2 ** attempt / 2));
      }
    }
  }

  // -- the loops ------------------------------------------------------------------------------

  async start() {
    $("device-id").textContent = this.id;
    $("device-link").href = `/dash/devices/${encodeURIComponent(this.id)}`;
    $("device-id").href = $("device-link").href;
    $("model").textContent = descriptor().model;
    $("caps").textContent = this.caps.join(", ");
    $("secure").textContent = window.isSecureContext ? "secure context: webcrypto offered"
      : "not a secure context (plain http to another host): only jssha is offered";
    $("pause").addEventListener("click", () => this.togglePause());
    document.addEventListener("visibilitychange", () => this.visibility());
    this.idleBeacons();
    await this.pollLoop();
  }

  togglePause() {
    this.paused = !this.paused;
    $("pause").textContent = this.paused ? "Resume claiming" : "Pause claiming";
    $("pause").setAttribute("aria-pressed", String(this.paused));
    this.log(this.paused ? "paused: no new jobs will be claimed" : "resumed claiming jobs");
    if (!this.paused && this.wake) this.wake();
  }

  visibility() {
    if (document.hidden) {
      this.log("page hidden: no new jobs will be claimed until it is shown again");
    } else {
      this.log("page visible again");
      if (this.wake) this.wake();
    }
  }

  canClaim() { return !this.paused && !document.hidden; }

  idleBeacons() {
    const tick = async () => {
      if (!this.job && this.registered) {
        try { await this.beacon(); } catch (err) {
          if (err.status === 404) this.registered = false;  // forgotten: enrol again
        }
      }
    };
    setInterval(tick, IDLE_BEACON_S * 1000);
  }

  async waitUntilClaimable() {
    while (!this.canClaim()) {
      this.status(this.paused ? "Paused: not claiming jobs." : "Hidden: not claiming jobs until this page is shown.", "idle");
      await new Promise((resolve) => { this.wake = resolve; });
      this.wake = null;
    }
  }

  async pollLoop() {
    let backoff = 1;
    for (;;) {
      await this.waitUntilClaimable();
      try {
        if (!this.registered) {
          this.status("Enrolling this browser as a device…");
          await this.register();
          this.log(`enrolled as ${this.id} (${this.caps.join(", ")})`, "good");
          await this.beacon();
        }
        this.status("Waiting for a job…", "idle");
        const { status, data } = await http("GET", `/devices/${encodeURIComponent(this.id)}/next-job`);
        backoff = 1;
        if (status === 200 && data) await this.claimed(data);
      } catch (err) {
        this.status(`Cannot reach the collector (${err.message}); retrying in ${backoff} s.`, "bad");
        this.log(`poll failed: ${err.message}`, "bad");
        if (err.status === 404) this.registered = false;
        await sleep(backoff);
        backoff = Math.min(backoff * 2, MAX_POLL_BACKOFF_S);
      }
    }
  }

  async claimed(spec) {
    if (!this.canClaim()) {
      // The long poll was already waiting when the page was hidden or paused: hand the job back.
      try {
        await http("POST", `/jobs/${encodeURIComponent(spec.job_id)}/release`, { device_id: this.id });
        this.log(`handed ${spec.job_id} back: this page is ${this.paused ? "paused" : "hidden"}`);
      } catch (err) {
        this.log(`could not hand ${spec.job_id} back (${err.message}); running it`, "bad");
        await this.run(spec);
      }
      return;
    }
    await this.run(spec);
  }

  // -- one job --------------------------------------------------------------------------------

  async run(spec) {
    this.job = { spec, stop: null };
    this.log(`claimed ${spec.job_id} (${spec.workload}${spec.backend ? `:${spec.backend}` : ""})`);
    const ttl = spec.lease?.ttl_s > 0 ? spec.lease.ttl_s : 600;
    const keeper = setInterval(() => this.renew(), Math.max(2, Math.min(30, ttl / 4)) * 1000);
    try {
      const outcome = await this.benchmark(spec);
      await this.post({ job_id: spec.job_id, iter: 0, final: true, ...outcome });
      this.done += 1;
      $("done").textContent = String(this.done);
      if (outcome.ok) {
        $("last-digest").textContent = outcome.metrics.synthetic_digest;
        this.log(`finished ${spec.job_id}: decode ${outcome.metrics.decode_tok_s ?? "–"} tok/s, digest ${outcome.metrics.synthetic_digest.slice(0, 16)}…`, "good");
      } else {
        this.log(`${spec.job_id} failed: ${outcome.error}`, "bad");
      }
    } catch (err) {
      if (err instanceof Stopped) this.log(`stopped ${spec.job_id}: ${err.message}`, "bad");
      else this.log(`could not finish ${spec.job_id}: ${err.message}`, "bad");
    } finally {
      clearInterval(keeper);
      this.job = null;
      this.showJob(null);
    }
  }

  async renew() {
    const job = this.job;
    if (!job) return;
    try {
      const reply = await this.beacon(job.spec.job_id);
      if (reply.lease_renewed === false) this.stopJob("the collector no longer holds this job for this browser (cancelled, or the lease lapsed)");
      else if (reply.preempt) this.stopJob("a job of higher priority is waiting", true);
    } catch (err) {
      this.log(`beacon failed: ${err.message}`, "bad");
    }
  }

  stopJob(reason, handBack = false) {
    if (!this.job || this.job.stop) return;
    this.job.stop = { reason, handBack };
    if (this.worker) { this.worker.terminate(); this.worker = null; }
    for (const [, p] of this.pending) p.reject(new Stopped(reason));
    this.pending.clear();
  }

  check() {
    if (this.job?.stop) throw new Stopped(this.job.stop.reason);
  }

  // One iteration on the job's block (`fresh`: a new block, the job's first iteration).
  iteration(backend, p, g, fresh) {
    return this.ask({ op: "iteration", backend, prompt_tokens: p, gen_tokens: g, fresh });
  }

  attest(backend) {
    return this.ask({ op: "attest", backend });
  }

  ask(message) {
    if (!this.worker) this.worker = this.newWorker();
    const id = this.nextMessage++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.worker.postMessage({ id, ...message });
    });
  }

  newWorker() {
    const worker = new Worker(new URL("./worker.js", import.meta.url), { type: "module" });
    worker.addEventListener("message", (ev) => {
      const waiting = this.pending.get(ev.data.id);
      if (!waiting) return;
      this.pending.delete(ev.data.id);
      if (ev.data.error) waiting.reject(new Refusal(ev.data.error));
      else waiting.resolve(ev.data.metrics);
    });
    worker.addEventListener("error", (ev) => {
      for (const [, p] of this.pending) p.reject(new Error(ev.message || "the benchmark worker failed"));
      this.pending.clear();
      this.worker = null;
    });
    return worker;
  }

  async refusalOf(spec) {
    if (spec.workload !== "benchmark") return `refused: the browser runner only runs benchmark jobs, not ${spec.workload}`;
    const backend = spec.backend || "synthetic";
    const have = this.caps.map((c) => c.split(":")[1]);
    if (!have.includes(backend)) {
      return `refused: this browser does not implement the benchmark backend '${backend}' (it implements: ${have.join(", ")}), so it will not report another backend's numbers`;
    }
    const c = spec.constraints || {};
    const v = await vitals();
    if (c.require_charging && v.charging !== true) {
      return v.charging === undefined ? "refused: the job requires charging and this browser cannot tell whether it is charging"
        : "refused: the job requires charging and this device is not charging";
    }
    if (typeof c.min_battery_pct === "number") {
      if (v.battery_pct === undefined) return `refused: the job needs at least ${c.min_battery_pct}% battery and this browser cannot read the battery level`;
      if (v.battery_pct < c.min_battery_pct) return `refused: the battery is at ${v.battery_pct}% and the job needs at least ${c.min_battery_pct}%`;
    }
    return null;
  }

  async benchmark(spec) {
    const refusal = await this.refusalOf(spec);
    if (refusal) return { ok: false, error: refusal, metrics: {} };
    const params = spec.params || {};
    let plan;
    try {
      plan = {
        p: intParam(params, "prompt_tokens", DEFAULTS.prompt_tokens, 0, 1000000),
        g: intParam(params, "gen_tokens", DEFAULTS.gen_tokens, 0, 1000000),
        warmup: intParam(params, "warmup_iters", DEFAULTS.warmup_iters, 0, 1000),
        measure: intParam(params, "measure_iters", DEFAULTS.measure_iters, 1, 10000),
      };
    } catch (err) {
      if (err instanceof Refusal) return { ok: false, error: err.message, metrics: {} };
      throw err;
    }
    const battery = (await vitals()).battery_pct;
    const completed = await this.measure(spec, plan);
    if (completed === null) return this.handBack(spec);
    const metrics = {};
    for (const key of ["prefill_tok_s", "decode_tok_s", "ttft_ms"]) {
      const values = completed.map((m) => m[key]).filter((x) => typeof x === "number");
      if (values.length) metrics[key] = Math.round(median(values) * 1000) / 1000;
    }
    // The attestation: the same backend on a fresh block, so a reader can check the figures
    // came from a correct SHA-256.
    Object.assign(metrics, await this.attest(spec.backend), { iterations: completed.length });
    const end = (await vitals()).battery_pct;
    if (battery !== undefined) metrics.battery_start_pct = battery;
    if (end !== undefined) metrics.battery_end_pct = end;
    if (metrics.synthetic_digest !== ATTESTATION) {
      return { ok: false, metrics, error: `this browser's ${spec.backend} SHA-256 gave the attestation digest ${metrics.synthetic_digest}, not the reference ${ATTESTATION}, so its figures are not comparable` };
    }
    return { ok: true, metrics, runner: { backend: spec.backend, user_agent: navigator.userAgent } };
  }

  // Warm-up then measured iterations; null when the collector asked for the job back.
  async measure(spec, plan) {
    const total = plan.warmup + plan.measure;
    const completed = [];
    try {
      for (let i = 1; i <= total; i += 1) {
        const warm = i <= plan.warmup;
        const phase = warm ? `warm-up ${i} of ${plan.warmup}` : `iteration ${i - plan.warmup} of ${plan.measure}`;
        this.status(`Running ${spec.job_id} (${spec.backend}): ${phase}`, "busy");
        this.showJob(spec, i - 1, total, phase);
        this.check();
        const metrics = await this.iteration(spec.backend, plan.p, plan.g, i === 1);
        this.check();
        if (!warm) {
          completed.push(metrics);
          const reply = await this.post({ job_id: spec.job_id, iter: completed.length, ok: true, final: false, metrics });
          // The reply tells the job's status: closed (cancelled) means stop without a beacon.
          if (["cancelled", "failed", "done"].includes(reply.status)) this.stopJob(`the job is ${reply.status} at the collector`);
          this.check();
        }
      }
    } catch (err) {
      if (err instanceof Stopped && this.job?.stop?.handBack) return null;
      throw err;
    }
    this.showJob(spec, total, total, "posting the summary");
    return completed;
  }

  handedBack(jobId) {
    const n = (this.handbacks.get(jobId) || 0) + 1;
    this.handbacks.set(jobId, n);
    return n;
  }

  handBack(spec) {
    this.log(`handing ${spec.job_id} back: a job of higher priority is waiting`);
    return {
      ok: false, preempted: true, iter: HANDBACK_ITER_TOP - this.handedBack(spec.job_id), metrics: {},
      error: "preempted by a job of higher priority; the job was handed back (this workload restarts from the beginning)",
    };
  }
}

new Runner().start();
