// Short messages after an action, read out by screen readers (an aria-live region in app.js).
const listeners = new Set();
let nextId = 1;

export function notify(text, kind = "ok", status = undefined) {
  const note = { id: nextId++, text, kind, status };
  for (const fn of listeners) fn(note);
}

export function onNotify(fn) { listeners.add(fn); return () => listeners.delete(fn); }
