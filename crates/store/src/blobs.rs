//! Content-addressed payload values (SPEC E5): read back by hash and checked against it.

use rein_core::blob::{BlobRef, PayloadError};
use serde_json::Value;

use crate::{Store, StoreError};

/// Blob storage totals: what the deduplication saves is `referenced_bytes - stored_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobStats {
    pub blobs: i64,
    pub stored_bytes: i64,
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

    /// The size and value of blob `sha256` when some run refers to it (`rein_blob_refs`)
    /// whose queue is among `queues` (any queue when `None`): what a reader bounded to those
    /// queues may see. `None` both for an unknown hash and for one no such run refers to.
    pub async fn blob_seen_from(
        &self,
        sha256: &str,
        queues: Option<&[String]>,
    ) -> Result<Option<(usize, Value)>, StoreError> {
        let row: Option<(i64, Vec<u8>)> = sqlx::query_as(
            "SELECT b.size_bytes, b.content FROM rein_blobs b
             WHERE b.sha256 = $1 AND EXISTS (
                 SELECT 1 FROM rein_blob_refs f JOIN rein_runs r ON r.run_id = f.run_id
                 WHERE f.sha256 = $1 AND ($2::text[] IS NULL OR r.queue = ANY($2)))",
        )
        .bind(sha256)
        .bind(queues)
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
    ) -> Result<Option<uuid::Uuid>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT x.run_id FROM rein_redactions x
             WHERE $1 = ANY(x.blobs_deleted) AND EXISTS (
                 SELECT 1 FROM rein_blob_refs f JOIN rein_runs r ON r.run_id = f.run_id
                 WHERE f.sha256 = $1 AND ($2::text[] IS NULL OR r.queue = ANY($2)))
             ORDER BY x.redacted_at LIMIT 1",
        )
        .bind(sha256)
        .bind(queues)
        .fetch_optional(self.pool())
        .await?)
    }

    pub async fn blob_stats(&self) -> Result<BlobStats, StoreError> {
        let (blobs, stored_bytes): (i64, i64) =
            sqlx::query_as("SELECT count(*), COALESCE(sum(size_bytes), 0)::bigint FROM rein_blobs")
                .fetch_one(self.pool())
                .await?;
        Ok(BlobStats {
            blobs,
            stored_bytes,
        })
    }
}
