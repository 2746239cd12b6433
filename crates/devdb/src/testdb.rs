//! One fresh database per test: on the server named by DATABASE_URL when set, else on a
//! private server started once per test process (and stopped when that process exits).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::{DevDbError, PrivatePostgres, PrivatePostgresOptions};

static SERVER: OnceLock<Result<String, String>> = OnceLock::new();
static COUNTER: AtomicU32 = AtomicU32::new(0);

fn server_url(base_dir: PathBuf) -> Result<String, String> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.is_empty()
    {
        return Ok(url);
    }
    SERVER
        .get_or_init(|| {
            let options = PrivatePostgresOptions {
                base_dir,
                name: format!("test-{}", std::process::id()),
                fast: true,
                max_connections: 300,
                ..Default::default()
            };
            PrivatePostgres::start(options)
                .and_then(|pg| {
                    if let Some(relocated) = pg.relocated() {
                        eprintln!("rein-devdb: {relocated}");
                    }
                    pg.stop_when_process_exits(std::process::id())
                })
                .map_err(|e| e.to_string())
        })
        .clone()
}

/// Creates an empty database named after `prefix` and returns its URL. `base_dir` is where
/// a private server keeps its data when one is needed (tests pass
/// `env!("CARGO_TARGET_TMPDIR")`).
pub fn test_database(prefix: &str, base_dir: impl Into<PathBuf>) -> Result<String, DevDbError> {
    let server = server_url(base_dir.into()).map_err(|message| DevDbError::Command {
        command: "start a private PostgreSQL".into(),
        status: "not started".into(),
        output: message,
        hint: "install PostgreSQL server binaries or set DATABASE_URL".into(),
    })?;
    let clean: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(30)
        .collect();
    let name = format!(
        "rein_t_{clean}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let output = Command::new("psql")
        .arg(&server)
        .args(["-v", "ON_ERROR_STOP=1", "-q", "-c"])
        .arg(format!("DROP DATABASE IF EXISTS {name}"))
        .arg("-c")
        .arg(format!("CREATE DATABASE {name}"))
        .output()
        .map_err(|source| DevDbError::Spawn {
            command: "psql".into(),
            source,
        })?;
    if !output.status.success() {
        return Err(DevDbError::Command {
            command: "psql CREATE DATABASE".into(),
            status: output.status.to_string(),
            output: String::from_utf8_lossy(&output.stderr).into_owned(),
            hint: "check that DATABASE_URL names a user allowed to create databases".into(),
        });
    }
    Ok(replace_database(&server, &name))
}

/// The same server URL with another database name.
pub fn replace_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let path_start = base[scheme_end..].find('/').map(|i| i + scheme_end);
    let host = match path_start {
        Some(i) => &base[..i],
        None => base,
    };
    match query {
        Some(q) => format!("{host}/{db}?{q}"),
        None => format!("{host}/{db}"),
    }
}
