// #/runs/<id>: one run — its timeline (followed live), state diagram, lease, pending action,
// why it is where it is, budgets, branches, model calls, resume brief, and the operator's
// actions the token's scopes allow.

import { api, qs, followStream } from "/console/api.js";
import { h, replace, table, shortId, time, until, badge, dl, pre, section, json, duration, UUID_RE } from "/console/dom.js";
import { showError, may, confirmDialog } from "/console/app.js";
import { stateDiagram } from "/console/diagram.js";

const EVENTS_PAGE = 200;
// A run's log may hold up to a million events: the timeline opens on the newest this many
// and loads earlier ones on request.
const TIMELINE_WINDOW = 1000;

function wide(panel) {
  panel.classList.add("span-2");
  return panel;
}

export function runPage(main, id) {
  const ctl = new AbortController();
  const signal = ctl.signal;
  let run = null;
  let why = null;
  let spec = null;
  // The definition's fetch, once started: what needs the spec (the resolve dialog) waits for
  // it rather than showing what it lacks.
  let specLoaded = Promise.resolve();
  const events = [];
  const seen = new Set();
  let refreshTimer = null;
  let pollTimer = null;
  let streaming = false;

  if (!UUID_RE.test(id)) {
    main.append(h("h1", { text: "Not a run id" }), h("p", {}, `“${id}” is not a run id. `, h("a", { href: "#/runs", text: "Back to the runs" })));
    return null;
  }

  const title = h("h1", { id: "run-title" }, `Run ${shortId(id)}`);
  const head = h("div", { class: "run-head" }, h("p", { class: "muted", text: "Loading…" }));
  const actions = h("div", { class: "actions run-actions", role: "group", "aria-label": "Actions" });
  const whyBox = h("div", {});
  const leaseBox = h("div", {});
  const pendingBox = h("div", {});
  const budgetBox = h("div", {});
  const branchBox = h("div", {}, h("p", { class: "muted", text: "Loading…" }));
  const diagramBox = h("div", { class: "diagram-wrap", id: "diagram" }, h("p", { class: "muted", text: "Loading the definition…" }));
  const diagramNote = h("p", { class: "muted legend" });
  const modelBox = h("div", {});
  const liveState = h("span", { class: "stream-state", id: "stream-state", "aria-live": "polite" }, "connecting…");
  const liveText = h("pre", { class: "live-text", id: "live-text", "aria-live": "off", tabindex: "0" });
  const liveCount = h("span", { class: "muted", id: "live-count" });
  const timelineBody = h("tbody", {});
  const earlierBox = h("div", { id: "timeline-earlier-box" });
  const briefBox = h("div", {}, h("p", { class: "muted", text: "Loading…" }));
  let deltas = 0;
  let liveTool = null;

  main.append(
    h("p", { class: "crumbs" }, h("a", { href: "#/runs", text: "← Runs" })),
    h("div", { class: "page-head" }, title, liveState),
    head,
    actions,
    h("div", { class: "grid" },
      wide(section("Why", whyBox)),
      section("Lease", leaseBox),
      section("Budgets used", budgetBox),
      wide(section("Pending action", pendingBox)),
      section("Branches", branchBox)),
    h("section", { class: "panel wide", "aria-labelledby": "sec-diagram" },
      h("h2", { id: "sec-diagram", text: "State diagram" }), diagramNote, diagramBox),
    h("div", { class: "grid" },
      wide(section("Model calls", modelBox)),
      wide(section("Live model output", h("p", {}, liveCount), liveText))),
    h("section", { class: "panel wide", "aria-labelledby": "sec-timeline" },
      h("h2", { id: "sec-timeline", text: "Timeline" }),
      earlierBox,
      h("div", { class: "table-wrap", tabindex: "0", role: "region", "aria-label": "Timeline" },
        h("table", { class: "timeline", id: "timeline" },
          h("caption", { class: "visually-hidden", text: "The run's events in sequence order" }),
          h("thead", {}, h("tr", {}, ["Seq", "Type", "Time", "By", "Token", "Payload"].map((c) => h("th", { scope: "col", text: c })))),
          timelineBody))),
    h("section", { class: "panel wide", "aria-labelledby": "sec-brief" },
      h("h2", { id: "sec-brief", text: "Resume brief" }), briefBox));

  // ---- loading ----

  async function loadRun() {
    const [r, w] = await Promise.all([
      api(`/v1/runs/${id}`, { signal }),
      api(`/v1/runs/${id}/why`, { signal }).catch((e) => { if (e.name !== "AbortError") showError(e, "Cannot read why the run is where it is"); return null; }),
    ]);
    run = r;
    why = w;
    renderHead();
    renderFacts();
    renderDiagram();
  }

  async function loadEvents() {
    let after = events.length ? events[events.length - 1].sequence
      : Math.max(0, ((run && run.sequence) || 0) - TIMELINE_WINDOW);
    await loadPages(after, Infinity);
    renderEarlier();
  }

  // Pages of events after `after`, up to (not including) sequence `before`.
  async function loadPages(after, before) {
    for (;;) {
      const page = await api(`/v1/runs/${id}/events${qs({ envelope: "true", after, limit: EVENTS_PAGE })}`, { signal });
      const got = page.events || [];
      for (const e of got) if (e.sequence < before) addEvent(e);
      if (page.next_after === null || page.next_after === undefined || !got.length) break;
      if (got[got.length - 1].sequence >= before - 1) break;
      after = page.next_after;
    }
  }

  function renderEarlier() {
    const first = events.length ? events[0].sequence : 1;
    const hidden = first - 1;
    replace(earlierBox, hidden > 0
      ? h("p", {}, `${hidden} earlier event${hidden === 1 ? " is" : "s are"} not shown (the diagram's path and the model calls count the events shown). `,
          h("button", { type: "button", id: "timeline-earlier", onclick: loadEarlier, text: `Show ${Math.min(hidden, TIMELINE_WINDOW)} earlier` }))
      : "");
  }

  async function loadEarlier() {
    const first = events[0].sequence;
    try {
      await loadPages(Math.max(0, first - 1 - TIMELINE_WINDOW), first);
      renderEarlier();
      renderDiagram();
      renderModelCalls();
    } catch (e) {
      if (e.name !== "AbortError") showError(e, "Cannot load the earlier events");
    }
  }

  async function loadSpec() {
    try {
      const def = await api(`/v1/definitions/${encodeURIComponent(run.definition)}${qs({ version: run.version })}`, { signal });
      spec = def.spec;
    } catch (e) {
      if (e.name === "AbortError") return;
      replace(diagramBox, h("p", { class: "muted", text: `The definition cannot be read: ${e.message}` }));
      return;
    }
    renderDiagram();
    renderActions();
  }

  async function loadBranches() {
    const parts = [];
    if (run.parent_run_id) parts.push(h("p", {}, "Parent: ", h("a", { href: `#/runs/${run.parent_run_id}`, class: "mono", text: run.parent_run_id })));
    try {
      const page = await api(`/v1/runs${qs({ envelope: "true", parent: id, limit: 50 })}`, { signal });
      const kids = page.runs || [];
      if (kids.length) {
        parts.push(h("ul", { class: "branches" }, kids.map((k) => h("li", {},
          h("a", { href: `#/runs/${k.run_id}`, class: "mono", text: shortId(k.run_id) }), " ", badge(k.status), " ",
          h("span", { class: "mono", text: k.state }), " ", h("span", { class: "muted", text: `${k.definition}@${k.version}` })))));
        if (page.next_cursor) parts.push(h("p", { class: "muted", text: "More branches than shown." }));
      } else parts.push(h("p", { class: "muted", text: "No branches." }));
    } catch (e) {
      if (e.name === "AbortError") return;
      parts.push(h("p", { class: "muted", text: `Branches cannot be listed: ${e.message}` }));
    }
    replace(branchBox, parts);
  }

  async function loadBrief() {
    try {
      const b = await api(`/v1/runs/${id}/brief`, { signal });
      replace(briefBox,
        b.warnings && b.warnings.length ? h("ul", { class: "warnings" }, b.warnings.map((w) => h("li", { text: w }))) : null,
        h("details", {}, h("summary", { text: "What a model would be given to pick the run up" }), pre(b.brief)));
    } catch (e) {
      if (e.name === "AbortError") return;
      replace(briefBox, h("p", { class: "muted", text: `No brief: ${e.message}` }));
    }
  }

  function addEvent(e) {
    if (seen.has(e.sequence)) return false;
    seen.add(e.sequence);
    const tr = eventRow(e);
    if (!events.length || e.sequence > events[events.length - 1].sequence) {
      // The usual case, in order: append.
      events.push(e);
      timelineBody.appendChild(tr);
      return true;
    }
    events.push(e);
    events.sort((a, b) => a.sequence - b.sequence);
    const after = [...timelineBody.children].find((r) => Number(r.dataset.sequence) > e.sequence);
    timelineBody.insertBefore(tr, after || null);
    return true;
  }

  function eventRow(e) {
    const by = e.sender || e.worker || "";
    const payload = e.payload;
    const empty = payload === null || (typeof payload === "object" && Object.keys(payload).length === 0);
    return h("tr", { dataset: { sequence: e.sequence, type: e.type } },
      h("td", { class: "mono num", text: e.sequence }),
      h("td", { class: "mono", text: e.type }),
      h("td", {}, time(e.occurred_at)),
      h("td", { class: "by", text: by || "–" }),
      h("td", { class: "mono num", text: e.token }),
      h("td", {}, empty ? h("span", { class: "muted", text: "{}" })
        : h("details", {}, h("summary", { text: summaryOf(payload) }), pre(payload))));
  }

  function summaryOf(payload) {
    const s = JSON.stringify(payload);
    return s.length > 60 ? `${s.slice(0, 57)}…` : s;
  }

  // ---- rendering ----

  function renderHead() {
    title.textContent = `Run ${shortId(run.run_id)}`;
    replace(head,
      h("p", { class: "badges" }, badge(run.status), " ", h("span", { class: "state-name mono", id: "run-state", text: run.state }), " ",
        h("a", { href: `#/runs?definition=${encodeURIComponent(run.definition)}`, text: `${run.definition}@${run.version}` })),
      dl([
        ["Run id", h("code", { text: run.run_id })],
        ["Queue", run.queue ?? null],
        run.priority !== undefined ? ["Priority", String(run.priority)] : null,
        ["Enqueued by", run.enqueued_by ?? null],
        ["Created", time(run.created_at)],
        ["In state since", time(run.state_entered_at)],
        ["Updated", time(run.updated_at)],
        run.terminal_reason ? ["Ended because", run.terminal_reason] : null,
        run.parent_run_id ? ["Parent", h("a", { href: `#/runs/${run.parent_run_id}`, class: "mono", text: shortId(run.parent_run_id) })] : null,
      ]));
    renderActions();
  }

  function renderActions() {
    if (!run) return;
    const buttons = [];
    if (may("operate")) {
      if (run.status !== "terminal") buttons.push(h("button", { type: "button", class: "button danger", id: "cancel-run", onclick: cancel }, "Cancel run…"));
      if (run.status === "terminal") buttons.push(h("button", { type: "button", class: "button", id: "rerun-run", onclick: rerun }, "Rerun…"));
      if (run.status === "needs_operator") buttons.push(h("button", { type: "button", class: "button primary", id: "resolve-run", onclick: resolve }, "Resolve the in-doubt call…"));
    } else {
      buttons.push(h("p", { class: "muted", text: "Cancelling, rerunning and resolving need the operate scope." }));
    }
    replace(actions, buttons);
  }

  function renderFacts() {
    const w = why || {};
    replace(whyBox, dl([
      ["Waiting for", w.waiting_for ?? null],
      ["Next step", w.next_step ?? null],
      ["Needs an operator", w.needs_operator ? h("strong", { class: "warn", text: `yes: ${w.operator_reason || "see the pending action"}` }) : "no"],
      w.last_rejection ? ["Last rejection", pre(w.last_rejection)] : null,
      w.timer ? ["Timer", [time(w.timer.wake_at, until)]] : null,
      w.last_error ? ["Last error", pre(w.last_error)] : null,
      ["Approvals", w.approvals && w.approvals.length
        ? h("ul", { class: "plain" }, w.approvals.map((a) => h("li", {}, badge(a.status || "?"), " ", h("span", { class: "mono", text: a.tool || "" }), " ",
          h("a", { href: "#/approvals?all=true", text: "in the inbox" }))))
        : null],
      ["Inbox", w.inbox && w.inbox.length ? h("ul", { class: "plain" }, w.inbox.map((m) => h("li", { class: "mono", text: m.type || m.event_type || json(m) }))) : null],
    ]));

    const lease = run.lease || {};
    const left = why && why.lease && typeof why.lease.left_ms === "number" ? why.lease.left_ms
      : lease.until ? Date.parse(lease.until) - Date.now() : null;
    replace(leaseBox, dl([
      ["Holder", lease.worker ? h("span", { class: "mono", text: lease.worker }) : null],
      ["Fencing token", String(lease.token ?? "–")],
      ["Time left", lease.until ? (left >= 0 ? duration(left) : `expired ${duration(-left)} ago`) : null],
      ["Live", lease.live ? badge("live", "live") : "no"],
    ]));

    replace(pendingBox, run.pending_action
      ? pre(run.pending_action)
      : h("p", { class: "muted", text: "No action waiting for its result." }));

    // The run's own sums (every call, not only the events loaded on this page).
    const usage = run.usage;
    replace(budgetBox, dl([
      ["Steps completed", String(run.steps_completed)],
      ["Attempt", String(run.attempt)],
      ["Events", String(run.sequence)],
      ["Model tokens", usage ? `${usage.input_tokens + usage.output_tokens} (${usage.input_tokens} in, ${usage.output_tokens} out, ${usage.calls} calls)` : "none"],
      usage && usage.cost != null ? ["Model cost", usage.cost.toFixed(4)] : null,
      why && why.since ? ["Time in state", duration(why.since.in_state_ms)] : null,
    ]));
  }

  function tokenUsage() {
    const out = { calls: 0, tokens: 0, input: 0, output: 0, cost: 0, rows: [] };
    for (const e of events) {
      if (e.type !== "MODEL_REPLIED") continue;
      const u = (e.payload && e.payload.usage) || {};
      out.calls += 1;
      out.tokens += u.tokens || 0;
      out.input += u.input_tokens || 0;
      out.output += u.output_tokens || 0;
      out.cost += u.cost || 0;
      out.rows.push({ e, u });
    }
    return out;
  }

  function renderModelCalls() {
    const usage = tokenUsage();
    if (!usage.calls) {
      replace(modelBox, h("p", { class: "muted", text: "No model calls yet." }));
      return;
    }
    const rows = usage.rows.map(({ e, u }) => h("tr", {},
      h("td", { class: "mono num", text: e.sequence }),
      h("td", { class: "mono", text: (e.payload && e.payload.model) || "–" }),
      h("td", { class: "num", text: u.input_tokens ?? "–" }),
      h("td", { class: "num", text: u.output_tokens ?? "–" }),
      h("td", { class: "num", text: u.tokens ?? "–" })));
    rows.push(h("tr", { class: "total" }, h("th", { scope: "row", colspan: "2", text: `Total (${usage.calls} calls)` }),
      h("td", { class: "num", text: usage.input }), h("td", { class: "num", text: usage.output }), h("td", { class: "num", text: usage.tokens })));
    replace(modelBox, table("Model calls", ["Seq", "Model", "In", "Out", "Tokens"], rows));
  }

  function renderDiagram() {
    if (!spec || !run) return;
    replace(diagramBox, stateDiagram(spec, { current: run.state, events }));
    replace(diagramNote, "Current state: ", h("strong", { class: "mono", id: "diagram-current", text: run.state }),
      ". Highlighted: the states and transitions this run went through.",
      spec.cancel_state ? ` CANCEL from any unfinished state leads to ${spec.cancel_state}.` : "");
  }

  // ---- live ----

  function refreshSoon() {
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(() => {
      loadRun().then(renderModelCalls).catch((e) => showError(e, "Cannot refresh the run"));
    }, 250);
  }

  function onStreamEvent(ev) {
    if (ev.event === "committed") {
      let e;
      try { e = JSON.parse(ev.data); } catch { return; }
      if (addEvent(e)) {
        renderModelCalls();
        refreshSoon();
      }
    } else if (ev.event === "delta") {
      let d;
      try { d = JSON.parse(ev.data); } catch { return; }
      deltas += 1;
      const put = (text) => { liveText.textContent += text; };
      if (d.type === "delta" && typeof d.content === "string") put(d.content);
      else if (d.type === "tool_call_delta") {
        if (d.name && d.name !== liveTool) {
          put(`${liveText.textContent && !liveText.textContent.endsWith("\n") ? "\n" : ""}${d.name}(`);
          liveTool = d.name;
        }
        put(d.arguments || "");
      } else if (d.type === "reply_done") {
        put(liveTool ? ")\n" : "\n");
        liveTool = null;
      }
      liveCount.textContent = `${deltas} deltas received while streaming`;
      liveText.scrollTop = liveText.scrollHeight;
    } else if (ev.event === "end") {
      refreshSoon();
    } else if (ev.event === "error") {
      let msg = ev.data;
      try { msg = JSON.parse(ev.data).error.message; } catch { /* keep the raw text */ }
      showError(new Error(msg), "The live stream stopped");
      startPolling();
    }
  }

  function setStreamState(s) {
    streaming = s === "live";
    const words = { live: "● live", reconnecting: "reconnecting…", ended: "run ended", closed: "not live" };
    liveState.textContent = words[s] || s;
    liveState.dataset.state = s;
  }

  function startStream() {
    const last = events.length ? events[events.length - 1].sequence : 0;
    followStream(`/v1/runs/${id}/stream${qs({ after: last })}`, { signal, onEvent: onStreamEvent, onState: setStreamState })
      .catch((e) => {
        if (e.name === "AbortError" || signal.aborted) return;
        setStreamState("closed");
        showError(e, "The live stream is not available; refreshing every 3 s instead");
        startPolling();
      });
  }

  function startPolling() {
    clearInterval(pollTimer);
    pollTimer = setInterval(() => {
      if (document.visibilityState !== "visible" || streaming || (run && run.status === "terminal")) return;
      Promise.all([loadRun(), loadEvents()]).then(renderModelCalls).catch((e) => showError(e, "Cannot refresh the run"));
    }, 3000);
  }

  // ---- actions ----

  async function act(what, fn) {
    try {
      await fn();
      refreshSoon();
    } catch (e) {
      showError(e, what);
    }
  }

  async function cancel() {
    const v = await confirmDialog({
      title: "Cancel this run?",
      body: `Run ${run.run_id} (${run.definition}, in ${run.state}) gets a CANCEL event and ends. This cannot be undone.`,
      confirm: "Cancel the run",
      danger: true,
      fields: [h("label", { for: "cancel-reason", text: "Reason (kept in the log)" }),
        h("input", { id: "cancel-reason", name: "reason", type: "text", maxlength: "1000", autocomplete: "off" })],
    });
    if (!v) return;
    const payload = v.reason.trim() ? { reason: v.reason.trim() } : {};
    act("Cannot cancel the run", () => api(`/v1/runs/${id}/events`, { method: "POST", body: { type: "CANCEL", payload } }));
  }

  async function rerun() {
    const v = await confirmDialog({
      title: "Run this again?",
      body: `A new run of ${run.definition}@${run.version} with the same input, queue and priority, linked to this one.`,
      confirm: "Rerun",
    });
    if (!v) return;
    try {
      const done = await api(`/v1/runs/${id}/rerun`, { method: "POST" });
      location.hash = `#/runs/${done.run_id}`;
    } catch (e) {
      showError(e, "Cannot rerun");
    }
  }

  async function resolve() {
    await specLoaded;
    const results = (spec && spec.call_results) || [];
    const pending = run.pending_action ? json(run.pending_action) : "(none)";
    const v = await confirmDialog({
      title: "Resolve the in-doubt call",
      body: "Say whether the call took effect. Check with the system it called first.",
      confirm: "Resolve",
      fields: [
        h("details", {}, h("summary", { text: "The pending action" }), pre(pending)),
        h("fieldset", {},
          h("legend", { text: "Did the call take effect?" }),
          h("label", { class: "radio" }, h("input", { type: "radio", name: "resolution", value: "not_applied", checked: true }), " No: dispatch the step again under the same idempotency key"),
          h("label", { class: "radio" }, h("input", { type: "radio", name: "resolution", value: "applied" }), " Yes: it took effect; record its result")),
        h("label", { for: "resolve-event", text: "Result event (when it took effect)" }),
        h("select", { id: "resolve-event", name: "event" }, results.length
          ? results.map((r) => h("option", { value: r, text: r }))
          : h("option", { value: "", disabled: true, selected: true, text: "(the run's definition cannot be read: reload to list its result events)" })),
        h("label", { for: "resolve-payload", text: "Result payload (a JSON object)" }),
        h("textarea", { id: "resolve-payload", name: "payload", rows: "4", spellcheck: "false" }, "{}"),
      ],
    });
    if (!v) return;
    const resolution = v.resolution;
    let body = { resolution: "not_applied" };
    if (resolution === "applied") {
      let payload;
      try { payload = JSON.parse(v.payload || "{}"); } catch (e) { showError(new Error(`the payload is not JSON: ${e.message}`), "Cannot resolve"); return; }
      body = { resolution: "applied", event: v.event, payload };
    }
    act("Cannot resolve the call", () => api(`/v1/runs/${id}/resolve`, { method: "POST", body }));
  }

  // ---- start ----

  (async () => {
    try {
      await loadRun();
      await loadEvents();
    } catch (e) {
      if (e.name === "AbortError") return;
      replace(head, h("p", { class: "muted", text: e.status === 404 ? "There is no run with this id." : "The run cannot be read." }));
      showError(e, "Cannot open the run");
      setStreamState("closed");
      return;
    }
    renderModelCalls();
    renderFacts();
    specLoaded = loadSpec();
    loadBranches();
    loadBrief();
    startStream();
    startPolling();
  })();

  return () => {
    ctl.abort();
    clearTimeout(refreshTimer);
    clearInterval(pollTimer);
  };
}
