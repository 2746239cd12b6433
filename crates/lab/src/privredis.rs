//! The private redis-server that `rein chaos` starts beside its fleet, and stops and starts
//! again as a fault: a child in a process group of its own on a free port, nothing saved to
//! disk, its pidfile and working directory in chaos's log directory. It is always killed and
//! reaped when the value is dropped ([`Children`]), panics included.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::procs::Children;

const NAME: &str = "redis-server";
/// How long a (re)started server may take to answer PING.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// `redis-server` on PATH.
pub fn installed() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(NAME))
        .find(|p| p.is_file())
}

pub struct PrivateRedis {
    program: PathBuf,
    port: u16,
    dir: PathBuf,
    children: Children,
}

impl PrivateRedis {
    /// Starts `program` on a free port with `dir` as its working directory (pidfile, logs);
    /// returns once it answers PING.
    pub fn start(program: PathBuf, dir: &Path) -> std::io::Result<PrivateRedis> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut redis = PrivateRedis {
            program,
            port,
            dir: dir.to_path_buf(),
            children: Children::new(dir)?,
        };
        redis.start_again()?;
        Ok(redis)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server (SIGKILL to the group it leads, which is itself) and reaps it.
    pub fn stop(&mut self) {
        let _ = self.children.kill(NAME);
    }

    /// Starts the server again on the same port; returns once it answers PING.
    pub fn start_again(&mut self) -> std::io::Result<()> {
        let mut cmd = Command::new(&self.program);
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--pidfile")
            .arg(self.dir.join("redis-server.pid"))
            .arg("--dir")
            .arg(&self.dir);
        self.children.spawn_command(NAME, cmd)?;
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if self.answers_ping() {
                return Ok(());
            }
            let exited = !self.children.get(NAME).is_some_and(|p| p.is_running());
            if exited || Instant::now() >= deadline {
                self.stop();
                let log = self.dir.join(format!("{NAME}.out"));
                return Err(std::io::Error::other(format!(
                    "redis-server on port {} {}; see {}",
                    self.port,
                    if exited {
                        "exited at start"
                    } else {
                        "did not answer PING"
                    },
                    log.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn answers_ping(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        let mut reply = [0u8; 7];
        stream.write_all(b"PING\r\n").is_ok()
            && stream.read_exact(&mut reply).is_ok()
            && &reply == b"+PONG\r\n"
    }
}
