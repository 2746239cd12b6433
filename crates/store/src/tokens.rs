//! API bearer tokens with scopes (SPEC Z1). A token's secret is `rein_` followed by 64 hex
//! digits of randomness; only its SHA-256 is stored, so a leaked table grants nothing.
//!
//! A token may also be bounded (SPEC Z4): to the queues its runs are in, to a priority
//! ceiling, and by quotas on its unfinished runs and on the runs it creates per minute.
//! Quotas are counted in PostgreSQL from the runs each token created, by the database clock,
//! so every API process behind a load balancer enforces the same numbers.

use serde::Serialize;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::{EnqueueRequest, Enqueued, Store, StoreError};

/// The scopes a token may carry; `admin` implies every other.
pub const SCOPES: [&str; 6] = ["read", "enqueue", "approve", "operate", "publish", "admin"];
/// The longest subject (who the token speaks for) accepted.
pub const SUBJECT_BYTES_MAX: usize = 128;
/// The longest secret worth hashing: anything longer is not one of ours.
const SECRET_BYTES_MAX: usize = 128;
const SECRET_PREFIX: &str = "rein_";
/// Most queues one token may be bound to.
pub const TOKEN_QUEUES_MAX: usize = 64;
/// Largest quota a token may carry (runs in flight, runs created per minute).
pub const TOKEN_QUOTA_MAX: u32 = 1_000_000;
/// What a caller whose unfinished runs are at its quota is told to wait: nobody knows when
/// one of them finishes, so this is a polite pace for asking again.
pub const IN_FLIGHT_RETRY_AFTER_S: u64 = 5;
/// The window of the enqueue-rate quota, in seconds.
const RATE_WINDOW_S: i64 = 60;
/// First key of the advisory locks that serialise one token's quota checks (the second is
/// the token's own): ASCII "rein". Two-key advisory locks never meet the migrator's one-key
/// lock.
const QUOTA_LOCK_SPACE: i32 = 0x7265_696e;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Read,
    Enqueue,
    Approve,
    Operate,
    /// Register definition versions and choose each name's current version (SPEC Z4).
    Publish,
    Admin,
}

impl Scope {
    pub fn parse(name: &str) -> Option<Scope> {
        Some(match name {
            "read" => Scope::Read,
            "enqueue" => Scope::Enqueue,
            "approve" => Scope::Approve,
            "operate" => Scope::Operate,
            "publish" => Scope::Publish,
            "admin" => Scope::Admin,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Enqueue => "enqueue",
            Scope::Approve => "approve",
            Scope::Operate => "operate",
            Scope::Publish => "publish",
            Scope::Admin => "admin",
        }
    }
}

/// What a valid, unrevoked token grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenInfo {
    pub token_id: Uuid,
    pub subject: String,
    pub scopes: Vec<String>,
    pub bounds: TokenBounds,
}

impl TokenInfo {
    /// Whether the token carries `scope` (or `admin`).
    pub fn allows(&self, scope: Scope) -> bool {
        self.scopes
            .iter()
            .any(|s| s == scope.as_str() || s == Scope::Admin.as_str())
    }

    /// Whether this token may create a run in `queue` with `priority` (enqueue, rerun).
    pub fn may_create(&self, queue: &str, priority: i32) -> Result<(), OutOfBounds> {
        self.may_act_on(queue)?;
        match self.bounds.priority_max {
            Some(max) if priority > max => Err(OutOfBounds::Priority { priority, max }),
            _ => Ok(()),
        }
    }

    /// Whether this token may act on a run in `queue` (send it events, decide its
    /// approvals, run it again).
    pub fn may_act_on(&self, queue: &str) -> Result<(), OutOfBounds> {
        match &self.bounds.queues {
            Some(allowed) if !allowed.iter().any(|q| q == queue) => Err(OutOfBounds::Queue {
                queue: queue.to_owned(),
                allowed: allowed.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Where an enqueue that names no queue goes: the token's first queue, else `default`.
    pub fn default_queue(&self) -> &str {
        self.bounds
            .queues
            .as_ref()
            .and_then(|q| q.first())
            .map_or("default", String::as_str)
    }
}

/// A token as `rein tokens list` shows it: everything but its secret, which is never stored,
/// and its hash, which is nobody's business.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenListing {
    pub token_id: Uuid,
    pub subject: String,
    pub scopes: Vec<String>,
    #[serde(flatten)]
    pub bounds: TokenBounds,
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// When it was revoked; `None` while it is live.
    pub revoked_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl TokenListing {
    fn info(self) -> TokenInfo {
        TokenInfo {
            token_id: self.token_id,
            subject: self.subject,
            scopes: self.scopes,
            bounds: self.bounds,
        }
    }
}

/// A row of `rein_tokens` as stored (its hash left out).
#[derive(sqlx::FromRow)]
struct TokenRow {
    token_id: Uuid,
    subject: String,
    scopes: Vec<String>,
    queues: Option<Vec<String>>,
    priority_max: Option<i32>,
    in_flight_max: Option<i32>,
    enqueue_per_minute_max: Option<i32>,
    created_at: chrono::DateTime<chrono::Utc>,
    revoked_at: Option<chrono::DateTime<chrono::Utc>>,
}

impl TokenRow {
    fn listing(self) -> TokenListing {
        TokenListing {
            token_id: self.token_id,
            subject: self.subject,
            scopes: self.scopes,
            bounds: TokenBounds {
                queues: self.queues,
                priority_max: self.priority_max,
                in_flight_max: self.in_flight_max.map(|n| n as u32),
                enqueue_per_minute_max: self.enqueue_per_minute_max.map(|n| n as u32),
            },
            created_at: self.created_at,
            revoked_at: self.revoked_at,
        }
    }
}

/// The most tokens one `list_tokens` returns.
pub const TOKENS_LIST_MAX: i64 = 10_000;

/// What a token may reach beyond its scopes (SPEC Z4). `None` leaves that bound off, so a
/// token without bounds reaches what its scopes allow everywhere.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TokenBounds {
    /// The queues its runs may be in; the first is where an enqueue naming none goes.
    pub queues: Option<Vec<String>>,
    /// The highest priority it may give a run.
    pub priority_max: Option<i32>,
    /// How many runs it created may be unfinished at once.
    pub in_flight_max: Option<u32>,
    /// How many runs it may create in any minute.
    pub enqueue_per_minute_max: Option<u32>,
}

impl TokenBounds {
    /// Checks the bounds a token is to be made with; the error names the one that is wrong.
    pub fn check(&self) -> Result<(), StoreError> {
        if let Some(queues) = &self.queues {
            if queues.is_empty() || queues.len() > TOKEN_QUEUES_MAX {
                return Err(StoreError::Invalid(format!(
                    "a token is bound to 1..={TOKEN_QUEUES_MAX} queues, not {}",
                    queues.len()
                )));
            }
            if let Some(problem) = queues.iter().find_map(|q| rein_core::name_problem(q)) {
                return Err(StoreError::InvalidField {
                    field: "queue".into(),
                    reason: format!("a token's queue: {problem}"),
                });
            }
        }
        for (what, quota) in [
            ("max-in-flight", self.in_flight_max),
            ("max-enqueue-per-minute", self.enqueue_per_minute_max),
        ] {
            if quota.is_some_and(|n| n == 0 || n > TOKEN_QUOTA_MAX) {
                return Err(StoreError::InvalidField {
                    field: what.into(),
                    reason: format!("{what} must be 1..={TOKEN_QUOTA_MAX}"),
                });
            }
        }
        Ok(())
    }

    fn has_quota(&self) -> bool {
        self.in_flight_max.is_some() || self.enqueue_per_minute_max.is_some()
    }

    /// The queues without repeats, in the order given.
    fn normalized(&self) -> TokenBounds {
        let mut out = self.clone();
        if let Some(queues) = &mut out.queues {
            let mut seen = std::collections::HashSet::new();
            queues.retain(|q| seen.insert(q.clone()));
        }
        out
    }
}

/// A request beyond what the caller's token is bound to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutOfBounds {
    #[error(
        "this token acts only on runs in {}; `{queue}` is not one of them (use a token bound to it)",
        list_queues(allowed)
    )]
    Queue { queue: String, allowed: Vec<String> },
    #[error("this token may give a run priority at most {max}; {priority} is above that")]
    Priority { priority: i32, max: i32 },
}

fn list_queues(queues: &[String]) -> String {
    let quoted: Vec<String> = queues.iter().map(|q| format!("`{q}`")).collect();
    match quoted.len() {
        1 => format!("queue {}", quoted[0]),
        _ => format!("queues {}", quoted.join(", ")),
    }
}

/// Which quota of a token is used up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Quota {
    /// Its unfinished runs.
    InFlight,
    /// The runs it created in the last minute.
    EnqueuePerMinute,
}

impl Quota {
    pub fn as_str(self) -> &'static str {
        match self {
            Quota::InFlight => "in_flight",
            Quota::EnqueuePerMinute => "enqueue_per_minute",
        }
    }
}

/// A run a token may not create now: one of its quotas is used up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct QuotaExceeded {
    pub quota: Quota,
    pub limit: u32,
    /// When asking again may succeed, in whole seconds (at least 1).
    pub retry_after_s: u64,
}

impl QuotaExceeded {
    fn describe(&self) -> String {
        match self.quota {
            Quota::InFlight => format!(
                "this token already has {} unfinished runs, its quota of runs in flight; \
                 enqueue again once one of them finishes",
                self.limit
            ),
            Quota::EnqueuePerMinute => format!(
                "this token created {} runs within the last minute, its quota; retry in {} s",
                self.limit, self.retry_after_s
            ),
        }
    }
}

fn hash_secret(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Checks a subject and scope names; the error says what is wrong.
pub fn check_token_request(subject: &str, scopes: &[String]) -> Result<(), StoreError> {
    if subject.trim().is_empty() || subject.len() > SUBJECT_BYTES_MAX {
        return Err(StoreError::Invalid(format!(
            "the subject must be 1..={SUBJECT_BYTES_MAX} bytes and not blank"
        )));
    }
    // The subject is printed into logs, `rein runs history` and approvals as it is.
    crate::input::check_printable("subject", subject)?;
    if scopes.is_empty() {
        return Err(StoreError::Invalid(format!(
            "a token needs at least one scope (one of {})",
            SCOPES.join(", ")
        )));
    }
    if let Some(bad) = scopes.iter().find(|s| Scope::parse(s).is_none()) {
        return Err(StoreError::Invalid(format!(
            "unknown scope `{bad}`; the scopes are {}",
            SCOPES.join(", ")
        )));
    }
    Ok(())
}

impl Store {
    /// Creates a token for `subject` with `scopes`; returns its id and its secret, which is
    /// not stored and cannot be shown again.
    pub async fn create_token(
        &self,
        subject: &str,
        scopes: &[String],
    ) -> Result<(Uuid, String), StoreError> {
        self.create_bounded_token(subject, scopes, &TokenBounds::default())
            .await
    }

    /// [`Store::create_token`] for a token held to `bounds`.
    pub async fn create_bounded_token(
        &self,
        subject: &str,
        scopes: &[String],
        bounds: &TokenBounds,
    ) -> Result<(Uuid, String), StoreError> {
        check_token_request(subject, scopes)?;
        bounds.check()?;
        let bounds = bounds.normalized();
        let mut scopes: Vec<String> = scopes.to_vec();
        scopes.sort();
        scopes.dedup();
        // Two v4 uuids: 244 bits from the operating system's random source.
        let secret = format!(
            "{SECRET_PREFIX}{}{}",
            Uuid::new_v4().simple(),
            Uuid::new_v4().simple()
        );
        let token_id = Uuid::now_v7();
        sqlx::query(
            "INSERT INTO rein_tokens (token_id, subject, scopes, token_hash, queues, priority_max,
                                      in_flight_max, enqueue_per_minute_max)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(token_id)
        .bind(subject)
        .bind(&scopes)
        .bind(hash_secret(&secret))
        .bind(&bounds.queues)
        .bind(bounds.priority_max)
        .bind(bounds.in_flight_max.map(|n| n as i32))
        .bind(bounds.enqueue_per_minute_max.map(|n| n as i32))
        .execute(self.pool())
        .await?;
        Ok((token_id, secret))
    }

    /// The token this secret belongs to, unless it is unknown or revoked.
    pub async fn verify_token(&self, secret: &str) -> Result<Option<TokenInfo>, StoreError> {
        if !secret.starts_with(SECRET_PREFIX) || secret.len() > SECRET_BYTES_MAX {
            return Ok(None);
        }
        let row: Option<TokenRow> = sqlx::query_as(
            "SELECT token_id, subject, scopes, queues, priority_max, in_flight_max,
                    enqueue_per_minute_max, created_at, revoked_at
             FROM rein_tokens WHERE token_hash = $1 AND revoked_at IS NULL",
        )
        .bind(hash_secret(secret))
        .fetch_optional(self.pool())
        .await?;
        Ok(row.map(|r| r.listing().info()))
    }

    /// The queue run `run_id` is in.
    pub async fn run_queue(&self, run_id: Uuid) -> Result<String, StoreError> {
        sqlx::query_scalar("SELECT queue FROM rein_runs WHERE run_id = $1")
            .bind(run_id)
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::RunNotFound(run_id))
    }

    /// Creates `request`'s run for `token` (none: on the database, which holds every
    /// right). The run must be in one of the token's queues and within its priority
    /// ceiling; the run records the token, and when the token has quotas, the enqueue and
    /// the count of its runs are one transaction, serialised per token, so concurrent API
    /// processes cannot together exceed them. A repeat of a keyed enqueue returns its run
    /// whatever the quotas say: it creates nothing.
    pub async fn enqueue_as(
        &self,
        token: Option<&TokenInfo>,
        mut request: EnqueueRequest,
    ) -> Result<Enqueued, StoreError> {
        let Some(token) = token else {
            return self.enqueue(request).await;
        };
        token
            .may_create(&request.queue, request.priority)
            .map_err(StoreError::OutOfBounds)?;
        // The nil token is the caller of an API serving without authentication.
        if token.token_id.is_nil() {
            return self.enqueue(request).await;
        }
        request.enqueued_token = Some(token.token_id);
        if !token.bounds.has_quota() {
            return self.enqueue(request).await;
        }
        let queue = request.queue.clone();
        let mut tx = self.pool().begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2::text))")
            .bind(QUOTA_LOCK_SPACE)
            .bind(token.token_id)
            .execute(&mut *tx)
            .await?;
        let done = crate::send::enqueue_on(&mut tx, std::slice::from_ref(&request))
            .await?
            .pop()
            .ok_or_else(|| StoreError::Corrupt("enqueue returned no row".into()))?;
        if done.created
            && let Some(exceeded) = quota_exceeded(&mut tx, token).await?
        {
            tx.rollback().await?;
            return Err(StoreError::QuotaExceeded(exceeded));
        }
        tx.commit().await?;
        self.woke(Some(&queue));
        request.root_span(&done);
        Ok(done)
    }

    /// The tokens, oldest first; the revoked ones too with `revoked`. At most
    /// [`TOKENS_LIST_MAX`].
    pub async fn list_tokens(&self, revoked: bool) -> Result<Vec<TokenListing>, StoreError> {
        let rows: Vec<TokenRow> = sqlx::query_as(
            "SELECT token_id, subject, scopes, queues, priority_max, in_flight_max,
                    enqueue_per_minute_max, created_at, revoked_at
             FROM rein_tokens WHERE $1 OR revoked_at IS NULL
             ORDER BY created_at, token_id LIMIT $2",
        )
        .bind(revoked)
        .bind(TOKENS_LIST_MAX)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.into_iter().map(TokenRow::listing).collect())
    }

    /// Revokes a token; false when it was unknown or already revoked.
    pub async fn revoke_token(&self, token_id: Uuid) -> Result<bool, StoreError> {
        Ok(sqlx::query(
            "UPDATE rein_tokens SET revoked_at = clock_timestamp()
             WHERE token_id = $1 AND revoked_at IS NULL",
        )
        .bind(token_id)
        .execute(self.pool())
        .await?
        .rows_affected()
            == 1)
    }
}

/// The first of `token`'s quotas its runs now exceed (the run just created included), with
/// when asking again may succeed. Each count stops one past its quota, so a check costs at
/// most that many index entries.
async fn quota_exceeded(
    tx: &mut sqlx::PgConnection,
    token: &TokenInfo,
) -> Result<Option<QuotaExceeded>, StoreError> {
    if let Some(limit) = token.bounds.in_flight_max {
        let unfinished: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT 1 FROM rein_runs
                                   WHERE enqueued_token = $1 AND status <> 'terminal'
                                   LIMIT $2) AS counted",
        )
        .bind(token.token_id)
        .bind(i64::from(limit) + 1)
        .fetch_one(&mut *tx)
        .await?;
        if unfinished > i64::from(limit) {
            return Ok(Some(QuotaExceeded {
                quota: Quota::InFlight,
                limit,
                retry_after_s: IN_FLIGHT_RETRY_AFTER_S,
            }));
        }
    }
    if let Some(limit) = token.bounds.enqueue_per_minute_max {
        // The newest runs in the window, newest first: when the run just created is one
        // too many, the window has room again once the oldest of the others leaves it.
        let (created, frees_in_ms): (i64, Option<f64>) = sqlx::query_as(
            "SELECT count(*),
                    (extract(epoch FROM min(created_at) + $3 * interval '1 second'
                                        - clock_timestamp()) * 1000)::float8
             FROM (SELECT created_at FROM rein_runs
                   WHERE enqueued_token = $1
                     AND created_at > clock_timestamp() - $3 * interval '1 second'
                   ORDER BY created_at DESC
                   LIMIT $2) AS recent",
        )
        .bind(token.token_id)
        .bind(i64::from(limit) + 1)
        .bind(RATE_WINDOW_S)
        .fetch_one(&mut *tx)
        .await?;
        if created > i64::from(limit) {
            let frees_in_ms = frees_in_ms.unwrap_or(0.0).max(0.0);
            return Ok(Some(QuotaExceeded {
                quota: Quota::EnqueuePerMinute,
                limit,
                retry_after_s: ((frees_in_ms / 1000.0).ceil() as u64).max(1),
            }));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(bounds: TokenBounds) -> TokenInfo {
        TokenInfo {
            token_id: Uuid::nil(),
            subject: "t".into(),
            scopes: vec!["enqueue".into()],
            bounds,
        }
    }

    #[test]
    fn an_unbound_token_reaches_every_queue_and_priority() {
        let t = token(TokenBounds::default());
        t.may_create("payments", i32::MAX).unwrap();
        assert_eq!(t.default_queue(), "default");
    }

    #[test]
    fn a_bound_token_stays_in_its_queues_and_under_its_ceiling() {
        let t = token(TokenBounds {
            queues: Some(vec!["a".into(), "b".into()]),
            priority_max: Some(10),
            ..TokenBounds::default()
        });
        assert_eq!(t.default_queue(), "a");
        t.may_create("b", 10).unwrap();
        assert_eq!(
            t.may_act_on("payments"),
            Err(OutOfBounds::Queue {
                queue: "payments".into(),
                allowed: vec!["a".into(), "b".into()]
            })
        );
        assert_eq!(
            t.may_create("a", 11),
            Err(OutOfBounds::Priority {
                priority: 11,
                max: 10
            })
        );
        assert!(
            t.may_create("payments", 0)
                .unwrap_err()
                .to_string()
                .contains("queues `a`, `b`")
        );
    }

    #[test]
    fn bounds_are_checked_before_a_token_is_made() {
        let bad = [
            TokenBounds {
                queues: Some(vec![]),
                ..TokenBounds::default()
            },
            TokenBounds {
                queues: Some(vec!["no spaces".into()]),
                ..TokenBounds::default()
            },
            TokenBounds {
                queues: Some((0..=TOKEN_QUEUES_MAX).map(|i| format!("q{i}")).collect()),
                ..TokenBounds::default()
            },
            TokenBounds {
                in_flight_max: Some(0),
                ..TokenBounds::default()
            },
            TokenBounds {
                enqueue_per_minute_max: Some(TOKEN_QUOTA_MAX + 1),
                ..TokenBounds::default()
            },
        ];
        for b in bad {
            assert!(b.check().is_err(), "{b:?}");
        }
        let repeated = TokenBounds {
            queues: Some(vec!["a".into(), "b".into(), "a".into()]),
            ..TokenBounds::default()
        };
        repeated.check().unwrap();
        assert_eq!(
            repeated.normalized().queues,
            Some(vec!["a".into(), "b".into()])
        );
    }

    #[test]
    fn subjects_that_would_drive_a_terminal_are_refused() {
        let read = ["read".to_owned()];
        for subject in ["a\nb", "esc\u{1b}[31m", "bell\u{7}"] {
            assert!(check_token_request(subject, &read).is_err(), "{subject:?}");
        }
        check_token_request("alice@example.com", &read).unwrap();
    }
}
