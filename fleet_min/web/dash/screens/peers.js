// Peers: other collectors this one knows (FLEET_PEERS), and a way into their read-only view.
import { html } from "../lib/core.js";
import { get, post } from "../lib/api.js";
import { useResource, useTick, useAction } from "../lib/hooks.js";
import { notify } from "../lib/notify.js";
import { Page, Loaded, Table, Ago, Pill, ConfirmButton } from "../lib/ui.js";

export function Peers() {
  useTick();
  const res = useResource(() => get("/api/peers", null, { local: true }), []);
  const [run, busy] = useAction(notify);
  const refresh = async () => {
    const r = await run(() => get("/api/peers", { refresh: "1" }, { local: true }), "Peers checked.");
    if (r) res.reload();
  };
  // A peer replaced on purpose names a new id; it is served under neither until its address is
  // unpinned here (the pin outlives restarts, so an impostor cannot take the address).
  const repin = async (p) => {
    // The reply says what the address names now (it may have gone silent meanwhile).
    const r = await run(() => post("/api/peers/forget", { url: p.url }),
      (reply) => reply.peer.id ? `${p.url} is now pinned to ${reply.peer.id}.` : `${p.url} is unpinned; it is pinned again when it next answers.`);
    if (r) res.reload();
  };
  return html`<${Page} title="Peers" subtitle="Other collectors, read through this one. They share nothing; their views are read-only here."
    actions=${html`<button type="button" class="btn" onClick=${refresh} disabled=${busy}>Check now</button>`}>
    <${Loaded} res=${res}>${(d) => html`<${Table} label="Peers" className="peers"
      empty=${html`No peers are configured. Set <code>FLEET_PEERS</code> to other collectors' addresses.`}
      head=${["Collector", "Address", "State", "Latency", "Checked", ""]}
      rows=${d.peers.map((p) => html`<tr>
        <td>${p.name || html`<span class="muted">unknown</span>`}${p.id ? html`<div class="mono small muted">${p.id}</div>` : null}</td>
        <td class="mono small">${p.url}</td>
        <td>${p.reachable ? html`<${Pill} status="online" label="reachable" />` : html`<${Pill} status="offline" label="unreachable" /> <span class="small">${p.error}</span>`}</td>
        <td>${p.latency_ms !== null && p.latency_ms !== undefined ? `${Math.round(p.latency_ms)} ms` : "–"}</td>
        <td><${Ago} iso=${p.last_checked} /></td>
        <td>${p.claimed ? html`<${ConfirmButton} small label=${`Pin to ${p.claimed}`}
            question=${`Was the collector at ${p.url} replaced? Only ${p.claimed} will be served at this address from now on.`}
            confirmLabel="Replaced: pin the new id" onConfirm=${() => repin(p)} />`
          : p.id ? html`<a class="btn small" href=${`/dash/@${encodeURIComponent(p.id)}`}>Open read-only view</a>` : null}</td>
      </tr>`)} />`}<//>
  <//>`;
}
