// The collector dashboard: layout, navigation, routes, live-stream status, alert banner.
import { html, render, useState, useEffect, useRef } from "./lib/core.js";
import { get, currentPeer, getToken } from "./lib/api.js";
import { stream } from "./lib/stream.js";
import { route, onRoute, match, href, installLinkHandler } from "./lib/router.js";
import { useResource, useStreamState } from "./lib/hooks.js";
import { onNotify } from "./lib/notify.js";
import { sentence } from "./lib/format.js";
import { Overview } from "./screens/overview.js";
import { Devices, DeviceDetail } from "./screens/devices.js";
import { Enroll } from "./screens/enroll.js";
import { Jobs, JobDetail } from "./screens/jobs.js";
import { Enqueue } from "./screens/enqueue.js";
import { Results } from "./screens/results.js";
import { Schedules, ScheduleDetail } from "./screens/schedules.js";
import { Artifacts, ArtifactDetail } from "./screens/artifacts.js";
import { Visual } from "./screens/visual.js";
import { Alerts } from "./screens/alerts.js";
import { Topics, TopicDetail } from "./screens/topics.js";
import { System } from "./screens/system.js";
import { Peers } from "./screens/peers.js";
import { Executors } from "./screens/executors.js";

const NAV = [
  ["/", "Overview"], ["/devices", "Devices"], ["/executors", "Executors"], ["/jobs", "Jobs"], ["/results", "Results"],
  ["/schedules", "Schedules"], ["/artifacts", "Artifacts"], ["/visual", "Visual review"], ["/alerts", "Alerts"],
  ["/topics", "Topics"], ["/system", "System"], ["/peers", "Peers"],
];

const ROUTES = [
  ["/", Overview], ["/devices", Devices], ["/devices/new", Enroll], ["/devices/:id", DeviceDetail], ["/executors", Executors],
  ["/jobs", Jobs], ["/jobs/new", Enqueue], ["/jobs/:id", JobDetail], ["/results", Results],
  ["/schedules", Schedules], ["/schedules/:id", ScheduleDetail],
  ["/artifacts", Artifacts], ["/artifacts/:sha", ArtifactDetail], ["/visual", Visual], ["/alerts", Alerts],
  ["/topics", Topics], ["/topics/:topic", TopicDetail], ["/system", System], ["/peers", Peers],
];

function resolve(path) {
  for (const [pattern, component] of ROUTES) {
    const params = match(pattern, path);
    if (params) return { component, params };
  }
  return null;
}

function section(path) {
  const first = `/${path.split("/")[1] || ""}`;
  return first === "/" ? "/" : first;
}

function StreamBadge() {
  const state = useStreamState();
  if (currentPeer()) return html`<span class="live polled" title="A peer's view is refreshed every 15 s">polled</span>`;
  const label = { live: "live", connecting: "connecting", reconnecting: "reconnecting", down: "offline" }[state] || state;
  return html`<span class=${`live ${state}`} role="status" title="Live updates from /api/stream">${label}</span>`;
}

function AlertBanner() {
  const res = useResource(() => get("/api/alerts", { state: "open" }), [currentPeer()],
    (e) => e.type === "alert");
  const loud = (res.data?.alerts || []).filter((a) => !a.muted);
  if (!loud.length) return null;
  const rules = [...new Set(loud.map((a) => a.rule))].join(", ");
  return html`<div class="banner" role="alert">
    <strong>${loud.length} open alert${loud.length === 1 ? "" : "s"}</strong>
    <span class="muted">${rules}</span>
    <a href=${href("/alerts")}>Review alerts</a>
  </div>`;
}

function PeerBanner({ peer }) {
  const res = useResource(() => get("/api/peers", null, { local: true }), [peer]);
  const info = (res.data?.peers || []).find((p) => p.id === peer);
  return html`<div class="banner peer" role="note">
    <span>Read-only view of <strong>${info?.name || peer}</strong>${info?.url ? html` <span class="muted">(${info.url})</span>` : null}.
      Changes are made on its own dashboard.</span>
    <a href="/dash/peers">Back to this collector</a>
  </div>`;
}

function Toasts() {
  const [notes, setNotes] = useState([]);
  useEffect(() => onNotify((note) => {
    setNotes((n) => [...n.slice(-3), note]);
    setTimeout(() => setNotes((n) => n.filter((x) => x.id !== note.id)), note.kind === "error" ? 9000 : 4000);
  }), []);
  return html`<div class="toasts" aria-live="polite">${notes.map((n) => html`<div class=${`toast ${n.kind}`}>
    ${sentence(n.text)}${n.status === 401 || n.status === 403 ? html` <a href=${href("/system", null)}>Enter a token</a>` : null}
  </div>`)}</div>`;
}

function NotFound({ path }) {
  return html`<div class="page"><h1 tabindex="-1" id="page-title">Not found</h1>
    <p>There is no dashboard screen at <code>${path}</code>.</p><p><a href=${href("/")}>Overview</a></p></div>`;
}

function App({ name }) {
  const [where, setWhere] = useState(route());
  const [menu, setMenu] = useState(false);
  useEffect(() => onRoute((r) => { setWhere(r); setMenu(false); }), []);
  const first = useRef(true);
  useEffect(() => {
    // After a navigation, move focus to the new screen's title (as a page load would).
    if (first.current) { first.current = false; return; }
    const title = document.getElementById("page-title");
    if (title) title.focus({ preventScroll: true });
  }, [where.path, where.peer]);

  const found = resolve(where.path);
  const active = section(where.path);
  const Screen = found?.component;
  const key = `${where.peer || ""}|${where.path}`;
  return html`
    <a class="skip" href="#main">Skip to content</a>
    <header class="top">
      <a class="brand" href=${href("/")}><span class="logo" aria-hidden="true">◆</span> fleet <span class="muted">${name}</span></a>
      <${StreamBadge} />
      ${getToken() && !where.peer ? html`<span class="token-set" title="A dashboard token is stored in this browser">token</span>` : null}
      <button type="button" class="btn menu-toggle" aria-expanded=${menu} aria-controls="nav"
        onClick=${() => setMenu(!menu)}>Menu</button>
    </header>
    <div class="layout">
      <nav id="nav" class=${menu ? "open" : ""} aria-label="Screens">
        ${NAV.map(([path, label]) => html`<a href=${href(path)} aria-current=${active === path ? "page" : undefined}>${label}</a>`)}
        <a class="legacy" href="/dash/legacy">Plain pages</a>
        <a class="legacy" href="/runner">Browser runner</a>
      </nav>
      <main id="main">
        ${where.peer ? html`<${PeerBanner} peer=${where.peer} />` : null}
        <${AlertBanner} key=${`alerts-${where.peer || ""}`} />
        ${Screen ? html`<${Screen} key=${key} ...${found.params} query=${where.query} />` : html`<${NotFound} path=${where.path} />`}
      </main>
    </div>
    <${Toasts} />`;
}

installLinkHandler();
stream.start();
const root = document.getElementById("app");
render(html`<${App} name=${root.dataset.name || ""} />`, root);
