// Talking to the API: the token lives in this module's memory only and goes out as an
// Authorization header on every request. Nothing is stored in the browser.

let token = null;
let onUnauthorized = () => {};

export function setToken(value) {
  token = value;
}

export function hasToken() {
  return token !== null;
}

export function whenUnauthorized(fn) {
  onUnauthorized = fn;
}

/** An error answered by the API (its `{"error": {code, message, details}}`) or the network. */
export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details || null;
  }
}

function headers(extra) {
  const h = { Accept: "application/json", ...extra };
  if (token !== null) h.Authorization = `Bearer ${token}`;
  return h;
}

async function errorOf(res) {
  let body = null;
  try {
    body = await res.json();
  } catch {
    body = null;
  }
  const e = body && typeof body === "object" ? body.error : null;
  if (e && typeof e.message === "string") {
    return new ApiError(res.status, e.code || `http_${res.status}`, e.message, e.details);
  }
  return new ApiError(res.status, `http_${res.status}`, `the server answered ${res.status} ${res.statusText}`.trim());
}

/** GET (or `method`) `path`; resolves to the parsed JSON body, rejects with an ApiError. */
export async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, headers: headers(), signal, cache: "no-store", credentials: "omit" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(path, init);
  } catch (e) {
    if (e && e.name === "AbortError") throw e;
    throw new ApiError(0, "network", `cannot reach the server (${e && e.message ? e.message : e}); check that rein api is running`);
  }
  if (!res.ok) {
    const err = await errorOf(res);
    if (res.status === 401) onUnauthorized(err);
    throw err;
  }
  if (res.status === 204) return null;
  const text = await res.text();
  return text ? JSON.parse(text) : null;
}

/** A query string of the non-empty entries of `params`. */
export function qs(params) {
  const u = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "") u.set(k, String(v));
  }
  const s = u.toString();
  return s ? `?${s}` : "";
}

/**
 * Follows a server-sent-events answer read with fetch (EventSource cannot send the
 * Authorization header). Calls `onEvent({event, data, id})` per event, resumes after the last
 * `id` when the connection drops before an `end` event, and stops for good on `end`, on an
 * `error` event, on an API error or when `signal` aborts. `onState(text)` reports the
 * connection's state in words.
 */
export async function followStream(path, { signal, onEvent, onState, lastId = null }) {
  let last = lastId;
  let ended = false;
  let failures = 0;
  while (!ended && !signal.aborted) {
    const h = headers({ Accept: "text/event-stream" });
    if (last !== null) h["Last-Event-ID"] = String(last);
    let res;
    try {
      res = await fetch(path, { headers: h, signal, cache: "no-store", credentials: "omit" });
    } catch (e) {
      if (signal.aborted) return;
      res = null;
    }
    if (res && !res.ok) {
      const err = await errorOf(res);
      if (res.status === 401) onUnauthorized(err);
      if (res.status !== 503) throw err;
      res = null;
    }
    if (res) {
      failures = 0;
      onState("live");
      try {
        const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value;
          let cut;
          while ((cut = frameEnd(buf)) !== null) {
            const frame = buf.slice(0, cut.at);
            buf = buf.slice(cut.at + cut.len);
            const ev = parseFrame(frame);
            if (!ev) continue;
            if (ev.id !== null) last = ev.id;
            onEvent(ev);
            if (ev.event === "end" || ev.event === "error") {
              ended = true;
              reader.cancel().catch(() => {});
              break;
            }
          }
          if (ended) break;
        }
      } catch (e) {
        if (signal.aborted) return;
      }
    }
    if (ended || signal.aborted) break;
    failures += 1;
    onState("reconnecting");
    await sleep(Math.min(1000 * failures, 5000), signal);
  }
  if (!signal.aborted) onState(ended ? "ended" : "closed");
}

function frameEnd(buf) {
  const m = /\r\n\r\n|\n\n|\r\r/.exec(buf);
  return m ? { at: m.index, len: m[0].length } : null;
}

function parseFrame(frame) {
  let event = "message";
  let id = null;
  const data = [];
  let any = false;
  for (const line of frame.split(/\r\n|\n|\r/)) {
    if (line === "" || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    any = true;
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
    else if (field === "id") id = value;
  }
  if (!any) return null;
  return { event, id, data: data.join("\n") };
}

export function sleep(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    if (signal) signal.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true });
  });
}
