// The live snapshot: one EventSource on /api/stream, each message a full snapshot.
// EventSource retries by itself after a dropped connection; when it gives up (an HTTP error
// closes it for good) we open a new one with a growing delay, and at once when the network
// comes back or the tab is shown again.

export function follow({ onSnapshot, onStatus }) {
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
