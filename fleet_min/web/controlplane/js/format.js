// Small formatters: durations, times, sizes, percentages, counts. Missing values read as an
// en dash; nothing here ever returns JSON, "undefined", "null" or "NaN" for a person to read.

export const DASH = "–";

const missing = (v) => v === null || v === undefined || v === "" || (typeof v === "number" && !Number.isFinite(v));
// Only a number or a string is read as a figure: String() or Number() of an object an agent
// sent (`{"toString": null}`) throws, and one throw blanked a whole table.
const unreadable = (v) => typeof v !== "number" && typeof v !== "string";

// Seconds as a person says them: "45 s", "7 min 37 s", "2 h 5 min", "3 d 4 h".
export function dur(seconds) {
  if (missing(seconds) || unreadable(seconds) || Number.isNaN(Number(seconds))) return DASH;
  const s = Math.round(Number(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min${s % 60 ? ` ${s % 60} s` : ""}`;
  if (s < 86400) return `${Math.floor(s / 3600)} h${Math.floor((s % 3600) / 60) ? ` ${Math.floor((s % 3600) / 60)} min` : ""}`;
  return `${Math.floor(s / 86400)} d${Math.floor((s % 86400) / 3600) ? ` ${Math.floor((s % 86400) / 3600)} h` : ""}`;
}

// A span for "… ago": seconds only under a minute, then minutes, hours and minutes, days and
// hours ("45 s", "12 min", "2 h 5 min", "3 d 4 h"); the exact time is in the title.
function roughly(seconds) {
  return seconds < 3600 && seconds >= 60 ? `${Math.floor(seconds / 60)} min` : dur(seconds);
}

function epochMs(t) {
  if (missing(t)) return NaN;
  return typeof t === "number" ? t * 1000 : Date.parse(t);
}

// An instant relative to now: "just now", "3 min ago", "in 20 min".
export function ago(t, now = Date.now()) {
  const ms = epochMs(t);
  if (Number.isNaN(ms)) return DASH;
  const s = (now - ms) / 1000;
  if (Math.abs(s) < 5) return "just now";
  return s > 0 ? `${roughly(s)} ago` : `in ${roughly(-s)}`;
}

// The exact local time, for a title: "26/11/2026, 07:39:14".
export function when(t) {
  const ms = epochMs(t);
  return Number.isNaN(ms) ? DASH : new Date(ms).toLocaleString();
}

// A local clock time for labels: "07:00", with the date too when it is not today.
export function clock(t) {
  const ms = epochMs(t);
  if (Number.isNaN(ms)) return DASH;
  const d = new Date(ms);
  const time = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  return d.toDateString() === new Date().toDateString() ? time
    : `${d.toLocaleDateString([], { day: "numeric", month: "short" })} ${time}`;
}

export function mb(value) {
  if (missing(value)) return DASH;
  return value >= 1024 ? `${(value / 1024).toFixed(1)} GiB` : `${value} MiB`;
}

export function bytes(value) {
  if (missing(value)) return DASH;
  if (value < 1024) return `${value} B`;
  if (value < 1024 * 1024) return `${(value / 1024).toFixed(1)} KiB`;
  return mb(Math.round(value / 1024 / 1024));
}

export function kb(value) {
  return missing(value) ? DASH : mb(Math.round(value / 1024));
}

// A value already in per cent: "12.5 %".
export function pct(value, digits = 0) {
  return missing(value) || unreadable(value) || Number.isNaN(Number(value)) ? DASH : `${Number(value).toFixed(digits)} %`;
}

// A fraction from 0 to 1 as per cent: 0.0712 -> "7.1 %".
export function share(fraction, digits = 1) {
  return missing(fraction) || unreadable(fraction) ? DASH : pct(100 * fraction, digits);
}

export function num(value, digits = 2) {
  if (missing(value) || unreadable(value)) return DASH;
  if (typeof value === "string") return value;
  return Number.isInteger(value) ? value.toLocaleString() : value.toFixed(digits);
}

// A message as a sentence: a capital first letter and a full stop ("no recorded jobs of
// octo/app ..." -> "No recorded jobs of octo/app ....").
export function sentence(text) {
  const t = String(text ?? "").trim();
  if (!t) return "";
  return `${t.charAt(0).toUpperCase()}${t.slice(1)}${/[.!?…)]$/.test(t) ? "" : "."}`;
}

// "1 job", "3 jobs".
export function plural(n, one, many = `${one}s`) {
  return `${num(n)} ${n === 1 ? one : many}`;
}

const SECONDS_KEY = /(^|_)(s|sec|seconds)$/i;

// A value of unknown shape (a field a newer daemon adds): scalars as text, a list as a
// comma-separated line, an object as "name value" pairs, so a person never reads JSON.
export function any(value, key = "", depth = 0) {
  if (missing(value)) return DASH;
  if (typeof value === "number") return SECONDS_KEY.test(key) ? dur(value) : num(value);
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (Array.isArray(value)) return value.length ? value.map((v) => any(v, key, depth + 1)).join(", ") : "none";
  if (typeof value === "object") {
    if (depth > 1) return "…";
    const pairs = Object.entries(value).map(([k, v]) => `${k.replaceAll("_", " ")} ${any(v, SECONDS_KEY.test(k) ? k : key, depth + 1)}`);
    return pairs.length ? pairs.join(", ") : "none";
  }
  return String(value);
}
