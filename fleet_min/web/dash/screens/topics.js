// Topics: pipeline topics with event counts and recent payloads; one topic's latest events,
// appended live from the stream.
import { html, useState, useEffect } from "../lib/core.js";
import { get, seg, currentPeer } from "../lib/api.js";
import { useResource, useTick } from "../lib/hooks.js";
import { stream } from "../lib/stream.js";
import { Page, Section, Loaded, Table, Ago, Link, Empty } from "../lib/ui.js";

function payloadText(p) {
  const text = JSON.stringify(p);
  return text && text.length > 300 ? `${text.slice(0, 300)}…` : text;
}

export function Topics() {
  useTick();
  const res = useResource(() => get("/api/events"), [], (e) => e.type === "topic");
  return html`<${Page} title="Topics" subtitle="Events that pipeline workloads publish and subscribe to.">
    <${Loaded} res=${res}>${(d) => html`<${Table} label="Topics" empty="Nothing has been published yet." className="topics"
      head=${["Topic", "Events", "Last event", "Recent payloads"]}
      rows=${d.topics.map((t) => html`<tr>
        <td><${Link} to=${`/topics/${encodeURIComponent(t.topic)}`}>${t.topic}<//></td><td>${t.count}</td>
        <td><${Ago} iso=${t.last_at} /></td>
        <td><ul class="plain payloads">${t.recent.map((e) => html`<li><span class="muted">#${e.seq}${e.source ? ` · ${e.source}` : ""}</span>${" "}${e.payload_omitted ? html`<span class="muted">${e.payload_bytes} bytes: open the topic</span>` : html`<code>${payloadText(e.payload)}</code>`}</li>`)}</ul></td></tr>`)} />`}<//>
  <//>`;
}

export function TopicDetail({ topic }) {
  useTick();
  const res = useResource(() => get(`/api/events/${seg(topic)}`, { limit: 100 }), [topic]);
  const [live, setLive] = useState([]);
  useEffect(() => stream.subscribe((e) => {
    if (e.type !== "topic" || e.topic !== topic) return;
    if (e.payload_omitted) { res.reload(); return; }
    setLive((old) => [{ seq: e.seq, at: e.at, source: e.source, payload: e.payload }, ...old].slice(0, 100));
  }), [topic]);
  if (currentPeer()) return html`<${Page} title=${topic}><${Empty}>A topic's events are not read through a peer's view.<//><//>`;
  return html`<${Page} title=${topic} subtitle="Topic">
    <${Loaded} res=${res}>${(d) => {
      const seen = new Set(d.events.map((e) => e.seq));
      const events = [...live.filter((e) => !seen.has(e.seq)), ...d.events];
      return html`<p class="muted count-line">${d.count + live.filter((e) => !seen.has(e.seq)).length} events</p>
        <${Section} title="Latest events" id="topic-events">
          <${Table} label="Events" empty="No events." head=${["Seq", "When", "Source", "Payload"]}
            rows=${events.map((e) => html`<tr><td>${e.seq}</td><td><${Ago} iso=${e.at} /></td><td>${e.source || "–"}</td>
              <td><code class="payload">${payloadText(e.payload)}</code></td></tr>`)} />
        <//>`;
    }}<//>
  <//>`;
}
