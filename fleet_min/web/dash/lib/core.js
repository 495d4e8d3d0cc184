// One place that imports the vendored libraries, so screens import from here.
import { h, render, Fragment } from "../../vendor/preact/preact.module.js";
import {
  useState, useEffect, useRef, useCallback, useMemo, useReducer,
} from "../../vendor/preact/hooks.module.js";
import htm from "../../vendor/htm/htm.module.js";

export const html = htm.bind(h);
export { h, render, Fragment, useState, useEffect, useRef, useCallback, useMemo, useReducer };
