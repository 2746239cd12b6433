//! The private PostgreSQL that `rein demo`, `rein bench` and `rein chaos` start from the
//! installed server binaries when no database is given (SPEC I5). Run as root from a
//! checkout the `postgres` user cannot reach (root's 0700 home), the server lives in a
//! private directory of its own in the temp dir instead, and says so.

use std::path::PathBuf;

use rein_devdb::{PrivatePostgres, PrivatePostgresOptions};

use rein_process::exit;

/// Where private servers live: `target/` when run from a checkout, else the temp dir
/// (readable by the `postgres` user when we run as root).
pub fn base_dir() -> PathBuf {
    let target = PathBuf::from("target");
    if target.is_dir() {
        std::fs::canonicalize(&target)
            .unwrap_or(target)
            .join("rein-pg")
    } else {
        std::env::temp_dir().join("rein-pg")
    }
}

/// Starts a private server named `role-PID`. `fast` turns fsync and synchronous_commit off
/// (fine for a demo; a benchmark says which it used). Prints where it is; on failure prints
/// the error and returns the exit code.
pub async fn start(role: &str, fast: bool) -> Result<PrivatePostgres, u8> {
    start_because(role, fast, "DATABASE_URL is unset").await
}

/// Like [`start`], with `pg_stat_statements` loaded when the installed server has it (what
/// `rein bench` reads each statement's time and WAL from).
pub async fn start_with_statement_stats(role: &str, fast: bool) -> Result<PrivatePostgres, u8> {
    start_options(role, fast, "DATABASE_URL is unset", true).await
}

/// Like [`start`], saying `why` a private server is started.
pub async fn start_because(role: &str, fast: bool, why: &str) -> Result<PrivatePostgres, u8> {
    start_options(role, fast, why, false).await
}

async fn start_options(
    role: &str,
    fast: bool,
    why: &str,
    statement_stats: bool,
) -> Result<PrivatePostgres, u8> {
    eprintln!("{why}: starting a private PostgreSQL from the installed binaries…");
    let options = PrivatePostgresOptions {
        base_dir: base_dir(),
        name: format!("{role}-{}", std::process::id()),
        fast,
        statement_stats,
        ..Default::default()
    };
    match tokio::task::spawn_blocking(move || PrivatePostgres::start(options)).await {
        Ok(Ok(pg)) => {
            if let Some(relocated) = pg.relocated() {
                eprintln!("note: {relocated}");
            }
            eprintln!(
                "private PostgreSQL on port {} (data in {})",
                pg.port(),
                pg.data_dir().display()
            );
            Ok(pg)
        }
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            Err(exit::DATABASE)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Err(exit::DATABASE)
        }
    }
}

/// Stops the server: its files are removed when the command succeeded and kept (with the
/// log's path printed) when it did not, for a look at what went wrong.
pub async fn finish(pg: PrivatePostgres, ok: bool) {
    let log = pg.log_file().to_path_buf();
    let _ = tokio::task::spawn_blocking(move || {
        if ok {
            pg.discard().ok();
        } else {
            drop(pg)
        }
    })
    .await;
    if !ok {
        eprintln!("the private PostgreSQL's log is kept at {}", log.display());
    }
}
