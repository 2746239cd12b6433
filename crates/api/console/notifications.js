// #/notifications: the webhooks and their recent deliveries (needs the operate scope).

import { api, qs } from "/console/api.js";
import { h, replace, table, time, until, badge, shortId } from "/console/dom.js";
import { showError, may } from "/console/app.js";

export function notificationsPage(main) {
  const ctl = new AbortController();
  main.append(h("div", { class: "page-head" }, h("h1", { text: "Notifications" })));
  if (!may("operate")) {
    main.append(h("p", { class: "notice", text: "Webhooks and their deliveries need the operate scope." }));
    return null;
  }
  const hooks = h("div", { id: "webhooks" }, h("p", { class: "muted", text: "Loading…" }));
  const deliveries = h("div", { id: "deliveries" }, h("p", { class: "muted", text: "Loading…" }));
  const body = h("div", { id: "notifications" },
    h("section", { class: "panel wide", "aria-labelledby": "sec-hooks" }, h("h2", { id: "sec-hooks", text: "Webhooks" }), hooks),
    h("section", { class: "panel wide", "aria-labelledby": "sec-deliveries" }, h("h2", { id: "sec-deliveries", text: "Recent deliveries" }), deliveries));
  main.append(body);

  const missing = (e) => e.status === 404 || e.status === 405;
  const unavailable = () => h("p", { class: "notice", id: "notifications-unavailable", text: "Notifications are not available on this server." });

  (async () => {
    try {
      const rows = await api("/v1/webhooks", { signal: ctl.signal });
      const list = Array.isArray(rows) ? rows : (rows && rows.webhooks) || [];
      replace(hooks, list.length ? table("Webhooks", ["Id", "URL", "Kinds", "Definition", "Queue", "Created"], list.map((w) => h("tr", { "data-webhook-id": w.webhook_id },
        h("td", { class: "mono", title: w.webhook_id, text: shortId(w.webhook_id) }),
        h("td", { class: "mono url", text: w.url }),
        h("td", { text: (w.kinds || []).join(", ") || "all" }),
        h("td", { text: w.definition || "any" }),
        h("td", { text: w.queue || "any" }),
        h("td", {}, time(w.created_at)))))
        : h("p", { class: "empty", text: "No webhooks." }));
    } catch (e) {
      if (e.name === "AbortError") return;
      if (missing(e)) {
        replace(body, unavailable());
        return;
      }
      replace(hooks, "");
      showError(e, "Cannot list the webhooks");
    }
    try {
      const rows = await api(`/v1/webhooks/deliveries${qs({ limit: 50 })}`, { signal: ctl.signal });
      const list = Array.isArray(rows) ? rows : (rows && rows.deliveries) || [];
      replace(deliveries, list.length ? table("Deliveries", ["Delivery", "Webhook", "Kind", "Run", "Status", "Attempts", "Last answer", "Created", "Delivered / next try"],
        list.map((d) => h("tr", { "data-delivery-id": d.delivery_id, "data-status": d.status, "data-webhook-id": d.webhook_id },
          h("td", { class: "mono", title: d.delivery_id, text: shortId(d.delivery_id) }),
          h("td", { class: "mono", title: d.url || "", text: shortId(d.webhook_id) }),
          h("td", { class: "mono", text: d.kind }),
          h("td", {}, d.run_id ? h("a", { href: `#/runs/${d.run_id}`, class: "mono", text: shortId(d.run_id) }) : "–"),
          h("td", {}, badge(d.status, `dl-${d.status}`)),
          h("td", { class: "num", text: d.attempts }),
          h("td", { text: [d.last_status_code, d.last_error].filter((x) => x !== null && x !== undefined && x !== "").join(" · ") || "–" }),
          h("td", {}, time(d.created_at)),
          h("td", {}, d.delivered_at ? time(d.delivered_at) : d.next_attempt_at ? time(d.next_attempt_at, until) : "–"))))
        : h("p", { class: "empty", text: "No deliveries yet." }));
    } catch (e) {
      if (e.name === "AbortError") return;
      replace(deliveries, missing(e) ? unavailable() : "");
      if (!missing(e)) showError(e, "Cannot list the deliveries");
    }
  })();
  return () => ctl.abort();
}
