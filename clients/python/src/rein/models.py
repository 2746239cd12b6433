# Generated from Rein's OpenAPI document (`rein openapi`) by
# clients/python/scripts/generate_models.py; do not edit. tests/test_contract.py fails
# when it and the document drift apart.

from __future__ import annotations

from typing import Any, Literal
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, RootModel


class ApprovalView(BaseModel):
    """
    An approval request.
    """

    action_hash: str
    approval_id: UUID
    args: Any
    """
    The tool's arguments, as the action would send them.
    """
    comment: str | None = None
    consumed_at: AwareDatetime | None = None
    decided_at: AwareDatetime | None = None
    decided_by: str | None = None
    expires_at: AwareDatetime
    node: str
    open: bool
    requested_at: AwareDatetime
    risk: str
    run_id: UUID
    status: Literal["pending", "granted", "denied", "void"]
    tool: str


class Comment(RootModel[str]):
    root: str = Field(..., max_length=4096)


class CurrentResponse(BaseModel):
    """
    Where a definition name's current version moved.
    """

    name: str
    previous: int | None = Field(None, ge=0)
    """
    The one before (absent when the name had none).
    """
    version: int = Field(..., ge=0)
    """
    The current version now.
    """


class Cursor(RootModel[str]):
    root: str = Field(
        ..., max_length=51, min_length=34, pattern="^[0-9]{1,18}_[0-9a-f]{32}$"
    )


class DecideBody(BaseModel):
    """
    A person's decision on an approval request. The body is optional: none (or `{}`)
    decides without a comment.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    comment: Comment | None = None


class DefinitionSummary(BaseModel):
    """
    A registered definition version.
    """

    created_at: AwareDatetime
    current: bool
    """
    Whether runs enqueued without a version start with this one.
    """
    description: str
    hash: str
    name: str
    registered_by: str | None = None
    """
    Who registered it (a token's subject, the CLI's `--as` name, `rein` for a
    built-in); absent for versions registered before Rein recorded it.
    """
    version: int = Field(..., ge=0)


class DeliveryView(BaseModel):
    """
    One delivery of a webhook: the id the receiver deduplicates by, and its attempts so far.
    """

    attempts: int
    created_at: AwareDatetime
    delivered_at: AwareDatetime | None = None
    delivery_id: UUID
    kind: Literal[
        "approval.requested",
        "approval.reminder",
        "approval.expired",
        "approval.decided",
        "run.finished",
        "run.failed",
    ]
    """
    What a delivery announces.
    """
    last_error: str | None = None
    """
    Why the last attempt failed.
    """
    last_status_code: int | None = None
    """
    The receiver's last HTTP status; null when it never answered.
    """
    next_attempt_at: AwareDatetime
    run_id: UUID
    status: Literal["pending", "delivered", "failed"]
    """
    Where a delivery stands.
    """
    url: str
    """
    The webhook's URL.
    """
    webhook_id: UUID


class EnqueueResponse(BaseModel):
    created: bool
    """
    False when the Idempotency-Key named a run that already existed.
    """
    run_id: UUID


class EventView(BaseModel):
    """
    One event of a run's log.
    """

    event_id: UUID
    node: str | None = None
    occurred_at: AwareDatetime
    payload: Any
    """
    Any JSON value (an object for the engine's own events).
    """
    run_id: UUID
    schema_version: int
    sender: str | None = None
    """
    Who sent it from outside the engine: `api:SUBJECT` for an API token, the `--as` name
    of the CLI, the approver or the operator. Absent for the engine's own events.
    """
    sequence: int
    token: int
    type: str
    worker: str


class ForkResponse(BaseModel):
    at_sequence: int
    """
    The source's sequence the fork starts after.
    """
    definition: str
    forked_from: UUID
    """
    The run it was forked from (unchanged).
    """
    run_id: UUID
    """
    The new run.
    """
    state: str
    """
    The control state the fork starts in.
    """
    version: int = Field(..., ge=0)


class Health(BaseModel):
    status: str


class LastEventView(BaseModel):
    occurred_at: AwareDatetime
    sequence: int
    type: str


class LeaseView(BaseModel):
    live: bool
    token: int
    until: AwareDatetime | None = None
    worker: str | None = None


class MeView(BaseModel):
    """
    Who the bearer token belongs to and what it may do: what a client shows and hides.
    """

    priority_max: int | None = None
    """
    The highest priority it may give a run; absent when unbounded.
    """
    queues: list[str] | None = None
    """
    The queues its runs may be in; absent when it is not bound to queues.
    """
    scopes: list[str]
    """
    Its scopes; `admin` includes every other.
    """
    subject: str
    """
    The token's subject: what decisions and sent events record as their sender.
    """
    token_id: UUID


class MigratedRun(BaseModel):
    """
    One run's fate in a migration.
    """

    from_state: str
    """
    Its state on the old version.
    """
    outcome: str
    """
    `moved`, `would_move` (dry run), `not_migratable` or `busy` (held by a worker or in
    the middle of a call past the wait).
    """
    run_id: UUID
    sequence: int | None = None
    """
    The sequence of its DEFINITION_MIGRATED event.
    """
    to_state: str | None = None
    """
    Its state on the new one, when it moves.
    """
    why: str | None = None
    """
    Why it did not move.
    """


class Name(RootModel[str]):
    root: str = Field(..., max_length=64, min_length=1, pattern="^[A-Za-z0-9_.-]+$")


class Priority(RootModel[int]):
    root: int = Field(..., ge=-2147483648, le=2147483647)


class Reason(RootModel[str]):
    root: str = Field(..., max_length=1024)


class RedactField(RootModel[str]):
    root: str = Field(..., max_length=64, min_length=1, pattern="^[A-Za-z0-9_.-]+$")


class RedactedValue(BaseModel):
    """
    One value a redaction replaced: its key and the sha256 its marker holds.
    """

    field: str
    sha256: str


class RegisterResponse(BaseModel):
    created: bool
    """
    False when this exact body was already registered under this version.
    """
    current_version: int = Field(..., ge=0)
    """
    The name's current version now: this one when it was made current, or when it is
    the name's first; otherwise registering left the pointer where it was.
    """
    name: str
    version: int = Field(..., ge=0)
    warnings: list[dict[str, Any]] | None = None
    """
    What validation found doubtful but not wrong (e.g. a cycle only timers drive), as
    `[{item, reason}]`, absent when there are none; the definition is registered
    regardless.
    """


class RerunResponse(BaseModel):
    parent_run_id: UUID
    """
    The finished run it repeats.
    """
    run_id: UUID
    """
    The new run.
    """


class ResolveBody(BaseModel):
    """
    How an operator settles a run's in-doubt call.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    event: Name | None = None
    payload: dict[str, Any] | None = None
    """
    `applied` only: the result event's payload, a JSON object (default `{}`).
    """
    resolution: Literal["applied", "not_applied"]
    """
    Whether an in-doubt call took effect.
    """


class ResolveResponse(BaseModel):
    """
    What resolving committed.
    """

    call_id: str
    """
    The call that was in doubt.
    """
    event: str
    """
    The event committed: the result event, or `ACTION_NOT_APPLIED`.
    """
    run_id: UUID
    sender: str
    """
    Who resolved it, as the log records it (`operator:NAME`).
    """


class SendBody(BaseModel):
    """
    An event sent to a run from outside.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    payload: Any | None = None
    """
    Any JSON value (default `{}`).
    """
    type: str = Field(..., max_length=64, min_length=1, pattern="^[A-Za-z0-9_.-]+$")
    """
    Event type, e.g. USER_REPLY or CANCEL: a name of the run's definition.
    """


class SendResponse(BaseModel):
    inbox_id: int | None = None
    outcome: Literal["applied", "queued"]
    """
    `applied` (committed at `sequence`) or `queued` (waits in the run's inbox).
    """
    sequence: int | None = None


class Sequence(RootModel[int]):
    root: int = Field(..., ge=0, le=9223372036854775807)


class UsageSums(BaseModel):
    """
    What model calls used, summed.
    """

    cached_tokens: int | None = Field(None, ge=0)
    """
    Input tokens served from the server's prompt cache; null until a server reports them.
    """
    calls: int = Field(..., ge=0)
    """
    Replies recorded.
    """
    cost: float | None = None
    """
    From the model's `price` in the definition; null when no call was priced.
    """
    input_tokens: int = Field(..., ge=0)
    output_tokens: int = Field(..., ge=0)
    reasoning_tokens: int | None = Field(None, ge=0)
    """
    Reasoning tokens; null until a server reports them (and for calls recorded before
    Rein read them).
    """


class VerifyView(BaseModel):
    """
    Whether a run's log replays to its stored projection and to every checkpoint.
    """

    ok: bool
    """
    True when the log replays to the projection and to every checkpoint.
    """
    problem: str | None = None
    """
    What does not match, when something does not.
    """
    run_id: UUID


class Version(RootModel[int]):
    root: int = Field(..., ge=1, le=2147483647)


class WaitSeconds(RootModel[int]):
    root: int = Field(..., ge=0, le=3600)


class WebhookView(BaseModel):
    """
    A registered webhook, without its secret.
    """

    created_at: AwareDatetime
    created_by: str
    definition: str | None = None
    """
    Only runs of this definition; null: every definition.
    """
    kinds: list[
        Literal[
            "approval.requested",
            "approval.reminder",
            "approval.expired",
            "approval.decided",
            "run.finished",
            "run.failed",
        ]
    ]
    """
    The kinds delivered; empty: every kind.
    """
    queue: str | None = None
    """
    Only runs on this queue; null: every queue.
    """
    url: str
    """
    Where deliveries are POSTed.
    """
    webhook_id: UUID


class WhatIfDefinition(BaseModel):
    """
    A definition as a what-if names it.
    """

    hash: str
    name: str
    version: int = Field(..., ge=0)


class WhatIfView(BaseModel):
    """
    What a what-if replay found, as `rein replay RUN --definition … --json` prints it.
    """

    compared: int = Field(..., ge=0)
    """
    Events replayed on both before the comparison ended.
    """
    compared_after: dict[str, Any] | None = None
    definition: WhatIfDefinition
    """
    The version replayed on.
    """
    divergence: dict[str, Any] | None = None
    events: int = Field(..., ge=0)
    """
    Events in the log.
    """
    recorded: dict[str, Any]
    """
    Where the recorded run ends: state, status, terminal_reason, sequence.
    """
    recorded_definition: WhatIfDefinition
    """
    The version the compared events ran on.
    """
    replayed: dict[str, Any]
    """
    Where the other definition takes it.
    """
    run_id: UUID
    verdict: Literal["same", "diverged", "refused", "unreplayable"]


class WhyEffects(BaseModel):
    """
    The side effects of the run's actions.
    """

    actions: list[dict[str, Any]]
    """
    Rows of the side-effect ledger: one per dispatched action.
    """
    sim: list[dict[str, Any]]
    """
    What the simulated tools recorded.
    """


class WhyFleet(BaseModel):
    """
    Live members of the fleet, by their heartbeats in the last minute.
    """

    schedulers: int
    workers: int


class WhyLease(BaseModel):
    left_ms: float | None = None
    """
    Milliseconds until it expires; negative once it has.
    """
    live: bool
    token: int
    until: AwareDatetime | None = None
    worker: str


class WhySince(BaseModel):
    in_state_ms: float
    state_entered_at: AwareDatetime
    updated_ago_ms: float
    updated_at: AwareDatetime


class WhyTimer(BaseModel):
    due_in_ms: float | None = None
    """
    Milliseconds until it fires; negative when overdue.
    """
    wake_at: AwareDatetime


class WhyView(BaseModel):
    """
    Why a run is where it is, as `rein why --json` prints it: the facts in the order of a
    diagnosis, then what it waits for and what would move it.
    """

    approvals: list[dict[str, Any]]
    """
    Its approval requests.
    """
    attempt: int = Field(..., ge=0)
    db_now: AwareDatetime
    """
    The database clock when these facts were read.
    """
    definition: str
    effects: WhyEffects
    fencing_token: int
    fleet: WhyFleet
    inbox: list[dict[str, Any]]
    """
    Events waiting in its inbox for a state that takes them.
    """
    last_error: Any
    """
    The last error a step reported (any JSON value).
    """
    last_event: dict[str, Any] | None = None
    last_rejection: dict[str, Any] | None = None
    lease: WhyLease | None = None
    needs_operator: bool
    next_step: str
    """
    What would move it, in words.
    """
    operator_reason: str | None = None
    operator_required: dict[str, Any] | None = None
    pending_action: dict[str, Any] | None = None
    queue: str
    run_id: UUID
    sequence: int
    since: WhySince
    state: str
    status: Literal["runnable", "parked", "needs_operator", "terminal"]
    terminal_reason: str | None = None
    timer: WhyTimer | None = None
    transitions_out: list[dict[str, Any]]
    """
    The transitions out of the run's state, highest priority first within an event,
    each with its guards' values against the run as it is (SPEC I4): `{event, from, to,
    priority, index, holds, chosen, guards: [{kind, name, expr, value (true, false,
    error, not_evaluated), error, reads_event}]}`. Guards are evaluated with an event
    without payload; one that reads the event says so.
    """
    version: int = Field(..., ge=0)
    waiting_for: str
    """
    What the run waits for, in words.
    """


class WorkerView(BaseModel):
    """
    A worker or scheduler as `GET /v1/workers` lists it.
    """

    heartbeat_at: AwareDatetime
    """
    Its last heartbeat, by the database clock.
    """
    info: dict[str, Any]
    """
    What it reported about itself with its heartbeat (queues, version...).
    """
    leader: bool
    """
    Whether it holds a live leader lease (a scheduler doing the scanning).
    """
    leases_held: int
    """
    Runs it holds a live lease on right now.
    """
    role: str
    """
    `worker` or `scheduler`.
    """
    silent_ms: float
    """
    Milliseconds since its last heartbeat.
    """
    started_at: AwareDatetime
    worker_id: str


class BlobView(BaseModel):
    """
    A large payload value stored by hash (SPEC E5), as `GET /v1/blobs/{sha256}` returns it.
    """

    bytes: int = Field(..., ge=0)
    """
    Size of the canonical JSON in bytes.
    """
    sha256: str = Field(..., max_length=64, min_length=64, pattern="^[0-9a-f]{64}$")
    """
    The sha256 of the value's canonical JSON (sorted keys, no spaces): the content was
    checked against it.
    """
    value: Any
    """
    The value, as the event that refers to it would hold it inline.
    """


class BriefView(BaseModel):
    """
    The resume brief of a run, and what in the stored checkpoints was not trusted.
    """

    brief: dict[str, Any]
    """
    Task, steps done with their results (or references), the pending step, the last
    error: what a model is given to pick the run up.
    """
    warnings: list[str]
    """
    Checkpoints that did not match the log: the brief was rebuilt from the log instead.
    """


class CurrentBody(BaseModel):
    """
    Which version of a definition name runs enqueued without a version start with.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    allow_builtin: bool | None = None
    """
    For a built-in name, allow a version other than the one this binary ships (needs
    the admin scope).
    """
    version: int = Field(..., ge=1, le=2147483647)
    """
    A registered version of the name.
    """


class DefinitionView(BaseModel):
    """
    A definition version with its spec.
    """

    current: bool
    """
    Whether runs enqueued without a version start with this one.
    """
    hash: str
    name: str
    registered_at: AwareDatetime
    registered_by: str | None = None
    """
    Who registered it (a token's subject, the CLI's `--as` name, `rein` for a built-in);
    absent for versions registered before Rein recorded it.
    """
    spec: dict[str, Any]
    """
    The validated document, as `rein definitions show --format json` prints it.
    """
    version: int = Field(..., ge=0)


class Delivery(BaseModel):
    """
    How a decision reached its run.
    """

    event: str | None = None
    """
    The event the run was sent (its waiting state's granted or denied event).
    """
    outcome: Literal["applied", "queued"]
    """
    `applied` (in the run's log at `sequence`) or `queued` (in the run's inbox, for the
    worker holding its lease).
    """
    sequence: int | None = None
    state: str | None = None
    """
    The run's state after the decision.
    """


class EnqueueBody(BaseModel):
    """
    A new run.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    definition: str = Field(
        ..., max_length=64, min_length=1, pattern="^[A-Za-z0-9_.-]+$"
    )
    """
    Definition name (registered in the database).
    """
    input: Any | None = None
    """
    The run's input (its initial business data): any JSON value; one that is not an
    object is kept as `{"input": VALUE}`. Default `{}`.
    """
    priority: Priority | None = None
    queue: Name | None = None
    version: Version | None = None


class ErrorDetail(BaseModel):
    code: Literal[
        "validation_failed",
        "invalid_transition",
        "fenced",
        "conflict",
        "not_found",
        "unauthorized",
        "forbidden",
        "event_not_allowed",
        "payload_too_large",
        "method_not_allowed",
        "quota_exceeded",
        "bad_request",
        "uri_too_long",
        "headers_too_large",
        "unsupported_media_type",
        "request_timeout",
        "too_many_requests",
        "unavailable",
        "internal",
    ]
    """
    Stable: what a client branches on.
    """
    details: dict[str, Any] | None = None
    message: str
    """
    For a person: what went wrong and what to change.
    """


class EventsPageView(BaseModel):
    """
    One page of `GET /v1/runs/{id}/events?envelope=true`: the events and, in the body as in
    the headers, where the next page starts.
    """

    events: list[EventView]
    next_after: Sequence | None = None
    truncated: bool
    """
    Whether the page holds fewer events than `limit` because more would pass its byte
    bound (as `Rein-Page-Truncated`).
    """


class ForkBody(BaseModel):
    """
    A fork (SPEC E6).
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    at: int = Field(..., ge=1, le=9223372036854775807)
    """
    The sequence of the source's log the fork starts after (its state there).
    """
    input_patch: dict[str, Any] | None = None
    reason: Reason | None = None
    version: Version | None = None


class MigrateBody(BaseModel):
    """
    What to move.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    dry_run: bool | None = None
    """
    Only list what would move and what would not, and why.
    """
    from_: int = Field(..., alias="from", ge=1, le=2147483647)
    """
    The version whose runs move.
    """
    reason: Reason | None = None
    runs: list[UUID] | None = None
    """
    Only these runs (at most 10,000).
    """
    to: int = Field(..., ge=1, le=2147483647)
    """
    The version they move to; it (or the versions between) declares `[migration]`.
    """
    wait_s: WaitSeconds | None = None


class MigrateResponse(BaseModel):
    """
    The result of a migration or its dry run.
    """

    busy: int = Field(..., ge=0)
    definition: str
    dry_run: bool
    from_: int = Field(..., alias="from", ge=0)
    moved: int = Field(..., ge=0)
    not_migratable: int = Field(..., ge=0)
    old_workers: list[str] | None = None
    """
    Live workers of a release that reads no moved run's log (they predate engine
    protocols): a migration is refused while any is at work; a dry run names them.
    """
    runs: list[MigratedRun]
    to: int = Field(..., ge=0)
    would_move: int = Field(..., ge=0)


class ModelUsageView(UsageSums):
    """
    The calls to one model (the one the definition asked for) and what they used.
    """

    model: str
    """
    The model the definition named; empty for a reply that named none.
    """


class RedactBody(BaseModel):
    """
    What to forget of a run.
    """

    model_config = ConfigDict(
        extra="forbid",
    )
    fields: list[RedactField] = Field(..., max_length=64, min_length=1)
    """
    Top-level keys of the run's data to replace by their markers.
    """
    reason: str = Field(..., max_length=1024, min_length=1, pattern="\\S")
    """
    Why, recorded with the redaction.
    """


class RedactResponse(BaseModel):
    """
    What a redaction changed.
    """

    blobs_deleted: list[str]
    """
    Blobs deleted because only finished, redacted runs referred to them.
    """
    events: int = Field(..., ge=0)
    """
    Events whose payload changed.
    """
    fields: list[str]
    finished: bool
    """
    Whether the run had finished: only then are the blobs it refers to forgotten.
    """
    hashes: list[RedactedValue]
    """
    Every value replaced, in the input, the events, the projection and checkpoints.
    """
    run_id: UUID


class RunView(BaseModel):
    """
    A run as `GET /v1/runs/{id}` returns it.
    """

    attempt: int = Field(..., ge=0)
    created_at: AwareDatetime
    data: dict[str, Any] | None = None
    definition: str
    enqueued_by: str | None = None
    """
    Who enqueued it: the token's subject, the CLI's `--as` name; a fan-out branch's
    parent's. Absent for runs created before Rein recorded it.
    """
    finished_at: AwareDatetime | None = None
    """
    When it reached a terminal status.
    """
    last_event: LastEventView | None = None
    lease: LeaseView
    parent_run_id: UUID | None = None
    """
    The run that started it as a branch (fan-out); absent for a run enqueued directly.
    """
    pending_action: dict[str, Any] | None = None
    priority: int
    queue: str = Field(..., max_length=64, min_length=1, pattern="^[A-Za-z0-9_.-]+$")
    run_id: UUID
    sequence: int
    state: str
    """
    The state of its definition it is in (the definition's own names).
    """
    state_entered_at: AwareDatetime
    status: Literal["runnable", "parked", "needs_operator", "terminal"]
    steps_completed: int = Field(..., ge=0)
    terminal_reason: str | None = None
    updated_at: AwareDatetime
    usage: UsageSums | None = None
    version: int = Field(..., ge=0)
    wake_at: AwareDatetime | None = None


class RunsPageView(BaseModel):
    """
    One page of `GET /v1/runs?envelope=true`: the runs and, in the body as in the headers,
    where the next page starts.
    """

    next_cursor: Cursor | None = None
    runs: list[RunView]
    truncated: bool
    """
    Whether the page holds fewer runs than `limit` because more would pass its byte
    bound (as `Rein-Page-Truncated`).
    """


class UsageView(BaseModel):
    """
    A run's model usage, by model and in all.
    """

    models: list[ModelUsageView]
    """
    By model, in name order.
    """
    run_id: UUID
    total: UsageSums | None = None


class DecisionView(ApprovalView):
    """
    A decided approval request and how the decision reached its run.
    """

    delivery: Delivery


class ErrorBody(BaseModel):
    """
    The body of every error response.
    """

    error: ErrorDetail


class EventsAnswer(RootModel[list[EventView] | EventsPageView]):
    root: list[EventView] | EventsPageView
    """
    What `GET /v1/runs/{id}/events` answers: the events as an array, or with
    `envelope=true` an object that carries the next page's `after` too.
    """


class RunsAnswer(RootModel[list[RunView] | RunsPageView]):
    root: list[RunView] | RunsPageView
    """
    What `GET /v1/runs` answers: the runs as an array, or with `envelope=true` an object that
    carries the cursor too.
    """
