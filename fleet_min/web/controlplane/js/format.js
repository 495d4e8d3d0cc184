// Small formatters: durations, ages, sizes, percentages. Missing values read as an en dash.

export const DASH = "–";

export function dur(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return DASH;
  const s = Math.round(Number(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60 ? `${s % 60} s` : ""}`.trim();
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

export function ago(iso, now = Date.now()) {
  if (!iso) return DASH;
  const t = typeof iso === "number" ? iso * 1000 : Date.parse(iso);
  if (Number.isNaN(t)) return String(iso);
  const s = Math.max(0, (now - t) / 1000);
  return s < 5 ? "just now" : `${dur(s)} ago`;
}

export function when(iso) {
  if (!iso) return DASH;
  const t = typeof iso === "number" ? new Date(iso * 1000) : new Date(iso);
  return Number.isNaN(t.getTime()) ? String(iso) : t.toLocaleString();
}

export function mb(value) {
  if (value === null || value === undefined) return DASH;
  return value >= 1024 ? `${(value / 1024).toFixed(1)} GiB` : `${value} MiB`;
}

export function bytes(value) {
  if (value === null || value === undefined) return DASH;
  if (value < 1024) return `${value} B`;
  if (value < 1024 * 1024) return `${(value / 1024).toFixed(1)} KiB`;
  return mb(Math.round(value / 1024 / 1024));
}

export function kb(value) {
  return value === null || value === undefined ? DASH : mb(Math.round(value / 1024));
}

export function pct(value, digits = 0) {
  return value === null || value === undefined || Number.isNaN(value) ? DASH : `${Number(value).toFixed(digits)} %`;
}

export function num(value, digits = 2) {
  if (value === null || value === undefined || value === "") return DASH;
  if (typeof value !== "number") return String(value);
  return Number.isInteger(value) ? String(value) : value.toFixed(digits);
}

// A value of unknown shape, for the generic tables of endpoints whose fields may change.
export function any(value) {
  if (value === null || value === undefined) return DASH;
  if (typeof value === "number") return num(value);
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (Array.isArray(value) && value.every((v) => typeof v !== "object" || v === null)) return value.join(", ");
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}
