// Minimal control-plane page: draws /api/state, follows /api/stream, posts actions.
// Everything is built with textContent (never innerHTML), so runner data cannot inject markup.
"use strict";

const $ = (id) => document.getElementById(id);
const tokenInput = $("token");
tokenInput.value = sessionStorage.getItem("fleet-token") || "";
tokenInput.addEventListener("change", () => sessionStorage.setItem("fleet-token", tokenInput.value));

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

async function act(id, name) {
  const out = $("result");
  out.hidden = false;
  out.textContent = `${id} ${name} …`;
  const response = await fetch("/api/action", {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${tokenInput.value}` },
    body: JSON.stringify({ id, args: { name } }),
  });
  const body = await response.json();
  out.textContent = body.ok ? `${id} ${name}: ok\n${body.output || ""}` : `${id} ${name}: ${body.error}`;
}

function runnerRow(r) {
  const row = el("tr");
  row.dataset.runner = r.name;
  row.append(el("td", r.name), el("td", r.repo || r.owner || ""),
    el("td", r.state, `state-${r.state}`), el("td", r.service.active),
    el("td", (r.labels || []).join(", ")), el("td", r.version || ""));
  const buttons = el("td");
  for (const [id, label] of [["runner.drain", "Drain"], ["runner.resume", "Resume"], ["runner.duplicate", "Duplicate"]]) {
    const button = el("button", label);
    button.addEventListener("click", () => act(id, r.name));
    buttons.append(button);
  }
  row.append(buttons);
  return row;
}

function render(snap) {
  $("host").textContent = snap.host ? snap.host.name : "?";
  $("runners").tBodies[0].replaceChildren(...(snap.runners || []).map(runnerRow));
  const cap = snap.capacity || {};
  $("capacity").textContent = `busy ${cap.busy ?? "?"} of ${cap.runners ?? "?"} runners, ceiling ${cap.ceiling ?? "?"}`
    + (cap.can_add === false ? ` — no room: ${cap.reasons.join("; ")}` : "");
  const alerts = [...(snap.drift || []), ...(snap.alerts || [])];
  $("alerts").replaceChildren(...alerts.map((a) => el("li", a.message, a.severity)));
  $("queue").replaceChildren(...(snap.queue_causes || []).map((q) => el("li", `${q.repo} #${q.run_id}: ${q.message}`)));
}

fetch("/api/state").then((r) => r.json()).then(render);
const source = new EventSource("/api/stream");
source.onopen = () => { $("live").textContent = "live"; $("live").classList.add("on"); };
source.onerror = () => { $("live").textContent = "reconnecting"; $("live").classList.remove("on"); };
source.onmessage = (event) => render(JSON.parse(event.data));
