//! How a Rein process starts and ends, whatever its role: the database and Redis flags every
//! role shares, connecting, logs, metrics and traces, signals and exit codes.

mod model_keys;
pub mod telemetry;

pub use model_keys::ModelKeyArgs;

use rein_store::{Store, StoreError};
use tokio_util::sync::CancellationToken;

/// Exit codes shared by every command.
pub mod exit {
    pub const OK: u8 = 0;
    /// Usage or input error.
    pub const INPUT: u8 = 1;
    /// Refused: invalid transition, fenced, a conflict, an event the sender may not send.
    pub const REFUSED: u8 = 2;
    /// Database, API or Redis unreachable or failing, or the schema too old or too new.
    pub const DATABASE: u8 = 3;
    /// The API refused the token: missing, revoked or lacking the scope.
    pub const AUTH: u8 = 4;
    /// `rein runs watch`, `rein enqueue --wait`: the run ended, and not well (its terminal
    /// state's outcome is `failed`, or a CANCEL ended it).
    pub const RUN_FAILED: u8 = 5;
    /// `rein runs watch`, `rein enqueue --wait`: `--timeout` passed and the run is still
    /// going.
    pub const TIMED_OUT: u8 = 6;
}

#[derive(clap::Args, Clone)]
pub struct DbArgs {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Connections this process may open (sized for 2 cores and Postgres' 100 connections).
    #[arg(long, default_value_t = rein_store::POOL_MAX_DEFAULT, value_parser = clap::value_parser!(u32).range(1..=90))]
    pub db_pool_max: u32,
    /// How long connecting to PostgreSQL may take before the command fails (exit 3); a
    /// server that refuses connections is asked again until then.
    #[arg(long, env = "REIN_DB_CONNECT_TIMEOUT_MS", value_name = "MS",
          default_value_t = rein_store::CONNECT_FIRST_TIMEOUT_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub db_connect_timeout_ms: u64,
    /// How deep a tree of fan-outs may grow (SPEC Z4): a run enqueued is at depth 0 and a
    /// run at this depth may not fan out; such a fan-out takes its failure path (reason
    /// `fan_out_depth_exceeded`). Every process that commits (worker, scheduler, api, send)
    /// enforces the value it is given: give them all the same.
    #[arg(long, env = "REIN_FAN_OUT_DEPTH_MAX", value_name = "N",
          default_value_t = rein_core::join::DEPTH_MAX_DEFAULT,
          value_parser = clap::value_parser!(u32).range(0..=rein_core::join::DEPTH_MAX_LIMIT as i64))]
    pub fan_out_depth_max: u32,
    /// Most runs one root's tree of fan-outs may start over its life (SPEC Z4); a fan-out
    /// that would pass it takes its failure path (reason `fan_out_descendants_exceeded`).
    #[arg(long, env = "REIN_FAN_OUT_DESCENDANTS_MAX", value_name = "N",
          default_value_t = rein_core::join::DESCENDANTS_MAX_DEFAULT,
          value_parser = clap::value_parser!(u64).range(0..=rein_core::join::DESCENDANTS_MAX_LIMIT))]
    pub fan_out_descendants_max: u64,
}

impl DbArgs {
    /// The bounds on fan-out trees these arguments set (clap keeps them in range).
    pub fn tree_bounds(&self) -> rein_core::join::TreeBounds {
        rein_core::join::TreeBounds {
            depth_max: self.fan_out_depth_max,
            descendants_max: self.fan_out_descendants_max,
        }
    }
}

/// Optional Redis (SPEC K1): wake-ups for idle workers. Never a source of truth.
#[derive(clap::Args, Clone, Default)]
pub struct RedisArgs {
    /// Redis URL; absent: workers poll only.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// Prefix of Rein's Redis channels and keys (deployments sharing one Redis).
    #[arg(long, env = "REIN_REDIS_PREFIX", default_value = "rein")]
    pub redis_prefix: String,
}

impl RedisArgs {
    pub fn config(&self) -> Option<rein_accel::RedisConfig> {
        let url = self.redis_url.as_deref().filter(|u| !u.is_empty())?;
        Some(rein_accel::RedisConfig::new(url).with_prefix(self.redis_prefix.clone()))
    }

    /// Makes `store` publish wake-ups after commits that make work runnable.
    pub fn publishing(
        &self,
        store: rein_store::Store,
        stop: &tokio_util::sync::CancellationToken,
    ) -> rein_store::Store {
        match self.config() {
            Some(config) => {
                let publisher = rein_accel::Publisher::start(config, stop.clone());
                store.with_wake_hook(std::sync::Arc::new(move |q| publisher.wake(q)))
            }
            None => store,
        }
    }

    /// Makes `worker` claim at once when a wake-up for one of its queues arrives.
    pub fn subscribe(
        &self,
        worker: &rein_worker::Worker,
        queues: &[String],
        stop: &tokio_util::sync::CancellationToken,
    ) {
        if let Some(config) = self.config() {
            rein_accel::subscribe(config, queues, worker.wakeups(), stop.clone());
        }
    }
}

pub async fn connect(db: &DbArgs, migrate: bool) -> Result<Store, u8> {
    let store = open(db).await?;
    let checked = if migrate {
        store.prepare_schema().await.map(|_| ())
    } else {
        store.check_schema().await
    };
    match checked {
        Ok(()) => Ok(store),
        Err(e) => Err(report(&e)),
    }
}

/// A pool on the database, schema unchecked.
pub async fn open(db: &DbArgs) -> Result<Store, u8> {
    let Some(url) = db.database_url.as_deref() else {
        eprintln!(
            "error: no database: set DATABASE_URL or pass --database-url (or run `rein demo`, which starts its own)"
        );
        return Err(exit::INPUT);
    };
    Store::connect_within(url, db.db_pool_max, db.db_connect_timeout_ms)
        .await
        .map(|store| store.with_tree_bounds(db.tree_bounds()))
        .map_err(|e| report(&e))
}

/// The redaction key `REIN_REDACTION_KEY` holds, if it is set; what is wrong with it when it
/// cannot key markers (too short, not text).
pub fn redaction_key() -> Result<Option<rein_core::redact::RedactionKey>, String> {
    use rein_core::redact::{REDACTION_KEY_ENV, RedactionKey, key_advice};
    match std::env::var(REDACTION_KEY_ENV) {
        Ok(secret) if secret.trim().is_empty() => Ok(None),
        Ok(secret) => RedactionKey::new(&secret).map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(format!("{REDACTION_KEY_ENV} is not text: {}", key_advice()))
        }
    }
}

/// Prints an error and picks its exit code from the README's table: a database that cannot
/// be reached or used 3, a refusal (invalid transition, conflict, an event the sender may
/// not send) 2, a missing right 4, bad input (a malformed URL, an unknown run) 1.
pub fn report(e: &StoreError) -> u8 {
    eprintln!("error: {e}");
    match e {
        StoreError::Unreachable(_)
        | StoreError::SchemaMismatch(_)
        | StoreError::Migrate(_)
        | StoreError::Db(_)
        | StoreError::Corrupt(_) => exit::DATABASE,
        StoreError::InvalidTransition(_)
        | StoreError::DefinitionConflict { .. }
        | StoreError::KeyConflict { .. }
        | StoreError::NotAllowed { .. } => exit::REFUSED,
        StoreError::NeedsApprover { .. } => exit::AUTH,
        _ => exit::INPUT,
    }
}

/// A token cancelled by SIGTERM or SIGINT. The handlers are installed before this returns,
/// so a signal that arrives as soon as the process says it is ready is not fatal.
pub fn shutdown_signal() -> CancellationToken {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install signal handlers; SIGTERM will stop this process at once");
        return token;
    };
    let t = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        t.cancel();
    });
    token
}

/// Logs to stderr: JSON lines for long-running roles unless on a terminal.
pub fn init_logging(json: bool) {
    init_logging_at(json, "info,sqlx=warn");
}

/// Like [`init_logging`] with another default filter (`REIN_LOG` still wins). `json` asks
/// for JSON lines, which a terminal gets in human format instead; `REIN_LOG_FORMAT=json` or
/// `text` decides outright.
pub fn init_logging_at(json: bool, default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let json = match std::env::var("REIN_LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => json && !std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
    let filter =
        EnvFilter::try_from_env("REIN_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    let fmt_json = json.then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
    });
    let fmt_text = (!json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_ansi(colours(
                std::io::IsTerminal::is_terminal(&std::io::stderr()),
                std::env::var_os("NO_COLOR").is_some(),
            ))
            .with_writer(std::io::stderr)
    });
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt_json)
        .with(fmt_text)
        .with(telemetry::otel_layer())
        .try_init();
}

/// Whether text logs carry ANSI colours: only on a terminal, and never when `NO_COLOR` is
/// set (<https://no-color.org>), so a log file or a pipe gets plain text.
fn colours(terminal: bool, no_color: bool) -> bool {
    terminal && !no_color
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn store_errors_exit_with_the_readme_codes() {
        let conflict = StoreError::KeyConflict {
            key: "k".into(),
            what: "body".into(),
        };
        let not_allowed = StoreError::NotAllowed {
            event: "next".into(),
            sender: "cli".into(),
            reason: "engine event".into(),
        };
        let definition = StoreError::DefinitionConflict {
            name: "d".into(),
            version: 1,
        };
        for (e, code) in [
            (StoreError::BadUrl("x".into()), exit::INPUT),
            (StoreError::RunNotFound(Uuid::nil()), exit::INPUT),
            (StoreError::Invalid("x".into()), exit::INPUT),
            (StoreError::Unreachable("x".into()), exit::DATABASE),
            (StoreError::SchemaMismatch("x".into()), exit::DATABASE),
            (conflict, exit::REFUSED),
            (not_allowed, exit::REFUSED),
            (definition, exit::REFUSED),
            (
                StoreError::NeedsApprover {
                    event: "APPROVED".into(),
                },
                exit::AUTH,
            ),
        ] {
            assert_eq!(report(&e), code, "{e}");
        }
    }
}
