// The control-plane UI: a shell (header, token, screens), the live snapshot from /api/stream,
// and hash routes: #/ overview, #/runner/<name>, #/analytics, #/repo/<owner/project>,
// #/concurrency, #/simulate, #/forecast, #/hosts, #/billing, #/settings. Plain ES modules, no
// build step; text is always rendered as text.
import { html, render, shown, useEffect, useRef, useState } from "./js/html.js";
import { state, set, subscribe, recordSnapshot, dismissToast } from "./js/store.js";
import { getJSON } from "./js/api.js";
import { TokenBox, ConfirmDialog } from "./js/actions.js";
import { Overview } from "./views/overview.js";
import { RunnerView } from "./views/runner.js";
import { Analytics, RepoView } from "./views/analytics.js";
import { Concurrency, Billing } from "./views/github.js";
import { Simulate } from "./views/simulate.js";
import { Forecast } from "./views/forecast.js";
import { Hosts } from "./views/hosts.js";
import { Settings } from "./views/settings.js";
import { ago, sentence } from "./js/format.js";

const SCREENS = [
  { name: "overview", label: "Runners", view: Overview },
  { name: "analytics", label: "Analytics", view: Analytics },
  { name: "concurrency", label: "Concurrency", view: Concurrency },
  { name: "simulate", label: "Simulate", view: Simulate },
  { name: "forecast", label: "Forecast", view: Forecast },
  { name: "hosts", label: "Hosts", view: Hosts },
  { name: "billing", label: "Billing", view: Billing },
  { name: "settings", label: "Settings", view: Settings },
];
// Pages about one thing, and the tab they belong under.
const DETAILS = { runner: "overview", repo: "analytics" };

function parseRoute() {
  const [, name = "", ...rest] = window.location.hash.replace(/^#/, "").split("/");
  if (DETAILS[name] && rest.length) {
    try {
      return { name, arg: decodeURIComponent(rest.join("/")) };
    } catch {
      return { name: "overview", arg: "" }; // a mangled link: the overview rather than nothing
    }
  }
  return { name: SCREENS.some((s) => s.name === name) ? name : "overview", arg: "" };
}

function Conn() {
  const labels = { live: "live", reconnecting: "reconnecting…", connecting: "connecting…" };
  const since = state.snap ? `last snapshot ${ago(state.snap.generated_at)}` : "no snapshot yet";
  return html`<span class=${`badge conn ${state.conn}`} id="conn" role="status" title=${since}>${labels[state.conn] || state.conn}</span>`;
}

// The screens' tabs; on a phone they fold behind a Menu button that opens them as a list
// (a tap, no hover), and choosing a screen folds them again.
function Nav() {
  const current = DETAILS[state.route.name] || state.route.name;
  const [open, setOpen] = useState(false);
  const toggle = useRef(null);
  useEffect(() => setOpen(false), [state.route.name, state.route.arg]);
  useEffect(() => {
    if (!open) return undefined;
    const close = (event) => {
      if (event.key !== "Escape") return;
      setOpen(false);
      toggle.current?.focus(); // focus was maybe on a link that is hidden now
    };
    document.addEventListener("keydown", close);
    return () => document.removeEventListener("keydown", close);
  }, [open]);
  const label = SCREENS.find((s) => s.name === current)?.label || "Screens";
  return html`<nav class=${`tabs${open ? " open" : ""}`} aria-label="Screens">
    <button type="button" class="menu-toggle" ref=${toggle} aria-expanded=${open ? "true" : "false"} aria-controls="screen-links"
      onClick=${() => setOpen(!open)}><span class="menu-icon" aria-hidden="true"></span>Menu <span class="menu-current">· ${label}</span></button>
    <div class="tab-links" id="screen-links">${SCREENS.map((s) => html`<a href=${`#/${s.name === "overview" ? "" : s.name}`}
      aria-current=${s.name === current ? "page" : undefined} onClick=${() => setOpen(false)}>${s.label}</a>`)}</div>
  </nav>`;
}

function Toasts() {
  return html`<div class="toasts" role="status" aria-live="polite">${state.toasts.map((t) => html`<div class=${`toast ${t.kind}`} key=${t.id}>
    <div class="toast-head"><strong>${t.title}</strong>
      <button type="button" class="close" aria-label="Dismiss" onClick=${() => dismissToast(t.id)}>×</button></div>
    ${t.detail?.error ? html`<p>${sentence(t.detail.error)}</p>` : null}
    ${t.detail?.command ? html`<p class="small"><code>${t.detail.command}</code> → exit ${t.detail.code} in ${t.detail.durationMs} ms</p>` : null}
    ${t.detail?.output ? html`<pre>${t.detail.output}</pre>` : null}
  </div>`)}</div>`;
}

function App() {
  const main = useRef(null);
  const first = useRef(true);
  const { route } = state;
  useEffect(() => {
    const screen = DETAILS[route.name] ? `${route.name} ${route.arg}` : route.name;
    document.title = shown(`${screen} · ${state.snap?.host?.name || "control plane"} · fleet-min`);
    if (first.current) first.current = false;
    else main.current?.focus({ preventScroll: false });
  }, [route.name, route.arg]);
  const screen = SCREENS.find((s) => s.name === route.name);
  const host = state.snap?.host?.name;
  return html`
    <button type="button" class="skip" onClick=${() => main.current?.focus()}>Skip to content</button>
    <header class="top">
      <div class="brand">
        <h1>Runners${host ? html` on <span class="host">${host}</span>` : null}</h1>
        <${Conn} />
      </div>
      <div class="token"><${TokenBox} /></div>
    </header>
    <${Nav} />
    <main id="main" ref=${main} tabindex="-1" data-screen=${route.name}>
      ${route.name === "runner" ? html`<${RunnerView} key=${route.arg} name=${route.arg} />`
        : route.name === "repo" ? html`<${RepoView} key=${route.arg} name=${route.arg} />` : html`<${screen.view} />`}
    </main>
    <${Toasts} />
    <${ConfirmDialog} />`;
}

function draw() {
  render(html`<${App} />`, document.getElementById("app"));
}

// The live snapshot: one EventSource on /api/stream, each message a full snapshot.
// EventSource retries by itself after a dropped connection; when it gives up (an HTTP error
// closes it for good) a new one is opened with a growing delay, and at once when the network
// comes back or the tab is shown again.
function follow({ onSnapshot, onStatus }) {
  let source = null;
  let timer = 0;
  let delay = 1000;

  function open() {
    clearTimeout(timer);
    if (source) source.close();
    source = new EventSource("/api/stream");
    source.onopen = () => {
      delay = 1000;
      onStatus("live");
    };
    source.onmessage = (event) => {
      let snap;
      try {
        snap = JSON.parse(event.data);
      } catch {
        return; // a torn message: the next tick brings a whole one
      }
      onStatus("live");
      onSnapshot(snap);
    };
    source.onerror = () => {
      onStatus("reconnecting");
      if (source.readyState === EventSource.CLOSED) {
        timer = setTimeout(open, delay);
        delay = Math.min(delay * 2, 30000);
      }
    };
  }

  const revive = () => {
    if (!source || source.readyState === EventSource.CLOSED) open();
  };
  window.addEventListener("online", revive);
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible") revive();
  });
  open();
}

async function loadCatalogue() {
  try {
    set({ catalogue: await getJSON("/api/actions") });
  } catch {
    // the daemon is unreachable: asked again once the stream is live
  }
}

function boot() {
  const root = document.getElementById("app");
  root.replaceChildren();
  set({ route: parseRoute() });
  subscribe(draw);
  window.addEventListener("hashchange", () => set({ route: parseRoute() }));
  loadCatalogue();
  getJSON("/api/state").then((snap) => { if (snap?.runners && !state.snap) recordSnapshot(snap); }).catch(() => {});
  follow({
    onSnapshot: recordSnapshot,
    onStatus: (conn) => {
      if (conn === state.conn) return;
      if (conn === "live" && !state.catalogue) loadCatalogue();
      set({ conn, connSince: Date.now() });
    },
  });
  draw();
}

boot();
