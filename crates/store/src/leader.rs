//! Leader leases (SPEC S3): one row per lease name with holder, fencing token and expiry by
//! the database clock. Taking, renewing and keeping a lease is one statement, so any number of
//! candidates may ask at once and at most one holds a live lease.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{Store, StoreError};

/// Longest and shortest leader lease a caller may ask for.
pub const LEADER_TTL_MS_MIN: u64 = 200;
pub const LEADER_TTL_MS_MAX: u64 = 600_000;

/// Takes the lease when it is free or expired, renews it when `$2` holds it; returns the
/// row only when `$2` holds it afterwards.
const ACQUIRE: &str = "
INSERT INTO rein_leader_leases AS l (name, holder, fencing_token, acquired_at, renewed_at, expires_at)
VALUES ($1, $2, 1, clock_timestamp(), clock_timestamp(),
        clock_timestamp() + $3 * interval '1 millisecond')
ON CONFLICT (name) DO UPDATE SET
    holder = EXCLUDED.holder,
    fencing_token = CASE WHEN l.holder = EXCLUDED.holder AND l.expires_at > clock_timestamp()
                         THEN l.fencing_token ELSE l.fencing_token + 1 END,
    acquired_at = CASE WHEN l.holder = EXCLUDED.holder AND l.expires_at > clock_timestamp()
                       THEN l.acquired_at ELSE clock_timestamp() END,
    renewed_at = clock_timestamp(),
    expires_at = EXCLUDED.expires_at
WHERE l.holder = EXCLUDED.holder OR l.expires_at <= clock_timestamp()
RETURNING fencing_token, acquired_at, expires_at";

/// A lease as its holder sees it after taking or renewing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderLease {
    pub fencing_token: i64,
    pub acquired_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

/// Who holds a lease right now, by the database clock.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct LeaderInfo {
    pub name: String,
    pub holder: String,
    pub fencing_token: i64,
    pub acquired_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// Whether `expires_at` is still ahead of the database clock.
    pub live: bool,
}

impl Store {
    /// Takes or renews lease `name` for `holder` for `ttl_ms`; `None` when another holder
    /// has a live lease.
    pub async fn acquire_leader(
        &self,
        name: &str,
        holder: &str,
        ttl_ms: u64,
    ) -> Result<Option<LeaderLease>, StoreError> {
        if !(LEADER_TTL_MS_MIN..=LEADER_TTL_MS_MAX).contains(&ttl_ms) {
            return Err(StoreError::Invalid(format!(
                "leader lease TTL {ttl_ms} ms is outside {LEADER_TTL_MS_MIN}..={LEADER_TTL_MS_MAX}"
            )));
        }
        let row: Option<(i64, DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(ACQUIRE)
            .bind(name)
            .bind(holder)
            .bind(ttl_ms as i64)
            .fetch_optional(self.pool())
            .await?;
        Ok(
            row.map(|(fencing_token, acquired_at, expires_at)| LeaderLease {
                fencing_token,
                acquired_at,
                expires_at,
            }),
        )
    }

    /// Gives lease `name` up if `holder` has it (a clean shutdown), so another candidate
    /// takes over at its next try instead of after the TTL.
    pub async fn release_leader(&self, name: &str, holder: &str) -> Result<bool, StoreError> {
        Ok(sqlx::query(
            "UPDATE rein_leader_leases SET expires_at = clock_timestamp()
             WHERE name = $1 AND holder = $2 AND expires_at > clock_timestamp()",
        )
        .bind(name)
        .bind(holder)
        .execute(self.pool())
        .await?
        .rows_affected()
            == 1)
    }

    /// Lease `name` as it stands, live or not; `None` if nobody ever held it.
    pub async fn leader(&self, name: &str) -> Result<Option<LeaderInfo>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT name, holder, fencing_token, acquired_at, expires_at,
                    expires_at > clock_timestamp() AS live
             FROM rein_leader_leases WHERE name = $1",
        )
        .bind(name)
        .fetch_optional(self.pool())
        .await?)
    }
}
