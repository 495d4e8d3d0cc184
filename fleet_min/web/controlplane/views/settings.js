// Live settings (GET /api/settings): value, default, range and where the value comes from;
// with the token, change one or put it back to its default without restarting the daemon.
import { html, useState } from "../js/html.js";
import { state, readOnly, set, toast } from "../js/store.js";
import { postJSON, isAuth } from "../js/api.js";
import { Panel, Badge, Loaded, useFetch } from "../js/ui.js";
import { any } from "../js/format.js";

function Editor({ s, onSaved }) {
  const [draft, setDraft] = useState(String(s.value));
  const [busy, setBusy] = useState(false);
  const disabled = readOnly() || !state.token;
  const send = async (body) => {
    setBusy(true);
    try {
      const reply = await postJSON("/api/settings", body, state.token);
      toast("ok", `${reply.key} is now ${reply.value}`, null, 5000);
      setDraft(String(reply.value));
      onSaved();
    } catch (err) {
      if (isAuth(err) && !readOnly()) set({ tokenRefused: true });
      toast("bad", `${s.key} not changed`, { error: err.message });
    } finally {
      setBusy(false);
    }
  };
  const submit = (event) => {
    event.preventDefault();
    const value = s.choices ? draft : Number(draft);
    send({ key: s.key, value });
  };
  if (readOnly()) return html`<span>${any(s.value)}</span>`;
  const inputId = `setting-${s.key}`;
  return html`<form class="setting-form" onSubmit=${submit}>
    <label class="sr-only" for=${inputId}>${s.key}</label>
    ${s.choices
      ? html`<select id=${inputId} value=${draft} disabled=${disabled} onChange=${(e) => setDraft(e.currentTarget.value)}>${s.choices.map((c) => html`<option value=${c}>${c}</option>`)}</select>`
      : html`<input id=${inputId} type="number" step=${s.type === "integer" ? 1 : "any"} min=${s.min} max=${s.max} value=${draft} disabled=${disabled}
          onInput=${(e) => setDraft(e.currentTarget.value)} />`}
    <button type="submit" disabled=${disabled || busy || draft === String(s.value)}>Save</button>
    ${s.source === "stored" ? html`<button type="button" class="link" disabled=${disabled || busy} onClick=${() => send({ key: s.key, reset: true })}>Reset</button>` : null}
  </form>`;
}

function range(s) {
  if (s.choices?.length) return s.choices.join(", ");
  const has = (v) => typeof v === "number";
  if (has(s.min) && has(s.max)) return `${any(s.min)} to ${any(s.max)}`;
  if (has(s.min)) return `at least ${any(s.min)}`;
  if (has(s.max)) return `at most ${any(s.max)}`;
  return "any";
}

export function Settings() {
  const [nonce, setNonce] = useState(0);
  const res = useFetch("/api/settings", nonce);
  return html`<div class="grid"><${Panel} id="settings" wide title="Live settings">
    ${!readOnly() && !state.token ? html`<p class="note">Enter the control token to change a setting; it takes effect at once.</p>` : null}
    <${Loaded} res=${res} what="Settings" path="/api/settings">${(data) => html`<div class="table-wrap"><table class="settings cards">
      <thead><tr><th scope="col">Setting</th><th scope="col">Value</th><th scope="col">Default</th><th scope="col">Range</th><th scope="col">Source</th></tr></thead>
      <tbody>${(data.settings || []).map((s) => html`<tr data-setting=${s.key}>
        <th scope="row" data-label="Setting"><span><code>${s.key}</code><div class="muted small">${s.help}</div></span></th>
        <td data-label="Value"><${Editor} key=${`${s.key}:${s.value}`} s=${s} onSaved=${() => setNonce((n) => n + 1)} /></td>
        <td data-label="Default"><span>${any(s.default)}</span></td>
        <td data-label="Range"><span>${range(s)}</span></td>
        <td data-label="Source"><span><${Badge} kind=${s.source === "stored" ? "info" : ""}>${s.source}<//>${s.env ? html` <span class="muted small">${s.env}</span>` : null}</span></td>
      </tr>`)}</tbody></table></div>`}<//>
  <//></div>`;
}
