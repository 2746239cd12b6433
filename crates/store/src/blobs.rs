//! Content-addressed payload values (SPEC E5): read back by hash and checked against it.

use rein_core::blob::{BlobRef, PayloadError};
use serde_json::Value;

use crate::{Store, StoreError};

/// Blob storage totals: what the deduplication saves is `referenced_bytes - stored_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobStats {
    pub blobs: i64,
    pub stored_bytes: i64,
    /// References recorded before commits recorded them that an operator should look at
    /// (`rein_blob_refs_to_review`: a forged reply's reference would be among them).
    pub refs_to_review: i64,
}

/// Whether a reader bounded to queues $2 (any when NULL) may see blob $1: a run in them
/// refers to it or, given run $3 (in them), that run or one it was forked from ($4 steps up).
macro_rules! referred {
    () => {
        "CASE WHEN $3::uuid IS NULL THEN EXISTS (
        SELECT 1 FROM rein_blob_refs f JOIN rein_runs r ON r.run_id = f.run_id
        WHERE f.sha256 = $1 AND ($2::text[] IS NULL OR r.queue = ANY($2)))
    ELSE EXISTS (
        SELECT 1 FROM rein_runs r
        WHERE r.run_id = $3 AND ($2::text[] IS NULL OR r.queue = ANY($2)))
      AND EXISTS (
        SELECT 1 FROM rein_blob_refs f
        WHERE f.sha256 = $1 AND f.run_id IN (SELECT run_id FROM rein_run_line($3, $4::int)))
    END"
    };
}

impl Store {
    /// The value stored under `blob`, after checking its content against the hash.
    pub async fn read_blob(&self, blob: &BlobRef) -> Result<Value, StoreError> {
        let content: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT content FROM rein_blobs WHERE sha256 = $1")
                .bind(&blob.sha256)
                .fetch_optional(self.pool())
                .await?;
        let content = content.ok_or_else(|| {
            StoreError::Corrupt(PayloadError::Missing(blob.sha256.clone()).to_string())
        })?;
        rein_core::blob::decode(blob, &content).map_err(|e| StoreError::Corrupt(e.to_string()))
    }

    /// The value stored under `blob` when run `run_id` may resolve it: the run, or a run it
    /// was forked from, refers to it (`rein_blob_refs`, recorded by the commit that stored or
    /// found the blob). `None` when none does, so a reference a run did not make (a hash
    /// copied from another run's events) reads nothing.
    pub async fn read_blob_of(
        &self,
        run_id: uuid::Uuid,
        blob: &BlobRef,
    ) -> Result<Option<Value>, StoreError> {
        let content: Option<Vec<u8>> = sqlx::query_scalar(
            "SELECT b.content FROM rein_blobs b
             WHERE b.sha256 = $2 AND EXISTS (
                 SELECT 1 FROM rein_blob_refs f
                 WHERE f.sha256 = $2 AND f.run_id IN (SELECT run_id FROM rein_run_line($1, $3)))",
        )
        .bind(run_id)
        .bind(&blob.sha256)
        .bind(crate::FORK_DEPTH_MAX as i32)
        .fetch_optional(self.pool())
        .await?;
        content
            .map(|c| rein_core::blob::decode(blob, &c))
            .transpose()
            .map_err(|e| StoreError::Corrupt(e.to_string()))
    }

    /// The size and value of blob `sha256` when a run whose queue is among `queues` (any
    /// queue when `None`) refers to it (`rein_blob_refs`): what a reader bounded to those
    /// queues may see. With `run`, only that run (when in `queues`) or a run it was forked
    /// from counts. `None` both for an unknown hash and for one no such run refers to.
    pub async fn blob_seen_from(
        &self,
        sha256: &str,
        queues: Option<&[String]>,
        run: Option<uuid::Uuid>,
    ) -> Result<Option<(usize, Value)>, StoreError> {
        let row: Option<(i64, Vec<u8>)> = sqlx::query_as(concat!(
            "SELECT b.size_bytes, b.content FROM rein_blobs b WHERE b.sha256 = $1 AND ",
            referred!()
        ))
        .bind(sha256)
        .bind(queues)
        .bind(run)
        .bind(crate::FORK_DEPTH_MAX as i32)
        .fetch_optional(self.pool())
        .await?;
        let Some((size, content)) = row else {
            return Ok(None);
        };
        let blob = BlobRef {
            sha256: sha256.to_owned(),
            bytes: usize::try_from(size).unwrap_or(0),
        };
        let value = rein_core::blob::decode(&blob, &content)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        Ok(Some((blob.bytes, value)))
    }

    /// The run whose redaction deleted blob `sha256`, when a run among `queues` (any queue
    /// when `None`) refers to it: why a blob that was there is not any more.
    pub async fn blob_forgotten_by(
        &self,
        sha256: &str,
        queues: Option<&[String]>,
        run: Option<uuid::Uuid>,
    ) -> Result<Option<uuid::Uuid>, StoreError> {
        Ok(sqlx::query_scalar(concat!(
            "SELECT x.run_id FROM rein_redactions x WHERE $1 = ANY(x.blobs_deleted) AND ",
            referred!(),
            " ORDER BY x.redacted_at LIMIT 1"
        ))
        .bind(sha256)
        .bind(queues)
        .bind(run)
        .bind(crate::FORK_DEPTH_MAX as i32)
        .fetch_optional(self.pool())
        .await?)
    }

    /// Whether `blob` is not stored because a redaction deleted it, and `run_id` (or a run
    /// it was forked from) refers to it: forgotten on purpose, not lost.
    pub(crate) async fn blob_forgotten(
        &self,
        blob: &BlobRef,
        run_id: uuid::Uuid,
    ) -> Result<bool, StoreError> {
        let stored: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM rein_blobs WHERE sha256 = $1)")
                .bind(&blob.sha256)
                .fetch_one(self.pool())
                .await?;
        Ok(!stored
            && self
                .blob_forgotten_by(&blob.sha256, None, Some(run_id))
                .await?
                .is_some())
    }

    pub async fn blob_stats(&self) -> Result<BlobStats, StoreError> {
        let (blobs, stored_bytes, refs_to_review): (i64, i64, i64) = sqlx::query_as(
            "SELECT count(*), COALESCE(sum(size_bytes), 0)::bigint,
                    (SELECT count(*) FROM rein_blob_refs_to_review)
             FROM rein_blobs",
        )
        .fetch_one(self.pool())
        .await?;
        Ok(BlobStats {
            blobs,
            stored_bytes,
            refs_to_review,
        })
    }
}
