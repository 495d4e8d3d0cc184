// The live stream (/api/stream): one EventSource for the page, reconnecting by itself.
//
// EventSource retries on its own after a dropped connection (sending Last-Event-ID, so the
// collector replays what was missed). When it gives up (the answer was not an event stream, for
// example a proxy's error page), we open a new one with a growing delay and ?last_event_id=.
// A changed collector instance (a restart resets event ids) tells listeners to reload.

// Every event type a screen listens for (its useResource filter) must be here, or the screen
// waits for its next reload instead (tests/web/test_stream_types.py reads both).
const TYPES = ["job", "device", "executor", "result", "beacon", "alert", "schedule", "template",
  "artifact", "topic"];

class LiveStream {
  constructor() {
    this.listeners = new Set();
    this.stateListeners = new Set();
    this.state = "connecting";
    this.source = null;
    this.lastId = null;
    this.instance = null;
    this.delay = 1000;
    this.timer = null;
  }

  start() {
    if (this.source || this.timer) return;
    const url = this.lastId ? `/api/stream?last_event_id=${encodeURIComponent(this.lastId)}` : "/api/stream";
    const source = new EventSource(url);
    this.source = source;
    this.setState("connecting");
    source.addEventListener("hello", (ev) => this.hello(ev));
    for (const type of TYPES) {
      source.addEventListener(type, (ev) => this.dispatch(type, ev));
    }
    source.addEventListener("open", () => { this.delay = 1000; });
    source.addEventListener("error", () => {
      if (source.readyState === EventSource.CLOSED) this.retryLater();
      else this.setState("reconnecting");
    });
  }

  retryLater() {
    if (this.source) this.source.close();
    this.source = null;
    this.setState("down");
    this.timer = setTimeout(() => { this.timer = null; this.start(); }, this.delay);
    this.delay = Math.min(this.delay * 2, 30000);
  }

  hello(ev) {
    let data = {};
    try { data = JSON.parse(ev.data); } catch { /* a hello without JSON still means live */ }
    const restarted = this.instance !== null && data.instance && data.instance !== this.instance;
    this.instance = data.instance || this.instance;
    this.setState("live");
    if (restarted) {
      this.lastId = null;
      this.emit({ type: "resync" });
    }
  }

  dispatch(type, ev) {
    if (ev.lastEventId) this.lastId = ev.lastEventId;
    let data;
    try { data = JSON.parse(ev.data); } catch { return; }
    this.emit({ ...data, type });
  }

  emit(event) {
    for (const fn of this.listeners) {
      try { fn(event); } catch (err) { console.warn("stream listener failed", err); }
    }
  }

  setState(state) {
    if (state === this.state) return;
    const wasLive = this.state === "live";
    this.state = state;
    for (const fn of this.stateListeners) fn(state);
    // Back after an outage: anything older than the collector's replay buffer is gone.
    if (state === "live" && !wasLive && this.everLive) this.emit({ type: "resync" });
    if (state === "live") this.everLive = true;
  }

  subscribe(fn) { this.listeners.add(fn); return () => this.listeners.delete(fn); }
  onState(fn) { this.stateListeners.add(fn); return () => this.stateListeners.delete(fn); }
}

export const stream = new LiveStream();
