//! API bearer tokens with scopes (SPEC Z1). A token's secret is `rein_` followed by 64 hex
//! digits of randomness; only its SHA-256 is stored, so a leaked table grants nothing.

use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::{Store, StoreError};

/// The scopes a token may carry; `admin` implies every other.
pub const SCOPES: [&str; 6] = ["read", "enqueue", "approve", "operate", "publish", "admin"];
/// The longest subject (who the token speaks for) accepted.
pub const SUBJECT_BYTES_MAX: usize = 128;
/// The longest secret worth hashing: anything longer is not one of ours.
const SECRET_BYTES_MAX: usize = 128;
const SECRET_PREFIX: &str = "rein_";

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
}

impl TokenInfo {
    /// Whether the token carries `scope` (or `admin`).
    pub fn allows(&self, scope: Scope) -> bool {
        self.scopes
            .iter()
            .any(|s| s == scope.as_str() || s == Scope::Admin.as_str())
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
        check_token_request(subject, scopes)?;
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
            "INSERT INTO rein_tokens (token_id, subject, scopes, token_hash) VALUES ($1, $2, $3, $4)",
        )
        .bind(token_id)
        .bind(subject)
        .bind(&scopes)
        .bind(hash_secret(&secret))
        .execute(self.pool())
        .await?;
        Ok((token_id, secret))
    }

    /// The token this secret belongs to, unless it is unknown or revoked.
    pub async fn verify_token(&self, secret: &str) -> Result<Option<TokenInfo>, StoreError> {
        if !secret.starts_with(SECRET_PREFIX) || secret.len() > SECRET_BYTES_MAX {
            return Ok(None);
        }
        let row: Option<(Uuid, String, Vec<String>)> = sqlx::query_as(
            "SELECT token_id, subject, scopes FROM rein_tokens
             WHERE token_hash = $1 AND revoked_at IS NULL",
        )
        .bind(hash_secret(secret))
        .fetch_optional(self.pool())
        .await?;
        Ok(row.map(|(token_id, subject, scopes)| TokenInfo {
            token_id,
            subject,
            scopes,
        }))
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
