// Reading responses whose exact fields are still settling (the analysis endpoints): find the
// per-item rows and the numeric columns worth charting, whatever the keys are called.

const isRow = (x) => x && typeof x === "object" && !Array.isArray(x);

// The first list of objects under one of `keys` (or anywhere at the top level); an object
// keyed by name ({"octo/app": {...}}) becomes rows with that name under `nameKey`.
export function rowsOf(data, keys = [], nameKey = "repo") {
  if (Array.isArray(data)) return data.filter(isRow);
  if (!isRow(data)) return [];
  const candidates = [...keys, ...Object.keys(data)];
  for (const key of candidates) {
    const value = data[key];
    if (Array.isArray(value) && value.length && value.every(isRow)) return value;
    if (keys.includes(key) && isRow(value) && Object.values(value).every(isRow) && Object.keys(value).length) {
      return Object.entries(value).map(([name, row]) => ({ [nameKey]: name, ...row }));
    }
  }
  return [];
}

export function labelOf(row, keys = ["repo", "name", "host", "key", "id"]) {
  for (const key of keys) if (row[key] !== undefined && row[key] !== null) return String(row[key]);
  return "?";
}

// Columns holding numbers in most rows, in their first-seen order, optionally filtered.
export function numericColumns(rows, test = () => true) {
  const keys = [...new Set(rows.flatMap((r) => Object.keys(r)))];
  return keys.filter((k) => test(k) && rows.filter((r) => typeof r[k] === "number").length >= Math.ceil(rows.length / 2));
}

export const isDuration = (k) => /(_s|_sec|_seconds|_ms)$/.test(k) || /p\d\d|median|mean|avg|duration|wait|queue/i.test(k);
export const isRate = (k) => /rate|pct|percent|share|ratio/i.test(k);
export const msToS = (k, v) => (typeof v === "number" && /_ms$/.test(k) ? v / 1000 : v);
