// A definition's state machine as SVG: states in layers by breadth-first distance from the
// initial state, transitions as arrows labelled with their events; the path a run took is
// marked and its current state stands out.

import { h } from "/console/dom.js";

const BOX_H = 34;
const GAP_X = 36;
const GAP_Y = 78;
const PAD = 24;
const CHAR_W = 7.4;

/**
 * Replays `events` (the run's log, in order) over `spec`'s transitions: the transitions
 * taken (keys "from\u0000event\u0000to") and the states visited.
 */
export function pathOf(spec, events) {
  const initial = (spec.states.find((s) => s.initial) || spec.states[0] || {}).name;
  const byFromEvent = new Map();
  for (const t of spec.transitions || []) {
    const k = `${t.from}\u0000${t.event}`;
    if (!byFromEvent.has(k)) byFromEvent.set(k, []);
    byFromEvent.get(k).push(t);
  }
  const taken = new Set();
  const visited = new Set(initial ? [initial] : []);
  let at = initial;
  for (const e of events) {
    const options = byFromEvent.get(`${at}\u0000${e.type}`);
    if (options && options.length) {
      const t = options[0];
      taken.add(`${t.from}\u0000${t.event}\u0000${t.to}`);
      at = t.to;
      visited.add(at);
    } else if (e.type === "CANCEL" && spec.cancel_state && at !== spec.cancel_state) {
      taken.add(`${at}\u0000CANCEL\u0000${spec.cancel_state}`);
      at = spec.cancel_state;
      visited.add(at);
    }
  }
  return { taken, visited };
}

export function stateDiagram(spec, { current, events = [] }) {
  const states = spec.states || [];
  const names = states.map((s) => s.name);
  const kind = new Map(states.map((s) => [s.name, s.kind]));
  const initial = (states.find((s) => s.initial) || states[0] || {}).name;
  const { taken, visited } = pathOf(spec, events);
  if (current) visited.add(current);

  // Edges grouped by (from, to); the cancel edge only where the run took it.
  const edges = new Map();
  const addEdge = (from, to, event) => {
    if (!kind.has(from) || !kind.has(to)) return;
    const k = `${from}\u0000${to}`;
    if (!edges.has(k)) edges.set(k, { from, to, events: [] });
    edges.get(k).events.push({ event, taken: taken.has(`${from}\u0000${event}\u0000${to}`) });
  };
  for (const t of spec.transitions || []) addEdge(t.from, t.to, t.event);
  for (const key of taken) {
    const [from, event, to] = key.split("\u0000");
    if (event === "CANCEL") addEdge(from, to, event);
  }

  // Layers by BFS from the initial state; the unreachable (the cancel state) go last.
  const layer = new Map();
  if (initial) layer.set(initial, 0);
  const queue = initial ? [initial] : [];
  while (queue.length) {
    const s = queue.shift();
    for (const e of edges.values()) {
      if (e.from === s && !layer.has(e.to)) {
        layer.set(e.to, layer.get(s) + 1);
        queue.push(e.to);
      }
    }
  }
  const deepest = Math.max(0, ...layer.values());
  for (const n of names) if (!layer.has(n)) layer.set(n, deepest + 1);
  const rows = [];
  for (const n of names) {
    const l = layer.get(n);
    (rows[l] ||= []).push(n);
  }

  const width = (n) => Math.max(90, n.length * CHAR_W + 28);
  const rowWidth = (row) => row.reduce((w, n) => w + width(n), 0) + GAP_X * (row.length - 1);
  const totalW = Math.max(...rows.filter(Boolean).map(rowWidth), 200) + PAD * 2 + 120;
  const pos = new Map();
  rows.forEach((row, i) => {
    if (!row) return;
    let x = (totalW - rowWidth(row)) / 2;
    const y = PAD + i * (BOX_H + GAP_Y);
    for (const n of row) {
      pos.set(n, { x, y, w: width(n), cx: x + width(n) / 2 });
      x += width(n) + GAP_X;
    }
  });
  const totalH = PAD * 2 + rows.length * BOX_H + (rows.length - 1) * GAP_Y + 10;

  const svg = h("svg", { class: "diagram", viewBox: `0 0 ${Math.ceil(totalW)} ${Math.ceil(totalH)}`, width: Math.ceil(totalW),
    role: "img", "aria-labelledby": "diagram-title", xmlns: "http://www.w3.org/2000/svg" });
  svg.appendChild(h("title", { id: "diagram-title" }, `State diagram of ${spec.name}@${spec.version}${current ? `; the run is in ${current}` : ""}`));
  svg.appendChild(h("defs", {},
    h("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" },
      h("path", { d: "M0,0 L10,5 L0,10 z", class: "arrow-head" })),
    h("marker", { id: "arrow-taken", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" },
      h("path", { d: "M0,0 L10,5 L0,10 z", class: "arrow-head taken" }))));

  const edgeLayer = h("g", { class: "edges" });
  const labelLayer = h("g", { class: "labels" });
  let bend = 0;
  for (const e of edges.values()) {
    const a = pos.get(e.from);
    const b = pos.get(e.to);
    const took = e.events.some((x) => x.taken);
    const cls = took ? "edge taken" : "edge";
    let d;
    let lx;
    let ly;
    if (e.from === e.to) {
      const x = a.x + a.w;
      const y = a.y + BOX_H / 2;
      d = `M${x},${y - 8} C${x + 46},${y - 34} ${x + 46},${y + 34} ${x},${y + 8}`;
      lx = x + 40;
      ly = y - 22;
    } else if (b.y > a.y) {
      const x1 = a.cx + (b.cx - a.cx) * 0.15;
      const y1 = a.y + BOX_H;
      const x2 = b.cx;
      const y2 = b.y;
      const my = (y1 + y2) / 2;
      d = `M${x1},${y1} C${x1},${my} ${x2},${my} ${x2},${y2}`;
      lx = (x1 + x2) / 2;
      ly = my - 4;
    } else if (b.y < a.y) {
      // Back up a layer: out of the source's side, round into the target's side.
      const left = b.cx < a.cx;
      const x1 = left ? a.x : a.x + a.w;
      const y1 = a.y + BOX_H / 2;
      const x2 = left ? b.x : b.x + b.w;
      const y2 = b.y + BOX_H / 2;
      const out = (left ? -1 : 1) * (60 + (bend++ % 3) * 22);
      d = `M${x1},${y1} C${x1 + out},${y1} ${x2 + out},${y2} ${x2},${y2}`;
      lx = (x1 + x2) / 2 + out * 0.75;
      ly = (y1 + y2) / 2;
    } else {
      const right = b.x > a.x;
      const x1 = right ? a.x + a.w : a.x;
      const x2 = right ? b.x : b.x + b.w;
      const y = a.y + BOX_H / 2;
      d = `M${x1},${y} L${x2},${y}`;
      lx = (x1 + x2) / 2;
      ly = y - 8;
    }
    edgeLayer.appendChild(h("path", { d, class: cls, "marker-end": took ? "url(#arrow-taken)" : "url(#arrow)",
      dataset: { from: e.from, to: e.to, taken: took ? "true" : "false" } },
      h("title", {}, `${e.from} → ${e.to}: ${e.events.map((x) => x.event).join(", ")}`)));
    const label = h("text", { x: lx, y: ly - (e.events.length - 1) * 6, class: "edge-label", "text-anchor": "middle" });
    e.events.forEach((x, i) => label.appendChild(h("tspan", { x: lx, dy: i === 0 ? 0 : 12, class: x.taken ? "taken" : "" }, x.event)));
    labelLayer.appendChild(label);
  }
  svg.appendChild(edgeLayer);
  svg.appendChild(labelLayer);

  const nodes = h("g", { class: "nodes" });
  for (const n of names) {
    const p = pos.get(n);
    const classes = ["state", `state-${kind.get(n)}`];
    if (visited.has(n)) classes.push("visited");
    if (n === current) classes.push("current");
    if (n === initial) classes.push("initial");
    const g = h("g", { class: classes.join(" "), dataset: { state: n, current: n === current ? "true" : "false", visited: visited.has(n) ? "true" : "false" } },
      h("title", {}, `${n} (${kind.get(n)})${n === current ? ": the run is here" : visited.has(n) ? ": the run passed here" : ""}`),
      h("rect", { x: p.x, y: p.y, width: p.w, height: BOX_H, rx: kind.get(n) === "terminal" ? 16 : 5 }),
      h("text", { x: p.cx, y: p.y + BOX_H / 2 + 4, "text-anchor": "middle" }, n));
    nodes.appendChild(g);
  }
  svg.appendChild(nodes);
  return svg;
}
