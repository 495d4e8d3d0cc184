// Topics: pipeline topics with event counts and recent payloads; one topic's latest events,
// appended live from the stream.
import { html, useState, useEffect, useRef } from "../lib/core.js";
import { get, seg, currentPeer } from "../lib/api.js";
import { useResource, useTick } from "../lib/hooks.js";
import { stream } from "../lib/stream.js";
import { Page, Section, Loaded, Table, Ago, Link, Empty } from "../lib/ui.js";

// GET /api/events lists the 500 most recently active topics, each with its 3 newest events, and
// anyone may publish: with large previews the listing is megabytes. A topic event for a listed
// topic carries all the list needs (seq, at, source, the payload or payload_omitted), so it
// updates that row in place; only a topic the list does not hold reloads it, at most every 2 s
// (as the Devices list does), however fast the events come.
const LISTED = 500;
const PREVIEWS = 3;
const RELOAD_MS = 2000;

function payloadText(p) {
  const text = JSON.stringify(p);
  return text && text.length > 300 ? `${text.slice(0, 300)}…` : text;
}

const newest = (a, b) => b.last_seq - a.last_seq;

// A topic event applied to the listed topics: its row counts one more, shows it first among its
// recent payloads and moves up. An event the row already counts (a replay after a reconnect, or
// one a reload answered with) changes nothing; nor does a topic the list does not hold.
function applyEvent(topics, e) {
  const i = topics.findIndex((t) => t.topic === e.topic);
  if (i < 0 || e.seq <= topics[i].last_seq) return topics;
  const t = topics[i];
  const preview = e.payload_omitted
    ? { seq: e.seq, at: e.at, source: e.source, payload_omitted: true }
    : { seq: e.seq, at: e.at, source: e.source, payload: e.payload };
  const row = { ...t, count: t.count + 1, last_seq: e.seq, last_at: e.at, recent: [preview, ...t.recent].slice(0, PREVIEWS) };
  return [row, ...topics.slice(0, i), ...topics.slice(i + 1)].sort(newest);
}

// A reloaded listing over the rows held: the reload is right, except for a row the stream moved
// on after the collector read it (a later seq than the reload's own row, or than any of its rows
// for a topic it does not list yet).
function merge(held, fresh) {
  if (!held) return fresh;
  const top = fresh.reduce((m, t) => Math.max(m, t.last_seq), 0);
  const rows = new Map(fresh.map((t) => [t.topic, t]));
  for (const t of held) {
    const f = rows.get(t.topic);
    if (f ? t.last_seq > f.last_seq : t.last_seq > top) rows.set(t.topic, t);
  }
  return [...rows.values()].sort(newest).slice(0, LISTED);
}

export function Topics() {
  useTick();
  const held = useRef(new Set());
  const res = useResource(() => get("/api/events"), [],
    (e) => e.type === "topic" && !held.current.has(e.topic), RELOAD_MS);
  const [topics, setTopics] = useState(null);
  useEffect(() => { if (res.data) setTopics((old) => merge(old, res.data.topics)); }, [res.data]);
  // A peer's stream is not proxied: its listing is polled, and this stream's events are not its.
  useEffect(() => (currentPeer() ? undefined : stream.subscribe((e) => {
    if (e.type === "topic") setTopics((old) => (old ? applyEvent(old, e) : old));
  })), []);
  held.current = new Set((topics || []).map((t) => t.topic));
  const shown = { ...res, data: res.data && { topics: topics || res.data.topics } };
  return html`<${Page} title="Topics" subtitle="Events that pipeline workloads publish and subscribe to.">
    <${Loaded} res=${shown}>${(d) => html`<${Table} label="Topics" empty="Nothing has been published yet." className="topics"
      head=${["Topic", "Events", "Last event", "Recent payloads"]}
      rows=${d.topics.map((t) => html`<tr>
        <td><${Link} to=${`/topics/${encodeURIComponent(t.topic)}`}>${t.topic}<//></td><td>${t.count}</td>
        <td><${Ago} iso=${t.last_at} /></td>
        <td><ul class="plain payloads">${t.recent.map((e) => html`<li><span class="muted">#${e.seq}${e.source ? ` · ${e.source}` : ""}</span>${" "}${e.payload_omitted ? html`<span class="muted">${e.payload_bytes ? `${e.payload_bytes} bytes` : "over 4096 bytes"}: open the topic</span>` : html`<code>${payloadText(e.payload)}</code>`}</li>`)}</ul></td></tr>`)} />`}<//>
  <//>`;
}

export function TopicDetail({ topic }) {
  useTick();
  // An event too large for the stream is read with the page's next reload, which the stream
  // asks for at most once a second (useResource), not once an event: 100 events may be 1 MiB.
  const res = useResource(() => get(`/api/events/${seg(topic)}`, { limit: 100 }), [topic],
    (e) => e.type === "topic" && e.topic === topic && e.payload_omitted);
  const [live, setLive] = useState([]);
  useEffect(() => stream.subscribe((e) => {
    if (e.type !== "topic" || e.topic !== topic || e.payload_omitted) return;
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
