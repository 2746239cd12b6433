//! Following a run to its end: every committed event in sequence order, the live deltas of
//! its actions (a model's tokens) when Redis carries them, and how it ended. The API's
//! `GET /v1/runs/{id}/stream` and `rein runs watch` on the database both run [`follow`], so
//! both see the same items in the same order.
//!
//! The committed log is the record; deltas are best effort. PostgreSQL here has no
//! LISTEN/NOTIFY of commits, so the log is polled: the run's row (one primary-key read) every
//! `poll`, and its events after the last one sent only when its sequence moved.

use std::pin::Pin;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use rein_store::{Store, StoredEvent, TokenInfo};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use utoipa::ToSchema;
use uuid::Uuid;

use crate::paging::PAGE_MAX;
use crate::service::{self, PAGE_BYTES_MAX_DEFAULT};
use crate::{Code, Error};

/// How often the run's row is read while nothing moves.
pub const POLL_INTERVAL_MS_DEFAULT: u64 = 200;
/// Items held between [`follow`] and whoever sends them on. A committed event waits for
/// room; a delta that finds none is dropped (the committed reply carries the whole text).
pub const BUFFER: usize = 256;
/// Largest delta passed on; a larger one is dropped.
pub const DELTA_BYTES_MAX: usize = 64 * 1024;

/// A deltas subscription, live before [`follow`] reads the log (see
/// `rein_accel::stream::subscribe_run`).
pub type Deltas = Pin<Box<dyn Stream<Item = String> + Send>>;

/// What following a run yields, in order: its committed events (sequence after sequence),
/// deltas in between, and last its end.
#[derive(Debug)]
pub enum Item {
    Committed(StoredEvent),
    /// One delta document as the worker published it (`{"type":"delta",...}`).
    Delta(Value),
    End(RunEnd),
}

/// How a run ended: the `end` event of a stream, what `rein runs watch` exits by.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RunEnd {
    pub run_id: Uuid,
    /// `succeeded`, `failed` or `cancelled`: the terminal state's `outcome`; a run that a
    /// CANCEL ended is `cancelled`.
    pub outcome: String,
    /// Always `terminal`.
    pub status: String,
    /// The terminal state it is in (the definition's own name).
    pub state: String,
    /// Its last event's sequence number.
    pub sequence: i64,
    pub terminal_reason: Option<String>,
}

impl RunEnd {
    pub fn succeeded(&self) -> bool {
        self.outcome == "succeeded"
    }
}

/// Checks that `token` may read run `run_id` (it exists; a token bound to queues reaches
/// only runs in them), before a stream of it starts.
pub async fn open(store: &Store, run_id: Uuid, token: Option<&TokenInfo>) -> Result<(), Error> {
    store.run(run_id).await?;
    service::within_queues(store, token, run_id).await
}

/// The `after` a follower starts from: `Last-Event-ID` (a reconnecting SSE client's) or the
/// `after` it asked for, checked.
pub fn start_after(last_event_id: Option<&str>, after: Option<i64>) -> Result<i64, Error> {
    let negative = |field: &str| {
        Error::validation(format!(
            "{field} must be a sequence number (0 or more): the `id` of the last event read"
        ))
        .with_details(json!({ "field": field }))
    };
    // Checked even when a Last-Event-ID wins over it: a bad parameter is refused, not ignored.
    if after.is_some_and(|n| n < 0) {
        return Err(negative("after"));
    }
    let after = match last_event_id.map(str::trim) {
        Some(text) => Some(text.parse::<i64>().map_err(|_| {
            Error::validation(format!(
                "Last-Event-ID must be the `id` of an event of this stream (a sequence number), not `{}`",
                text.chars().take(40).collect::<String>()
            ))
            .with_details(json!({ "field": "Last-Event-ID" }))
        })?),
        None => after,
    };
    match after.unwrap_or(0) {
        n if n < 0 => Err(negative("Last-Event-ID")),
        n => Ok(n),
    }
}

/// Sends run `run_id`'s items to `tx`: its committed events after sequence `after`, then,
/// once it has caught up, each new one and the deltas of `deltas`, until the run is terminal
/// (then [`Item::End`]) or `tx` is closed. An error (the database unreachable, a gap in
/// the log) is sent last.
pub async fn follow(
    store: Store,
    run_id: Uuid,
    after: i64,
    deltas: Option<Deltas>,
    poll: Duration,
    tx: mpsc::Sender<Result<Item, Error>>,
) {
    if let Err(e) = follow_log(&store, run_id, after, deltas, poll, &tx).await {
        let _ = tx.send(Err(e)).await;
    }
}

async fn follow_log(
    store: &Store,
    run_id: Uuid,
    after: i64,
    mut deltas: Option<Deltas>,
    poll: Duration,
    tx: &mpsc::Sender<Result<Item, Error>>,
) -> Result<(), Error> {
    let mut last = after;
    let mut pump: Option<Pump> = None;
    loop {
        if tx.is_closed() {
            return Ok(());
        }
        let row = store.run(run_id).await?;
        while row.last_sequence > last {
            let page = service::events(
                store,
                run_id,
                Some(last),
                Some(PAGE_MAX),
                PAGE_BYTES_MAX_DEFAULT,
            )
            .await?;
            if page.events.is_empty() {
                break;
            }
            for event in page.events {
                check_next(last, event.sequence, run_id)?;
                last = event.sequence;
                if tx.send(Ok(Item::Committed(event))).await.is_err() {
                    return Ok(());
                }
            }
        }
        if row.status == "terminal" && last >= row.last_sequence {
            let end = end_of(store, &row).await?;
            let _ = tx.send(Ok(Item::End(end))).await;
            return Ok(());
        }
        // Caught up: from now on deltas are passed on as they come. Those published while the
        // log was read waited in the subscription.
        if pump.is_none()
            && let Some(deltas) = deltas.take()
        {
            pump = Some(Pump(tokio::spawn(pass_deltas(deltas, tx.clone()))));
        }
        tokio::time::sleep(poll).await;
    }
}

/// Fails unless `sequence` follows `last`: the log has no gaps, so a follower that sees one
/// has read it wrong and must not pretend otherwise.
pub fn check_next(last: i64, sequence: i64, run_id: Uuid) -> Result<(), Error> {
    if sequence == last + 1 {
        return Ok(());
    }
    Err(Error::new(
        Code::Internal,
        format!(
            "run {run_id}'s log read event {sequence} after event {last}: events are missing; check the log with `rein runs verify {run_id}`"
        ),
    ))
}

/// The delta task of a follower; stopped when the follower ends.
struct Pump(tokio::task::JoinHandle<()>);

impl Drop for Pump {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Passes each delta that is a JSON object of at most [`DELTA_BYTES_MAX`] bytes on, dropping
/// it when the buffer is full, until the subscription or `tx` ends.
async fn pass_deltas(mut deltas: Deltas, tx: mpsc::Sender<Result<Item, Error>>) {
    while let Some(text) = deltas.next().await {
        let Some(delta) = delta_of(&text) else {
            tracing::debug!(
                bytes = text.len(),
                "a delta that is not a small JSON object is dropped"
            );
            continue;
        };
        match tx.try_send(Ok(Item::Delta(delta))) {
            Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => return,
        }
    }
    tracing::debug!("the deltas subscription ended; committed events still follow");
}

/// A published delta as passed on: a JSON object with a `type`, of at most
/// [`DELTA_BYTES_MAX`] bytes.
pub fn delta_of(text: &str) -> Option<Value> {
    if text.len() > DELTA_BYTES_MAX {
        return None;
    }
    let value: Value = serde_json::from_str(text).ok()?;
    value.get("type")?.as_str()?;
    Some(value)
}

/// How the terminal run `row` ended, judged as the finished-runs metric judges it: the
/// terminal state's `outcome`, `cancelled` when a CANCEL ended it.
pub async fn end_of(store: &Store, row: &rein_store::RunRow) -> Result<RunEnd, Error> {
    let def = store
        .load_definition(&row.definition, Some(row.version))
        .await?;
    let last = store
        .history_page(
            row.run_id,
            row.last_sequence - 1,
            1,
            rein_store::PageView {
                with_data: true,
                bytes_max: PAGE_BYTES_MAX_DEFAULT as i64,
            },
        )
        .await?;
    let last = last.rows.first();
    let finish = rein_store::metrics::Finish::of(
        &def,
        def.initial_state(),
        &row.state,
        last.map(|e| (e.kind.as_str(), &e.payload)),
    );
    let outcome = match finish {
        Some(finish) => finish.as_str(),
        // A run that starts in a terminal state never ran a step.
        None => "failed",
    };
    Ok(RunEnd {
        run_id: row.run_id,
        outcome: outcome.to_owned(),
        status: row.status.clone(),
        state: row.state.clone(),
        sequence: row.last_sequence,
        terminal_reason: row.terminal_reason.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_starts_after_last_event_id_before_the_query_and_refuses_what_is_not_a_sequence() {
        assert_eq!(start_after(None, None).unwrap(), 0);
        assert_eq!(start_after(None, Some(4)).unwrap(), 4);
        assert_eq!(start_after(Some(" 7 "), Some(4)).unwrap(), 7);
        for bad in ["x", "", "1.5"] {
            let e = start_after(Some(bad), None).unwrap_err();
            assert_eq!(e.code, Code::ValidationFailed, "{bad}");
        }
        assert!(start_after(Some("-1"), None).is_err());
        assert!(start_after(None, Some(-1)).is_err());
    }

    #[test]
    fn only_small_json_objects_with_a_type_are_deltas() {
        assert_eq!(
            delta_of(r#"{"type":"delta","content":"He"}"#),
            Some(json!({"type": "delta", "content": "He"}))
        );
        assert_eq!(delta_of("not json"), None);
        assert_eq!(delta_of(r#"{"content":"no type"}"#), None);
        assert_eq!(delta_of("[1]"), None);
        let big = format!(
            r#"{{"type":"delta","content":"{}"}}"#,
            "x".repeat(DELTA_BYTES_MAX)
        );
        assert_eq!(delta_of(&big), None);
    }

    #[test]
    fn a_sequence_that_skips_one_is_refused() {
        let run = Uuid::nil();
        assert!(check_next(0, 1, run).is_ok());
        assert!(check_next(4, 5, run).is_ok());
        let gap = check_next(4, 6, run).unwrap_err();
        assert_eq!(gap.code, Code::Internal);
        assert!(gap.message.contains("missing"), "{}", gap.message);
        assert!(check_next(4, 4, run).is_err(), "a repeat");
    }
}
