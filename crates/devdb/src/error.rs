use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong while bringing up or tearing down a private
/// server. Each message names the failed step and, where the fix is not
/// obvious, what to do next, because these errors usually surface as a failed
/// test far away from this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DevDbError {
    #[error(
        "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found; searched {searched}.\n\
         Install them with `apt-get install postgresql` (Debian/Ubuntu) or \
         `brew install postgresql` (macOS), or set DATABASE_URL to an existing server."
    )]
    NoBinaries { searched: String },

    #[error("could not {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("could not run `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: io::Error,
    },

    #[error("`{command}` failed ({status}):\n{output}\n{hint}")]
    Command {
        command: String,
        status: String,
        output: String,
        hint: String,
    },

    #[error(
        "the `postgres` user cannot reach {}: {} has mode {mode:o} and is not searchable by others.\n\
         Running as root, the server runs as `postgres`; put base_dir somewhere it can reach \
         (e.g. under /tmp) or run `chmod o+x {}`.",
        dir.display(), blocked_at.display(), blocked_at.display()
    )]
    NotTraversable {
        dir: PathBuf,
        blocked_at: PathBuf,
        mode: u32,
    },

    #[error(
        "PostgreSQL failed to start on 127.0.0.1:{port}; last lines of {}:\n{log_tail}\n{hint}",
        log_file.display()
    )]
    StartFailed {
        port: u16,
        log_file: PathBuf,
        log_tail: String,
        hint: String,
    },

    #[error(
        "PostgreSQL on 127.0.0.1:{port} did not accept connections within {waited:?}; \
         last lines of {}:\n{log_tail}",
        log_file.display()
    )]
    NotReady {
        port: u16,
        waited: Duration,
        log_file: PathBuf,
        log_tail: String,
    },

    #[error("could not find a free TCP port on 127.0.0.1: {0}")]
    NoFreePort(#[source] io::Error),
}
