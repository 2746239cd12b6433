use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::DevDbError;
use crate::bin_dir::{find_pg_bin_dir, is_executable, which};

/// How long to keep polling `pg_isready` after `pg_ctl -w` returned; pg_ctl
/// already waited, so this only guards against a server that came up on the
/// socket but not on TCP.
const READY_DEADLINE: Duration = Duration::from_secs(30);

/// Longest socket directory whose `.s.PGSQL.NNNNN` still fits in `sun_path`
/// (108 bytes including the NUL on Linux).
const MAX_SOCKET_DIR_LEN: usize = 92;

const LOG_TAIL_LINES: usize = 20;

/// Where and how to run a private server.
#[derive(Debug, Clone)]
pub struct PrivatePostgresOptions {
    /// Parent of the instance directory. A library cannot know the cargo
    /// target dir, so callers should pass one (tests: `CARGO_TARGET_TMPDIR`).
    pub base_dir: PathBuf,
    /// Instance subdirectory; an existing one is wiped on start so every run
    /// begins from a fresh cluster (and reruns do not pile up clusters), which
    /// also means concurrently running instances need distinct names.
    pub name: String,
    /// `None` picks a free port, which is what parallel tests want.
    pub port: Option<u16>,
    /// Trades durability for speed (fsync, full_page_writes and
    /// synchronous_commit off). Crash tests via `restart_immediate` still work
    /// because an immediate stop does not drop the OS page cache.
    pub fast: bool,
    pub max_connections: u32,
    /// Loads `pg_stat_statements` at start (when the installed server has it), so a
    /// benchmark can read what each statement cost in time and WAL.
    pub statement_stats: bool,
    /// Defaults to `postgres.log` inside the instance directory.
    pub log_file: Option<PathBuf>,
}

impl Default for PrivatePostgresOptions {
    fn default() -> Self {
        Self {
            base_dir: std::env::temp_dir().join("rein-pg"),
            name: "default".to_owned(),
            port: None,
            fast: false,
            max_connections: 200,
            statement_stats: false,
            log_file: None,
        }
    }
}

/// How server tools are launched: PostgreSQL refuses to run as root, so root
/// hands them to the `postgres` user.
#[derive(Debug, Clone)]
enum Runner {
    Direct,
    Runuser(PathBuf),
    Setpriv(PathBuf),
}

/// A PostgreSQL cluster owned by this process, stopped on drop.
#[derive(Debug)]
pub struct PrivatePostgres {
    bin_dir: PathBuf,
    runner: Runner,
    instance_dir: PathBuf,
    data_dir: PathBuf,
    log_file: PathBuf,
    port: u16,
    server_opts: String,
    running: bool,
    kept: bool,
    relocated: Option<Relocated>,
}

/// Why a server does not live where it was asked to: running as root, the `postgres` user
/// could not reach the requested directory (e.g. a checkout in root's 0700 home), so its
/// data, socket and log went to a private directory of its own in the temp dir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relocated {
    /// The instance directory asked for.
    pub wanted: PathBuf,
    /// The first directory on the way that the `postgres` user may not enter, and its mode.
    pub blocked_at: PathBuf,
    pub mode: u32,
    /// Where the instance lives instead (mode 0700, owned by `postgres`).
    pub dir: PathBuf,
}

impl std::fmt::Display for Relocated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the postgres user cannot reach {} ({} has mode {:o}), so the server's data, socket \
             and log are in {} instead",
            self.wanted.display(),
            self.blocked_at.display(),
            self.mode,
            self.dir.display()
        )
    }
}

/// A private directory for the instance `name` in `temp_dir` that does not exist yet.
fn fallback_instance_dir(temp_dir: &Path, name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    let mut nonce = u64::from(nanos) ^ (u64::from(std::process::id()) << 32);
    loop {
        let dir = temp_dir.join(format!("rein-pg-{name}-{nonce:x}"));
        // symlink_metadata: a dangling link is taken too.
        if std::fs::symlink_metadata(&dir).is_err() {
            return dir;
        }
        nonce = nonce.wrapping_mul(6364136223846793005).wrapping_add(1);
    }
}

impl PrivatePostgres {
    /// Creates a fresh cluster and starts it, returning once it accepts TCP
    /// connections.
    pub fn start(opts: PrivatePostgresOptions) -> Result<Self, DevDbError> {
        let bin_dir = find_pg_bin_dir()?;
        let runner = if is_root() {
            if let Some(p) = which("runuser") {
                Runner::Runuser(p)
            } else if let Some(p) = which("setpriv") {
                Runner::Setpriv(p)
            } else {
                return Err(DevDbError::Command {
                    command: "runuser".to_owned(),
                    status: "not found".to_owned(),
                    output: String::new(),
                    hint: "running as root needs `runuser` or `setpriv` (util-linux) to start \
                           PostgreSQL as the `postgres` user; install util-linux or run as non-root"
                        .to_owned(),
                });
            }
        } else {
            Runner::Direct
        };

        let instance_dir = opts.base_dir.join(&opts.name);
        let mut pg = Self {
            bin_dir,
            runner,
            data_dir: instance_dir.join("data"),
            log_file: opts
                .log_file
                .clone()
                .unwrap_or_else(|| instance_dir.join("postgres.log")),
            instance_dir,
            port: 0,
            server_opts: String::new(),
            running: false,
            kept: false,
            relocated: None,
        };

        match pg.prepare_dirs() {
            Err(DevDbError::NotTraversable {
                dir,
                blocked_at,
                mode,
            }) => {
                // Nothing of ours is in it yet but the empty directories just made.
                let _ = std::fs::remove_dir_all(&dir);
                let fallback = fallback_instance_dir(&std::env::temp_dir(), &opts.name);
                pg.data_dir = fallback.join("data");
                if opts.log_file.is_none() {
                    pg.log_file = fallback.join("postgres.log");
                }
                pg.instance_dir = fallback.clone();
                pg.relocated = Some(Relocated {
                    wanted: dir,
                    blocked_at,
                    mode,
                    dir: fallback,
                });
                pg.prepare_dirs()?;
            }
            other => other?,
        }
        let socket_dir = pg.instance_dir.join("sock");
        pg.initdb()?;

        let mut server_opts = vec![
            "-c listen_addresses=127.0.0.1".to_owned(),
            format!("-c max_connections={}", opts.max_connections),
        ];
        // A socket path that does not fit sun_path makes the server refuse to
        // start; everything here talks TCP, so drop the socket instead.
        let sock = socket_dir.to_string_lossy();
        if sock.len() <= MAX_SOCKET_DIR_LEN {
            server_opts.push(format!("-k {}", shell_quote(&sock)));
        } else {
            server_opts.push("-k ''".to_owned());
        }
        if opts.fast {
            server_opts
                .push("-c fsync=off -c full_page_writes=off -c synchronous_commit=off".to_owned());
        }
        if opts.statement_stats && pg.has_extension_library("pg_stat_statements") {
            server_opts.push(
                "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=top"
                    .to_owned(),
            );
        }
        pg.server_opts = server_opts.join(" ");

        pg.port = match opts.port {
            Some(port) => port,
            None => free_port()?,
        };
        match pg.start_server() {
            Err(DevDbError::StartFailed { ref log_tail, .. })
                if opts.port.is_none() && log_tail.contains("could not bind") =>
            {
                // Another process took the port between probing and binding.
                pg.port = free_port()?;
                pg.start_server()?;
            }
            other => other?,
        }
        Ok(pg)
    }

    /// The `postgres` database, which tests use to create their own.
    /// Whether the server's library directory (`../lib` of its binaries, the Debian and
    /// source-install layout) holds the shared library `name`.
    fn has_extension_library(&self, name: &str) -> bool {
        self.bin_dir
            .parent()
            .is_some_and(|root| root.join("lib").join(format!("{name}.so")).is_file())
    }

    pub fn url(&self) -> String {
        self.url_for_db("postgres")
    }

    pub fn url_for_db(&self, db: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            self.port,
            percent_encode(db)
        )
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The directory holding the data, socket and (by default) log.
    pub fn instance_dir(&self) -> &Path {
        &self.instance_dir
    }

    /// Set when the server could not live where it was asked to and why (see [`Relocated`]).
    pub fn relocated(&self) -> Option<&Relocated> {
        self.relocated.as_ref()
    }

    /// Useful to attach to a failing test's output.
    pub fn log_file(&self) -> &Path {
        &self.log_file
    }

    /// Best-effort stop for callers that do not care why it failed; see
    /// [`Self::try_stop`].
    pub fn stop(&mut self) {
        let _ = self.try_stop();
    }

    /// Fast shutdown (aborts open sessions, checkpoints). Falls back to an
    /// immediate stop so a stuck session never keeps a stray server alive.
    pub fn try_stop(&mut self) -> Result<(), DevDbError> {
        if !self.running {
            return Ok(());
        }
        let fast = self.pg_ctl_stop("fast");
        if fast.is_err() {
            self.pg_ctl_stop("immediate")?;
        }
        self.running = false;
        Ok(())
    }

    /// Simulates a crash (no shutdown checkpoint, crash recovery on start) on
    /// the same port, so existing connection URLs stay valid.
    pub fn restart_immediate(&mut self) -> Result<(), DevDbError> {
        if self.running {
            self.pg_ctl_stop("immediate")?;
            self.running = false;
        }
        self.start_server()
    }

    /// Stops the server and deletes its directory (data, socket, log): for callers done
    /// with it that have nothing left to inspect.
    pub fn discard(mut self) -> Result<(), DevDbError> {
        self.try_stop()?;
        self.kept = true;
        std::fs::remove_dir_all(&self.instance_dir).map_err(|source| DevDbError::Io {
            action: "remove",
            path: self.instance_dir.clone(),
            source,
        })
    }

    /// Leaves the server running after this value is gone, e.g. for a dev
    /// server that outlives the command that started it. Returns its URL.
    pub fn keep(mut self) -> String {
        self.kept = true;
        self.url()
    }

    /// Leaves the server running while process `pid` lives and stops it (immediate mode)
    /// once that process is gone, however it ended: a watchdog shell polls for it. For test
    /// binaries, whose statics are never dropped. Returns the server URL.
    pub fn stop_when_process_exits(mut self, pid: u32) -> Result<String, DevDbError> {
        let pg_ctl = self.bin_dir.join("pg_ctl");
        // A relocated instance has a name of its own in the temp dir that nothing reuses:
        // it is removed with the server.
        let remove = if self.relocated.is_some() {
            "; rm -rf \"$2\""
        } else {
            ""
        };
        let script = format!(
            "while [ -e /proc/{pid} ]; do sleep 1; done; \"$0\" -D \"$1\" -m immediate stop >/dev/null 2>&1{remove}"
        );
        let mut cmd = self.as_postgres(Path::new("/bin/sh"));
        cmd.arg("-c")
            .arg(script)
            .arg(&pg_ctl)
            .arg(&self.data_dir)
            .arg(&self.instance_dir)
            .current_dir("/")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        cmd.spawn().map_err(|source| DevDbError::Spawn {
            command: "/bin/sh (watchdog)".to_owned(),
            source,
        })?;
        self.kept = true;
        Ok(self.url())
    }

    fn prepare_dirs(&self) -> Result<(), DevDbError> {
        let socket_dir = &self.instance_dir.join("sock");
        // A server left running by a killed earlier run would keep the old
        // files open and the port busy; stop it before deleting its data.
        if self.data_dir.join("postmaster.pid").exists() {
            let _ = self.pg_ctl_stop("immediate");
        }
        if self.instance_dir.exists() {
            std::fs::remove_dir_all(&self.instance_dir).map_err(|source| DevDbError::Io {
                action: "remove old instance directory",
                path: self.instance_dir.clone(),
                source,
            })?;
        }
        std::fs::create_dir_all(socket_dir).map_err(|source| DevDbError::Io {
            action: "create directory",
            path: socket_dir.to_path_buf(),
            source,
        })?;
        if let Some(parent) = self.log_file.parent() {
            std::fs::create_dir_all(parent).map_err(|source| DevDbError::Io {
                action: "create log directory",
                path: parent.to_path_buf(),
                source,
            })?;
        }
        std::fs::write(&self.log_file, b"").map_err(|source| DevDbError::Io {
            action: "create log file",
            path: self.log_file.clone(),
            source,
        })?;

        if matches!(self.runner, Runner::Direct) {
            return Ok(());
        }
        // The server's files are the `postgres` user's alone (root still gets in).
        std::fs::set_permissions(&self.instance_dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|source| DevDbError::Io {
                action: "make private",
                path: self.instance_dir.clone(),
                source,
            })?;
        let chown = which("chown").unwrap_or_else(|| PathBuf::from("chown"));
        let hint = "running as root needs a `postgres` system user \
                    (apt-get install postgresql creates one), or run as non-root";
        let mut cmd = Command::new(&chown);
        cmd.arg("-R").arg("postgres:").arg(&self.instance_dir);
        run_checked(&mut cmd, hint)?;
        let mut cmd = Command::new(&chown);
        cmd.arg("postgres:").arg(&self.log_file);
        run_checked(&mut cmd, hint)?;
        self.check_reachable()
    }

    /// Asks the `postgres` user itself whether it can write the instance
    /// directory, then explains which ancestor blocks it.
    fn check_reachable(&self) -> Result<(), DevDbError> {
        let mut probe = self.as_postgres(Path::new("test"));
        probe.arg("-w").arg(&self.instance_dir).current_dir("/");
        if probe.output().is_ok_and(|o| o.status.success()) {
            return Ok(());
        }
        let blocked = self
            .instance_dir
            .ancestors()
            .skip(1)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .find_map(|dir| {
                let mode = std::fs::metadata(dir).ok()?.permissions().mode();
                (mode & 0o001 == 0).then(|| (dir.to_path_buf(), mode & 0o7777))
            });
        let (blocked_at, mode) = blocked.unwrap_or_else(|| (self.instance_dir.clone(), 0));
        Err(DevDbError::NotTraversable {
            dir: self.instance_dir.clone(),
            blocked_at,
            mode,
        })
    }

    fn initdb(&self) -> Result<(), DevDbError> {
        let mut cmd = self.pg_tool("initdb");
        cmd.arg("-D").arg(&self.data_dir).args([
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        ]);
        run_checked(
            &mut cmd,
            "initdb could not create the cluster; check free disk space and that the \
             base_dir is writable",
        )
        .map(drop)
    }

    fn start_server(&mut self) -> Result<(), DevDbError> {
        let mut cmd = self.pg_tool("pg_ctl");
        cmd.arg("-D")
            .arg(&self.data_dir)
            .arg("-l")
            .arg(&self.log_file)
            .args(["-w", "-t", "60", "start", "-o"])
            .arg(format!("-p {} {}", self.port, self.server_opts));
        let output = run(&mut cmd)?;
        if !output.status.success() {
            let log_tail = self.log_tail();
            return Err(DevDbError::StartFailed {
                port: self.port,
                log_file: self.log_file.clone(),
                hint: start_hint(&log_tail, self.port),
                log_tail: format!("{log_tail}\npg_ctl said:\n{}", combined(&output)),
            });
        }
        self.running = true;
        self.wait_ready()
    }

    fn wait_ready(&self) -> Result<(), DevDbError> {
        let started = Instant::now();
        loop {
            let mut cmd = self.pg_tool("pg_isready");
            cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-t", "1"]);
            if run(&mut cmd)?.status.success() {
                return Ok(());
            }
            if started.elapsed() > READY_DEADLINE {
                return Err(DevDbError::NotReady {
                    port: self.port,
                    waited: started.elapsed(),
                    log_file: self.log_file.clone(),
                    log_tail: self.log_tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn pg_ctl_stop(&self, mode: &str) -> Result<(), DevDbError> {
        let mut cmd = self.pg_tool("pg_ctl");
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-m", mode, "-w", "-t", "20", "stop"]);
        run_checked(&mut cmd, "see the server log for why shutdown stalled").map(drop)
    }

    /// A server tool from the chosen bin dir, run as whoever may run it.
    /// `pg_isready` is also shipped by client-only packages, so fall back to
    /// PATH for it.
    fn pg_tool(&self, name: &str) -> Command {
        let mut program = self.bin_dir.join(name);
        if !is_executable(&program) {
            program = PathBuf::from(name);
        }
        let mut cmd = self.as_postgres(&program);
        // The postgres user may not be allowed into the caller's cwd
        // (e.g. /root), which makes the tools complain.
        cmd.current_dir(&self.instance_dir);
        cmd
    }

    fn as_postgres(&self, program: &Path) -> Command {
        match &self.runner {
            Runner::Direct => Command::new(program),
            Runner::Runuser(runuser) => {
                let mut cmd = Command::new(runuser);
                cmd.args(["-u", "postgres", "--"]).arg(program);
                cmd
            }
            Runner::Setpriv(setpriv) => {
                let mut cmd = Command::new(setpriv);
                cmd.args([
                    "--reuid=postgres",
                    "--regid=postgres",
                    "--init-groups",
                    "--",
                ])
                .arg(program);
                cmd
            }
        }
    }

    fn log_tail(&self) -> String {
        match std::fs::read(&self.log_file) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let lines: Vec<&str> = text.lines().collect();
                lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
            }
            Err(e) => format!("(could not read {}: {e})", self.log_file.display()),
        }
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if !self.kept {
            self.stop();
        }
    }
}

fn start_hint(log_tail: &str, port: u16) -> String {
    if log_tail.contains("could not bind") || log_tail.contains("already in use") {
        format!("port {port} is taken; use `port: None` to pick a free one")
    } else if log_tail.contains("shared memory") || log_tail.contains("semaphore") {
        "the kernel refused shared memory; lower max_connections or enlarge /dev/shm \
         (docker: --shm-size)"
            .to_owned()
    } else if log_tail.contains("Permission denied") {
        "the server user cannot access a path it needs; check ownership of base_dir and log_file"
            .to_owned()
    } else {
        "read the full server log named above".to_owned()
    }
}

fn is_root() -> bool {
    // /proc/self/status "Uid:" holds real, effective, ...; effective decides.
    if let Ok(status) = std::fs::read_to_string("/proc/self/status")
        && let Some(line) = status.lines().find(|l| l.starts_with("Uid:"))
        && let Some(euid) = line.split_whitespace().nth(2)
    {
        return euid == "0";
    }
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn free_port() -> Result<u16, DevDbError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(DevDbError::NoFreePort)?;
    let port = listener
        .local_addr()
        .map_err(DevDbError::NoFreePort)?
        .port();
    Ok(port)
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

fn run(cmd: &mut Command) -> Result<Output, DevDbError> {
    cmd.stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| DevDbError::Spawn {
            command: describe(cmd),
            source,
        })
}

fn run_checked(cmd: &mut Command, hint: &str) -> Result<Output, DevDbError> {
    let output = run(cmd)?;
    if output.status.success() {
        return Ok(output);
    }
    Err(DevDbError::Command {
        command: describe(cmd),
        status: output.status.to_string(),
        output: combined(&output),
        hint: hint.to_owned(),
    })
}

fn combined(output: &Output) -> String {
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    text.trim_end().to_owned()
}

/// pg_ctl hands `-o` to /bin/sh, so paths must survive shell parsing.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(shell_quote("/a b/it's"), r"'/a b/it'\''s'");
    }

    #[test]
    fn db_names_are_encoded() {
        assert_eq!(percent_encode("rein_test-1"), "rein_test-1");
        assert_eq!(percent_encode("a b/c"), "a%20b%2Fc");
    }
}
