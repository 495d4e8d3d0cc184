// Client-side routes under /dash (history API). /dash/@<peer id>/... is a peer's read-only view.
import { setPeer, seg } from "./api.js";

const listeners = new Set();

export function parseLocation(loc = window.location) {
  let rest = loc.pathname.replace(/^\/dash/, "") || "/";
  let peer = null;
  const m = rest.match(/^\/@([^/]+)(\/.*)?$/);
  if (m) {
    peer = decodeURIComponent(m[1]);
    rest = m[2] || "/";
  }
  if (rest.length > 1 && rest.endsWith("/")) rest = rest.slice(0, -1);
  return { path: rest, peer, query: new URLSearchParams(loc.search) };
}

let current = parseLocation();
setPeer(current.peer);

export function route() { return current; }

export function href(path, peer = current.peer) {
  return (peer ? `/dash/@${seg(peer)}` : "/dash") + (path === "/" ? "" : path);
}

function changed() {
  current = parseLocation();
  setPeer(current.peer);
  for (const fn of listeners) fn(current);
}

export function navigate(url, { replace = false } = {}) {
  if (replace) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  changed();
  if (!replace) window.scrollTo(0, 0);
}

// Keep filters in the address (so a view can be bookmarked and shared) without a new entry.
export function setQuery(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) q.set(k, v);
  const search = q.toString();
  const url = window.location.pathname + (search ? `?${search}` : "");
  history.replaceState(null, "", url);
  current = { ...current, query: q };
}

export function onRoute(fn) { listeners.add(fn); return () => listeners.delete(fn); }

// Match "/jobs/:id" against a path; returns params or null.
export function match(pattern, path) {
  const p = pattern.split("/");
  const s = path.split("/");
  if (p.length !== s.length) return null;
  const params = {};
  for (let i = 0; i < p.length; i += 1) {
    if (p[i].startsWith(":")) {
      try { params[p[i].slice(1)] = decodeURIComponent(s[i]); } catch { return null; }
    } else if (p[i] !== s[i]) {
      return null;
    }
  }
  return params;
}

export function installLinkHandler() {
  window.addEventListener("popstate", changed);
  document.addEventListener("click", (ev) => {
    if (ev.defaultPrevented || ev.button !== 0 || ev.metaKey || ev.ctrlKey || ev.shiftKey || ev.altKey) return;
    const a = ev.target.closest && ev.target.closest("a[href]");
    if (!a || a.target || a.hasAttribute("download")) return;
    const url = new URL(a.href, window.location.href);
    if (url.origin !== window.location.origin) return;
    if (!/^\/dash(\/|$)/.test(url.pathname) || url.pathname.startsWith("/dash/legacy")) return;
    ev.preventDefault();
    navigate(url.pathname + url.search);
  });
}
