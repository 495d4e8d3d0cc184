// The page's whole state in one object; set() merges a change and schedules one redraw.
// The live snapshot comes from /api/stream, everything else is asked for by the screen showing it.

const TOKEN_KEY = "fleet-cp-token";
const HISTORY_S = 3600; // vitals kept for the load chart: the last hour, one point per 5 s at most
const STEP_S = 5;

function storedToken() {
  try {
    const remembered = localStorage.getItem(TOKEN_KEY);
    if (remembered) return { token: remembered, remember: true };
    return { token: sessionStorage.getItem(TOKEN_KEY) || "", remember: false };
  } catch {
    return { token: "", remember: false }; // storage refused (private mode, policy): keep in memory
  }
}

export const state = {
  snap: null,            // latest snapshot (GET /api/state shape)
  conn: "connecting",    // connecting | live | reconnecting
  connSince: Date.now(),
  catalogue: null,       // GET /api/actions
  ...storedToken(),
  tokenRefused: false,
  route: { name: "overview", arg: "" },
  toasts: [],
  confirm: null,         // {title, body, confirmLabel, danger, fields, run}
  pending: new Set(),    // action keys in flight
  history: [],           // [{t, load1, memUsedPct, busy}]
};

const listeners = new Set();
let scheduled = false;

export function subscribe(fn) {
  listeners.add(fn);
  return () => listeners.delete(fn);
}

export function set(patch) {
  Object.assign(state, patch);
  if (scheduled) return;
  scheduled = true;
  queueMicrotask(() => {
    scheduled = false;
    for (const fn of listeners) fn(state);
  });
}

export function readOnly() {
  return Boolean(state.snap?.host?.read_only || state.catalogue?.read_only);
}

export function saveToken(token, remember) {
  try {
    localStorage.removeItem(TOKEN_KEY);
    sessionStorage.removeItem(TOKEN_KEY);
    if (token) (remember ? localStorage : sessionStorage).setItem(TOKEN_KEY, token);
  } catch {
    // storage refused: the token lives for this page only
  }
  set({ token, remember, tokenRefused: false });
}

export function recordSnapshot(snap) {
  const v = snap.vitals || {};
  const point = {
    t: Date.parse(snap.generated_at) / 1000 || Date.now() / 1000,
    load1: Array.isArray(v.load) ? v.load[0] : null,
    memUsedPct: v.mem_total_mb ? 100 * (1 - v.mem_available_mb / v.mem_total_mb) : null,
    busy: snap.capacity?.busy ?? null,
  };
  const last = state.history[state.history.length - 1];
  const history = last && point.t - last.t < STEP_S ? state.history
    : [...state.history.filter((p) => p.t > point.t - HISTORY_S), point];
  set({ snap, history });
}

let toastId = 0;
export function toast(kind, title, detail, ttlMs) {
  const id = ++toastId;
  set({ toasts: [...state.toasts, { id, kind, title, detail }] });
  if (ttlMs) setTimeout(() => dismissToast(id), ttlMs);
  return id;
}

export function dismissToast(id) {
  set({ toasts: state.toasts.filter((t) => t.id !== id) });
}
