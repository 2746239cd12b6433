//! The operator operations, once: the API handlers call them after authenticating the caller,
//! and the CLI calls them directly when it talks to the database. Both print what these
//! return, so `rein … --json` is the same document through `REIN_URL` as through
//! `DATABASE_URL`. Errors come back as [`Error`], with its stable codes.

use chrono::{DateTime, Utc};
use rein_core::{Definition, Format, GuardRegistry, RunStatus};
use rein_store::{
    Approval, ClientKey, DefinitionRow, EnqueueRequest, INBOX_TTL_MS_DEFAULT, Member, PageView,
    Publication, RunFilter, SendOutcome, Sender, Store, StoreError, StoredEvent, TokenInfo,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::error::Error;
pub use crate::paging::{
    CURSOR_ID_DIGITS, CURSOR_MICROS_DIGITS_MAX, EVENTS_PAGE_DEFAULT, PAGE_BYTES_MAX_DEFAULT,
    PAGE_DEFAULT, PAGE_MAX, PAGE_MIN, cursor_pattern,
};

/// The response header naming the next page of `GET /v1/runs`.
pub const NEXT_CURSOR: &str = "rein-next-cursor";
/// The response header naming the next page of `GET /v1/runs/{id}/events`.
pub const NEXT_AFTER: &str = "rein-next-after";
/// The response header of a page cut short by its byte bound.
pub const PAGE_TRUNCATED: &str = "rein-page-truncated";
/// Longest approver name recorded with a decision.
pub const APPROVER_BYTES_MAX: usize = 256;

// ---- shapes -------------------------------------------------------------------------------

/// A new run.
#[derive(Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"definition": "research-agent", "input": {"topic": "refunds"}}))]
pub struct EnqueueBody {
    /// Definition name (registered in the database).
    #[schema(value_type = crate::schema::Name)]
    pub definition: String,
    /// Definition version; the name's current version when absent (`rein definitions
    /// current`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::schema::integral"
    )]
    #[schema(value_type = Option<crate::schema::Version>)]
    pub version: Option<u32>,
    /// The run's input (its initial business data): any JSON value; one that is not an
    /// object is kept as `{"input": VALUE}`. Default `{}`.
    #[serde(default = "empty_object")]
    #[schema(value_type = Value)]
    pub input: Value,
    /// Queue name, a name like a definition's (default `default`; for a token bound to
    /// queues, the first of them).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::schema::Name>)]
    pub queue: Option<String>,
    /// Higher is claimed first (default 0).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::schema::integral"
    )]
    #[schema(value_type = Option<crate::schema::Priority>)]
    pub priority: Option<i32>,
}

#[derive(Serialize, ToSchema)]
pub struct EnqueueResponse {
    pub run_id: Uuid,
    /// False when the Idempotency-Key named a run that already existed.
    pub created: bool,
}

#[derive(Serialize, ToSchema)]
pub struct SendResponse {
    /// `applied` (committed at `sequence`) or `queued` (waits in the run's inbox).
    #[schema(value_type = crate::schema::Outcome)]
    pub outcome: String,
    pub sequence: Option<i64>,
    pub inbox_id: Option<i64>,
}

impl SendResponse {
    pub fn applied(&self) -> bool {
        self.outcome == "applied"
    }
}

#[derive(Serialize, ToSchema)]
pub struct RerunResponse {
    /// The new run.
    pub run_id: Uuid,
    /// The finished run it repeats.
    pub parent_run_id: Uuid,
}

/// A definition version with its spec.
#[derive(Serialize, ToSchema)]
pub struct DefinitionView {
    pub name: String,
    pub version: u32,
    pub hash: String,
    /// Whether runs enqueued without a version start with this one.
    pub current: bool,
    /// Who registered it (a token's subject, the CLI's `--as` name, `rein` for a built-in);
    /// absent for versions registered before Rein recorded it.
    pub registered_by: Option<String>,
    pub registered_at: DateTime<Utc>,
    /// The validated document, as `rein definitions show --format json` prints it.
    #[schema(value_type = crate::schema::JsonObject)]
    pub spec: Value,
}

#[derive(Serialize, ToSchema)]
pub struct RegisterResponse {
    pub name: String,
    pub version: u32,
    /// False when this exact body was already registered under this version.
    pub created: bool,
    /// The name's current version now: this one when it was made current, or when it is
    /// the name's first; otherwise registering left the pointer where it was.
    pub current_version: u32,
    /// What validation found doubtful but not wrong (e.g. a cycle only timers drive), as
    /// `[{item, reason}]`, absent when there are none; the definition is registered
    /// regardless.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<crate::schema::JsonObject>)]
    pub warnings: Vec<Value>,
}

/// Where a definition name's current version moved.
#[derive(Serialize, ToSchema)]
pub struct CurrentResponse {
    pub name: String,
    /// The current version now.
    pub version: u32,
    /// The one before (absent when the name had none).
    pub previous: Option<u32>,
}

/// Who publishes a definition version and how.
#[derive(Debug, Clone, Copy)]
pub struct Publisher<'a> {
    /// The token's subject; the CLI's `--as` name on the database.
    pub by: &'a str,
    /// Make the version its name's current one.
    pub make_current: bool,
    /// Allow a version of a built-in name other than the one this binary ships (an admin's
    /// decision through the API).
    pub allow_builtin: bool,
    /// Where each model key may be sent: a model state that would send its key elsewhere is
    /// refused.
    pub model_keys: &'a rein_core::model_keys::KeyBindings,
}

/// How a decision reached its run.
#[derive(Serialize, ToSchema)]
pub struct Delivery {
    /// `applied` (in the run's log at `sequence`) or `queued` (in the run's inbox, for the
    /// worker holding its lease).
    #[schema(value_type = crate::schema::Outcome)]
    pub outcome: String,
    /// The event the run was sent (its waiting state's granted or denied event).
    pub event: Option<String>,
    pub sequence: Option<i64>,
    /// The run's state after the decision.
    pub state: Option<String>,
}

/// A decided approval request and what the run got.
#[derive(Serialize)]
pub struct Decision {
    #[serde(flatten)]
    pub approval: Approval,
    pub delivery: Delivery,
}

/// A large payload value stored by hash (SPEC E5), as `GET /v1/blobs/{sha256}` returns it.
#[derive(Serialize, ToSchema)]
pub struct BlobView {
    /// The sha256 of the value's canonical JSON (sorted keys, no spaces): the content was
    /// checked against it.
    #[schema(value_type = crate::schema::Sha256)]
    pub sha256: String,
    /// Size of the canonical JSON in bytes.
    pub bytes: usize,
    /// The value, as the event that refers to it would hold it inline.
    #[schema(value_type = Value)]
    pub value: Value,
}

/// Blob storage totals (`rein blobs stats`).
#[derive(Serialize)]
pub struct BlobStatsView {
    pub blobs: i64,
    pub stored_bytes: i64,
    /// References recorded before commits recorded them, shared with another queue: the
    /// rows of `rein_blob_refs_to_review` an operator should look at.
    pub refs_to_review: i64,
}

/// One page of runs, newest first; `next` continues after its last run.
pub struct RunsPage {
    pub runs: Vec<Value>,
    pub next: Option<String>,
    /// The page holds fewer runs than asked because they would not fit its byte bound.
    pub truncated: bool,
}

/// One page of a run's events in order; `next` is the `after` of the page that follows.
pub struct EventsPage {
    pub events: Vec<StoredEvent>,
    pub next: Option<i64>,
    /// The page holds fewer events than asked because they would not fit its byte bound.
    pub truncated: bool,
}

/// Rows of a page asked for one past `limit` and kept within the page's byte bound: the
/// page's rows, whether more follow, and whether the bound cut it short.
fn paged<T>(page: rein_store::Budgeted<T>, limit: i64) -> (Vec<T>, bool, bool) {
    let mut rows = page.rows;
    let more = page.cut || rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let truncated = page.cut && (rows.len() as i64) < limit;
    (rows, more, truncated)
}

fn empty_object() -> Value {
    json!({})
}

// ---- input checks -------------------------------------------------------------------------

/// `limit` when given, checked against [`PAGE_MIN`]..=[`PAGE_MAX`].
pub fn page(limit: Option<i64>) -> Result<i64, Error> {
    page_or(limit, PAGE_DEFAULT)
}

fn page_or(limit: Option<i64>, default: i64) -> Result<i64, Error> {
    let limit = limit.unwrap_or(default);
    if !(PAGE_MIN..=PAGE_MAX).contains(&limit) {
        return Err(Error::validation(format!(
            "limit must be {PAGE_MIN}..={PAGE_MAX}"
        )));
    }
    Ok(limit)
}

/// A name when given (of a definition, event or queue, or a filter on one): the rule every
/// name in a definition follows ([`rein_core::name_problem`]), so one that breaks it is
/// refused rather than matching nothing.
pub fn name(what: &str, value: Option<String>) -> Result<Option<String>, Error> {
    match value {
        Some(v) => match rein_core::name_problem(&v) {
            Some(problem) => Err(Error::validation(format!("{what}: {problem}"))
                .with_details(serde_json::json!({ "field": what }))),
            None => Ok(Some(v)),
        },
        None => Ok(None),
    }
}

/// A status filter when given: one of [`RunStatus::ALL`].
pub fn status(value: Option<String>) -> Result<Option<String>, Error> {
    match value {
        Some(v) if !RunStatus::ALL.iter().any(|s| s.as_str() == v) => {
            let all: Vec<&str> = RunStatus::ALL.iter().map(|s| s.as_str()).collect();
            Err(
                Error::validation(format!("status must be one of {}", all.join(", ")))
                    .with_details(json!({ "field": "status", "allowed": all })),
            )
        }
        other => Ok(other),
    }
}

pub fn encode_cursor(at: DateTime<Utc>, run_id: Uuid) -> String {
    format!("{}_{}", at.timestamp_micros(), run_id.simple())
}

pub fn decode_cursor(cursor: &str) -> Result<(DateTime<Utc>, Uuid), Error> {
    let bad = || Error::validation("the cursor is malformed; use a Rein-Next-Cursor value");
    let (micros, id) = cursor.split_once('_').ok_or_else(bad)?;
    if micros.is_empty()
        || micros.len() > CURSOR_MICROS_DIGITS_MAX
        || !micros.bytes().all(|b| b.is_ascii_digit())
        || id.len() != CURSOR_ID_DIGITS
        || !id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return Err(bad());
    }
    let micros: i64 = micros.parse().map_err(|_| bad())?;
    let at = DateTime::from_timestamp_micros(micros).ok_or_else(bad)?;
    let id = Uuid::try_parse(id).map_err(|_| bad())?;
    Ok((at, id))
}

/// An approver's name, trimmed: non-empty, at most [`APPROVER_BYTES_MAX`] bytes, no control
/// characters.
pub fn approver(name: &str) -> Result<&str, String> {
    let name = name.trim();
    if name.is_empty() {
        return Err("the approver's name is empty".into());
    }
    if name.len() > APPROVER_BYTES_MAX {
        return Err(format!(
            "the approver's name is {} bytes; at most {APPROVER_BYTES_MAX}",
            name.len()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err("the approver's name contains control characters".into());
    }
    Ok(name)
}

// ---- operations ---------------------------------------------------------------------------

/// Creates a run enqueued by `enqueued_by` (or finds the one `caller`'s `key` already
/// created for this same body), within `token`'s bounds and quotas when an API token asks
/// (none on the database). The run's root span links to the caller's `traceparent`.
pub async fn enqueue(
    store: &Store,
    body: EnqueueBody,
    key: Option<String>,
    (caller, enqueued_by): (&str, &str),
    token: Option<&TokenInfo>,
    traceparent: Option<&str>,
) -> Result<EnqueueResponse, Error> {
    let definition = name("definition", Some(body.definition))?.unwrap_or_default();
    let def = store.load_definition(&definition, body.version).await?;
    if rein_worker::sim::runs_sim(&def)
        && let Some(problem) = rein_worker::sim::input_problem(&body.input)
    {
        return Err(Error::validation(problem));
    }
    let mut request = EnqueueRequest::new(def, body.input);
    request.version_asked = body.version;
    request.client_key = key.map(|key| ClientKey::new(caller, key));
    request.queue = match name("queue", body.queue)? {
        Some(queue) => queue,
        None => token.map_or("default", TokenInfo::default_queue).to_owned(),
    };
    request.priority = body.priority.unwrap_or(0);
    request.enqueued_by = Some(enqueued_by.to_owned());
    request.traceparent = traceparent.map(str::to_owned);
    let done = store.enqueue_as(token, request).await?;
    Ok(EnqueueResponse {
        run_id: done.run_id,
        created: done.created,
    })
}

pub async fn run(store: &Store, run_id: Uuid) -> Result<Value, Error> {
    let row = store.run(run_id).await?;
    let mut run = run_json(&row);
    with_last_events(store, std::slice::from_mut(&mut run), &[&row]).await?;
    crate::usage::with_usage(store, std::slice::from_mut(&mut run), &[row.run_id]).await?;
    Ok(run)
}

/// Sets each run's `last_event` (its newest event's type, sequence and time) in one read.
async fn with_last_events(
    store: &Store,
    runs: &mut [Value],
    rows: &[&rein_store::RunRow],
) -> Result<(), Error> {
    let at: Vec<(Uuid, i64)> = rows.iter().map(|r| (r.run_id, r.last_sequence)).collect();
    let last = store.events_at(&at).await?;
    for (run, row) in runs.iter_mut().zip(rows) {
        if let Some(run) = run.as_object_mut() {
            run.insert("last_event".to_owned(), json!(last.get(&row.run_id)));
        }
    }
    Ok(())
}

/// One page of runs matching `filter`, after the run `cursor` names: each run as `GET
/// /v1/runs/{id}` shows it, without its `data` unless `data`, and at most about `bytes_max`
/// bytes of them.
pub async fn runs(
    store: &Store,
    filter: RunFilter,
    cursor: Option<&str>,
    limit: Option<i64>,
    (data, bytes_max): (bool, usize),
) -> Result<RunsPage, Error> {
    let limit = page(limit)?;
    let filter = RunFilter {
        status: status(filter.status)?,
        definition: name("definition", filter.definition)?,
        state: name("state", filter.state)?,
        queue: name("queue", filter.queue)?,
        ..filter
    };
    let after = cursor.map(decode_cursor).transpose()?;
    let view = PageView {
        with_data: data,
        bytes_max: bytes_max as i64,
    };
    // One row more than asked tells whether another page follows.
    let (rows, more, truncated) = paged(
        store.runs_page(&filter, after, limit + 1, view).await?,
        limit,
    );
    let next = match rows.last() {
        Some(last) if more => Some(encode_cursor(last.created_at, last.run_id)),
        _ => None,
    };
    let mut runs: Vec<Value> = rows
        .iter()
        .map(|row| {
            let mut run = run_json(row);
            if !data && let Some(run) = run.as_object_mut() {
                run.remove("data");
            }
            run
        })
        .collect();
    with_last_events(store, &mut runs, &rows.iter().collect::<Vec<_>>()).await?;
    let ids: Vec<Uuid> = rows.iter().map(|r| r.run_id).collect();
    crate::usage::with_usage(store, &mut runs, &ids).await?;
    Ok(RunsPage {
        runs,
        next,
        truncated,
    })
}

/// One page of the run's events after sequence `after` (from the first when absent), at most
/// about `bytes_max` bytes of them; not found when there is no such run.
pub async fn events(
    store: &Store,
    run_id: Uuid,
    after: Option<i64>,
    limit: Option<i64>,
    bytes_max: usize,
) -> Result<EventsPage, Error> {
    let limit = page_or(limit, EVENTS_PAGE_DEFAULT)?;
    let after = after.unwrap_or(0);
    if after < 0 {
        return Err(Error::validation(
            "after must be a sequence number (0 or more): the `Rein-Next-After` of the page before",
        )
        .with_details(json!({ "field": "after" })));
    }
    store.run(run_id).await?;
    let view = PageView {
        with_data: true,
        bytes_max: bytes_max as i64,
    };
    let (events, more, truncated) = paged(
        store.history_page(run_id, after, limit + 1, view).await?,
        limit,
    );
    let next = match events.last() {
        Some(last) if more => Some(last.sequence),
        _ => None,
    };
    Ok(EventsPage {
        events,
        next,
        truncated,
    })
}

/// Refuses `token` acting on run `run_id` when the token is bound to queues the run is not
/// in; a token without queue bounds is not asked about.
pub async fn within_queues(
    store: &Store,
    token: Option<&TokenInfo>,
    run_id: Uuid,
) -> Result<(), Error> {
    match token {
        Some(t) if t.bounds.queues.is_some() => {
            let queue = store.run_queue(run_id).await?;
            t.may_act_on(&queue)
                .map_err(|e| Error::from(StoreError::OutOfBounds(e)))
        }
        _ => Ok(()),
    }
}

/// Sends an event from outside: applied now, or queued in the run's inbox. With `key`, a
/// repeat returns what became of the first send instead of applying it again. A token
/// bound to queues sends only to runs in them.
pub async fn send(
    store: &Store,
    run_id: Uuid,
    kind: &str,
    payload: Value,
    sender: &Sender,
    key: Option<&str>,
    token: Option<&TokenInfo>,
) -> Result<SendResponse, Error> {
    name("type", Some(kind.to_owned()))?;
    within_queues(store, token, run_id).await?;
    let sent = match key {
        Some(key) => {
            store
                .send_once(run_id, kind, payload, sender, key, INBOX_TTL_MS_DEFAULT)
                .await?
        }
        None => {
            store
                .send(run_id, kind, payload, sender, INBOX_TTL_MS_DEFAULT)
                .await?
        }
    };
    Ok(match sent {
        SendOutcome::Applied { sequence } => SendResponse {
            outcome: "applied".to_owned(),
            sequence: Some(sequence),
            inbox_id: None,
        },
        SendOutcome::Queued { inbox_id } => SendResponse {
            outcome: "queued".to_owned(),
            sequence: None,
            inbox_id: Some(inbox_id),
        },
    })
}

/// A new run like a finished one, linked to it (SPEC E6) and enqueued by `by`; conflict
/// while it runs. For a token, the new run is held to its bounds and quotas like an enqueue.
pub async fn rerun(
    store: &Store,
    parent: Uuid,
    by: &str,
    token: Option<&TokenInfo>,
) -> Result<RerunResponse, Error> {
    match store.rerun_as(token, parent, Some(by)).await {
        Ok(run_id) => Ok(RerunResponse {
            run_id,
            parent_run_id: parent,
        }),
        Err(StoreError::Invalid(m)) => Err(Error::conflict(m)),
        Err(e) => Err(e.into()),
    }
}

pub async fn workers(store: &Store) -> Result<Vec<Member>, Error> {
    Ok(store.members().await?)
}

pub async fn approvals(
    store: &Store,
    all: bool,
    run: Option<Uuid>,
    limit: Option<i64>,
) -> Result<Vec<Approval>, Error> {
    Ok(store.approvals(all, run, page(limit)?).await?)
}

/// Grants or denies a request as `approver` and says what the run got. Unknown requests are
/// not found; ones that can no longer be decided conflict, with the store's reason. A token
/// bound to queues decides only for runs in them.
pub async fn decide(
    store: &Store,
    approval_id: Uuid,
    grant: bool,
    approver_name: &str,
    comment: Option<&str>,
    token: Option<&TokenInfo>,
) -> Result<Decision, Error> {
    let approver_name = approver(approver_name).map_err(Error::validation)?;
    if comment.is_some_and(|c| c.len() > rein_store::COMMENT_BYTES_MAX) {
        return Err(Error::validation(format!(
            "the comment must be at most {} bytes",
            rein_store::COMMENT_BYTES_MAX
        )));
    }
    let comment = comment.filter(|c| !c.trim().is_empty());
    let existing = match store.approval(approval_id).await {
        Ok(a) => a,
        Err(StoreError::Invalid(_)) => {
            return Err(Error::not_found(format!(
                "no approval request {approval_id} (`rein approvals list --all` shows them)"
            ))
            .with_details(json!({ "approval_id": approval_id })));
        }
        Err(e) => return Err(e.into()),
    };
    within_queues(store, token, existing.run_id).await?;
    // Where the run's log stood before the decision, to find the event it is sent.
    let before = store.run(existing.run_id).await?.last_sequence;
    let decided = match store
        .decide_approval(approval_id, grant, approver_name, comment)
        .await
    {
        Ok(decided) => decided,
        Err(StoreError::Invalid(message)) => {
            return Err(Error::conflict(message)
                .with_details(json!({ "approval_id": approval_id, "status": existing.status })));
        }
        Err(e) => return Err(e.into()),
    };
    let delivery = delivery(store, &decided, before, grant).await?;
    Ok(Decision {
        approval: decided,
        delivery,
    })
}

/// Which event the run got: in its log after `before` (applied), or waiting in its inbox for
/// the lease holder (queued; the event named from the waiting state's policy).
async fn delivery(
    store: &Store,
    decided: &Approval,
    before: i64,
    grant: bool,
) -> Result<Delivery, Error> {
    let id = decided.approval_id.to_string();
    let events = store.history_after(decided.run_id, before).await?;
    let run = store.run(decided.run_id).await?;
    if let Some(e) = events
        .iter()
        .find(|e| e.payload.get("approval_id").and_then(Value::as_str) == Some(id.as_str()))
    {
        return Ok(Delivery {
            outcome: "applied".to_owned(),
            event: Some(e.kind.clone()),
            sequence: Some(e.sequence),
            state: Some(run.state),
        });
    }
    let def = store
        .load_definition(&run.definition, Some(run.version))
        .await?;
    let event = def
        .state(&run.state)
        .and_then(|s| s.approval.as_ref())
        .map(|policy| {
            if grant {
                policy.granted_event().to_owned()
            } else {
                policy.denied_event().to_owned()
            }
        });
    Ok(Delivery {
        outcome: "queued".to_owned(),
        event,
        sequence: None,
        state: Some(run.state),
    })
}

pub async fn definitions(store: &Store) -> Result<Vec<DefinitionRow>, Error> {
    Ok(store.list_definitions().await?)
}

/// One registered version (the current one unless `version`) with its spec.
pub async fn definition(
    store: &Store,
    definition: &str,
    version: Option<u32>,
) -> Result<DefinitionView, Error> {
    let definition = name("name", Some(definition.to_owned()))?.unwrap_or_default();
    let def = store.load_definition(&definition, version).await?;
    let row = store
        .definition_row(&definition, Some(def.version()))
        .await?;
    let spec = serde_json::to_value(def.spec())
        .map_err(|e| Error::from(StoreError::Corrupt(e.to_string())))?;
    Ok(DefinitionView {
        name: def.name().to_owned(),
        version: def.version(),
        hash: def.hash().to_owned(),
        current: row.current,
        registered_by: row.registered_by,
        registered_at: row.created_at,
        spec,
    })
}

/// Refuses to give built-in name `name` a version other than the one this binary ships
/// (`version` with body `hash`, or any body when `hash` is absent) unless `allow_builtin`:
/// such a version would change what every run of the built-in does.
fn builtin_unshadowed(
    name: &str,
    version: u32,
    hash: Option<&str>,
    allow_builtin: bool,
) -> Result<(), Error> {
    let Some(Ok(shipped)) = rein_core::builtin::load(name) else {
        return Ok(());
    };
    let is_shipped = version == shipped.version() && hash.is_none_or(|h| h == shipped.hash());
    if is_shipped || allow_builtin {
        return Ok(());
    }
    Err(Error::conflict(format!(
        "{name} is a built-in definition (this binary ships v{}): another version of it would \
         change what every run of {name} does. Register your own under another name, or, as an \
         admin who means to replace it, pass allow_builtin=true (`--allow-builtin`)",
        shipped.version()
    ))
    .with_details(json!({ "definition": name, "builtin_version": shipped.version() })))
}

/// Refuses a definition whose model state would send its key to an endpoint the key is not
/// bound to (a registration rule: versions stored before it still load, and their workers
/// refuse such a call).
fn unbound_keys_refused(
    keys: &rein_core::model_keys::KeyBindings,
    def: &Definition,
) -> Result<(), Error> {
    let unbound = keys.problems(def.spec());
    let Some((_, first)) = unbound.first() else {
        return Ok(());
    };
    let problems: Vec<Value> = unbound
        .iter()
        .map(|(item, why)| json!({ "item": item, "reason": why.to_string() }))
        .collect();
    Err(Error::validation(format!(
        "the definition's model key is not bound to its endpoint: {first}"
    ))
    .with_details(json!({ "problems": problems })))
}

/// Validates a definition document and stores it as a version published by `publisher`;
/// every problem is listed in `details.problems` with its location.
pub async fn register(
    store: &Store,
    text: &str,
    format: Format,
    publisher: Publisher<'_>,
) -> Result<RegisterResponse, Error> {
    let def = Definition::parse(text, format, &GuardRegistry::new()).map_err(|e| {
        let problems: Vec<Value> = e
            .problems()
            .into_iter()
            .map(|p| json!({ "item": p.item, "reason": p.reason }))
            .collect();
        Error::validation(format!(
            "the definition is invalid ({} problem{})",
            problems.len(),
            if problems.len() == 1 { "" } else { "s" }
        ))
        .with_details(json!({ "problems": problems }))
    })?;
    unbound_keys_refused(publisher.model_keys, &def)?;
    // What cannot be stored is refused as such before who may store it is asked.
    let body = serde_json::to_value(def.spec())
        .map_err(|e| Error::from(StoreError::Corrupt(e.to_string())))?;
    rein_store::input::check_json("definition", &body)?;
    builtin_unshadowed(
        def.name(),
        def.version(),
        Some(def.hash()),
        publisher.allow_builtin,
    )?;
    let published = store
        .publish_definition(
            &def,
            Publication {
                by: publisher.by,
                make_current: publisher.make_current,
            },
        )
        .await?;
    Ok(RegisterResponse {
        name: def.name().to_owned(),
        version: def.version(),
        created: published.created,
        current_version: published.current_version,
        warnings: def
            .warnings()
            .iter()
            .map(|w| json!({ "item": w.item, "reason": w.reason }))
            .collect(),
    })
}

/// Points definition `name` at its registered `version`, as `by`: runs enqueued without a
/// version start with it from now on.
pub async fn set_current(
    store: &Store,
    definition: &str,
    version: u32,
    (by, allow_builtin): (&str, bool),
) -> Result<CurrentResponse, Error> {
    let definition = name("name", Some(definition.to_owned()))?.unwrap_or_default();
    if !(1..=rein_core::limits::VERSION_MAX).contains(&version) {
        return Err(Error::validation(format!(
            "a definition version is 1..={}",
            rein_core::limits::VERSION_MAX
        ))
        .with_details(json!({ "field": "version" })));
    }
    builtin_unshadowed(&definition, version, None, allow_builtin)?;
    let moved = store
        .set_current_definition(&definition, version, by)
        .await?;
    Ok(CurrentResponse {
        name: definition,
        version: moved.version,
        previous: moved.previous,
    })
}

/// The diagnosis of `rein why` (seed 000 §16) as one document.
/// Whether `text` names a blob: exactly 64 lowercase hex digits.
pub fn blob_hash(text: &str) -> Result<&str, Error> {
    if text.len() == 64
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Ok(text);
    }
    Err(Error::validation(format!(
        "`{}` is not a blob hash: a blob is named by the 64 lowercase hex digits of its sha256, as an event's `{{\"$blob\": {{\"sha256\": ...}}}}` reference shows it",
        rein_core::text::storable(&text.chars().take(80).collect::<String>())
    ))
    .with_details(json!({ "field": "sha256" })))
}

/// The blob named `sha256`, for a reader that may see it: some run it may read refers to it
/// (for a token bound to queues, a run in one of them; on the database, any run), or with
/// `run`, that run (which it may read) or a run it was forked from. A run refers to the
/// blobs its commits stored or found stored, never to a hash written into a payload. Not
/// found alike when there is no such blob and when the reader may not see it, so a hash's
/// existence is not told to whoever guesses it.
pub async fn blob(
    store: &Store,
    sha256: &str,
    run: Option<Uuid>,
    token: Option<&TokenInfo>,
) -> Result<BlobView, Error> {
    let sha256 = blob_hash(sha256)?;
    let queues = token.and_then(|t| t.bounds.queues.as_deref());
    match store.blob_seen_from(sha256, queues, run).await? {
        Some((bytes, value)) => Ok(BlobView {
            sha256: sha256.to_owned(),
            bytes,
            value,
        }),
        None => match store.blob_forgotten_by(sha256, queues, run).await? {
            Some(run) => Err(Error::not_found(format!(
                "blob {sha256} was forgotten: the redaction of run {run} deleted it, as only \
                 finished, redacted runs referred to it"
            ))
            .with_details(json!({ "sha256": sha256, "redacted_run": run }))),
            None => Err(Error::not_found(format!(
            "no blob {sha256} that a run you may read refers to (event payloads show blob references as `{{\"$blob\": {{\"sha256\": ...}}}}`)"
        ))
        .with_details(json!({ "sha256": sha256 }))),
        },
    }
}

/// How many blobs are stored and their bytes.
pub async fn blob_stats(store: &Store) -> Result<BlobStatsView, Error> {
    let stats = store.blob_stats().await?;
    Ok(BlobStatsView {
        blobs: stats.blobs,
        stored_bytes: stats.stored_bytes,
        refs_to_review: stats.refs_to_review,
    })
}

pub async fn why(store: &Store, run_id: Uuid) -> Result<Value, Error> {
    let facts = store.why(run_id).await?;
    let def = store
        .load_definition(&facts.run.definition, Some(facts.run.version))
        .await?;
    Ok(crate::why::diagnosis(&facts, &def))
}

/// A run as the document every route answers with.
pub fn run_json(row: &rein_store::RunRow) -> Value {
    json!({
        "run_id": row.run_id,
        "definition": row.definition,
        "version": row.version,
        "status": row.status,
        "state": row.state,
        "sequence": row.last_sequence,
        "attempt": row.projection.attempt,
        "steps_completed": row.projection.steps_completed,
        "pending_action": row.projection.action,
        "terminal_reason": row.terminal_reason,
        "enqueued_by": row.enqueued_by,
        "queue": row.queue,
        "priority": row.priority,
        "parent_run_id": row.parent_run_id,
        "finished_at": row.finished_at,
        "lease": {
            "worker": row.lease_owner,
            "token": row.fencing_token,
            "until": row.lease_until,
            "live": row.lease_live,
        },
        "wake_at": row.wake_at,
        "created_at": row.created_at,
        "updated_at": row.updated_at,
        "state_entered_at": row.state_entered_at,
        "data": row.projection.data,
    })
}

/// The live webhooks, oldest first, without their secrets.
pub async fn webhooks(store: &Store) -> Result<Vec<rein_store::Webhook>, Error> {
    Ok(store.webhooks().await?)
}

/// Webhook deliveries, newest first, only those in `status` when given; at most `limit`
/// (default 50).
pub async fn webhook_deliveries(
    store: &Store,
    status: Option<&str>,
    limit: Option<i64>,
) -> Result<Vec<rein_store::WebhookDelivery>, Error> {
    let limit = page(limit)?;
    Ok(store.webhook_deliveries(status, limit).await?)
}
