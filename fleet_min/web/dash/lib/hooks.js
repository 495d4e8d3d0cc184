// Data hooks: a resource that loads from the API and reloads when the stream says it changed.
import { useState, useEffect, useRef, useCallback } from "./core.js";
import { stream } from "./stream.js";
import { currentPeer } from "./api.js";

const PEER_POLL_MS = 15000;  // a peer's stream is not proxied, so its views are polled
// The least time between two reloads the stream causes. Anyone may post result rows or publish
// events, and a steady trickle of them (one every 250 ms) had every open screen reload its
// listings four times a second for every viewer; a reload after a quiet spell still comes after
// delayMs alone.
const RELOAD_GAP_MS = 1000;

// loader: () => Promise<data>. deps: reload when these change.
// changes: (event) => boolean, which stream events make this resource stale.
// delayMs: how long to gather a burst of events before one reload.
export function useResource(loader, deps, changes, delayMs = 200) {
  const [state, setState] = useState({ data: null, error: null, loading: true });
  const seq = useRef(0);
  const timer = useRef(null);
  const loaderRef = useRef(loader);
  loaderRef.current = loader;
  const changesRef = useRef(changes);
  changesRef.current = changes;

  const loadedAt = useRef(0);

  const load = useCallback(async () => {
    loadedAt.current = Date.now();
    const mine = ++seq.current;
    setState((s) => ({ ...s, loading: true }));
    try {
      const data = await loaderRef.current();
      if (mine === seq.current) setState({ data, error: null, loading: false });
    } catch (error) {
      if (mine === seq.current) setState((s) => ({ data: s.data, error, loading: false }));
    }
  }, []);

  useEffect(() => { load(); }, deps);  // eslint-disable-line react-hooks/exhaustive-deps

  useEffect(() => {
    if (currentPeer()) {
      const id = setInterval(load, PEER_POLL_MS);
      return () => clearInterval(id);
    }
    const off = stream.subscribe((event) => {
      const stale = event.type === "resync" || (changesRef.current && changesRef.current(event));
      if (!stale || timer.current) return;
      // Coalesce a burst of events (a fan-out, a busy agent) into one reload.
      const wait = Math.max(delayMs, loadedAt.current + RELOAD_GAP_MS - Date.now());
      timer.current = setTimeout(() => { timer.current = null; load(); }, wait);
    });
    return () => { off(); clearTimeout(timer.current); timer.current = null; };
  }, [load, delayMs]);

  return { ...state, reload: load };
}

// Re-render every `ms` so relative times ("3 min ago") stay true.
export function useTick(ms = 15000) {
  const [, setN] = useState(0);
  useEffect(() => {
    const id = setInterval(() => setN((n) => n + 1), ms);
    return () => clearInterval(id);
  }, [ms]);
}

export function useStreamState() {
  const [state, setState] = useState(stream.state);
  useEffect(() => stream.onState(setState), []);
  return state;
}

// Run an action (a POST), reporting its outcome through notify; returns [run, busy].
export function useAction(notify) {
  const [busy, setBusy] = useState(false);
  const run = useCallback(async (fn, success) => {
    setBusy(true);
    try {
      const result = await fn();
      if (success) notify(typeof success === "function" ? success(result) : success, "ok");
      return result;
    } catch (err) {
      notify(err.message || String(err), "error", err.status);
      return undefined;
    } finally {
      setBusy(false);
    }
  }, [notify]);
  return [run, busy];
}
