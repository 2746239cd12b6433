// #/approvals: the approval requests, each with what it would do and, for a token with the
// approve scope, Approve / Deny with a comment. A refused decision stays on its request
// with the server's reason.

import { api, qs } from "/console/api.js";
import { h, replace, clear, shortId, time, until, badge, dl, pre } from "/console/dom.js";
import { showError, may, subject } from "/console/app.js";

const REFRESH_MS = 5000;

export function approvalsPage(main, params) {
  const all = params.get("all") === "true";
  const ctl = new AbortController();
  const signal = ctl.signal;
  const cards = new Map();
  let timer = null;

  const toggle = h("input", { type: "checkbox", id: "show-all", checked: all });
  toggle.addEventListener("change", () => { location.hash = toggle.checked ? "#/approvals?all=true" : "#/approvals"; });
  const list = h("div", { class: "approvals", id: "approvals", "aria-busy": "true" }, h("p", { class: "muted", text: "Loading…" }));
  const refresh = h("button", { type: "button", class: "button", onclick: () => load() }, "Refresh");

  main.append(
    h("div", { class: "page-head" }, h("h1", { text: "Approvals" }),
      h("div", { class: "toolbar" }, h("label", { class: "check", for: "show-all" }, toggle, " Show decided, expired and void requests too"), refresh)),
    ...(may("approve") ? [] : [h("p", { class: "notice", id: "read-only-note", text: "Your token can read requests but not decide them: deciding needs the approve scope." })]),
    list);

  async function load() {
    clearTimeout(timer);
    try {
      const rows = await api(`/v1/approvals${qs({ all: all ? "true" : "", limit: 100 })}`, { signal });
      render(rows || []);
    } catch (e) {
      if (e.name === "AbortError") return;
      showError(e, "Cannot list the approval requests");
    }
    list.setAttribute("aria-busy", "false");
    if (!signal.aborted) timer = setTimeout(() => { if (document.visibilityState === "visible") load(); else timer = setTimeout(load, REFRESH_MS); }, REFRESH_MS);
  }

  function render(rows) {
    if (cards.size === 0) clear(list);
    // New requests go on top; a card already shown stays as it is (its comment box, a
    // refusal or a decision shown on it) until the page is left.
    let anchor = list.firstChild;
    for (const a of rows) {
      if (cards.has(a.approval_id)) {
        anchor = cards.get(a.approval_id).el.nextSibling;
        continue;
      }
      const card = approvalCard(a, signal);
      cards.set(a.approval_id, card);
      list.insertBefore(card.el, anchor);
    }
    const empty = list.querySelector(".empty");
    if (cards.size === 0 && !empty) list.appendChild(h("p", { class: "empty", text: all ? "No approval requests." : "No open approval requests. Nothing waits for a person." }));
    if (cards.size > 0 && empty) empty.remove();
  }

  load();
  return () => {
    ctl.abort();
    clearTimeout(timer);
  };
}

function approvalCard(a, signal) {
  const id = a.approval_id;
  const outcome = h("div", { class: "outcome", "aria-live": "polite" });
  let status = badge(a.status, `ap-${a.status}`);
  const expires = h("span", {}, time(a.expires_at, until));
  const comment = h("textarea", { id: `comment-${id}`, name: "comment", rows: "2", maxlength: "4096" });
  const grant = h("button", { type: "submit", class: "button primary approve", value: "grant" }, "Approve");
  const deny = h("button", { type: "submit", class: "button danger deny", value: "deny" }, "Deny");
  const decide = a.open && may("approve")
    ? h("form", { class: "decide", "aria-label": `Decide on ${a.tool}` },
      h("label", { for: `comment-${id}`, text: "Comment (kept with the decision)" }),
      comment,
      h("div", { class: "actions" }, grant, deny))
    : null;
  const el = h("article", { class: `approval ${a.open ? "open" : "closed"}`, dataset: { approvalId: id, runId: a.run_id }, "aria-labelledby": `ap-${id}` },
    h("header", {},
      h("h2", { id: `ap-${id}` }, h("span", { class: "mono", text: a.tool }), " ", badge(`risk ${a.risk}`, `risk-${a.risk}`), " ", status),
      h("a", { href: `#/runs/${a.run_id}`, class: "run-link" }, "Run ", h("span", { class: "mono", text: shortId(a.run_id) }))),
    dl([
      ["Arguments", pre(a.args)],
      ["Action hash", h("code", { class: "hash", title: a.action_hash, text: a.action_hash })],
      ["Requested", time(a.requested_at)],
      ["Expires", [h("span", { text: new Date(a.expires_at).toLocaleString() }), " (", expires, ")"]],
      a.decided_by ? ["Decided by", `${a.decided_by}${a.decided_at ? ` · ${new Date(a.decided_at).toLocaleString()}` : ""}`] : null,
      a.comment ? ["Comment", a.comment] : null,
    ]),
    decide,
    outcome);

  if (decide) {
    decide.addEventListener("submit", async (e) => {
      e.preventDefault();
      const verb = e.submitter && e.submitter.value === "deny" ? "deny" : "grant";
      grant.disabled = true;
      deny.disabled = true;
      replace(outcome, h("p", { class: "muted", text: verb === "grant" ? "Approving…" : "Denying…" }));
      const text = comment.value.trim();
      try {
        const d = await api(`/v1/approvals/${id}/${verb}`, { method: "POST", body: text ? { comment: text } : {}, signal });
        decided(d);
      } catch (err) {
        if (err.name === "AbortError") return;
        replace(outcome, h("div", { class: "refusal", role: "alert", dataset: { code: err.code } },
          h("strong", { text: `Refused (${err.code}): ` }), h("span", { class: "reason", text: err.message })));
        el.classList.add("refused");
        if (err.status === 401) return;
        if (err.status === 409) refreshStatus();
        if (err.status === 0 || err.status >= 500) { grant.disabled = false; deny.disabled = false; }
      }
    });
  }

  // After a refusal: what the request is now (decided by someone else, expired, void).
  async function refreshStatus() {
    try {
      const rows = await api(`/v1/approvals${qs({ run: a.run_id, all: "true" })}`, { signal });
      const now = (rows || []).find((r) => r.approval_id === id);
      if (!now) return;
      const fresh = badge(now.status, `ap-${now.status}`);
      status.replaceWith(fresh);
      status = fresh;
    } catch {
      // The refusal already says why; the badge stays as it was.
    }
  }

  function decided(d) {
    el.classList.remove("open");
    el.classList.add("closed", "decided");
    decide.remove();
    const now = badge(d.status, `ap-${d.status}`);
    status.replaceWith(now);
    status = now;
    const runState = h("span", { class: "run-now", text: "reading…" });
    replace(outcome, h("div", { class: "decision", role: "status" },
      h("p", {}, h("strong", { text: d.status === "granted" ? "Approved" : d.status === "denied" ? "Denied" : d.status }),
        " by ", h("span", { class: "decided-by", text: d.decided_by || subject() || "" }),
        d.decided_at ? ` at ${new Date(d.decided_at).toLocaleTimeString()}` : "",
        d.comment ? [" — “", h("span", { class: "decided-comment", text: d.comment }), "”"] : ""),
      d.delivery ? h("p", { class: "muted", text: `The run got ${d.delivery.event || "the decision"}${d.delivery.outcome ? ` (${d.delivery.outcome})` : ""}.` }) : null,
      h("p", {}, "The run now: ", runState)));
    followRun(a.run_id, runState, signal);
  }

  return { el };
}

/** Shows the run's state as it moves on after a decision, for a while. */
async function followRun(runId, into, signal) {
  let last = "";
  for (let i = 0; i < 20 && !signal.aborted; i++) {
    try {
      const r = await api(`/v1/runs/${runId}`, { signal });
      const now = `${r.state} (${r.status.replace("_", " ")})`;
      if (now !== last) {
        replace(into, h("a", { href: `#/runs/${runId}`, class: "mono", dataset: { state: r.state, status: r.status } }, now));
        last = now;
      }
      if (r.status === "terminal") return;
    } catch (e) {
      if (e.name === "AbortError") return;
      replace(into, h("span", { class: "muted", text: `cannot read it: ${e.message}` }));
      return;
    }
    await new Promise((res) => setTimeout(res, 500));
  }
}
