// Formatting of times, sizes and numbers for display. API times are UTC ISO-8601 with Z.

export function parseTime(iso) {
  if (!iso) return null;
  const t = Date.parse(iso);
  return Number.isNaN(t) ? null : t;
}

export function localTime(iso) {
  const t = parseTime(iso);
  if (t === null) return "";
  return new Date(t).toLocaleString(undefined, {
    year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
    second: "2-digit",
  });
}

export function duration(seconds) {
  const s = Math.abs(seconds);
  if (s < 1) return "now";
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  if (s < 86400 * 2) return `${(s / 3600).toFixed(s < 36000 ? 1 : 0)} h`;
  return `${Math.round(s / 86400)} d`;
}

export function relative(iso, now = Date.now()) {
  const t = parseTime(iso);
  if (t === null) return "–";
  const delta = (t - now) / 1000;
  if (Math.abs(delta) < 1) return "just now";
  return delta < 0 ? `${duration(delta)} ago` : `in ${duration(delta)}`;
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n);
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${v} B` : `${v.toFixed(v < 10 ? 2 : 1)} ${units[i]}`;
}

export function num(v, digits = 1) {
  if (v === null || v === undefined || v === "") return "–";
  if (typeof v !== "number") return String(v);
  if (!Number.isFinite(v)) return "–";
  if (Number.isInteger(v)) return v.toLocaleString();
  return v.toLocaleString(undefined, { maximumFractionDigits: digits });
}

export function shortSha(sha) {
  return sha ? sha.slice(0, 12) : "–";
}

// One metric's value as text: numbers rounded, yes/no, a dash for nothing.
function metricValue(v) {
  if (typeof v === "number") return num(v, 3);
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (v === null || v === undefined || v === "") return "–";
  return String(v);
}

// Plain metrics as `name=value · ...`; nested values are left to the JSON of the row.
export function metricText(metrics) {
  if (!metrics || typeof metrics !== "object") return "";
  return Object.keys(metrics).sort()
    .filter((k) => typeof metrics[k] !== "object" || metrics[k] === null)
    .map((k) => `${k}=${metricValue(metrics[k])}`)
    .join(" · ");
}

// The collector's refusals are phrases ("no job 'x'"); on the screen they read as sentences.
export function sentence(text) {
  const t = String(text ?? "").trim();
  if (!t) return "Something went wrong, and the collector did not say what.";
  const first = t[0].toUpperCase() + t.slice(1);
  return /[.!?…]$/.test(first) ? first : `${first}.`;
}

export function plural(n, one, many = `${one}s`) {
  return `${n} ${n === 1 ? one : many}`;
}
