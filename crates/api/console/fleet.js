// #/fleet: workers and schedulers with their heartbeats and leases, refreshed every 2 s.

import { api } from "/console/api.js";
import { h, replace, table, time, duration, badge } from "/console/dom.js";
import { showError } from "/console/app.js";

const REFRESH_MS = 2000;

export function fleetPage(main) {
  const ctl = new AbortController();
  let timer = null;
  const body = h("div", { id: "fleet", "aria-busy": "true" }, h("p", { class: "muted", text: "Loading…" }));
  main.append(h("div", { class: "page-head" }, h("h1", { text: "Fleet" })), body);

  async function load() {
    try {
      const rows = await api("/v1/workers", { signal: ctl.signal });
      render(rows || []);
    } catch (e) {
      if (e.name === "AbortError") return;
      showError(e, "Cannot list the fleet");
    }
    body.setAttribute("aria-busy", "false");
    if (!ctl.signal.aborted) timer = setTimeout(() => (document.visibilityState === "visible" ? load() : (timer = setTimeout(load, REFRESH_MS))), REFRESH_MS);
  }

  function render(rows) {
    if (!rows.length) {
      replace(body, h("p", { class: "empty", text: "No worker or scheduler has sent a heartbeat." }));
      return;
    }
    replace(body, table("Workers and schedulers", ["Role", "Id", "Started", "Heartbeat", "Leases held", "Leader", "Reports"],
      rows.map((w) => {
        const silent = w.silent_ms;
        const stale = silent > 30000;
        const info = w.info && typeof w.info === "object" ? w.info : {};
        const reports = Object.entries(info).slice(0, 6).map(([k, v]) => `${k}: ${typeof v === "object" ? JSON.stringify(v) : v}`).join("; ");
        return h("tr", { dataset: { workerId: w.worker_id, role: w.role } },
          h("td", {}, badge(w.role, `role-${w.role}`)),
          h("td", { class: "mono", text: w.worker_id }),
          h("td", {}, time(w.started_at)),
          h("td", { class: stale ? "warn" : "" }, `silent for ${duration(silent)}`),
          h("td", { class: "num", text: w.leases_held }),
          h("td", {}, w.leader ? badge("leader", "leader") : h("span", { class: "muted", text: "–" })),
          h("td", { class: "muted small", text: reports || "–" }));
      })));
  }

  load();
  return () => { ctl.abort(); clearTimeout(timer); };
}
