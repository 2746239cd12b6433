// A definition's state machine as SVG: states in columns by breadth-first distance from
// the initial state, transitions as arrows labelled with their events; the path a run took is
// marked and its current state stands out.

import { h } from "/console/dom.js";

const BOX_H = 34;
const GAP_X = 170;
const GAP_Y = 52;
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

  // Columns are layers, left to right; a column's states are stacked and centred.
  const width = (n) => Math.max(96, n.length * CHAR_W + 28);
  const colW = Math.max(...names.map(width), 96);
  const tallest = Math.max(1, ...rows.filter(Boolean).map((r) => r.length));
  const totalH = PAD * 2 + 28 + tallest * BOX_H + (tallest - 1) * GAP_Y;
  const totalW = PAD * 2 + rows.length * colW + (rows.length - 1) * GAP_X;
  const pos = new Map();
  rows.forEach((row, i) => {
    if (!row) return;
    const colH = row.length * BOX_H + (row.length - 1) * GAP_Y;
    let y = PAD + 28 + (totalH - PAD * 2 - 28 - colH) / 2;
    for (const n of row) {
      const w = width(n);
      const x = PAD + i * (colW + GAP_X) + (colW - w) / 2;
      pos.set(n, { x, y, w, cx: x + w / 2, cy: y + BOX_H / 2 });
      y += BOX_H + GAP_Y;
    }
  });

  const svg = h("svg", { class: "diagram", viewBox: `0 0 ${Math.ceil(totalW)} ${Math.ceil(totalH)}`, width: Math.ceil(totalW),
    role: "img", "aria-labelledby": "diagram-title", xmlns: "http://www.w3.org/2000/svg" });
  svg.appendChild(h("title", { id: "diagram-title" }, `State diagram of ${spec.name}@${spec.version}${current ? `; the run is in ${current}` : ""}`));
  svg.appendChild(h("defs", {},
    h("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" },
      h("path", { d: "M0,0 L10,5 L0,10 z", class: "arrow-head" })),
    h("marker", { id: "arrow-taken", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" },
      h("path", { d: "M0,0 L10,5 L0,10 z", class: "arrow-head taken" }))));

  // Where the line from a box's centre towards (tx, ty) leaves the box.
  const exit = (p, tx, ty) => {
    const dx = tx - p.cx;
    const dy = ty - p.cy;
    const k = Math.min(dx ? (p.w / 2 + 2) / Math.abs(dx) : Infinity, dy ? (BOX_H / 2 + 2) / Math.abs(dy) : Infinity);
    return [p.cx + dx * k, p.cy + dy * k];
  };
  const edgeLayer = h("g", { class: "edges" });
  const labelLayer = h("g", { class: "labels" });
  for (const e of edges.values()) {
    const a = pos.get(e.from);
    const b = pos.get(e.to);
    const took = e.events.some((x) => x.taken);
    let d;
    let lx;
    let ly;
    let anchor = "middle";
    if (e.from === e.to) {
      // A loop over the box's top.
      const x1 = a.cx - 14;
      const x2 = a.cx + 14;
      d = `M${x1},${a.y} C${x1 - 10},${a.y - 34} ${x2 + 10},${a.y - 34} ${x2},${a.y}`;
      lx = a.cx;
      ly = a.y - 30 - (e.events.length - 1) * 12;
    } else {
      // A curve bowed to its left, so that A→B and B→A are apart.
      const dx = b.cx - a.cx;
      const dy = b.cy - a.cy;
      const len = Math.hypot(dx, dy) || 1;
      const bow = Math.min(40, 14 + len * 0.08);
      const nx = dy / len;
      const ny = -dx / len;
      const mx = (a.cx + b.cx) / 2 + nx * bow;
      const my = (a.cy + b.cy) / 2 + ny * bow;
      const [x1, y1] = exit(a, mx, my);
      const [x2, y2] = exit(b, mx, my);
      d = `M${x1},${y1} Q${mx},${my} ${x2},${y2}`;
      // The label sits on the curve, past its middle (nearer the target, where curves
      // from one state have spread apart).
      const t = a.cx === b.cx ? 0.5 : 0.6;
      lx = (1 - t) * (1 - t) * x1 + 2 * (1 - t) * t * mx + t * t * x2;
      ly = (1 - t) * (1 - t) * y1 + 2 * (1 - t) * t * my + t * t * y2 - 4;
      if (a.cx === b.cx) {
        anchor = nx > 0 ? "start" : "end";
        lx += nx * 6;
      }
      ly -= ((e.events.length - 1) * 12) / 2;
    }
    edgeLayer.appendChild(h("path", { d, class: took ? "edge taken" : "edge", "marker-end": took ? "url(#arrow-taken)" : "url(#arrow)",
      dataset: { from: e.from, to: e.to, taken: took ? "true" : "false" } },
      h("title", {}, `${e.from} → ${e.to}: ${e.events.map((x) => x.event).join(", ")}`)));
    const label = h("text", { x: lx, y: ly, class: "edge-label", "text-anchor": anchor });
    e.events.forEach((x, i) => label.appendChild(h("tspan", { x: lx, dy: i === 0 ? 0 : 12, class: x.taken ? "taken" : "" }, x.event)));
    labelLayer.appendChild(label);
  }
  svg.appendChild(edgeLayer);

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
  svg.appendChild(labelLayer);
  return svg;
}
