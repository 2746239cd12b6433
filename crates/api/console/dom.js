// Building the page: elements from data, never HTML from strings, so every value shown is
// text. Small formatting helpers for times and JSON.

/**
 * h("a", {href: "#/runs", class: "x", onclick: fn}, "text", child, ...): an element.
 * Attributes starting with "on" become listeners; `text` sets textContent; false/null
 * attributes and children are left out.
 */
export function h(tag, attrs, ...children) {
  const el = tag === "svg" || SVG_TAGS.has(tag)
    ? document.createElementNS("http://www.w3.org/2000/svg", tag)
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = String(v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "value" && "value" in el && !(el instanceof SVGElement)) el.value = v;
    else if (k === "checked" || k === "disabled" || k === "selected") el[k] = Boolean(v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

const SVG_TAGS = new Set(["g", "rect", "path", "text", "tspan", "title", "defs", "marker", "line", "circle"]);

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else if (c instanceof Node) el.appendChild(c);
    else el.appendChild(document.createTextNode(String(c)));
  }
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function replace(el, ...children) {
  clear(el);
  append(el, children);
  return el;
}

/** A table with a caption, column headers (`<th scope="col">`) and rows of cells. */
export function table(caption, columns, rows, { className = "" } = {}) {
  return h("div", { class: "table-wrap", tabindex: "0", role: "region", "aria-label": caption },
    h("table", { class: className },
      h("caption", { class: "visually-hidden", text: caption }),
      h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col", text: c })))),
      h("tbody", {}, rows)));
}

/** An id short enough for a table: its start (what a prefix search takes) and its end, which
 * tells apart ids made in the same millisecond (UUIDv7 ids start with their time). */
export function shortId(id) {
  const s = String(id || "");
  return s.length > 16 ? `${s.slice(0, 8)}…${s.slice(-4)}` : s;
}

export function json(value) {
  return JSON.stringify(value, null, 2);
}

/** "3 s", "4 min", "2 h 5 min", "3 d" for milliseconds. */
export function duration(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return "–";
  const neg = ms < 0;
  let s = Math.round(Math.abs(ms) / 1000);
  let out;
  if (s < 60) out = `${s} s`;
  else if (s < 3600) out = `${Math.floor(s / 60)} min${s % 60 && s < 600 ? ` ${s % 60} s` : ""}`;
  else if (s < 86400) {
    const m = Math.floor((s % 3600) / 60);
    out = `${Math.floor(s / 3600)} h${m ? ` ${m} min` : ""}`;
  } else out = `${Math.floor(s / 86400)} d`;
  return neg ? `-${out}` : out;
}

export function ago(ts) {
  if (!ts) return "–";
  const ms = Date.now() - Date.parse(ts);
  return ms < 0 ? "just now" : `${duration(ms)} ago`;
}

export function until(ts) {
  if (!ts) return "–";
  const ms = Date.parse(ts) - Date.now();
  return ms >= 0 ? `in ${duration(ms)}` : `${duration(-ms)} ago`;
}

/** A <time> with the local date and time, and the ISO instant as its datetime and title. */
export function time(ts, relative = ago) {
  if (!ts) return h("span", { class: "muted", text: "–" });
  const d = new Date(ts);
  return h("time", { datetime: ts, title: d.toLocaleString() }, relative(ts));
}

export function badge(text, kind = text) {
  return h("span", { class: `badge badge-${String(kind).replace(/[^a-z0-9_-]/gi, "")}`, text });
}

export function dl(pairs) {
  return h("dl", { class: "facts" }, pairs.filter(Boolean).map(([k, v]) => [
    h("dt", { text: k }),
    h("dd", {}, v === null || v === undefined || v === "" ? h("span", { class: "muted", text: "–" }) : v),
  ]));
}

export function pre(value, className = "json") {
  return h("pre", { class: className, tabindex: "0" }, typeof value === "string" ? value : json(value));
}

export function section(title, ...children) {
  const id = `sec-${title.toLowerCase().replace(/[^a-z0-9]+/g, "-")}`;
  return h("section", { class: "panel", "aria-labelledby": id }, h("h2", { id, text: title }), children);
}

export const UUID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
