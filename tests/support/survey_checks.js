// What tests/support/survey.py checks inside a page. One object of functions, evaluated in the
// page by name: survey.py runs `(CHECKS)[name](arg)`.
({
  // The document must never scroll sideways: [scrollWidth, clientWidth] when it does.
  sideways() {
    const root = document.documentElement;
    return root.scrollWidth > root.clientWidth ? [root.scrollWidth, root.clientWidth] : null;
  },

  // Raw data that leaked into what a person reads; JSON is fine inside <pre> and <code>. With
  // times: true an ISO timestamp ("2026-11-26T03:39:14Z") counts as raw too: times are for
  // reading as "3 min ago" or a local date, the exact one in a title.
  visibleRaw({ times = false } = {}) {
    const raw = times ? /\b(undefined|NaN|null|None)\b|\[object Object\]|\{"|\b\d{4}-\d\d-\d\dT\d\d:\d\d/
      : /\b(undefined|NaN|null|None)\b|\[object Object\]|\{"/;
    const found = [];
    const look = (text, where) => {
      const m = raw.exec(text || "");
      if (m) found.push(`${where}: ${JSON.stringify(m[0])} in ${JSON.stringify(text.trim().slice(0, 140))}`);
    };
    look(document.title, "title");
    const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    for (let node = walk.nextNode(); node; node = walk.nextNode()) {
      const el = node.parentElement;
      if (!el || el.closest("pre, code, script, style, noscript, textarea, template")) continue;
      if (!el.checkVisibility({ visibilityProperty: true })) continue;
      look(node.textContent, `text in <${el.tagName.toLowerCase()}>`);
    }
    for (const el of document.body.querySelectorAll("[title], [aria-label], [placeholder], input")) {
      if (!el.checkVisibility()) continue;
      const tag = el.tagName.toLowerCase();
      for (const name of ["title", "aria-label", "placeholder"]) look(el.getAttribute(name), `${name} of <${tag}>`);
      if (tag === "input" && el.type !== "password") look(el.value, "value of <input>");
    }
    return found;
  },

  // Text cut short with an ellipsis must carry its whole value as a title (on it or around it).
  cutText() {
    return [...document.body.querySelectorAll("*")]
      .filter((el) => el.scrollWidth > el.clientWidth + 1 && el.checkVisibility()
        && getComputedStyle(el).textOverflow === "ellipsis" && !el.closest("[title]"))
      .map((el) => `text cut without its full value as a title: ${JSON.stringify(el.textContent.trim().slice(0, 80))}`);
  },

  // A table wider than its box scrolls inside the box and keeps its first column in view.
  keptColumn() {
    return [...document.querySelectorAll("table")].filter((table) => table.checkVisibility())
      .filter((table) => {
        const box = table.parentElement;
        return box.scrollWidth > box.clientWidth + 1 && getComputedStyle(box).overflowX !== "visible";
      })
      .filter((table) => {
        const cell = table.querySelector("tbody tr > :first-child");
        return cell && getComputedStyle(cell).position !== "sticky";
      })
      .map((table) => `a table scrolls sideways without keeping its first column: ${JSON.stringify(
        (table.querySelector("th")?.textContent || table.textContent).trim().slice(0, 40))}`);
  },

  // Boxes that must show all of their content without scrolling sideways.
  clipped(selector) {
    return [...document.querySelectorAll(selector)]
      .filter((el) => el.scrollWidth > el.clientWidth + 1)
      .map((el) => `${selector} needs ${el.scrollWidth} px and has ${el.clientWidth} px`);
  },

  // Chart labels a person reads: page text, whole (or with a title), each in its own place.
  labels(selector) {
    const shown = [...document.querySelectorAll(selector)].filter((el) => el.checkVisibility());
    if (!shown.length) return [`no chart label (${selector}) shows as page text`];
    const name = (el) => JSON.stringify(el.textContent.trim());
    const found = shown.filter((el) => el.scrollWidth > el.clientWidth + 1 && !el.closest("[title]"))
      .map((el) => `label cut: ${name(el)}`);
    const boxes = shown.map((el) => el.getBoundingClientRect());
    const overlap = (a, b) => a.left < b.right - 1 && b.left < a.right - 1
      && a.top < b.bottom - 1 && b.top < a.bottom - 1;
    for (let i = 0; i < boxes.length; i += 1) {
      for (let j = i + 1; j < boxes.length; j += 1) {
        if (overlap(boxes[i], boxes[j])) found.push(`labels overlap: ${name(shown[i])} and ${name(shown[j])}`);
      }
    }
    return found;
  },
})
