// One place that imports the vendored libraries, so screens import from here.
import { h, render, Fragment } from "../../vendor/preact/preact.module.js";
import {
  useState, useEffect, useRef, useCallback, useMemo, useReducer,
} from "../../vendor/preact/hooks.module.js";
import htm from "../../vendor/htm/htm.module.js";
import { shown, shownElements } from "../../common/shown.js";

// Every element the templates make shows reordering characters written out (common/shown.js).
export const html = htm.bind(shownElements(h));
export { shown };
export { h, render, Fragment, useState, useEffect, useRef, useCallback, useMemo, useReducer };
