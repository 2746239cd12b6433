//! Webhooks: outside systems told of approvals and runs' ends by signed POSTs. The
//! deliveries are queued by triggers (`migrations/20261204000100_webhooks.sql`) in the same
//! transaction as the fact they announce; schedulers claim the due ones, post them outside
//! any transaction and record what happened here.

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::{Store, StoreError};

/// Every kind of delivery, as `--kind` and the body's `kind` name it.
pub const WEBHOOK_KINDS: [&str; 6] = [
    "approval.requested",
    "approval.reminder",
    "approval.expired",
    "approval.decided",
    "run.finished",
    "run.failed",
];
/// The shortest signing secret accepted.
pub const WEBHOOK_SECRET_BYTES_MIN: usize = 16;
/// The longest signing secret accepted.
pub const WEBHOOK_SECRET_BYTES_MAX: usize = 1024;
/// The longest definition or queue name a webhook may be bound to.
const WEBHOOK_NAME_BYTES_MAX: usize = 256;
/// Most deliveries one claim takes.
pub const WEBHOOK_CLAIM_MAX: i64 = 1000;
/// Most deliveries one listing shows.
pub const WEBHOOK_DELIVERIES_LIST_MAX: i64 = 1000;
/// The longest error text recorded with a failed attempt.
const DELIVERY_ERROR_BYTES_MAX: usize = 1024;

/// A registered webhook, without its secret.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Webhook {
    pub webhook_id: Uuid,
    pub url: String,
    /// Empty: every kind.
    pub kinds: Vec<String>,
    /// `None`: runs of every definition.
    pub definition: Option<String>,
    /// `None`: every queue.
    pub queue: Option<String>,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
}

/// What `add_webhook` is asked to register.
#[derive(Debug, Clone)]
pub struct NewWebhook<'a> {
    pub url: &'a str,
    pub secret: &'a str,
    pub kinds: &'a [String],
    pub definition: Option<&'a str>,
    pub queue: Option<&'a str>,
    pub created_by: &'a str,
}

impl NewWebhook<'_> {
    /// Refuses a URL that is not http(s) with a host (at most 2048 bytes, no credentials), a
    /// secret outside 16..=1024 bytes, an unknown kind (listing the valid ones) and names
    /// that cannot be stored.
    pub fn check(&self) -> Result<(), StoreError> {
        let field = |field: &str, reason: String| StoreError::InvalidField {
            field: field.into(),
            reason,
        };
        rein_core::http_url::parse(self.url)
            .map_err(|p| field("url", format!("{}; give an http(s) URL", p.reason)))?;
        crate::input::check_text("url", self.url)?;
        if !(WEBHOOK_SECRET_BYTES_MIN..=WEBHOOK_SECRET_BYTES_MAX).contains(&self.secret.len()) {
            return Err(field(
                "secret",
                format!(
                    "the secret is {} bytes; it must be {WEBHOOK_SECRET_BYTES_MIN}..={WEBHOOK_SECRET_BYTES_MAX} \
                     (e.g. `openssl rand -hex 32`)",
                    self.secret.len()
                ),
            ));
        }
        crate::input::check_text("secret", self.secret)?;
        for kind in self.kinds {
            if !WEBHOOK_KINDS.contains(&kind.as_str()) {
                return Err(field(
                    "kind",
                    format!(
                        "unknown kind `{}`; the kinds are {}",
                        rein_core::text::storable(kind),
                        WEBHOOK_KINDS.join(", ")
                    ),
                ));
            }
        }
        for (name, value) in [
            ("definition", self.definition),
            ("queue", self.queue),
            ("created_by", Some(self.created_by)),
        ] {
            let Some(value) = value else { continue };
            crate::input::check_text(name, value)?;
            if value.is_empty() || value.len() > WEBHOOK_NAME_BYTES_MAX {
                return Err(field(
                    name,
                    format!("must be 1..={WEBHOOK_NAME_BYTES_MAX} bytes"),
                ));
            }
        }
        Ok(())
    }
}

/// A delivery as operators see it: no secret, with its webhook's URL.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct WebhookDelivery {
    pub delivery_id: Uuid,
    pub webhook_id: Uuid,
    pub url: String,
    pub kind: String,
    pub run_id: Uuid,
    /// pending | delivered | failed
    pub status: String,
    pub attempts: i32,
    pub last_status_code: Option<i32>,
    pub last_error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub delivered_at: Option<DateTime<Utc>>,
    pub next_attempt_at: DateTime<Utc>,
}

/// A delivery a scheduler claimed: what to post where, and the key to sign it with (no
/// `Debug`, so the secret cannot reach a log by accident).
#[derive(Clone, sqlx::FromRow)]
pub struct DueDelivery {
    pub delivery_id: Uuid,
    pub webhook_id: Uuid,
    pub kind: String,
    pub url: String,
    pub secret: String,
    /// The body exactly as it is signed and sent.
    pub body: String,
    /// Attempts made before this one.
    pub attempts: i32,
    /// Unix seconds by the database clock at the claim: the signature's timestamp.
    pub claimed_at_s: i64,
}

/// What became of a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptFailed {
    /// Another attempt is due after the backoff.
    WillRetry,
    /// The attempts are used up: the delivery is failed.
    GaveUp,
    /// The delivery was no longer this scheduler's (its claim had passed and another
    /// recorded it): nothing changed.
    NotClaimed,
}

const DELIVERY_COLUMNS: &str = "d.delivery_id, d.webhook_id, w.url, d.kind, d.run_id, d.status,
    d.attempts, d.last_status_code, d.last_error, d.created_at, d.delivered_at,
    d.next_attempt_at";

impl Store {
    /// Registers a webhook after [`NewWebhook::check`].
    pub async fn add_webhook(&self, hook: &NewWebhook<'_>) -> Result<Webhook, StoreError> {
        hook.check()?;
        Ok(sqlx::query_as(
            "INSERT INTO rein_webhooks
                 (webhook_id, url, secret, kinds, definition, queue, created_by)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             RETURNING webhook_id, url, kinds, definition, queue, created_at, created_by",
        )
        .bind(Uuid::now_v7())
        .bind(hook.url)
        .bind(hook.secret)
        .bind(hook.kinds)
        .bind(hook.definition)
        .bind(hook.queue)
        .bind(hook.created_by)
        .fetch_one(self.pool())
        .await?)
    }

    /// The live webhooks, oldest first.
    pub async fn webhooks(&self) -> Result<Vec<Webhook>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT webhook_id, url, kinds, definition, queue, created_at, created_by
             FROM rein_webhooks WHERE disabled_at IS NULL ORDER BY created_at, webhook_id",
        )
        .fetch_all(self.pool())
        .await?)
    }

    /// Stops a webhook: nothing more is queued for it, and its pending deliveries fail with
    /// that reason. Its deliveries stay listed. False when no live webhook has this id.
    pub async fn remove_webhook(&self, webhook_id: Uuid) -> Result<bool, StoreError> {
        self.stop_webhook(webhook_id, None).await
    }

    /// Stops a webhook the way [`Store::remove_webhook`] does, recording `reason` (what a
    /// scheduler's egress rules refuse in its URL); its pending deliveries fail with it.
    pub async fn disable_webhook(
        &self,
        webhook_id: Uuid,
        reason: &str,
    ) -> Result<bool, StoreError> {
        self.stop_webhook(webhook_id, Some(reason)).await
    }

    async fn stop_webhook(
        &self,
        webhook_id: Uuid,
        reason: Option<&str>,
    ) -> Result<bool, StoreError> {
        let reason = reason.map(|r| truncated(rein_core::text::storable(r)));
        let error = match &reason {
            Some(reason) => truncated(format!("the webhook was disabled: {reason}")),
            None => "the webhook was removed".to_owned(),
        };
        let mut tx = self.pool().begin().await?;
        let stopped = sqlx::query(
            "UPDATE rein_webhooks SET disabled_at = clock_timestamp(), disabled_reason = $2
             WHERE webhook_id = $1 AND disabled_at IS NULL",
        )
        .bind(webhook_id)
        .bind(&reason)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        sqlx::query(
            "UPDATE rein_webhook_deliveries
             SET status = 'failed', last_error = $2, claimed_until = NULL
             WHERE webhook_id = $1 AND status = 'pending'",
        )
        .bind(webhook_id)
        .bind(&error)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(stopped)
    }

    /// Why a webhook was disabled (`None`: live, removed by an operator, or unknown).
    pub async fn webhook_disabled_reason(
        &self,
        webhook_id: Uuid,
    ) -> Result<Option<String>, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT disabled_reason FROM rein_webhooks WHERE webhook_id = $1")
                .bind(webhook_id)
                .fetch_optional(self.pool())
                .await?
                .flatten(),
        )
    }

    /// Deliveries, newest first; only those with `status` when given.
    pub async fn webhook_deliveries(
        &self,
        status: Option<&str>,
        limit: i64,
    ) -> Result<Vec<WebhookDelivery>, StoreError> {
        if let Some(s) = status
            && !matches!(s, "pending" | "delivered" | "failed")
        {
            return Err(StoreError::InvalidField {
                field: "status".into(),
                reason: format!(
                    "unknown status `{}`; it is pending, delivered or failed",
                    rein_core::text::storable(s)
                ),
            });
        }
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {DELIVERY_COLUMNS}
             FROM rein_webhook_deliveries d JOIN rein_webhooks w USING (webhook_id)
             WHERE $1::text IS NULL OR d.status = $1
             ORDER BY d.created_at DESC, d.delivery_id DESC LIMIT $2"
        )))
        .bind(status)
        .bind(limit.clamp(1, WEBHOOK_DELIVERIES_LIST_MAX))
        .fetch_all(self.pool())
        .await?)
    }

    /// Claims up to `limit` due deliveries for `claim_ms` by the database clock: until then
    /// no other scheduler takes them; past it (this one died mid-post) another does.
    ///
    /// At most `per_webhook_max` posts of one webhook are the caller's at a time: `in_flight`
    /// says how many it is posting to each webhook, and a webhook's due deliveries beyond
    /// what is left to it stay due and unclaimed, so a receiver that hangs cannot take every
    /// slot from the others. Earliest due first, within each webhook and overall.
    pub async fn claim_webhook_deliveries(
        &self,
        limit: i64,
        claim_ms: u64,
        per_webhook_max: i64,
        in_flight: &[(Uuid, i64)],
    ) -> Result<Vec<DueDelivery>, StoreError> {
        let (busy, posts): (Vec<Uuid>, Vec<i64>) = in_flight.iter().copied().unzip();
        Ok(sqlx::query_as(
            "WITH busy AS (
                 SELECT webhook_id, sum(posts) AS posts
                 FROM unnest($3::uuid[], $4::bigint[]) AS b(webhook_id, posts)
                 GROUP BY webhook_id),
             picked AS (
                 SELECT due.delivery_id
                 FROM rein_webhooks w
                 LEFT JOIN busy b USING (webhook_id)
                 CROSS JOIN LATERAL (
                     SELECT d.delivery_id, d.next_attempt_at
                     FROM rein_webhook_deliveries d
                     WHERE d.webhook_id = w.webhook_id
                       AND d.status = 'pending' AND d.next_attempt_at <= clock_timestamp()
                       AND (d.claimed_until IS NULL OR d.claimed_until <= clock_timestamp())
                     ORDER BY d.next_attempt_at
                     LIMIT greatest($5 - COALESCE(b.posts, 0), 0)
                     FOR UPDATE OF d SKIP LOCKED) due
                 ORDER BY due.next_attempt_at
                 LIMIT $1)
             UPDATE rein_webhook_deliveries d
             SET claimed_until = clock_timestamp() + $2 * interval '1 millisecond'
             FROM rein_webhooks w, picked
             WHERE w.webhook_id = d.webhook_id AND d.delivery_id = picked.delivery_id
             RETURNING d.delivery_id, d.webhook_id, d.kind, w.url, w.secret, d.body::text AS body, d.attempts,
                 extract(epoch FROM clock_timestamp())::bigint AS claimed_at_s",
        )
        .bind(limit.clamp(1, WEBHOOK_CLAIM_MAX))
        .bind(claim_ms as i64)
        .bind(&busy)
        .bind(&posts)
        .bind(per_webhook_max.clamp(1, WEBHOOK_CLAIM_MAX))
        .fetch_all(self.pool())
        .await?)
    }

    /// Records a delivery the receiver accepted (a 2xx `status_code`).
    pub async fn webhook_delivered(
        &self,
        delivery_id: Uuid,
        status_code: u16,
    ) -> Result<bool, StoreError> {
        Ok(sqlx::query(
            "UPDATE rein_webhook_deliveries
             SET status = 'delivered', attempts = attempts + 1, delivered_at = clock_timestamp(),
                 claimed_until = NULL, last_status_code = $2, last_error = NULL
             WHERE delivery_id = $1 AND status = 'pending'",
        )
        .bind(delivery_id)
        .bind(i32::from(status_code))
        .execute(self.pool())
        .await?
        .rows_affected()
            == 1)
    }

    /// Records a failed attempt (`status_code` when the receiver answered): the next is due
    /// `backoff_ms` from now by the database clock, unless this was attempt `attempts_max`,
    /// after which the delivery is failed.
    pub async fn webhook_attempt_failed(
        &self,
        delivery_id: Uuid,
        status_code: Option<u16>,
        error: &str,
        backoff_ms: u64,
        attempts_max: u32,
    ) -> Result<AttemptFailed, StoreError> {
        let error = truncated(rein_core::text::storable(error));
        let status: Option<String> = sqlx::query_scalar(
            "UPDATE rein_webhook_deliveries
             SET attempts = attempts + 1, last_status_code = $2, last_error = $3,
                 claimed_until = NULL,
                 next_attempt_at = clock_timestamp() + $4 * interval '1 millisecond',
                 status = CASE WHEN attempts + 1 >= $5 THEN 'failed' ELSE 'pending' END
             WHERE delivery_id = $1 AND status = 'pending'
             RETURNING status",
        )
        .bind(delivery_id)
        .bind(status_code.map(i32::from))
        .bind(&error)
        .bind(backoff_ms as i64)
        .bind(attempts_max as i32)
        .fetch_optional(self.pool())
        .await?;
        Ok(match status.as_deref() {
            None => AttemptFailed::NotClaimed,
            Some("failed") => AttemptFailed::GaveUp,
            Some(_) => AttemptFailed::WillRetry,
        })
    }
}

/// `text` cut to [`DELIVERY_ERROR_BYTES_MAX`] bytes on a character boundary.
fn truncated(mut text: String) -> String {
    if text.len() > DELIVERY_ERROR_BYTES_MAX {
        let mut end = DELIVERY_ERROR_BYTES_MAX;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}
