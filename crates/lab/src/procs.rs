//! Child processes for `rein bench --processes` and `rein chaos` (`rein` roles, and chaos's
//! redis-server): each in its own process group, output to files, and always reaped — continued (a stopped process cannot
//! die otherwise), killed and waited for — when the [`Children`] value is dropped, panics
//! included.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// One child process and the group it leads.
pub struct Proc {
    pub name: String,
    pub child: Child,
    /// Whether it is stopped with SIGSTOP right now.
    pub stopped: bool,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `signal` to the process's whole group.
    pub fn signal(&mut self, signal: i32) -> std::io::Result<()> {
        // SAFETY: kill(2) with a negative pid addresses the group this process leads; it has
        // no memory effects.
        let rc = unsafe { libc::kill(-self.pid(), signal) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        match signal {
            libc::SIGSTOP => self.stopped = true,
            libc::SIGCONT => self.stopped = false,
            _ => {}
        }
        Ok(())
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Peak resident set size (VmHWM) in bytes, while the process lives.
    pub fn peak_rss_bytes(&self) -> Option<u64> {
        peak_rss_of(&format!("/proc/{}/status", self.pid()))
    }
}

/// The command line of a `rein ROLE` child: `ROLE --database-url URL --id ID` and then each
/// `--flag value` (a flag with an empty value is passed alone).
pub fn role_args(role: &str, url: &str, id: &str, flags: &[(&str, String)]) -> Vec<String> {
    let mut args: Vec<String> = [role, "--database-url", url, "--id", id]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for (flag, value) in flags {
        args.push((*flag).to_owned());
        if !value.is_empty() {
            args.push(value.clone());
        }
    }
    args
}

/// This binary with `args` and `env`, and without the inherited variables in `unset` (a
/// child must not pick up, say, a `REDIS_URL` its parent chose not to give it).
pub fn rein_command(
    args: &[String],
    env: &[(&str, &str)],
    unset: &[&str],
) -> std::io::Result<Command> {
    Ok(command_of(&std::env::current_exe()?, args, env, unset))
}

/// [`rein_command`] for another `rein` binary (`rein chaos --old-bin`: a previous release).
pub fn command_of(bin: &Path, args: &[String], env: &[(&str, &str)], unset: &[&str]) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(args);
    for k in unset {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Peak resident set size of this process in bytes.
pub fn own_peak_rss_bytes() -> Option<u64> {
    peak_rss_of("/proc/self/status")
}

fn peak_rss_of(status_file: &str) -> Option<u64> {
    let status = std::fs::read_to_string(status_file).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Every child a command started.
pub struct Children {
    pub log_dir: PathBuf,
    pub procs: Vec<Proc>,
}

impl Children {
    pub fn new(log_dir: &Path) -> std::io::Result<Children> {
        std::fs::create_dir_all(log_dir)?;
        Ok(Children {
            log_dir: log_dir.to_path_buf(),
            procs: Vec::new(),
        })
    }

    /// Starts `cmd` in a process group of its own; stdout and stderr go to `NAME.out` and
    /// `NAME.err` in the log directory.
    pub fn spawn_command(&mut self, name: &str, mut cmd: Command) -> std::io::Result<()> {
        let out = File::create(self.log_dir.join(format!("{name}.out")))?;
        let err = File::create(self.log_dir.join(format!("{name}.err")))?;
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = cmd.spawn()?;
        self.procs.push(Proc {
            name: name.to_owned(),
            child,
            stopped: false,
        });
        Ok(())
    }

    pub fn get(&mut self, name: &str) -> Option<&mut Proc> {
        self.procs.iter_mut().find(|p| p.name == name)
    }

    /// Kills (SIGKILL) and reaps one process; it leaves the list.
    pub fn kill(&mut self, name: &str) -> std::io::Result<()> {
        let Some(i) = self.procs.iter().position(|p| p.name == name) else {
            return Ok(());
        };
        let mut p = self.procs.remove(i);
        reap(&mut p);
        Ok(())
    }

    /// Asks every process to stop (SIGCONT, then SIGTERM), waits up to `grace` for them, then
    /// kills what is left.
    pub fn shutdown(&mut self, grace: std::time::Duration) {
        for p in &mut self.procs {
            let _ = p.signal(libc::SIGCONT);
            let _ = p.signal(libc::SIGTERM);
        }
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline && self.procs.iter_mut().any(|p| p.is_running())
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        for mut p in self.procs.drain(..) {
            reap(&mut p);
        }
    }

    /// Names of processes that exited on their own.
    pub fn exited(&mut self) -> Vec<String> {
        self.procs
            .iter_mut()
            .filter_map(|p| (!p.is_running()).then(|| p.name.clone()))
            .collect()
    }
}

fn reap(p: &mut Proc) {
    if matches!(p.child.try_wait(), Ok(Some(_))) {
        return;
    }
    // SAFETY: as in `Proc::signal`; a group that is already gone makes these fail harmlessly.
    unsafe {
        libc::kill(-p.pid(), libc::SIGCONT);
        libc::kill(-p.pid(), libc::SIGKILL);
    }
    let _ = p.child.wait();
}

impl Drop for Children {
    fn drop(&mut self) {
        for mut p in self.procs.drain(..) {
            reap(&mut p);
        }
    }
}
