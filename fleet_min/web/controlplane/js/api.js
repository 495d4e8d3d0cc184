// Talking to the daemon: JSON in and out, the control token on the routes that need it.

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
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
    const message = body?.error || `the daemon answered ${response.status} ${response.statusText}`;
    throw new HttpError(response.status, message);
  }
  return body;
}

export async function getJSON(path, { signal } = {}) {
  const response = await fetch(path, { headers: { Accept: "application/json" }, signal, cache: "no-store" });
  return parse(response);
}

export async function postJSON(path, body, token) {
  const headers = { "Content-Type": "application/json", Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  const response = await fetch(path, { method: "POST", headers, body: JSON.stringify(body), cache: "no-store" });
  return parse(response);
}

// A text download that needs the token (the runner bundle): fetched, then saved from a blob.
export async function download(path, token, filename) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${token}` }, cache: "no-store" });
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

export const isMissing = (err) => err instanceof HttpError && err.status === 404;
export const isAuth = (err) => err instanceof HttpError && (err.status === 401 || err.status === 403);
