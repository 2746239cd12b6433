// The console's shell: sign-in, the header with who is signed in, hash routing, alerts and
// the confirmation dialog. Pages live in their own modules and return a cleanup function.

import { api, setToken, whenUnauthorized, ApiError } from "/console/api.js";
import { h, replace, clear } from "/console/dom.js";
import { runsPage } from "/console/runs.js";
import { runPage } from "/console/run.js";
import { approvalsPage } from "/console/approvals.js";
import { fleetPage } from "/console/fleet.js";
import { notificationsPage } from "/console/notifications.js";

const main = document.getElementById("main");
const header = document.getElementById("header");
const alerts = document.getElementById("alerts");

/** Who is signed in: `/v1/me`'s answer; null on the sign-in page. */
let me = null;
let leave = null;
let renders = 0;

export function may(scope) {
  if (!me) return false;
  const scopes = me.scopes || [];
  return scopes.includes("admin") || scopes.includes(scope);
}

export function subject() {
  return me ? me.subject : null;
}

/** Shows an error (an ApiError's code and message) in the alert area until dismissed. */
export function showError(err, context) {
  if (err && err.name === "AbortError") return;
  const code = err instanceof ApiError ? err.code : "error";
  const message = err && err.message ? err.message : String(err);
  const text = context ? `${context}: ${message}` : message;
  for (const old of alerts.querySelectorAll(".alert")) {
    if (old.dataset.text === text) return;
  }
  const box = h("div", { class: "alert alert-error", dataset: { text, code } },
    h("strong", { text: code === "error" ? "Error" : code.replace(/_/g, " ") }),
    h("span", { class: "alert-message", text }),
    h("button", { type: "button", class: "link-button", "aria-label": "Dismiss", onclick: () => box.remove() }, "Dismiss"));
  alerts.appendChild(box);
}

export function clearAlerts() {
  clear(alerts);
}

/** Asks to confirm `what`; resolves to the dialog's form values, or null when cancelled. */
export function confirmDialog({ title, body, confirm, danger = false, fields = [] }) {
  return new Promise((resolve) => {
    const form = h("form", { method: "dialog", class: "dialog-form" },
      h("h2", { text: title }),
      body ? h("p", {}, body) : null,
      fields,
      h("div", { class: "actions" },
        h("button", { type: "button", class: "button", value: "cancel", onclick: () => dialog.close("cancel") }, "Back"),
        h("button", { type: "submit", class: danger ? "button danger" : "button primary", value: "ok" }, confirm)));
    const dialog = h("dialog", { class: "dialog", "aria-label": title }, form);
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const values = {};
      for (const el of form.elements) {
        if (!el.name || (el.type === "radio" && !el.checked)) continue;
        values[el.name] = el.type === "checkbox" ? el.checked : el.value;
      }
      dialog.close("ok");
      resolve(values);
    });
    dialog.addEventListener("close", () => {
      dialog.remove();
      if (dialog.returnValue !== "ok") resolve(null);
    });
    document.body.appendChild(dialog);
    dialog.showModal();
  });
}

// ---- sign-in ------------------------------------------------------------------------------

function signOut(message) {
  if (leave) leave();
  leave = null;
  me = null;
  setToken(null);
  renderSignIn(message);
}

whenUnauthorized((err) => {
  if (me) signOut(`Signed out: ${err.message}`);
});

function renderSignIn(message) {
  clearAlerts();
  replace(header, h("span", { class: "brand", text: "Rein" }));
  const error = h("p", { class: "form-error", id: "signin-error", role: "alert", "aria-live": "assertive" }, message || "");
  if (!message) error.hidden = true;
  const input = h("input", { id: "token", name: "token", type: "password", required: true, autocomplete: "off",
    spellcheck: "false", "aria-describedby": "token-help signin-error" });
  const button = h("button", { type: "submit", class: "button primary" }, "Sign in");
  const form = h("form", { class: "signin", "aria-labelledby": "signin-title" },
    h("h1", { id: "signin-title", text: "Sign in to Rein" }),
    h("label", { for: "token", text: "API token" }),
    input,
    h("p", { id: "token-help", class: "muted" },
      "A token from ", h("code", { text: "rein tokens create" }),
      ". It is kept in this page's memory only: reloading the page asks for it again."),
    error,
    button);
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const value = input.value.trim();
    if (!value) return;
    button.disabled = true;
    error.hidden = true;
    setToken(value);
    try {
      me = await api("/v1/me");
      input.value = "";
      renderHeader();
      if (!location.hash || location.hash === "#" || location.hash === "#/") location.hash = "#/runs";
      else route();
    } catch (err) {
      setToken(null);
      me = null;
      error.textContent = err.status === 401
        ? `That token was not accepted: ${err.message}`
        : `Cannot sign in: ${err.message}`;
      error.hidden = false;
      button.disabled = false;
      input.focus();
      input.select();
    }
  });
  replace(main, form);
  input.focus();
}

// ---- header and routing -------------------------------------------------------------------

const NAV = [
  ["#/runs", "Runs", null],
  ["#/approvals", "Approvals", null],
  ["#/fleet", "Fleet", null],
  ["#/notifications", "Notifications", "operate"],
];

function renderHeader() {
  const scopes = me.scopes || [];
  replace(header,
    h("a", { class: "brand", href: "#/runs", text: "Rein" }),
    h("nav", { "aria-label": "Sections" },
      h("ul", {}, NAV.filter(([, , scope]) => !scope || may(scope)).map(([href, label]) =>
        h("li", {}, h("a", { href, class: "nav-link", dataset: { route: href.slice(2) } }, label))))),
    h("div", { class: "who" },
      h("span", { class: "subject", id: "whoami", title: `token ${me.token_id || ""}` }, me.subject),
      h("span", { class: "scopes", "aria-label": "scopes" }, scopes.map((s) => h("span", { class: "scope", text: s }))),
      me.queues ? h("span", { class: "queues", text: `queues: ${me.queues.join(", ")}` }) : null,
      h("button", { type: "button", class: "link-button", onclick: () => signOut("Signed out.") }, "Sign out")));
}

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, query] = raw.split("?");
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), params: new URLSearchParams(query || "") };
}

function route() {
  if (!me) return;
  if (leave) leave();
  leave = null;
  clearAlerts();
  const { parts, params } = parseHash();
  const page = parts[0] || "runs";
  for (const a of header.querySelectorAll(".nav-link")) {
    if (a.dataset.route === page) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  clear(main);
  let cleanup = null;
  if (page === "runs" && parts[1]) cleanup = runPage(main, parts[1]);
  else if (page === "runs") cleanup = runsPage(main, params);
  else if (page === "approvals") cleanup = approvalsPage(main, params);
  else if (page === "fleet") cleanup = fleetPage(main);
  else if (page === "notifications") cleanup = notificationsPage(main);
  else {
    main.appendChild(h("h1", { text: "Not found" }));
    main.appendChild(h("p", {}, "No such page. ", h("a", { href: "#/runs", text: "Go to the runs" })));
  }
  leave = typeof cleanup === "function" ? cleanup : null;
  // Which rendering of a page this is: lets a test (or a person with devtools) tell a page
  // from the one it replaced.
  main.dataset.rendered = String(++renders);
  // Keyboard focus that was on what the page replaced starts again at the new page.
  if (!document.activeElement || document.activeElement === document.body || !document.activeElement.isConnected) {
    main.focus({ preventScroll: true });
  }
  const h1 = main.querySelector("h1");
  if (h1) document.title = `${h1.textContent} · Rein`;
}

document.getElementById("skip").addEventListener("click", () => main.focus());
window.addEventListener("hashchange", route);
renderSignIn();
