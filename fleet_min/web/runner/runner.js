// The browser runner: once the person presses Start, enrols this browser as a temporary device,
// long-polls for jobs, runs synthetic benchmarks (jssha: SHA-256 written in the page; webcrypto:
// the platform digest), posts per-iteration rows and a summary, beacons while open, and stops
// claiming when hidden. Until Start, the page sends nothing to the collector: a link, a redirect
// or a popup from another site must not make a visitor's browser a worker.

import { browserModel } from "./brand.js";

const TTL_S = 600;                // the device leaves the shelf after this much silence
const IDLE_BEACON_S = 30;
const MAX_POLL_BACKOFF_S = 30;
const HANDBACK_ITER_TOP = 1000000; // the agent's iteration numbers for hand-back rows
// decisions.md: the hex SHA-256 of a fresh synthetic block after 1,000 rounds. A backend that
// computes another digest computes SHA-256 wrongly, and its figures mean nothing.
const ATTESTATION = "d7e8b70dfb48593edebc84967a969e78429f9ac6da8d0c681a4b57a2fe078a84";
const DEFAULTS = { prompt_tokens: 512, gen_tokens: 128, warmup_iters: 1, measure_iters: 3 };
// sessionStorage (this tab, this origin): Start was pressed on this tab's runner page.
const STARTED_KEY = "fleet.runner.started";
const START_ARM_MS = 800;         // Start stays disabled this long after it is shown (armStart)

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

// Start pressed in this tab is remembered for reloads of the page only. Another site can send
// the tab here by a link, a redirect, window.open (which copies sessionStorage into the new tab)
// or history.back(), but cannot reload this page: those arrive as navigate or back_forward.
function startedBefore() {
  let started = false;
  try {
    started = sessionStorage.getItem(STARTED_KEY) === "1";
  } catch { /* storage off: Start is asked for on every load */ }
  const arrival = performance.getEntriesByType("navigation")[0]?.type;
  return { started, resume: started && arrival === "reload" };
}

function rememberStarted(started) {
  try {
    if (started) sessionStorage.setItem(STARTED_KEY, "1");
    else sessionStorage.removeItem(STARTED_KEY);
  } catch { /* storage off: nothing to remember */ }
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

// Why a job is stopped before its end: the log's words, and for a job handed back (its final
// row says preempted, and the collector queues it again) the row's error.
const PREEMPTED = { reason: "a job of higher priority is waiting", handBack: "preempted by a job of higher priority" };
const STOP_PRESSED = { reason: "Stop pressed", handBack: "stopped on the browser runner page" };
const FROM_HISTORY = { reason: "back from the browser's history, so Start is asked for again", handBack: "stopped on the browser runner page" };

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
    this.running = false;    // between Start (or a resuming reload) and the end of the loops
    this.everStarted = false;
    this.registered = false;
    this.loop = null;        // the poll loop's promise while running
    this.poll = null;        // aborts the waiting long poll on Stop
    this.paused = false;
    this.job = null;         // { spec, stop: null | { reason, handBack } }
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

  // What the page knows without asking the collector; then idle, or running again after a reload
  // of a tab where Start was pressed.
  init() {
    $("device-id").textContent = this.id;
    $("device-link").href = `/dash/devices/${encodeURIComponent(this.id)}`;
    $("device-id").href = $("device-link").href;
    $("model").textContent = descriptor().model;
    $("caps").textContent = this.caps.join(", ");
    $("secure").textContent = window.isSecureContext ? "secure context: webcrypto offered"
      : "not a secure context (plain http to another host): only jssha is offered";
    $("start").addEventListener("click", (ev) => this.pressStart(ev));
    $("stop").addEventListener("click", () => this.stop(STOP_PRESSED));
    $("pause").addEventListener("click", () => this.togglePause());
    document.addEventListener("visibilitychange", () => this.visibility());
    // A page the browser kept in its back/forward cache comes back as it was left, running:
    // history.back() from another site must not bring back a worker either.
    window.addEventListener("pageshow", (ev) => {
      if (ev.persisted) this.stop(FROM_HISTORY);
    });
    this.idleBeacons();
    const { started, resume } = startedBefore();
    if (resume) {
      this.begin("resumed after a reload: Start was pressed in this tab");
    } else {
      if (started) {
        rememberStarted(false);
        this.log("not resumed: this tab came back to the page by a link or its history, not a reload");
      }
      this.idle();
    }
  }

  pressStart(ev) {
    // Only the person's own click or key press: no script of this page clicks the button.
    if (!ev.isTrusted || this.running || this.loop) return;
    rememberStarted(true);
    this.begin("Start pressed");
  }

  begin(why) {
    this.running = true;
    this.everStarted = true;
    this.registered = false;   // enrol again: a stopped device may have left the shelf
    this.paused = false;
    this.showPause();
    this.showControls();
    this.log(why);
    this.loop = this.pollLoop().finally(() => {
      this.loop = null;
      this.idle();
    });
  }

  // Stop claiming, give back a waiting poll and a running job, forget Start; the poll loop
  // then ends and the page is idle again.
  stop(why) {
    if (!this.running) return;
    this.running = false;
    rememberStarted(false);
    this.log(`${why.reason}: no new jobs will be claimed`);
    this.status("Stopping…", "idle");
    if (this.poll) this.poll.abort();  // the collector hands back a job claimed for a poll that went away
    if (this.job) this.stopJob(why);
    if (this.wake) this.wake();
  }

  idle() {
    this.showControls();
    if (this.registered) this.log(`stopped; ${this.id} leaves the shelf after ten minutes of silence`);
    this.registered = false;
    this.status(this.everStarted ? "Stopped: this browser sends nothing more to the collector until you press Start."
      : "Not started: this browser sends nothing to the collector until you press Start.", "idle");
  }

  // Start answers only once it has been on screen for a moment. A page elsewhere can open this
  // one in a popup timed so that the visitor's next click (the second of a double-click they
  // were asked for) lands on the button: that click comes before the delay is over.
  armStart(focus = false) {
    const start = $("start");
    start.disabled = true;
    clearTimeout(this.armTimer);
    this.armTimer = setTimeout(() => {
      start.disabled = false;
      if (focus && document.activeElement === document.body) start.focus();
    }, START_ARM_MS);
  }

  showControls() {
    const moveFocus = document.activeElement === $(this.running ? "start" : "stop");
    // Start, shown again, takes the focus once it is armed (a disabled button cannot).
    if (!this.running && $("start").hidden) this.armStart(moveFocus);
    $("start").hidden = this.running;  // hidden in the HTML until this script runs
    $("stop").hidden = !this.running;
    $("pause").hidden = !this.running;
    if (moveFocus && this.running) $("stop").focus();
  }

  showPause() {
    $("pause").textContent = this.paused ? "Resume claiming" : "Pause claiming";
    $("pause").setAttribute("aria-pressed", String(this.paused));
  }

  togglePause() {
    this.paused = !this.paused;
    this.showPause();
    this.log(this.paused ? "paused: no new jobs will be claimed" : "resumed claiming jobs");
    if (!this.paused && this.wake) this.wake();
  }

  visibility() {
    if (!this.running) {
      if (!document.hidden) this.armStart();  // shown again, perhaps brought to the front
      return;
    }
    if (document.hidden) {
      this.log("page hidden: no new jobs will be claimed until it is shown again");
    } else {
      this.log("page visible again");
      if (this.wake) this.wake();
    }
  }

  canClaim() { return this.running && !this.paused && !document.hidden; }

  idleBeacons() {
    const tick = async () => {
      if (this.running && !this.job && this.registered) {
        try { await this.beacon(); } catch (err) {
          if (err.status === 404) this.registered = false;  // forgotten: enrol again
        }
      }
    };
    setInterval(tick, IDLE_BEACON_S * 1000);
  }

  // Until the page may claim, or `seconds` pass (when given); Stop ends the wait at once.
  async rest(seconds) {
    await new Promise((resolve) => {
      this.wake = resolve;
      if (seconds !== undefined) setTimeout(resolve, seconds * 1000);
    });
    this.wake = null;
  }

  async waitUntilClaimable() {
    while (this.running && !this.canClaim()) {
      this.status(this.paused ? "Paused: not claiming jobs." : "Hidden: not claiming jobs until this page is shown.", "idle");
      await this.rest();
    }
  }

  async pollLoop() {
    let backoff = 1;
    while (this.running) {
      await this.waitUntilClaimable();
      if (!this.running) break;
      try {
        await this.pollOnce();
        backoff = 1;
      } catch (err) {
        if (!this.running) break;  // Stop aborted the poll
        this.status(`Cannot reach the collector (${err.message}); retrying in ${backoff} s.`, "bad");
        this.log(`poll failed: ${err.message}`, "bad");
        if (err.status === 404) this.registered = false;
        await this.rest(backoff);
        backoff = Math.min(backoff * 2, MAX_POLL_BACKOFF_S);
      }
    }
  }

  // Enrol when not enrolled, then one long poll, and the job it brings.
  async pollOnce() {
    if (!this.registered) {
      this.status("Enrolling this browser as a device…");
      await this.register();
      this.log(`enrolled as ${this.id} (${this.caps.join(", ")})`, "good");
      await this.beacon();
      if (!this.running) return;
    }
    this.status("Waiting for a job…", "idle");
    this.poll = new AbortController();
    try {
      const { status, data } = await http("GET", `/devices/${encodeURIComponent(this.id)}/next-job`, undefined, this.poll.signal);
      if (status === 200 && data) await this.claimed(data);
    } finally {
      this.poll = null;
    }
  }

  whyNotClaiming() {
    if (!this.running) return "stopped";
    return this.paused ? "paused" : "hidden";
  }

  async claimed(spec) {
    if (!this.canClaim()) {
      // The long poll was already waiting when the page was hidden, paused or stopped: hand
      // the job back.
      try {
        await http("POST", `/jobs/${encodeURIComponent(spec.job_id)}/release`, { device_id: this.id });
        this.log(`handed ${spec.job_id} back: this page is ${this.whyNotClaiming()}`);
      } catch (err) {
        if (!this.running) {
          this.log(`could not hand ${spec.job_id} back (${err.message}); the collector queues it again when its lease lapses`, "bad");
          return;
        }
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
      const outcome = await this.outcome(spec);
      await this.post({ job_id: spec.job_id, iter: 0, final: true, ...outcome });
      if (outcome.preempted) {
        this.log(`handed ${spec.job_id} back: ${this.job.stop.reason}`);
        return;
      }
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

  // The job's final row: the benchmark's, or a hand-back's when the job was stopped to be given
  // back (a preemption, or Stop), whichever phase it was in.
  async outcome(spec) {
    try {
      return await this.benchmark(spec);
    } catch (err) {
      const stop = this.job?.stop;
      if (err instanceof Stopped && stop?.handBack) return this.handBack(spec, stop.handBack);
      throw err;
    }
  }

  async renew() {
    const job = this.job;
    if (!job) return;
    try {
      const reply = await this.beacon(job.spec.job_id);
      if (reply.lease_renewed === false) this.stopJob({ reason: "the collector no longer holds this job for this browser (cancelled, or the lease lapsed)" });
      else if (reply.preempt) this.stopJob(PREEMPTED);
    } catch (err) {
      this.log(`beacon failed: ${err.message}`, "bad");
    }
  }

  // `why`: { reason, handBack }, handBack the final row's error when the job is given back.
  stopJob(why) {
    if (!this.job || this.job.stop) return;
    this.job.stop = why;
    if (this.worker) { this.worker.terminate(); this.worker = null; }
    for (const [, p] of this.pending) p.reject(new Stopped(why.reason));
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

  // Warm-up then measured iterations.
  async measure(spec, plan) {
    const total = plan.warmup + plan.measure;
    const completed = [];
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
        if (["cancelled", "failed", "done"].includes(reply.status)) this.stopJob({ reason: `the job is ${reply.status} at the collector` });
        this.check();
      }
    }
    this.showJob(spec, total, total, "posting the summary");
    return completed;
  }

  handedBack(jobId) {
    const n = (this.handbacks.get(jobId) || 0) + 1;
    this.handbacks.set(jobId, n);
    return n;
  }

  handBack(spec, why) {
    return {
      ok: false, preempted: true, iter: HANDBACK_ITER_TOP - this.handedBack(spec.job_id), metrics: {},
      error: `${why}; the job was handed back (this workload restarts from the beginning)`,
    };
  }
}

new Runner().init();
