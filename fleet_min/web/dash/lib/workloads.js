// Workload names from the spec, for suggestions (the set is open: anything may be typed).
import { html } from "./core.js";

export const DEVICE_WORKLOADS = [
  "benchmark", "thermal", "batch", "pipeline", "vision-eval", "speech-eval", "embed-eval",
  "vantage", "model-convert", "dataset-prep", "serve", "shell", "self-check", "build", "llm-eval",
];
export const HOST_WORKLOADS = [
  "install", "ui-test", "cold-start", "app-soak", "a11y-audit", "locale-shots", "web-test",
  "web-shots", "web-audit", "web-unfurl", "drain", "archive", "digest", "soak",
];
export const BACKENDS = ["synthetic", "jssha", "webcrypto", "llama.cpp"];

export function WorkloadList() {
  return html`<datalist id="workloads">${[...DEVICE_WORKLOADS, ...HOST_WORKLOADS].map((w) => html`<option value=${w} />`)}</datalist>
    <datalist id="backends">${BACKENDS.map((b) => html`<option value=${b} />`)}</datalist>`;
}
