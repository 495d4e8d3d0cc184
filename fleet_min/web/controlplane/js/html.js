// One place that binds the vendored Preact and htm: views write html`<div>${x}</div>`.
// Text goes through Preact as text nodes, never as markup, so runner data cannot inject HTML.
import { h, render, Fragment } from "../vendor/preact/preact.module.js";
import htm from "../vendor/htm/htm.module.js";
import { shown, shownElements } from "../common/shown.js";

export { h, render, Fragment };
export {
  useState, useEffect, useRef, useMemo, useCallback, useLayoutEffect,
} from "../vendor/preact/hooks.module.js";
// Every element the templates make shows reordering characters written out (common/shown.js).
export const html = htm.bind(shownElements(h));
export { shown };
