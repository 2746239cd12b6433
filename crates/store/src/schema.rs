//! The schema's two kinds of change, so a fleet upgrades without stopping (SPEC V1).
//!
//! An *expand* migration (`migrations/*.sql`) only adds: binaries of the release before it
//! keep working on the expanded schema, so it runs as soon as any new binary starts. A
//! *contract* migration (`migrations/contract/*.sql`, named `VERSION_contract_*.sql`) takes
//! away what only older releases used; it runs only from `rein migrate --contract`, and only
//! while every live member says (in its heartbeat, `info.schema`) that it embeds it.
//!
//! A binary reads the schema as current when every expand migration it knows is applied and
//! everything applied that it does not know is an expand step of a newer release. A
//! contract step it does not know means a newer release took something away this binary may
//! use: it refuses to start and says to upgrade.

use serde::Serialize;
use sqlx::migrate::Migrator;

use crate::{MIGRATOR, SchemaState, Store, StoreError, is_unreachable};

/// The contract migrations this binary embeds.
pub static CONTRACT_MIGRATOR: Migrator = sqlx::migrate!("../../migrations/contract");

/// How a contract migration's description starts (`VERSION_contract_*.sql`), which is how a
/// binary tells one it does not embed from an expand step.
const CONTRACT_PREFIX: &str = "contract";

/// The newest migration, expand or contract, this binary embeds: what its heartbeat reports
/// as `info.schema`.
pub fn schema_version() -> i64 {
    MIGRATOR
        .iter()
        .chain(CONTRACT_MIGRATOR.iter())
        .map(|m| m.version)
        .max()
        .unwrap_or(0)
}

/// `migrations` with applied versions it does not embed tolerated: the other kind's steps,
/// and a newer release's expand steps.
fn tolerant(migrations: &Migrator) -> Migrator {
    let mut m = Migrator::with_migrations(migrations.iter().cloned().collect());
    m.set_ignore_missing(true);
    m
}

/// The name every connection of this process gives the database: its pid and the newest
/// migration it embeds, so an operator (and `rein migrate --contract`) can tell which release
/// each connected process is. Releases before this one name themselves `rein-PID`.
pub fn application_name() -> String {
    format!("rein-{}-s{}", std::process::id(), schema_version())
}

/// The `application_name` pattern of process `pid`'s connections, whichever release it is:
/// `rein-PID` or `rein-PID-s...`. Use as `application_name = $1 OR application_name LIKE $1 || '-%'`.
pub fn application_name_of(pid: impl std::fmt::Display) -> String {
    format!("rein-{pid}")
}

/// Something a contract step waits for: a live member (by its heartbeat) or a process
/// connected to the database right now (by its connections' name) of an older release.
#[derive(Debug, Clone, Serialize)]
pub struct Blocker {
    /// The member's id, or the connections' `application_name`.
    pub worker_id: String,
    /// The member's role, or the database user the connections log in as.
    pub role: String,
    /// The newest migration it embeds; `None` for a release that does not say.
    pub schema: Option<i64>,
    /// Since its last heartbeat; `None` for a connected process.
    pub silent_ms: Option<f64>,
    /// `heartbeat` or `connection`.
    pub seen_by: &'static str,
    /// Connections it holds (for `connection`).
    pub connections: i64,
}

/// What `rein migrate --contract` did or, with a dry run or blockers, would do.
#[derive(Debug, Clone, Serialize)]
pub struct ContractPlan {
    /// Contract migrations this binary embeds that are not applied yet, oldest first.
    pub pending: Vec<Pending>,
    /// Live members that predate the newest pending step.
    pub blockers: Vec<Blocker>,
    /// Whether the pending steps were applied.
    pub applied: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Pending {
    pub version: i64,
    pub description: String,
}

impl Store {
    /// Takes `rein_runs`' first statistics once it holds `at_least` runs, if nobody has
    /// (`rein_first_statistics`): plans made on a nearly empty, never analyzed table scan
    /// it, and this makes every connection plan again. True once the table has statistics.
    pub async fn first_statistics(&self, at_least: u64) -> Result<bool, StoreError> {
        Ok(sqlx::query_scalar("SELECT rein_first_statistics($1)")
            .bind(at_least.min(i64::MAX as u64) as i64)
            .fetch_one(self.pool())
            .await?)
    }

    /// Applies the expand migrations this binary embeds (what every role that starts work
    /// does when the schema is behind), then registers the built-in definitions.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        tolerant(&MIGRATOR)
            .run(self.pool())
            .await
            .map_err(StoreError::Migrate)?;
        self.register_builtins().await
    }

    /// Where the database's schema stands against this binary's migrations.
    pub async fn schema_state(&self) -> Result<SchemaState, StoreError> {
        let applied: Vec<(i64, String)> = match sqlx::query_as(
            "SELECT version, description FROM _sqlx_migrations WHERE success ORDER BY version",
        )
        .fetch_all(self.pool())
        .await
        {
            Ok(applied) => applied,
            Err(e) if is_unreachable(&e) => return Err(e.into()),
            Err(_) => return Ok(SchemaState::Missing),
        };
        let embeds = |v: i64| MIGRATOR.version_exists(v) || CONTRACT_MIGRATOR.version_exists(v);
        let contracted_by_newer = applied
            .iter()
            .any(|(v, d)| !embeds(*v) && d.starts_with(CONTRACT_PREFIX));
        let expand_missing = MIGRATOR
            .iter()
            .any(|m| !applied.iter().any(|(v, _)| *v == m.version));
        Ok(if contracted_by_newer {
            SchemaState::Newer
        } else if expand_missing {
            SchemaState::Older
        } else {
            SchemaState::Current
        })
    }

    /// The contract steps this binary embeds that are not applied, and the live members that
    /// keep them from running. With `apply`, runs them when nothing blocks (expand steps
    /// first, so a contract never runs on a schema behind it).
    pub async fn contract(&self, apply: bool) -> Result<ContractPlan, StoreError> {
        if apply {
            self.migrate().await?;
        }
        let applied: Vec<i64> =
            match sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                .fetch_all(self.pool())
                .await
            {
                Ok(applied) => applied,
                Err(e) if is_unreachable(&e) => return Err(e.into()),
                Err(_) => Vec::new(),
            };
        let pending: Vec<Pending> = CONTRACT_MIGRATOR
            .iter()
            .filter(|m| !applied.contains(&m.version))
            .map(|m| Pending {
                version: m.version,
                description: m.description.to_string(),
            })
            .collect();
        let newest = pending.iter().map(|p| p.version).max();
        let blockers = match newest {
            None => Vec::new(),
            Some(newest) => self.older_than(newest).await?,
        };
        let run = apply && !pending.is_empty() && blockers.is_empty();
        if run {
            tolerant(&CONTRACT_MIGRATOR)
                .run(self.pool())
                .await
                .map_err(StoreError::Migrate)?;
        }
        Ok(ContractPlan {
            pending,
            blockers,
            applied: run,
        })
    }

    /// Live members and connected processes that do not embed migration `newest`.
    async fn older_than(&self, newest: i64) -> Result<Vec<Blocker>, StoreError> {
        let mut blockers: Vec<Blocker> = self
            .members()
            .await?
            .into_iter()
            .filter_map(|m| {
                let schema = m.info.get("schema").and_then(serde_json::Value::as_i64);
                schema.is_none_or(|s| s < newest).then_some(Blocker {
                    worker_id: m.worker_id,
                    role: m.role,
                    schema,
                    silent_ms: Some(m.silent_ms),
                    seen_by: "heartbeat",
                    connections: 0,
                })
            })
            .collect();
        // Processes that do not heartbeat (an API, a command) are seen by their connections;
        // any role may read another session's application_name and user.
        let connected: Vec<(String, Option<String>, i64)> = sqlx::query_as(
            "SELECT application_name, usename::text, count(*)
             FROM pg_stat_activity
             WHERE datname = current_database() AND application_name LIKE 'rein-%'
             GROUP BY 1, 2 ORDER BY 1",
        )
        .fetch_all(self.pool())
        .await?;
        for (name, user, connections) in connected {
            let schema = name
                .rsplit_once("-s")
                .and_then(|(_, s)| s.parse::<i64>().ok());
            if schema.is_none_or(|s| s < newest) {
                blockers.push(Blocker {
                    worker_id: name,
                    role: user.unwrap_or_default(),
                    schema,
                    silent_ms: None,
                    seen_by: "connection",
                    connections,
                });
            }
        }
        Ok(blockers)
    }
}
