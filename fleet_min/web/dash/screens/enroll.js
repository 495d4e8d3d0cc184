// Add a device: the address to point it at (as a QR code for a phone's camera and as the one-line
// command for a shell), the newest phone runner build, and a watch that says when it registered.
import { html, useState, useEffect } from "../lib/core.js";
import { get, seg, currentPeer } from "../lib/api.js";
import { useResource } from "../lib/hooks.js";
import { Page, Section, Loaded, CopyButton, DeviceLink, Empty, Ago, Link } from "../lib/ui.js";
import { bytes } from "../lib/format.js";

const KIND = {
  current: "as this page was loaded", lan: "LAN", mesh: "tailnet: works off the LAN",
  name: "host name", loopback: "this machine only (a simulator)", other: "public address",
};

// The browser's own origin first when a phone could use it too (not a tunnel to localhost).
function candidates(bases) {
  const origin = window.location.origin;
  const local = /^https?:\/\/(localhost|127\.|\[::1\])/.test(origin);
  const known = bases.some((b) => b.url === origin);
  const first = local || known ? [] : [{ url: origin, address: window.location.host, kind: "current",
    via: "browser", command: `curl -fsSL ${origin}/agent/fleet_agent.py -o fleet_agent.py && python3 fleet_agent.py --collector ${origin}` }];
  return { list: [...first, ...bases], tunnel: local };
}

function Command({ text, what }) {
  return html`<div class="command"><pre class="json mono" tabindex="0">${text}</pre><${CopyButton} value=${text} what=${what} /></div>`;
}

function Watch({ before }) {
  // Only the devices first seen since the page opened: the registry may hold 25,000.
  const res = useResource(() => get("/api/devices", { expired: "1", first_seen_after: before.at }), [before.at],
    (e) => e.type === "device" || e.type === "beacon", 1000);
  // New: first seen after the page opened, by the collector's clock (ISO strings of one format
  // compare as times), however large the registry: its answer names only the newest 1,000 ids.
  const fresh = (res.data?.devices || []).filter((d) => d.first_seen && d.first_seen > before.at
    && !before.ids.has(d.device_id));
  if (!fresh.length) {
    return html`<p class="muted" role="status" id="enroll-waiting">Watching the registry: a device shows here the moment it registers.
      ${before.count ? ` (${before.count} already registered.)` : ""}</p>`;
  }
  return html`<ul class="plain" id="enroll-arrived" role="status">${fresh.map((d) => html`<li>
    <strong><${DeviceLink} id=${d.device_id} name=${d.name} /></strong> registered (seen <${Ago} iso=${d.last_seen} />);
    open it to give it a name, notes or pools.</li>`)}</ul>`;
}

function Runner({ apk, app, pinnedOnly }) {
  if (!apk) {
    return html`<p class="muted" id="runner-none">No ${pinnedOnly ? "pinned " : ""}build of <code>${app}</code> in the artifact store yet.
      Upload one with the header <code>x-artifact-app: ${app}</code>${pinnedOnly
        ? ", then pin it on its artifact page: with a dashboard token set, only a build you pinned is offered here"
        : " and it is offered here"}.</p>`;
  }
  const link = apk.download;  // carries ?filename= already
  return html`<p><a href=${link} download=${apk.filename} id="runner-download"><strong>${apk.filename}</strong></a>
    <span class="muted"> ${bytes(apk.size)} · build ${apk.build || "–"} · <${Ago} iso=${apk.created_at} /></span></p>
    <p class="small">SHA-256 <code id="runner-sha">${apk.sha256}</code></p>
    ${apk.approved ? null : html`<p class="notice" role="note" id="runner-unapproved">Not pinned: anyone who can reach
      this collector can upload a build, and the newest upload is offered. Check this hash against your own build,
      then pin it on <${Link} to=${`/artifacts/${seg(apk.sha256)}`}>its artifact page<//> to approve it; a pinned build
      is offered before any newer upload.</p>`}
    <p class="hint">Open that link on the phone itself (scan the code above, then browse to /dash/devices/new), or sideload
      it over USB: <code>adb install -r ${apk.filename}</code>.</p>`;
}

export function Enroll() {
  const res = useResource(() => get("/api/enroll", null, { local: true }), [], (e) => e.type === "artifact");
  const [chosen, setChosen] = useState(null);
  const [before, setBefore] = useState(null);
  useEffect(() => {
    if (res.data && before === null) {
      setBefore({ at: res.data.now, count: res.data.known_devices, ids: new Set(res.data.known_device_ids) });
    }
  }, [res.data, before]);
  if (currentPeer()) return html`<${Page} title="Add a device"><${Empty}>Devices enrol with the collector they are pointed at: open the peer's own dashboard.<//><//>`;
  return html`<${Page} title="Add a device" subtitle="Point a phone, a board or a laptop at this collector.">
    <${Loaded} res=${res}>${(d) => {
      const { list, tunnel } = candidates(d.bases);
      const pick = list.find((b) => b.url === chosen) || list[0];
      if (!pick) return html`<${Empty}>This collector is bound to no address a device could reach.<//>`;
      return html`
      ${tunnel ? html`<p class="banner peer" role="note">This page came through ${window.location.host}, a tunnel or this machine itself:
        a device cannot use that address. Pick one below that is on the device's network.</p>` : null}
      <div class="grid two enroll">
        <${Section} title="1 · The address" id="enroll-address">
          <figure class="qr-box">
            <img class="qr" id="enroll-qr" src=${`/api/enroll/qr?text=${seg(pick.url)}`} width="220" height="220"
              alt=${`QR code of ${pick.url}`} />
            <figcaption><code id="enroll-url">${pick.url}</code></figcaption>
          </figure>
          <p class="hint">Scan it with the phone's camera, or type it into the runner's collector field. The same address enrols every device.</p>
          ${list.length > 1 ? html`<fieldset class="choices"><legend>Address to use</legend>
            ${list.map((b) => html`<label class="check"><input type="radio" name="base" value=${b.url} checked=${b.url === pick.url}
              onChange=${() => setChosen(b.url)} /> <code>${b.url}</code> <span class="muted small">${KIND[b.kind] || b.kind}${b.via && b.kind !== "current" ? ` · ${b.via}` : ""}</span></label>`)}
          </fieldset>` : null}
        <//>
        <${Section} title="2 · Start the agent" id="enroll-agent">
          <p>On a board, a laptop or a phone with Termux (<code>pkg install python</code>), one line fetches the agent from this
            collector and starts it:</p>
          <${Command} text=${pick.command} what="command" />
          <p class="hint">Add <code>${"--pool <name>"}</code> to put it in a pool. For a service that starts at boot, see the agent's docs.</p>
          <h3 class="sub">Android runner app</h3>
          <${Runner} apk=${d.runner_apk} app=${d.runner_app} pinnedOnly=${d.runner_pinned_only} />
        <//>
      </div>
      <${Section} title="3 · Watch for it" id="enroll-watch">
        ${before ? html`<${Watch} before=${before} />` : null}
        ${d.pools.length ? html`<p class="hint">A device joins the pools its agent reports (<code>--pool</code>); you can override them on
          its page. Pools in use: ${d.pools.map((p) => html`<code>${p}</code> `)}</p>` : null}
      <//>`;
    }}<//>
  <//>`;
}
