// The README's API examples as a TypeScript program against the types openapi-typescript
// generates from the served document (`rein.d.ts` beside this file when it is checked):
// `tsc --strict --noEmit` must accept every example, and refuse each value marked
// `@ts-expect-error` (a refused value that type-checks is an error too).
import type { components, operations, paths } from "./rein";

type Schemas = components["schemas"];

// `rein enqueue --definition refund-agent --input '{...}'` as POST /v1/runs.
export const refund: Schemas["EnqueueBody"] = {
  definition: "refund-agent",
  input: {
    agent: {
      script: [
        { decision: "call_tool", tool: "refund", args: { order_id: "B7", amount: 420 } },
        { decision: "FINISH" },
      ],
    },
  },
};

export const research: Schemas["EnqueueBody"] = {
  definition: "research-agent",
  input: { topic: "refunds" },
  queue: "default",
  priority: 5,
};

export const reply: Schemas["SendBody"] = { type: "USER_REPLY", payload: {} };
export const cancel: Schemas["SendBody"] = { type: "CANCEL", payload: { reason: "no longer needed" } };

export const grant: Schemas["DecideBody"] = { comment: "checked the order" };
// A decision's body is optional.
export const grantRequest: operations["grant_approval"]["requestBody"] = undefined;

export const current: Schemas["CurrentBody"] = { version: 2 };

// A definition document registered as JSON is any object.
export const definition: NonNullable<operations["register_definition"]["requestBody"]>["content"]["application/json"] = {
  name: "my-agent",
  version: 1,
  states: [{ name: "START", kind: "active" }],
};

// `GET /v1/runs?status=parked&limit=20`, and the next page by the cursor in the body.
export const parked: NonNullable<paths["/v1/runs"]["get"]["parameters"]["query"]> = {
  status: "parked",
  limit: 20,
  envelope: true,
};
export const badStatus: NonNullable<paths["/v1/runs"]["get"]["parameters"]["query"]> = {
  // @ts-expect-error `waiting` is a kind of state, not a run status
  status: "waiting",
};

type Status = Schemas["RunView"]["status"];
export const statuses: Status[] = ["runnable", "parked", "needs_operator", "terminal"];

type RunsAnswer = operations["list_runs"]["responses"][200]["content"]["application/json"];

/** Where the next page starts, whichever shape the answer has. */
export function nextCursor(answer: RunsAnswer): string | null | undefined {
  return Array.isArray(answer) ? undefined : answer.next_cursor;
}

/** A run's input reads back as an object with any keys. */
export function topic(run: Schemas["RunView"]): unknown {
  return run.data?.["topic"];
}

/** An error's code is one of the documented ones; its details have any keys. */
export function explain(e: Schemas["ErrorBody"]): string {
  const code: Schemas["ErrorCode"] = e.error.code;
  const field = e.error.details?.["field"];
  return `${code}: ${e.error.message}${typeof field === "string" ? ` (${field})` : ""}`;
}
// @ts-expect-error not a documented error code
export const noSuchCode: Schemas["ErrorCode"] = "waiting";

/** A 500 reads as the error body too. */
export function serverError(
  r: operations["get_run"]["responses"][500]["content"]["application/json"],
): string {
  return explain(r);
}

/** `rein why --json` and `GET /v1/runs/{id}/why` have named fields. */
export function verdict(why: Schemas["WhyView"]): string {
  return `${why.state} (${why.status}): ${why.waiting_for} / ${why.next_step}`;
}

/** `GET /v1/workers` lists workers with their heartbeats. */
export function silent(workers: operations["list_workers"]["responses"][200]["content"]["application/json"]): string[] {
  return workers.filter((w) => w.silent_ms > 60_000).map((w) => w.worker_id);
}

/** A decision says what the run got. */
export function delivered(d: Schemas["DecisionView"]): boolean {
  const outcome: "applied" | "queued" = d.delivery.outcome;
  return outcome === "applied";
}
