// #/runs: recent runs, filtered, paged by cursor, refreshed every 2 s while the tab shows.

import { api, qs, ApiError } from "/console/api.js";
import { h, replace, table, shortId, time, ago, badge, UUID_RE } from "/console/dom.js";
import { showError, clearAlerts } from "/console/app.js";

export const STATUSES = ["runnable", "parked", "needs_operator", "terminal"];
const REFRESH_MS = 2000;
const FILTERS = ["status", "state", "definition", "queue", "q"];
/** A run id's start, optionally with "…" and its end (a short id as the tables show it). */
const SEARCH_RE = /^[0-9a-f-]{1,36}(?:(?:…|\.\.\.?)[0-9a-f-]{1,36})?$/i;

export function runsPage(main, params) {
  const filters = {};
  for (const f of FILTERS) filters[f] = params.get(f) || "";
  const cursors = []; // cursors of the pages before the current one ("" for the first)
  let cursor = "";
  let page = null;
  let fetchedAt = null;
  let timer = null;
  let ticker = null;
  let gone = false;
  let inflight = null;

  const field = (name, label, input) => h("div", { class: "field" }, h("label", { for: `f-${name}`, text: label }), input);
  const status = h("select", { id: "f-status", name: "status" },
    h("option", { value: "", text: "any" }),
    STATUSES.map((s) => h("option", { value: s, text: s.replace("_", " "), selected: filters.status === s })));
  const text = (name, placeholder) => h("input", { id: `f-${name}`, name, type: "text", value: filters[name], placeholder, autocomplete: "off", spellcheck: "false" });
  const search = text("q", "full id or hex prefix");
  const form = h("form", { class: "filters", role: "search", "aria-label": "Filter runs" },
    field("q", "Run id", search),
    field("status", "Status", status),
    field("state", "State", text("state", "e.g. WAITING_APPROVAL")),
    field("definition", "Definition", text("definition", "e.g. refund-agent")),
    field("queue", "Queue", text("queue", "e.g. default")),
    h("div", { class: "field field-buttons" },
      h("button", { type: "submit", class: "button primary" }, "Apply"),
      h("a", { href: "#/runs", class: "button", text: "Clear" })));

  const body = h("div", { id: "runs-body", "aria-busy": "true" }, h("p", { class: "muted", text: "Loading runs…" }));
  const updated = h("span", { class: "muted updated", id: "runs-updated", "aria-live": "off" });
  const newer = h("button", { type: "button", class: "button", disabled: true, onclick: () => go(cursors.pop() ?? "") }, "← Newer");
  const next = h("button", { type: "button", class: "button", disabled: true, onclick: () => { cursors.push(cursor); go(page.next_cursor); } }, "Next page →");
  const pageNo = h("span", { class: "muted" });

  main.append(
    h("div", { class: "page-head" }, h("h1", { text: "Runs" }), updated),
    form,
    body,
    h("nav", { class: "pager", "aria-label": "Pages of runs" }, newer, pageNo, next));

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const values = Object.fromEntries(new FormData(form).entries());
    const q = (values.q || "").trim();
    if (UUID_RE.test(q)) {
      try {
        const run = await api(`/v1/runs/${encodeURIComponent(q.toLowerCase())}`);
        location.hash = `#/runs/${run.run_id}`;
      } catch (err) {
        showError(err, err.status === 404 ? `No run ${q}` : "Cannot open the run");
      }
      return;
    }
    if (q && !SEARCH_RE.test(q)) {
      showError(new ApiError(0, "validation_failed", "a run id is hexadecimal: type the whole id, its first characters, or a short id as the tables show it (start…end)"), "Search");
      return;
    }
    const next = new URLSearchParams();
    for (const f of FILTERS) if ((values[f] || "").trim()) next.set(f, values[f].trim());
    const hash = `#/runs${next.toString() ? `?${next}` : ""}`;
    if (location.hash === hash) go(cursor); else location.hash = hash;
  });
  status.addEventListener("change", () => form.requestSubmit());

  function searched() {
    const [start, end] = filters.q.toLowerCase().split(/…|\.\.\.?/);
    return { prefix: (start || "").replace(/-/g, ""), suffix: (end || "").replace(/-/g, "") };
  }

  function query(at) {
    const prefix = searched().prefix;
    return qs({ envelope: "true", limit: 50, status: filters.status, state: filters.state, definition: filters.definition,
      queue: filters.queue, id_prefix: prefix, cursor: at });
  }

  async function go(at) {
    cursor = at || "";
    await load(true);
  }

  async function load(user) {
    if (gone) return;
    if (inflight) inflight.abort();
    const ctl = new AbortController();
    inflight = ctl;
    try {
      page = await api(`/v1/runs${query(cursor)}`, { signal: ctl.signal });
      if (gone) return;
      fetchedAt = Date.now();
      render();
      if (user) clearAlerts();
    } catch (err) {
      if (err.name === "AbortError" || gone) return;
      showError(err, "Cannot list the runs");
      body.setAttribute("aria-busy", "false");
    } finally {
      if (inflight === ctl) inflight = null;
    }
    schedule();
  }

  function schedule() {
    clearTimeout(timer);
    if (!gone) timer = setTimeout(() => { if (document.visibilityState === "visible") load(false); else schedule(); }, REFRESH_MS);
  }

  function render() {
    body.setAttribute("aria-busy", "false");
    const { suffix } = searched();
    const runs = (page.runs || []).filter((r) => !suffix || r.run_id.replace(/-/g, "").endsWith(suffix));
    if (runs.length === 0) {
      replace(body, h("p", { class: "empty", text: Object.values(filters).some(Boolean) ? "No runs match these filters." : "No runs yet." }));
    } else {
      replace(body, table("Runs", ["Run", "Status", "State", "Definition", "Queue", "Tokens", "Age", "Last event"],
        runs.map(row), { className: "runs" }));
    }
    newer.disabled = cursors.length === 0;
    next.disabled = !page.next_cursor;
    pageNo.textContent = `page ${cursors.length + 1}${page.truncated ? " (shortened: large runs)" : ""}`;
    tick();
  }

  function row(run) {
    const last = run.last_event;
    return h("tr", { dataset: { runId: run.run_id } },
      h("td", {}, h("a", { href: `#/runs/${run.run_id}`, class: "mono", title: run.run_id, "aria-label": `run ${run.run_id}` }, shortId(run.run_id))),
      h("td", {}, badge(run.status)),
      h("td", { class: "mono", text: run.state }),
      h("td", {}, `${run.definition}@${run.version}`),
      h("td", { text: run.queue ?? "–" }),
      h("td", { class: "num tokens" }, tokens(run.usage)),
      h("td", {}, time(run.created_at)),
      h("td", {}, last ? [h("span", { class: "mono", text: last.type }), " ", h("span", { class: "muted", text: `· ${ago(last.occurred_at)}` })] : h("span", { class: "muted", text: "–" })));
  }

  // What the run's model calls used (`usage`, all models): tokens, with the calls and the
  // cost where the model has a price in the title.
  function tokens(usage) {
    if (!usage) return h("span", { class: "muted", text: "–" });
    const cost = usage.cost == null ? "no price" : `cost ${usage.cost.toFixed(4)}`;
    return h("span", { title: `${usage.calls} model calls: ${usage.input_tokens} in, ${usage.output_tokens} out; ${cost}`,
      text: String(usage.input_tokens + usage.output_tokens) });
  }

  function tick() {
    if (fetchedAt) updated.textContent = `updated ${Math.max(0, Math.round((Date.now() - fetchedAt) / 1000))} s ago`;
  }
  ticker = setInterval(tick, 1000);

  load(false);
  return () => {
    gone = true;
    clearTimeout(timer);
    clearInterval(ticker);
    if (inflight) inflight.abort();
  };
}
