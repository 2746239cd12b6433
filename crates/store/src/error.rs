#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("DATABASE_URL is not a valid PostgreSQL URL: {0}")]
    BadUrl(String),
    #[error(
        "cannot reach PostgreSQL: {0}. Check that the server is running and DATABASE_URL is right, or unset DATABASE_URL to let `rein demo` start a private server"
    )]
    Unreachable(String),
    #[error("migration failed: {0}")]
    Migrate(sqlx::migrate::MigrateError),
    #[error("schema mismatch: {0}")]
    SchemaMismatch(String),
    #[error(
        "definition {name} version {version} is already registered with a different body; register it as a new version"
    )]
    DefinitionConflict { name: String, version: u32 },
    #[error("unknown definition {name}{}", .version.map(|v| format!(" version {v}")).unwrap_or_default())]
    UnknownDefinition { name: String, version: Option<u32> },
    #[error("run {0} not found")]
    RunNotFound(uuid::Uuid),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The request is well formed but the run's state refuses it now (a lease held, a key
    /// the definition reads, a run that moved meanwhile).
    #[error("{0}")]
    Conflict(String),
    /// One field of the request cannot be taken as it is (SPEC Z2).
    #[error("invalid request: {reason}")]
    InvalidField { field: String, reason: String },
    /// The sender may not write this event (SPEC Z3): engine events and call results are the
    /// engine's, and outside callers send only the definition's external events.
    #[error("{event} is not accepted from {sender}: {reason}")]
    NotAllowed {
        event: String,
        sender: String,
        reason: String,
    },
    /// An approval event sent by a caller who may not decide approvals (SPEC Z1, Z3).
    #[error("{event} delivers an approval decision: sending it needs the approve scope")]
    NeedsApprover { event: String },
    /// A grant by the person who enqueued the run, where the definition or the deployment
    /// separates the two duties (SPEC H1).
    #[error(
        "{approver} enqueued run {run_id} and may not grant its approvals ({rule}): another person with the approve scope must grant it (denying it stays allowed)"
    )]
    ApproverIsEnqueuer {
        run_id: uuid::Uuid,
        approver: String,
        /// Which rule: the definition's policy or the deployment's flag.
        rule: String,
    },
    /// A client idempotency key used again with a different request (SPEC I3).
    #[error(
        "idempotency key `{key}` was already used with a different {what}; use a new key for a new request"
    )]
    KeyConflict { key: String, what: String },
    /// A request beyond what the caller's token is bound to: another queue, a higher
    /// priority (SPEC Z4).
    #[error(transparent)]
    OutOfBounds(crate::OutOfBounds),
    /// One of the caller's token quotas is used up (SPEC Z4).
    #[error(transparent)]
    QuotaExceeded(crate::QuotaExceeded),
    #[error(transparent)]
    InvalidTransition(#[from] rein_core::InvalidTransition),
    #[error("database error: {0}")]
    Db(sqlx::Error),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if is_unreachable(&e) {
            StoreError::Unreachable(e.to_string())
        } else {
            StoreError::Db(e)
        }
    }
}

impl StoreError {
    pub(crate) fn from_connect(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::Database(_) | sqlx::Error::Configuration(_) => {
                StoreError::Unreachable(e.to_string())
            }
            other => StoreError::Unreachable(other.to_string()),
        }
    }

    /// True when PostgreSQL refused the statement for lack of a privilege (SQLSTATE 42501),
    /// e.g. a worker's database user asked to change the schema.
    pub fn is_permission_denied(&self) -> bool {
        let db_error = match self {
            StoreError::Db(e) => e.as_database_error(),
            StoreError::Migrate(sqlx::migrate::MigrateError::Execute(e))
            | StoreError::Migrate(sqlx::migrate::MigrateError::ExecuteMigration(e, _)) => {
                e.as_database_error()
            }
            _ => None,
        };
        db_error.and_then(|d| d.code()).as_deref() == Some("42501")
    }

    /// True for errors that a retry after a pause may cure (connection lost, server
    /// restarting, serialization failure).
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Unreachable(_) => true,
            StoreError::Db(e) => {
                is_unreachable(e)
                    || e.as_database_error()
                        .and_then(|d| d.code())
                        .is_some_and(|c| {
                            c.starts_with("40") || c.starts_with("57") || c.starts_with("08")
                        })
            }
            _ => false,
        }
    }
}

pub fn is_unreachable(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Tls(_)
    )
}
