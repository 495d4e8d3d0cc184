// The browser's name and version, for the model of the device this page enrols.
//
// Chromium-based browsers list their brands in navigator.userAgentData.brands, plus a made-up
// "GREASE" brand ("Not;A=Brand", "Not A(Brand", "(Not(A:Brand", " Not;A Brand", ...) that exists
// only so that sites cannot depend on the list's exact shape: it is never the browser's name.
// GREASE brands mix "Not", "A" and "Brand" with punctuation real brand names do not carry.

const GREASE_PUNCTUATION = /[()/:;=?_]/;
const GREASE_WORDS = /^[^a-z]*not[^a-z]*a[^a-z]*brand[^a-z]*$/i;

export function isGrease(brand) {
  return GREASE_PUNCTUATION.test(brand) || GREASE_WORDS.test(brand);
}

// For browsers without client hints: the first of these tokens, in this order, that the user
// agent string carries (Edge and Opera also carry "Chrome/"; Chrome and Safari carry "Safari/").
const UA_TOKENS = [["Firefox", "Firefox"], ["Edg", "Microsoft Edge"], ["OPR", "Opera"],
  ["SamsungBrowser", "Samsung Internet"], ["Chrome", "Chrome"], ["Version", "Safari"]];

function fromUserAgent(userAgent) {
  for (const [token, name] of UA_TOKENS) {
    const m = new RegExp(`\\b${token}/(\\d+)`).exec(userAgent || "");
    if (m) return `${name} ${m[1]}`;
  }
  return null;
}

// A specific brand ("Google Chrome", "Microsoft Edge", "Opera") before "Chromium", the engine
// they share; "Chromium <version>" when that is all there is; then the user agent string for a
// browser without client hints; the platform when nothing names the browser.
export function browserModel(uaData, userAgent, platform) {
  const listed = Array.isArray(uaData?.brands) ? uaData.brands : [];
  const brands = listed.filter((b) => b && typeof b.brand === "string" && b.brand.trim() && !isGrease(b.brand));
  const chosen = brands.find((b) => b.brand.trim() !== "Chromium") || brands[0];
  if (chosen) return `${chosen.brand.trim()} ${chosen.version || ""}`.trim();
  if (!listed.length) {
    const named = fromUserAgent(userAgent);
    if (named) return named;
  }
  return uaData?.platform || platform || "browser";
}
