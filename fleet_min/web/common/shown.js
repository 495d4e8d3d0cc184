// Text as the pages show it. Stored free text (a result's error, a metric, a beacon's note, a
// spec member no rule covers) may carry the Unicode characters that reorder what follows them
// (U+202A-202E embeddings and overrides, U+2066-2069 isolates): "report\u202Efdp.exe" reads as
// "reportexe.pdf", and an override left open reverses the rest of its line. Names are refused
// them at the door (fleet_min/validate.py); everything else is shown with each such character
// written out as [U+202E], so the page shows what was sent, in the order it was sent.
const REORDERING = /[\u202A-\u202E\u2066-\u2069]/;
const EVERY_REORDERING = /[\u202A-\u202E\u2066-\u2069]/g;

// Attributes a person reads; values of form fields stay as they are, so saving a form never
// stores the written-out form instead of the character.
const READ_ATTRIBUTES = ["title", "alt", "aria-label", "placeholder"];

export function shown(text) {
  if (typeof text !== "string") return text;
  if (!REORDERING.test(text)) return text;
  return text.replace(EVERY_REORDERING, (c) => `[U+${c.charCodeAt(0).toString(16).toUpperCase()}]`);
}

function shownChild(child) {
  if (typeof child === "string") return shown(child);
  if (Array.isArray(child)) return child.map(shownChild);
  return child;
}

function shownProps(props) {
  if (!props) return props;
  let copy = null;
  for (const name of READ_ATTRIBUTES) {
    const value = props[name];
    if (typeof value === "string" && shown(value) !== value) {
      copy = copy || { ...props };
      copy[name] = shown(value);
    }
  }
  return copy || props;
}

// Wraps Preact's h for htm.bind: every text child and read attribute of every element the
// templates make passes through shown().
export function shownElements(h) {
  return (type, props, ...children) => h(type, shownProps(props), ...children.map(shownChild));
}
