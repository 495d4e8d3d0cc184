// Talking to the daemon: JSON in and out, the control token on the routes that need it.

export class HttpError extends Error {
  constructor(status, message, routeMissing = false) {
    super(message);
    this.status = status;
    this.routeMissing = routeMissing; // the daemon has no such route (older, or without it)
  }
}

async function parse(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (!response.ok) {
    // The daemon's own sentence when it gave one; a bare status only when it did not.
    const said = typeof body?.error === "string" && body.error.trim() ? body.error.trim() : "";
    const message = said || `The daemon answered ${response.status} ${response.statusText || "without a reason"}.`;
    const routeMissing = response.status === 404 && (!said || /^no such route/i.test(said));
    throw new HttpError(response.status, message, routeMissing);
  }
  return body;
}

// fetch() itself fails only when no answer came at all: say that, not "Failed to fetch".
async function send(path, init) {
  try {
    return await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new Error("The daemon did not answer; it may be restarting. Try again in a moment.");
  }
}

export async function getJSON(path, { signal } = {}) {
  return parse(await send(path, { headers: { Accept: "application/json" }, signal, cache: "no-store" }));
}

export async function postJSON(path, body, token) {
  const headers = { "Content-Type": "application/json", Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  return parse(await send(path, { method: "POST", headers, body: JSON.stringify(body), cache: "no-store" }));
}

// A text download that needs the token (the runner bundle): fetched, then saved from a blob.
export async function download(path, token, filename) {
  const response = await send(path, { headers: { Authorization: `Bearer ${token}` }, cache: "no-store" });
  if (!response.ok) await parse(response);
  const url = URL.createObjectURL(await response.blob());
  const link = document.createElement("a");
  link.href = url;
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// A 404 because the daemon does not offer the route at all; a 404 about a thing (a repository
// without history, a runner gone) carries the daemon's sentence instead and is shown as such.
export const isMissing = (err) => err instanceof HttpError && err.routeMissing;
export const isAuth = (err) => err instanceof HttpError && (err.status === 401 || err.status === 403);
