// Visual review: a suite's latest screenshots as a page x profile grid, each judged against its
// baseline (new, pass, diverged, missing); one cell side by side with its baseline or as a
// difference drawn here on a canvas; accepting a capture makes it the slot's baseline.
import { html, useState, useEffect, useRef } from "../lib/core.js";
import { get, post, currentPeer } from "../lib/api.js";
import { useResource, useAction } from "../lib/hooks.js";
import { setQuery } from "../lib/router.js";
import { notify } from "../lib/notify.js";
import { shortSha } from "../lib/format.js";
import { Page, Section, Loaded, Pill, Ago, JobLink, Empty, Action, Fields } from "../lib/ui.js";

const LABELS = { new: "new", pass: "matching", diverged: "diverged", missing: "missing", error: "error", pending: "pending" };
const PILL = { new: "waiting", pass: "done", diverged: "failed", missing: "cancelled", error: "failed", pending: "claimed" };

function Status({ cell }) {
  const pct = cell.diff_pct == null || cell.status === "new" ? "" : ` · ${cell.diff_pct}%`;
  return html`<${Pill} status=${PILL[cell.status] || "muted"} label=${`${LABELS[cell.status] || cell.status}${pct}`} />`;
}

function Grid({ m, chosen, choose }) {
  const at = new Map(m.cells.map((c) => [`${c.page}\u0000${c.profile}`, c]));
  return html`<div class="table-wrap" tabindex="0" role="region" aria-label="Screenshots by page and profile">
    <table class="visual-grid">
      <thead><tr><th scope="col">Page</th>${m.profiles.map((p) => html`<th scope="col">${p}</th>`)}</tr></thead>
      <tbody>${m.pages.map((page) => html`<tr><th scope="row">${page}</th>
        ${m.profiles.map((profile) => {
          const cell = at.get(`${page}\u0000${profile}`);
          if (!cell) return html`<td class="muted">–</td>`;
          const on = chosen && chosen.page === page && chosen.profile === profile;
          return html`<td><button type="button" class=${`cell-btn ${on ? "on" : ""}`} aria-pressed=${on}
            aria-label=${`${page}, ${profile}: ${LABELS[cell.status] || cell.status}`} onClick=${() => choose(cell)}>
            <${Status} cell=${cell} /></button></td>`;
        })}</tr>`)}</tbody>
    </table></div>`;
}

function loadImage(src) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error(`the image ${src} could not be loaded`));
    img.src = src;
  });
}

// The difference drawn in the browser: the capture dimmed, every pixel that differs from the
// baseline in red. Images of different sizes are compared over the capture's area.
function DiffCanvas({ baseline, capture }) {
  const ref = useRef(null);
  const [note, setNote] = useState("Drawing the difference…");
  useEffect(() => {
    let live = true;
    Promise.all([loadImage(`/artifacts/${baseline}`), loadImage(`/artifacts/${capture}`)]).then(([a, b]) => {
      if (!live || !ref.current) return;
      const w = b.naturalWidth, h = b.naturalHeight, canvas = ref.current;
      canvas.width = w; canvas.height = h;
      const ctx = canvas.getContext("2d", { willReadFrequently: true });
      ctx.drawImage(a, 0, 0); const base = ctx.getImageData(0, 0, w, h).data;
      ctx.clearRect(0, 0, w, h); ctx.drawImage(b, 0, 0);
      const out = ctx.getImageData(0, 0, w, h), px = out.data;
      let differing = 0;
      for (let i = 0; i < px.length; i += 4) {
        if (px[i] !== base[i] || px[i + 1] !== base[i + 1] || px[i + 2] !== base[i + 2] || px[i + 3] !== base[i + 3]) {
          px[i] = 255; px[i + 1] = 0; px[i + 2] = 0; px[i + 3] = 255; differing++;
        } else {
          px[i] = 128 + (px[i] >> 2); px[i + 1] = 128 + (px[i + 1] >> 2); px[i + 2] = 128 + (px[i + 2] >> 2);
        }
      }
      ctx.putImageData(out, 0, 0);
      const sized = a.naturalWidth === w && a.naturalHeight === h ? "" : ` (the baseline is ${a.naturalWidth}x${a.naturalHeight}, the capture ${w}x${h})`;
      setNote(`${differing} of ${w * h} pixels differ, in red${sized}.`);
    }).catch((e) => live && setNote(e.message));
    return () => { live = false; };
  }, [baseline, capture]);
  return html`<figure class="shot"><canvas ref=${ref} class="shot-img" aria-label="Difference image"></canvas>
    <figcaption class="small muted">${note}</figcaption></figure>`;
}

function Shot({ sha, caption }) {
  if (!sha) return html`<figure class="shot"><div class="shot-none muted">${caption}: none</div></figure>`;
  return html`<figure class="shot"><a href=${`/artifacts/${sha}`} target="_blank" rel="noopener">
    <img class="shot-img" src=${`/artifacts/${sha}`} alt=${`${caption} ${shortSha(sha)}`} loading="lazy" /></a>
    <figcaption class="small muted">${caption} · <span class="mono">${shortSha(sha)}…</span></figcaption></figure>`;
}

function Review({ suite, cell, jobId, onAccepted }) {
  const [view, setView] = useState("side");
  const [run, busy] = useAction(notify);
  const canDiff = cell.sha256 && cell.baseline_sha256 && cell.sha256 !== cell.baseline_sha256;
  const accept = async () => {
    const body = { suite, page: cell.page, profile: cell.profile, sha256: cell.sha256, job_id: jobId };
    if (await run(() => post("/api/visual/baselines/accept", body), `The capture is now the baseline of ${cell.page} (${cell.profile}).`)) onAccepted();
  };
  const canAccept = !currentPeer() && cell.sha256 && cell.sha256 !== cell.baseline_sha256;
  return html`<div class="visual-review"><${Section} title=${`${cell.page} · ${cell.profile}`} id="visual-review"
    actions=${canAccept ? html`<${Action} kind="primary" onClick=${accept} disabled=${busy}>Accept as baseline<//>` : null}>
    <${Fields} pairs=${[["Status", html`<${Status} cell=${cell} />`], cell.note ? ["Note", cell.note] : null,
      ["Earlier runs", cell.history.length ? html`<span class="chips">${cell.history.map((h) => html`<span class="chip" title=${h.job_id}>${h.sha256 ? (h.ok === false ? "failed" : "shot") : "none"}${h.diff_pct != null ? ` ${h.diff_pct}%` : ""}</span>`)}</span>` : null]]} />
    <div class="tabs" role="tablist" aria-label="How to compare">
      <button type="button" role="tab" class=${`tab ${view === "side" ? "on" : ""}`} aria-selected=${view === "side"} onClick=${() => setView("side")}>Side by side</button>
      <button type="button" role="tab" class=${`tab ${view === "diff" ? "on" : ""}`} aria-selected=${view === "diff"} disabled=${!canDiff} onClick=${() => setView("diff")}>Difference</button>
    </div>
    ${view === "diff" && canDiff ? html`<${DiffCanvas} baseline=${cell.baseline_sha256} capture=${cell.sha256} />`
      : html`<div class="shots"><${Shot} sha=${cell.baseline_sha256} caption="Baseline" /><${Shot} sha=${cell.sha256} caption="This run" /></div>`}
  <//></div>`;
}

function Matrix({ suite, threshold }) {
  const [chosen, setChosen] = useState(null);
  const res = useResource(() => get("/api/visual/matrix", { suite, threshold }), [suite, threshold],
    (e) => e.type === "artifact" && e.action === "baseline");
  useEffect(() => setChosen(null), [suite]);
  return html`<${Loaded} res=${res}>${(m) => {
    if (!m.latest) return html`<${Empty}>No screenshots of ${suite} yet.<//>`;
    const counts = m.cells.reduce((n, c) => ({ ...n, [c.status]: (n[c.status] || 0) + 1 }), {});
    const current = chosen && m.cells.find((c) => c.page === chosen.page && c.profile === chosen.profile);
    const summary = Object.entries(counts).map(([s, n]) => `${n} ${LABELS[s] || s}`).join(", ");
    return html`<p class="muted count-line">Run <${JobLink} id=${m.latest.job_id} /> <${Ago} iso=${m.latest.created_at} />${` · ${summary}`}</p>
      <${Grid} m=${m} chosen=${current} choose=${setChosen} />
      ${current ? html`<${Review} suite=${suite} cell=${current} jobId=${m.latest.job_id} onAccepted=${res.reload} />`
        : html`<p class="hint">Choose a cell to compare it with its baseline.</p>`}`;
  }}<//>`;
}

export function Visual({ query }) {
  const [suite, setSuite] = useState(query.get("suite") || "");
  const [threshold, setThreshold] = useState(query.get("threshold") || "0.1");
  const suites = useResource(() => get("/api/visual/suites"), [], (e) => e.type === "artifact");
  useEffect(() => {
    const list = suites.data?.suites || [];
    if (!suite && list.length) setSuite(list[0]);
  }, [suites.data]);
  const pick = (s) => { setSuite(s); setQuery({ suite: s, threshold: threshold === "0.1" ? "" : threshold }); };
  if (currentPeer()) return html`<${Page} title="Visual review"><${Empty}>Visual review is not read through a peer's view.<//><//>`;
  return html`<${Page} title="Visual review">
    <${Loaded} res=${suites}>${(d) => d.suites.length ? html`
      <form class="filters" onSubmit=${(e) => e.preventDefault()}>
        <label>Suite <select value=${suite} onChange=${(e) => pick(e.target.value)}>
          ${d.suites.map((s) => html`<option value=${s}>${s}</option>`)}</select></label>
        <label>Threshold (% of pixels) <input type="number" min="0" max="100" step="0.1" value=${threshold}
          onChange=${(e) => setThreshold(e.target.value || "0.1")} /></label>
      </form>
      ${suite ? html`<${Matrix} suite=${suite} threshold=${threshold} />` : null}`
      : html`<${Empty}>No screenshots yet: web-shots, locale-shots and a11y-audit jobs fill this page.<//>`}<//>
  <//>`;
}
