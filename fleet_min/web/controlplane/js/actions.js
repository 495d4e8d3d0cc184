// Action buttons drawn from GET /api/actions, the token box, and the confirmation dialog.
// The token stays in this browser (sessionStorage, or localStorage when "remember" is ticked)
// and goes only to this daemon, in the Authorization header of the calls that need it.
import { html, useLayoutEffect, useRef, useState } from "./html.js";
import { state, set, saveToken, readOnly, toast } from "./store.js";
import { getJSON, postJSON, isAuth } from "./api.js";

// Actions that take a runner out of service ask first; the catalogue may also say so itself.
const DESTRUCTIVE = new Set(["runner.drain", "runner.deregister"]);
const isDestructive = (entry) => Boolean(entry.destructive || entry.confirm || DESTRUCTIVE.has(entry.id));

function relevant(entry, runner) {
  if (entry.id === "runner.drain") return !runner.draining;
  if (entry.id === "runner.resume") return runner.draining;
  return true;
}

// The daemon's default name for a copy (actions.py copy_name): the name without a trailing
// "-<number>", then "-2", or the lowest free number above it among that host's runners.
export function copyName(name, taken) {
  const base = name.replace(/-\d+$/, "");
  for (let n = 2; n < 1000; n += 1) {
    if (!taken.has(`${base}-${n}`)) return `${base}-${n}`;
  }
  return "";
}

const FOLLOW_EVERY_MS = 1000;
const FOLLOW_FOR_MS = 180000; // a forwarded duplicate runs config.sh on the agent: minutes at most

const pause = (ms) => new Promise((resolve) => { setTimeout(resolve, ms); });

// A forwarded action's real outcome: the agent's result, read from GET /api/hosts (commands).
async function followForwarded(reply, title, subject) {
  const until = Date.now() + FOLLOW_FOR_MS;
  while (Date.now() < until) {
    await pause(FOLLOW_EVERY_MS);
    let hosts;
    try {
      hosts = await getJSON("/api/hosts");
    } catch {
      continue; // the daemon restarting: ask again
    }
    const done = (hosts.commands || []).find((c) => c.id === reply.command_id && c.done_at);
    if (done) {
      const made = done.runner && done.runner !== subject ? `: ${done.runner}` : "";
      toast(done.ok ? "ok" : "bad", `${title} on ${reply.host} ${done.ok ? "done" : "failed"}${made}`,
        { error: done.error, output: done.output, code: done.code }, done.ok ? 8000 : 0);
      return;
    }
  }
  toast("bad", `${title}: no answer from ${reply.host} yet`,
    { error: `It runs when ${reply.host} next calls in; the Hosts screen and GET /api/hosts show its result.` });
}

export async function runAction(entry, args, subject) {
  const key = `${entry.id}:${subject || ""}`;
  const title = subject ? `${entry.label}: ${subject}` : entry.label;
  set({ pending: new Set([...state.pending, key]) });
  try {
    const reply = await postJSON("/api/action", { id: entry.id, args }, state.token);
    if (reply.queued) {
      toast("info", `${title} sent to ${reply.host}`, { output: "Waiting for its result…" }, 5000);
      await followForwarded(reply, title, subject);
    } else {
      toast(reply.ok ? "ok" : "bad", `${title} ${reply.ok ? "done" : "failed"}`, reply, reply.ok ? 8000 : 0);
    }
  } catch (err) {
    if (isAuth(err) && !readOnly()) set({ tokenRefused: true });
    toast("bad", `${title} refused`, { error: err.message });
  } finally {
    const pending = new Set(state.pending);
    pending.delete(key);
    set({ pending });
  }
}

function runnersOn(host) {
  return new Set((state.snap?.runners || []).filter((r) => r.host === host).map((r) => r.name));
}

function ask(entry, runner) {
  // A runner another host reports is named with its host, so the coordinator forwards the
  // action there even if another agent reports the same name.
  const args = runner ? { name: runner.name, ...(runner.remote ? { host: runner.host } : {}) } : {};
  const fields = [];
  if (entry.id === "runner.deregister") fields.push({ name: "delete_dir", type: "checkbox", label: "Also delete the runner's directory" });
  if (entry.id === "runner.duplicate") fields.push({ name: "new_name", type: "text", label: "Name of the new runner (optional)", placeholder: copyName(runner.name, runnersOn(runner.host)) });
  const go = (values) => runAction(entry, { ...args, ...values }, runner?.name);
  if (!isDestructive(entry) && !fields.length) return go({});
  set({
    confirm: {
      title: runner ? `${entry.label} ${runner.name}?` : `${entry.label}?`,
      body: entry.description || "",
      confirmLabel: entry.label,
      danger: isDestructive(entry),
      fields,
      run: go,
    },
  });
  return undefined;
}

export function ActionButton({ entry, runner }) {
  const key = `${entry.id}:${runner?.name || ""}`;
  const busy = state.pending.has(key);
  const noToken = !state.token;
  const label = runner ? `${entry.label} ${runner.name}` : entry.label;
  return html`<button type="button" class=${`act${isDestructive(entry) ? " danger" : ""}`}
      data-action=${entry.id} data-runner=${runner?.name} aria-label=${label}
      title=${noToken ? "Enter the control token (top right) to use this" : entry.description}
      disabled=${noToken || busy} aria-busy=${busy ? "true" : undefined}
      onClick=${() => ask(entry, runner)}>${busy ? `${entry.label}…` : entry.label}</button>`;
}

// The runner actions that fit this runner's state; nothing at all in read-only mode.
export function RunnerActions({ runner }) {
  if (readOnly() || !state.catalogue) return null;
  const entries = (state.catalogue.actions || []).filter((a) => a.runner && relevant(a, runner));
  return html`<span class="actions">${entries.map((entry) => html`<${ActionButton} entry=${entry} runner=${runner} />`)}</span>`;
}

export function HostActions() {
  if (readOnly() || !state.catalogue) return null;
  const entries = (state.catalogue.actions || []).filter((a) => !a.runner);
  return html`<span class="actions">${entries.map((entry) => html`<${ActionButton} entry=${entry} />`)}</span>`;
}

export function TokenBox() {
  const [draft, setDraft] = useState("");
  const [remember, setRemember] = useState(state.remember);
  if (readOnly()) {
    return html`<span class="badge info" title="FLEET_READ_ONLY=1: this daemon takes no actions">read-only</span>`;
  }
  if (state.token) {
    return html`<span class="token-set">
      <span class=${`badge ${state.tokenRefused ? "bad" : "ok"}`}>${state.tokenRefused ? "token refused" : "token set"}</span>
      <button type="button" class="link" onClick=${() => saveToken("", false)}>Forget token</button>
    </span>`;
  }
  const submit = (event) => {
    event.preventDefault();
    const token = draft.trim();
    if (token) saveToken(token, remember);
    setDraft("");
  };
  return html`<form class="token-form" onSubmit=${submit} aria-label="Control token">
    <label class="sr-only" for="token">Control token</label>
    <input id="token" name="token" type="password" autocomplete="off" spellcheck="false" placeholder="Control token"
      value=${draft} onInput=${(e) => setDraft(e.currentTarget.value)} />
    <label class="remember" title="Keep the token in this browser after the tab closes">
      <input type="checkbox" checked=${remember} onChange=${(e) => setRemember(e.currentTarget.checked)} /> remember
    </label>
    <button type="submit">Use token</button>
  </form>`;
}

export function ConfirmDialog() {
  const ref = useRef(null);
  const ask = state.confirm;
  const [values, setValues] = useState({});
  // A layout effect opens the dialog in the same commit that renders its content: with a plain
  // effect there is a frame where the content exists but the dialog is still closed, and a quick
  // Enter-then-Escape from the keyboard lands in that frame and leaves the dialog open.
  useLayoutEffect(() => {
    const dialog = ref.current;
    if (!dialog) return;
    if (ask && !dialog.open) {
      setValues({});
      dialog.showModal();
    } else if (!ask && dialog.open) {
      dialog.close();
    }
  }, [ask]);
  const close = () => set({ confirm: null });
  const submit = (event) => {
    event.preventDefault();
    const chosen = Object.fromEntries(Object.entries(values).filter(([, v]) => v !== "" && v !== false));
    const run = ask.run;
    close();
    run(chosen);
  };
  return html`<dialog ref=${ref} class="confirm" aria-labelledby="confirm-title" onClose=${close} onCancel=${close}>
    ${ask ? html`<form onSubmit=${submit}>
      <h2 id="confirm-title">${ask.title}</h2>
      ${ask.body ? html`<p>${ask.body}</p>` : null}
      ${ask.fields.map((f) => (f.type === "checkbox"
        ? html`<label class="check"><input type="checkbox" name=${f.name} checked=${Boolean(values[f.name])}
            onChange=${(e) => setValues({ ...values, [f.name]: e.currentTarget.checked })} /> ${f.label}</label>`
        : html`<label class="field">${f.label}<input type="text" name=${f.name} placeholder=${f.placeholder} value=${values[f.name] || ""}
            onInput=${(e) => setValues({ ...values, [f.name]: e.currentTarget.value.trim() })} /></label>`))}
      <div class="dialog-buttons">
        <button type="button" onClick=${close}>Cancel</button>
        <button type="submit" class=${ask.danger ? "danger primary" : "primary"} data-confirm="yes">${ask.confirmLabel}</button>
      </div>
    </form>` : null}
  </dialog>`;
}
