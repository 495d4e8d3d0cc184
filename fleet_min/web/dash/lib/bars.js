// Horizontal bars for one measure per category (a device running a model): median as the bar,
// min to max as a whisker. The labels are page text beside the bars, so they wrap and stay whole
// at any width, where labels drawn on a canvas axis overlap and are cut.
import { html } from "./core.js";
import { num } from "./format.js";

function finite(v) {
  return typeof v === "number" && Number.isFinite(v);
}

// groups: [{ title, rows: [{ key, label, median, min, max, detail }] }]; one scale for all groups.
export function Bars({ title, groups }) {
  const values = groups.flatMap((g) => g.rows.flatMap((r) => [r.median, r.max])).filter(finite);
  const top = Math.max(0, ...values);
  const pct = (v) => (top > 0 && finite(v) ? Math.max(0, Math.min(100, (100 * v) / top)) : 0);
  return html`<figure class="bars">
    <figcaption>${title}</figcaption>
    <div class="bar-scale" aria-hidden="true"><span></span><span class="axis"><span>0</span><span>${num(top, 2)}</span></span></div>
    ${groups.map((g) => html`<section class="bar-group" aria-label=${g.title}>
      <h3 class="bar-group-title">${g.title}</h3>
      <ul class="bar-list">${g.rows.map((r) => html`<li class="bar-row" key=${r.key} title=${r.detail}>
        <span class="bar-label">${r.label}</span>
        <span class="bar-track" aria-hidden="true">
          <span class="bar" style=${`width:${pct(r.median)}%`}></span>
          ${finite(r.min) && finite(r.max) ? html`<span class="whisker"
            style=${`left:${pct(r.min)}%;width:${Math.max(0.5, pct(r.max) - pct(r.min))}%`}></span>` : null}
        </span>
        <span class="bar-value">${num(r.median, 2)}</span>
        <span class="sr-only">${r.detail}</span>
      </li>`)}</ul>
    </section>`)}
  </figure>`;
}
