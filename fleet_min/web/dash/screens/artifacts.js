// Artifacts: published builds, pins with their reasons, collection candidates; one artifact's
// holds, references and producers; pin, unpin, baseline, delete.
import { html, useState } from "../lib/core.js";
import { get, post, del, seg, currentPeer } from "../lib/api.js";
import { useResource, useTick, useAction } from "../lib/hooks.js";
import { navigate, href, setQuery } from "../lib/router.js";
import { notify } from "../lib/notify.js";
import { bytes, shortSha } from "../lib/format.js";
import {
  Page, Section, Loaded, Table, Pill, Ago, JobLink, DeviceLink, Fields, Action, ConfirmButton, Link, Pager, Empty, Hash,
} from "../lib/ui.js";

// Where an artifact's bytes are: built from its hash, never from the answer's `url`, which a
// peer's view takes from that peer (a link to another site on our own page); a peer's bytes are
// not ours to serve, so its view offers no download.
const HEX64 = /^[0-9a-f]{64}$/;
const download = (sha) => (!currentPeer() && HEX64.test(sha) ? `/artifacts/${sha}` : null);

const TABS = [["all", "All"], ["builds", "Published builds"], ["pinned", "Pinned"], ["gc", "Collection candidates"]];

// Published builds carry an app name; the list API has no such filter, so this page of the
// listing is narrowed here and its counts say so.
function builds(d) {
  const artifacts = d.artifacts.filter((a) => a.app);
  return { ...d, artifacts, total: artifacts.length, bytes: artifacts.reduce((n, a) => n + a.size, 0) };
}

function PinForm({ sha, onDone }) {
  const [reason, setReason] = useState("");
  const [open, setOpen] = useState(false);
  const [run, busy] = useAction(notify);
  if (currentPeer()) return null;
  if (!open) return html`<button type="button" class="btn small" onClick=${() => setOpen(true)}>Pin</button>`;
  const submit = async (e) => {
    e.preventDefault();
    if (await run(() => post(`/api/artifacts/${seg(sha)}/pin`, { reason }), `Pinned ${shortSha(sha)}.`)) { setOpen(false); onDone(); }
  };
  return html`<form class="inline" onSubmit=${submit}>
    <label class="sr-only" for=${`pin-${sha}`}>Reason for the pin</label>
    <input id=${`pin-${sha}`} required maxlength="500" placeholder="why keep it?" value=${reason} onInput=${(e) => setReason(e.target.value)} />
    <button type="submit" class="btn small primary" disabled=${busy}>Pin</button>
    <button type="button" class="btn small" onClick=${() => setOpen(false)}>Cancel</button></form>`;
}

function ArtifactRows({ items, reload }) {
  const [run] = useAction(notify);
  const unpin = async (a) => { if (await run(() => del(`/api/artifacts/${seg(a.sha256)}/pin`), `Unpinned ${shortSha(a.sha256)}.`)) reload(); };
  const remove = async (a) => { if (await run(() => del(`/api/artifacts/${seg(a.sha256)}`), `Deleted ${shortSha(a.sha256)}.`)) reload(); };
  return html`<${Table} label="Artifacts" empty="No artifacts here." className="artifacts"
    head=${["Artifact", "App · build", "Platform", "Size", "Stored", "Pin", ""]}
    rows=${items.map((a) => html`<tr>
      <td><${Link} to=${`/artifacts/${a.sha256}`}>${a.name || shortSha(a.sha256)}<//><div class="small muted"><${Hash} value=${a.sha256} copy=${false} /></div></td>
      <td>${a.app ? `${a.app}${a.build ? ` · ${a.build}` : ""}` : "–"}</td><td>${a.platform || "–"}</td>
      <td class="nowrap">${bytes(a.size)}</td><td><${Ago} iso=${a.created_at} /></td>
      <td>${a.pinned ? html`<span class="chip pin" title="pinned">pinned: ${a.pinned_reason}</span>` : ""}${a.baseline ? html` <span class="chip">baseline</span>` : null}</td>
      <td class="actions-cell">${download(a.sha256) ? html`<a class="btn small" href=${download(a.sha256)} download>Download</a>` : null}
        ${a.pinned ? html`<${Action} kind="small" onClick=${() => unpin(a)}>Unpin<//>` : html`<${PinForm} sha=${a.sha256} onDone=${reload} />`}
        ${!a.pinned && !a.baseline ? html`<${ConfirmButton} small label="Delete" question="Delete these bytes?" onConfirm=${() => remove(a)} />` : null}</td>
    </tr>`)} />`;
}

export function Artifacts({ query }) {
  useTick();
  const [tab, setTab] = useState(query.get("tab") || "all");
  const [name, setName] = useState(query.get("name") || "");
  const [page, setPage] = useState(1);
  const res = useResource(() => {
    if (tab === "gc") return get("/api/artifacts/gc-candidates", { page });
    const filters = { name, page, pinned: tab === "pinned" ? "true" : "" };
    return get("/api/artifacts", filters).then((d) => (tab === "builds" ? builds(d) : d));
  }, [tab, name, page], (e) => e.type === "artifact");
  const choose = (t) => { setTab(t); setPage(1); setQuery({ tab: t === "all" ? "" : t, name }); };
  return html`<${Page} title="Artifacts">
    <div class="tabs" role="tablist" aria-label="Which artifacts">
      ${TABS.map(([k, label]) => html`<button type="button" role="tab" aria-selected=${tab === k} class=${`tab ${tab === k ? "on" : ""}`}
        onClick=${() => choose(k)}>${label}</button>`)}
    </div>
    ${tab !== "gc" ? html`<form class="filters" role="search" onSubmit=${(e) => e.preventDefault()}>
      <label>Name <input type="search" value=${name} onInput=${(e) => { setName(e.target.value); setPage(1); }} /></label></form>` : null}
    ${tab === "gc" && currentPeer() ? html`<${Empty}>Collection candidates are not read through a peer's view.<//>` : html`
    <${Loaded} res=${res}>${(d) => html`
      <p class="muted count-line">${d.total} artifact${d.total === 1 ? "" : "s"}, ${bytes(d.bytes)}${tab === "gc" ? " would be freed by deleting them all" : ""}</p>
      ${tab === "gc" ? html`<p class="hint">Unreferenced, unpinned and not a baseline. Nothing is collected automatically: review and delete.</p>` : null}
      <${ArtifactRows} items=${d.artifacts} reload=${res.reload} />
      <${Pager} data=${d} onPage=${setPage} />`}<//>`}
  <//>`;
}

export function ArtifactDetail({ sha }) {
  useTick();
  const res = useResource(() => get(`/api/artifacts/${seg(sha)}`), [sha], (e) => e.type === "artifact" && e.sha256 === sha);
  const [run, busy] = useAction(notify);
  const a = res.data;
  const baseline = async () => { if (await run(() => post(`/api/artifacts/${seg(sha)}/baseline`, { accepted: !a.baseline }), a.baseline ? "No longer a baseline." : "Accepted as a baseline.")) res.reload(); };
  const unpin = async () => { if (await run(() => del(`/api/artifacts/${seg(sha)}/pin`), "Unpinned.")) res.reload(); };
  const remove = async () => { if (await run(() => del(`/api/artifacts/${seg(sha)}`), "Deleted.")) navigate(href("/artifacts")); };
  return html`<${Page} title=${a?.name || `Artifact ${shortSha(sha)}…`} subtitle=${html`<span class="small">SHA-256 <${Hash} value=${sha} full /></span>`}
    actions=${a ? html`${download(sha) ? html`<a class="btn" href=${download(sha)} download>Download</a>` : null}
      ${a.pinned ? html`<${Action} onClick=${unpin} disabled=${busy}>Unpin<//>` : html`<${PinForm} sha=${sha} onDone=${res.reload} />`}
      <${Action} onClick=${baseline} disabled=${busy}>${a.baseline ? "Drop baseline" : "Accept as baseline"}<//>
      ${a.deletable ? html`<${ConfirmButton} label="Delete" question="Delete these bytes?" onConfirm=${remove} />` : null}` : null}>
    <${Loaded} res=${res}>${(x) => html`
      <div class="grid two">
        <${Section} title="Artifact" id="art-info"><${Fields} pairs=${[
          ["Size", bytes(x.size)], ["App", x.app], ["Build", x.build], ["Platform", x.platform],
          ["Stored", html`<${Ago} iso=${x.created_at} />`], ["On disk", x.stored === undefined ? null : x.stored ? "yes" : "missing"],
          ["Pinned", x.pinned ? x.pinned_reason : "no"], ["Baseline", x.baseline ? "accepted" : "no"],
        ]} /><//>
        <${Section} title="What keeps it" id="art-holds">
          ${x.holds?.length ? html`<ul class="plain">${x.holds.map((h) => html`<li>${h}</li>`)}</ul>` : html`<${Empty}>Nothing holds it: it may be deleted.<//>`}
        <//>
      </div>
      <div class="grid two">
        <${Section} title="Referenced by" id="art-refs">
          <${Table} label="Jobs naming it" empty="No job or schedule names it."
            head=${["Job or schedule", "Status"]}
            rows=${[...(x.referenced_by?.jobs || []).map((j) => html`<tr><td><${JobLink} id=${j.job_id} /></td><td><${Pill} status=${j.status} /></td></tr>`),
              ...(x.referenced_by?.schedules || []).map((s) => html`<tr><td><${Link} to=${`/schedules/${encodeURIComponent(s)}`}>${s}<//></td><td>schedule</td></tr>`)]} />
        <//>
        <${Section} title="Produced by" id="art-producers">
          <${Table} label="Result rows listing it" empty="No result row lists it." head=${["Job", "Device", "Iter"]}
            rows=${(x.produced_by || []).map((p) => html`<tr><td><${JobLink} id=${p.job_id} /></td><td><${DeviceLink} id=${p.device_id} /></td><td>${p.iter}</td></tr>`)} />
        <//>
      </div>`}<//>
  <//>`;
}
