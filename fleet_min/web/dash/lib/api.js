// HTTP to this collector, or read-only through /api/peers/{id}/... when viewing a peer.

const TOKEN_KEY = "fleet.dashToken";
let peer = null;

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function setPeer(id) { peer = id || null; }
export function currentPeer() { return peer; }

export function getToken() {
  try { return localStorage.getItem(TOKEN_KEY) || ""; } catch { return ""; }
}

export function setToken(value) {
  try {
    if (value) localStorage.setItem(TOKEN_KEY, value);
    else localStorage.removeItem(TOKEN_KEY);
  } catch { /* storage refused (private mode): the token lives for this page only */ }
}

function query(params) {
  if (!params) return "";
  const kept = Object.entries(params).filter(([, v]) => v !== undefined && v !== null && v !== "");
  return kept.length ? `?${new URLSearchParams(kept)}` : "";
}

// One segment of a path. "new" is also the name of the Enqueue and Add-a-device routes, which
// come first: a job or device of that id had its first letter encoded, or its page was never
// reached. The server and the router decode it back.
export function seg(value) {
  const encoded = encodeURIComponent(value);
  return encoded === "new" ? "%6Eew" : encoded;
}

async function reply(resp) {
  const text = await resp.text();
  let body = null;
  if (text) {
    try { body = JSON.parse(text); } catch { body = null; }
  }
  if (!resp.ok) {
    const sentence = body && typeof body.error === "string" ? body.error
      : `the collector answered ${resp.status} ${resp.statusText}`.trim();
    throw new ApiError(resp.status, sentence);
  }
  return body;
}

async function call(url, init) {
  let resp;
  try {
    resp = await fetch(url, init);
  } catch {
    throw new ApiError(0, "the collector could not be reached; check the network and retry");
  }
  return reply(resp);
}

// GET a path of this collector, or of the peer being viewed (the proxy reads the same paths).
export function get(path, params, { local = false, signal } = {}) {
  const prefix = peer && !local ? `/api/peers/${seg(peer)}` : "";
  return call(prefix + path + query(params), {
    headers: { Accept: "application/json" }, signal,
  });
}

// A change: always to this collector, with the dashboard token when one is stored.
export function send(method, path, body) {
  if (peer) {
    return Promise.reject(new ApiError(403, "a peer's view is read-only; open its own dashboard to change it"));
  }
  const headers = { Accept: "application/json" };
  const token = getToken();
  if (token) headers["X-Fleet-Token"] = token;
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  return call(path, init);
}

export const post = (path, body) => send("POST", path, body ?? {});
export const patch = (path, body) => send("PATCH", path, body);
export const del = (path) => send("DELETE", path);
