//! One helper that sets up the real thing for the CLI's integration tests: a fresh database
//! on real PostgreSQL, real `rein` processes in their own process groups, reaped even when a
//! test panics.

#![allow(dead_code)]

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const REIN: &str = env!("CARGO_BIN_EXE_rein");
pub const TMP: &str = env!("CARGO_TARGET_TMPDIR");

/// A fresh, empty database; its URL.
pub fn fresh_database(prefix: &str) -> String {
    rein_devdb::test_database(prefix, TMP).unwrap_or_else(|e| panic!("a fresh test database: {e}"))
}

/// A fresh database with Rein's schema, and a store on it.
pub async fn fresh_store(prefix: &str) -> (String, rein_store::Store) {
    let url = fresh_database(prefix);
    let store = rein_store::Store::connect(&url, 8)
        .await
        .expect("connect and migrate");
    (url, store)
}

/// Runs `rein ARGS` to completion with DATABASE_URL unset.
pub fn rein(args: &[&str]) -> Output {
    Command::new(REIN)
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REIN_URL")
        .env_remove("REIN_TOKEN")
        .output()
        .expect("run the rein binary")
}

/// A token made by `rein tokens create` on the database at `url`.
pub fn token(url: &str, subject: &str, scopes: &[&str]) -> String {
    token_with(url, subject, scopes, &[])
}

/// [`token`] with `extra` flags of `rein tokens create` (its bounds and quotas).
pub fn token_with(url: &str, subject: &str, scopes: &[&str], extra: &[&str]) -> String {
    let mut args = vec![
        "tokens",
        "create",
        "--database-url",
        url,
        "--subject",
        subject,
    ];
    for s in scopes {
        args.extend_from_slice(&["--scope", s]);
    }
    args.extend_from_slice(extra);
    let out = rein(&args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 1, "the token alone on stdout: {text}");
    text.trim().to_owned()
}

/// Runs `rein ARGS` (DATABASE_URL unset) with its stdout a pipe whose reading end is already
/// closed, as `rein ... | head` once head has exited.
pub fn rein_into_closed_pipe(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    Command::new(REIN)
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REIN_URL")
        .env_remove("REIN_TOKEN")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("run the rein binary")
}

/// Whether the process was ended by SIGPIPE, as a Unix tool writing to a closed pipe is.
pub fn ended_by_sigpipe(o: &Output) -> bool {
    use std::os::unix::process::ExitStatusExt;
    o.status.signal() == Some(libc::SIGPIPE)
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A directory under the target's tmp dir, unique to this test process and `name`.
pub fn tmp_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(TMP).join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create a tmp dir");
    dir
}

/// A long-running `rein` process (worker, scheduler) in its own process group.
pub struct Proc {
    pub name: String,
    pub child: Child,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `signal` to the process's whole group.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) with a negative pid addresses the group this process leads; it has
        // no memory effects.
        let rc = unsafe { libc::kill(-self.pid(), signal) };
        assert_eq!(rc, 0, "kill({}, {signal}) failed", self.name);
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// Children that are killed when the thread that started them ends: a test process killed
/// from outside (a CI timeout) leaves no `rein` process behind, which `Fleet`'s drop cannot
/// promise. Spawned from the test's own thread, which outlives its `Fleet`.
pub trait DieWithParent {
    fn die_with_parent(&mut self) -> &mut Self;
}

impl DieWithParent for Command {
    fn die_with_parent(&mut self) -> &mut Self {
        let parent = std::process::id() as i32;
        // SAFETY: prctl and getppid are async-signal-safe; nothing else runs between fork
        // and exec.
        unsafe {
            self.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent died before the request took effect.
                if libc::getppid() != parent {
                    libc::raise(libc::SIGKILL);
                }
                Ok(())
            })
        }
    }
}

/// Every process a test started: on drop, each group is continued (a stopped process cannot
/// die otherwise), killed and reaped, so nothing outlives the test even when it panics.
pub struct Fleet {
    pub url: String,
    pub log_dir: PathBuf,
    pub procs: Vec<Proc>,
}

impl Fleet {
    pub fn new(url: &str, name: &str) -> Fleet {
        Fleet {
            url: url.to_owned(),
            log_dir: tmp_dir(name),
            procs: Vec::new(),
        }
    }

    /// Starts `rein ARGS --database-url URL --id ID`; stdout and stderr go to files named
    /// after `id` in the log directory. Returns the index of the process.
    pub fn spawn(&mut self, id: &str, args: &[&str]) -> usize {
        self.spawn_env(id, args, &[])
    }

    /// [`Fleet::spawn`] with extra environment variables.
    pub fn spawn_env(&mut self, id: &str, args: &[&str], env: &[(&str, &str)]) -> usize {
        let out = File::create(self.log_dir.join(format!("{id}.out"))).expect("log file");
        let err = File::create(self.log_dir.join(format!("{id}.err"))).expect("log file");
        let child = Command::new(REIN)
            .args(args)
            .args(["--database-url", &self.url, "--id", id])
            .env("REIN_LOG", "info,sqlx=warn")
            // A test names the Redis it means (`--redis-url` or `env`): one inherited from
            // the test command is shared with every earlier run, whose limits it still holds.
            .env_remove("REDIS_URL")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .die_with_parent()
            .spawn()
            .expect("spawn rein");
        self.procs.push(Proc {
            name: id.to_owned(),
            child,
        });
        self.procs.len() - 1
    }

    /// Starts `rein ARGS --database-url URL` (a server such as `rein api`) in its own process
    /// group, stderr to a file named after `id`, and returns the first line it prints on
    /// stdout (the bound address). Panics with its stderr when it exits first.
    pub fn spawn_server(&mut self, id: &str, args: &[&str]) -> String {
        self.spawn_server_env(id, args, &[])
    }

    /// [`Fleet::spawn_server`] with extra environment variables.
    pub fn spawn_server_env(&mut self, id: &str, args: &[&str], env: &[(&str, &str)]) -> String {
        use std::io::{BufRead, BufReader};
        let err_path = self.log_dir.join(format!("{id}.err"));
        let err = File::create(&err_path).expect("log file");
        let mut child = Command::new(REIN)
            .args(args)
            .args(["--database-url", &self.url])
            .env("REIN_LOG", "info,sqlx=warn")
            // As for [`Fleet::spawn_env`]: a server uses the Redis its test names, if any.
            .env_remove("REDIS_URL")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .process_group(0)
            .die_with_parent()
            .spawn()
            .expect("spawn rein");
        let stdout = child.stdout.take().expect("a stdout pipe");
        self.procs.push(Proc {
            name: id.to_owned(),
            child,
        });
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the server's first line");
        if line.trim().is_empty() {
            let log = std::fs::read_to_string(&err_path).unwrap_or_default();
            panic!("{id} printed no address before exiting; stderr:\n{log}");
        }
        line.trim().to_owned()
    }

    /// Starts `rein worker` with lease TTL `lease_ttl_ms` polling every 20 ms.
    pub fn spawn_worker(&mut self, id: &str, lease_ttl_ms: &str) -> usize {
        self.spawn(
            id,
            &[
                "worker",
                "--lease-ttl-ms",
                lease_ttl_ms,
                "--poll-interval-ms",
                "20",
            ],
        )
    }

    pub fn proc(&mut self, id: &str) -> &mut Proc {
        self.procs
            .iter_mut()
            .find(|p| p.name == id)
            .unwrap_or_else(|| panic!("no process {id}"))
    }

    /// Sends SIGTERM and waits (at most `within`) for the process to exit; its exit code.
    pub fn terminate(&mut self, id: &str, within: Duration) -> Option<i32> {
        let p = self.proc(id);
        p.signal(libc::SIGTERM);
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = p.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("{id} did not exit within {within:?} of SIGTERM");
    }

    /// Kills (SIGKILL) and reaps one process.
    pub fn kill(&mut self, id: &str) {
        let p = self.proc(id);
        p.signal(libc::SIGKILL);
        p.child.wait().expect("reap the killed process");
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for p in &mut self.procs {
            if matches!(p.child.try_wait(), Ok(Some(_))) {
                continue;
            }
            // SAFETY: as in `Proc::signal`; failures (group already gone) are harmless here.
            unsafe {
                libc::kill(-p.pid(), libc::SIGCONT);
                libc::kill(-p.pid(), libc::SIGKILL);
            }
            let _ = p.child.wait();
        }
    }
}

/// Polls `condition` every `every` until it holds or `deadline_after` passes.
pub async fn wait_for<F, Fut>(
    what: &str,
    deadline_after: Duration,
    every: Duration,
    mut condition: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + deadline_after;
    loop {
        if condition().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {deadline_after:?} waiting for {what}"
        );
        tokio::time::sleep(every).await;
    }
}

/// Enqueues `n` runs of the current version of `definition` with `input` on `queue`; their
/// ids.
pub async fn enqueue_many(
    store: &rein_store::Store,
    definition: &str,
    input: serde_json::Value,
    queue: &str,
    n: usize,
) -> Vec<uuid::Uuid> {
    let def = store.load_definition(definition, None).await.expect("def");
    let requests: Vec<rein_store::EnqueueRequest> = (0..n)
        .map(|_| {
            let mut r = rein_store::EnqueueRequest::new(def.clone(), input.clone());
            r.queue = queue.to_owned();
            r
        })
        .collect();
    store
        .enqueue_batch(&requests)
        .await
        .expect("enqueue")
        .iter()
        .map(|e| e.run_id)
        .collect()
}

/// Waits until every run in the database is terminal.
pub async fn await_all_terminal(store: &rein_store::Store, deadline_after: Duration) {
    wait_for(
        "every run terminal",
        deadline_after,
        Duration::from_millis(20),
        || async { store.run_totals().await.is_ok_and(|(n, t)| n == t) },
    )
    .await;
}

/// A database holding a few finished runs, each kept for one planted violation.
pub struct Finished {
    pub url: String,
    pub store: rein_store::Store,
    /// Lifecycle runs that completed with a side effect.
    pub done: Vec<uuid::Uuid>,
    /// A lifecycle run whose approval was denied.
    pub denied: uuid::Uuid,
}

/// Drives a few runs to the end with an in-process worker and scheduler, denying the one
/// approval, and checks the audit is clean.
pub async fn finished_runs(prefix: &str) -> Finished {
    let (url, store) = fresh_store(prefix).await;
    let lifecycle = store.load_definition("lifecycle", None).await.expect("def");
    let research = store
        .load_definition("research-agent", None)
        .await
        .expect("def");
    let mut requests: Vec<rein_store::EnqueueRequest> = (0..5)
        .map(|_| {
            rein_store::EnqueueRequest::new(
                lifecycle.clone(),
                serde_json::json!({ "sim": { "work_ms": 5 } }),
            )
        })
        .collect();
    requests.push(rein_store::EnqueueRequest::new(
        lifecycle.clone(),
        serde_json::json!({ "sim": { "work_ms": 5, "approval": "deny", "amount": 500 } }),
    ));
    requests.push(rein_store::EnqueueRequest::new(
        research,
        serde_json::json!({ "sim": { "work_ms": 5, "steps": 2, "transient_failures": 1 } }),
    ));
    let ids: Vec<uuid::Uuid> = store
        .enqueue_batch(&requests)
        .await
        .expect("enqueue")
        .iter()
        .map(|e| e.run_id)
        .collect();
    let denied = ids[5];

    let stop = tokio_util::sync::CancellationToken::new();
    let mut wconfig = rein_worker::WorkerConfig::new(format!("{prefix}-w"));
    wconfig.lease_ttl_ms = 2_000;
    wconfig.poll_interval_ms = 20;
    let worker = rein_worker::Worker::new(
        store.clone(),
        wconfig,
        rein_worker::builtin_registry(store.clone()),
    );
    let mut sconfig = rein_scheduler::SchedulerConfig::new(format!("{prefix}-s"));
    sconfig.tick_ms = 20;
    let mut scheduler = rein_scheduler::Scheduler::new(store.clone(), sconfig);
    let worker_task = tokio::spawn({
        let stop = stop.clone();
        async move { worker.run(stop).await }
    });
    let scheduler_task = tokio::spawn({
        let stop = stop.clone();
        async move { scheduler.run(stop).await }
    });
    wait_for(
        "every fixture run terminal",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            let store = store.clone();
            async move {
                if store.run(denied).await.is_ok_and(|r| r.state == "paused") {
                    let _ = store
                        .send(
                            denied,
                            "approval_denied",
                            serde_json::json!({ "reason": "no" }),
                            &rein_store::Sender::Approver("test".into()),
                            60_000,
                        )
                        .await;
                }
                store.run_totals().await.is_ok_and(|(n, t)| n == t)
            }
        },
    )
    .await;
    stop.cancel();
    worker_task.await.expect("worker task").expect("worker");
    scheduler_task
        .await
        .expect("scheduler task")
        .expect("scheduler");
    let clean = store.audit().await.expect("audit");
    assert_eq!(clean.violations(), 0, "the fixture audits clean: {clean:?}");
    Finished {
        url,
        store,
        done: ids[..5].to_vec(),
        denied,
    }
}

/// A private redis-server on a free port: a child in its own process group that dies with
/// the test (see [`DieWithParent`]), killed and reaped on `stop` and on drop.
pub struct PrivateRedis {
    port: u16,
    child: std::sync::Mutex<Option<Child>>,
}

/// A TCP port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl PrivateRedis {
    pub fn start(port: u16, dir: &std::path::Path) -> PrivateRedis {
        let log = File::create(dir.join(format!("redis-{port}.log"))).expect("redis log file");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("redis log file"))
            .stderr(log)
            .process_group(0)
            .die_with_parent()
            .spawn()
            .expect("redis-server must be installed (SPEC K1 tests need a real Redis)");
        let redis = PrivateRedis {
            port,
            child: std::sync::Mutex::new(Some(child)),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server is not listening");
            std::thread::sleep(Duration::from_millis(20));
        }
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (only the one this test started) and waits until its port is free.
    pub fn stop(&self) {
        let Some(mut child) = self.child.lock().ok().and_then(|mut c| c.take()) else {
            return;
        };
        let _ = child.kill();
        let _ = child.wait();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(Instant::now() < deadline, "redis-server did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `rein ARGS` with only `env` of the variables that pick a route (database, API, token,
/// who acts).
pub fn rein_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(REIN);
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("REIN_URL")
        .env_remove("REIN_TOKEN")
        .env_remove("REIN_APPROVER")
        .env_remove("REIN_OPERATOR");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run rein")
}

/// Commits `events` to an unleased run, each at once, as a worker would (what a node's action
/// decides is the engine's to write).
pub async fn as_the_engine(store: &rein_store::Store, run: uuid::Uuid, events: &[&str]) {
    for event in events {
        let sent = store
            .send(
                run,
                event,
                serde_json::json!({}),
                &rein_store::Sender::Engine("test-worker".into()),
                60_000,
            )
            .await
            .unwrap_or_else(|e| panic!("send {event}: {e}"));
        assert!(
            matches!(sent, rein_store::SendOutcome::Applied { .. }),
            "{event} applies at once to a run without a lease: {sent:?}"
        );
    }
}

/// Opens an hour-long request to approve run `run`'s refund call with `args` (the tool
/// `refund` of state ACTING), named by action hash `hash`; its id.
pub async fn ask_refund_approval(
    store: &rein_store::Store,
    run: uuid::Uuid,
    args: serde_json::Value,
    hash: &str,
) -> uuid::Uuid {
    store
        .request_approval(rein_store::ApprovalAsk {
            run_id: run,
            node: "ACTING",
            tool: "refund",
            args: &args,
            action_hash: hash,
            risk: "high",
            expires_after_ms: 3_600_000,
        })
        .await
        .expect("request an approval")
        .approval_id
}

/// A fresh database, a running `rein api` on it (the real binary, on a free port), and a
/// store for setting up and checking.
pub struct Api {
    pub fleet: Fleet,
    pub url: String,
    pub base: String,
    pub store: rein_store::Store,
    pub http: reqwest::Client,
}

impl Api {
    pub async fn start(prefix: &str, extra: &[&str]) -> Api {
        Api::start_env(prefix, extra, &[]).await
    }

    /// [`Api::start`] with extra environment variables.
    pub async fn start_env(prefix: &str, extra: &[&str], env: &[(&str, &str)]) -> Api {
        let (url, store) = fresh_store(prefix).await;
        let mut fleet = Fleet::new(&url, prefix);
        let mut args = vec!["api", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let base = fleet.spawn_server_env("api", &args, env);
        assert!(base.starts_with("http://127.0.0.1:"), "first line: {base}");
        Api {
            fleet,
            url,
            base,
            store,
            http: reqwest::Client::new(),
        }
    }

    /// A token made by `rein tokens create`.
    pub fn token(&self, subject: &str, scopes: &[&str]) -> String {
        token(&self.url, subject, scopes)
    }

    pub fn get(&self, path: &str, token: Option<&str>) -> reqwest::RequestBuilder {
        let req = self.http.get(format!("{}{path}", self.base));
        match token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    pub fn post(&self, path: &str, token: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{path}", self.base))
            .bearer_auth(token)
    }

    /// POSTs `body` as JSON and reads the JSON answer.
    pub async fn post_json(
        &self,
        path: &str,
        token: &str,
        body: &serde_json::Value,
    ) -> (reqwest::StatusCode, serde_json::Value) {
        json_of(self.post(path, token).json(body).send().await.unwrap()).await
    }

    /// POSTs `text` as a TOML document (a definition) and reads the JSON answer.
    pub async fn post_toml(
        &self,
        path: &str,
        token: &str,
        text: &str,
    ) -> (reqwest::StatusCode, serde_json::Value) {
        json_of(
            self.post(path, token)
                .header("content-type", "application/toml")
                .body(text.to_owned())
                .send()
                .await
                .unwrap(),
        )
        .await
    }

    /// GETs `path` and reads the JSON answer.
    pub async fn get_json(
        &self,
        path: &str,
        token: &str,
    ) -> (reqwest::StatusCode, serde_json::Value) {
        json_of(self.get(path, Some(token)).send().await.unwrap()).await
    }
}

/// The status and JSON body of an API response.
pub async fn json_of(r: reqwest::Response) -> (reqwest::StatusCode, serde_json::Value) {
    let status = r.status();
    let text = r.text().await.expect("a body");
    let value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("status {status}: body is not JSON ({e}): {text}"));
    (status, value)
}

/// The stable code of an API error document.
pub fn code(v: &serde_json::Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("<none>")
}

/// A research-agent run parked in WAITING_APPROVAL with an open request, without a worker.
pub async fn waiting_approval(store: &rein_store::Store) -> (uuid::Uuid, uuid::Uuid) {
    let def = store.load_definition("research-agent", None).await.unwrap();
    let run = store
        .enqueue(rein_store::EnqueueRequest::new(def, serde_json::json!({})))
        .await
        .unwrap()
        .run_id;
    as_the_engine(
        store,
        run,
        &["TASK_ACCEPTED", "PLAN_READY", "APPROVAL_REQUIRED"],
    )
    .await;
    let approval = store
        .request_approval(rein_store::ApprovalAsk {
            run_id: run,
            node: "ACTING",
            tool: "refund",
            args: &serde_json::json!({"order_id": "A1", "amount": 150}),
            action_hash: "h-api",
            risk: "high",
            expires_after_ms: 3_600_000,
        })
        .await
        .unwrap()
        .approval_id;
    (run, approval)
}

/// Cancels an unleased run at once, as an outside caller.
pub async fn cancel(store: &rein_store::Store, run: uuid::Uuid) {
    store
        .send(
            run,
            "CANCEL",
            serde_json::json!({"reason": "test"}),
            &rein_store::Sender::outside("test"),
            60_000,
        )
        .await
        .unwrap();
}

/// The open approval request of `run`, as `rein approvals list --json` shows it.
pub fn open_request(url: &str, run: uuid::Uuid) -> serde_json::Value {
    let out = rein(&["approvals", "list", "--json", "--database-url", url]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let open: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    open.as_array()
        .and_then(|a| a.iter().find(|r| r["run_id"] == serde_json::json!(run)))
        .unwrap_or_else(|| panic!("no open request for {run}: {open}"))
        .clone()
}

/// A research-agent run in ACTING, moved there as its worker would.
pub async fn acting_run(store: &rein_store::Store) -> uuid::Uuid {
    let def = store.load_definition("research-agent", None).await.unwrap();
    let run = store
        .enqueue(rein_store::EnqueueRequest::new(def, serde_json::json!({})))
        .await
        .unwrap()
        .run_id;
    as_the_engine(store, run, &["TASK_ACCEPTED", "PLAN_READY"]).await;
    run
}

/// What the worker does when a refund of `amount` needs a person: opens the request and
/// commits APPROVAL_REQUESTED with the wait's event. The request's id.
pub async fn ask_for_approval(
    store: &rein_store::Store,
    run: uuid::Uuid,
    amount: u32,
) -> uuid::Uuid {
    let args = serde_json::json!({"order_id": "A1", "amount": amount});
    let hash = format!("refund-{amount}");
    let approval = ask_refund_approval(store, run, args.clone(), &hash).await;
    let engine = rein_store::Sender::Engine("test-worker".into());
    store
        .send(
            run,
            "APPROVAL_REQUESTED",
            serde_json::json!({"approval_id": approval, "action_hash": hash, "tool": "refund", "args": args}),
            &engine,
            60_000,
        )
        .await
        .unwrap();
    store
        .send(
            run,
            "APPROVAL_REQUIRED",
            serde_json::json!({}),
            &engine,
            60_000,
        )
        .await
        .unwrap();
    assert_eq!(store.run(run).await.unwrap().state, "WAITING_APPROVAL");
    approval
}

/// A small definition written in YAML; [`GREETER_TOML`] is the same one in TOML.
pub const GREETER_YAML: &str = "name: greeter
version: 1
cancel_state: DONE
events: [GREETED, REPLIED]
external_events: [REPLIED]
states:
  - {name: GREET, kind: active, initial: true, action: noop}
  - {name: WAIT, kind: waiting}
  - {name: DONE, kind: terminal}
transitions:
  - {from: GREET, event: GREETED, to: WAIT}
  - {from: WAIT, event: REPLIED, to: DONE}
";

/// [`GREETER_YAML`] in TOML.
pub const GREETER_TOML: &str = r#"
name = "greeter"
version = 1
cancel_state = "DONE"
events = ["GREETED", "REPLIED"]
external_events = ["REPLIED"]
states = [
  { name = "GREET", kind = "active", initial = true, action = "noop" },
  { name = "WAIT", kind = "waiting" },
  { name = "DONE", kind = "terminal" },
]
transitions = [
  { from = "GREET", event = "GREETED", to = "WAIT" },
  { from = "WAIT", event = "REPLIED", to = "DONE" },
]
"#;

/// The fork fixture with START a timer instead of the `fork` action: the run fans out into
/// two children as soon as its timer fires (the scheduler's commit creates them).
pub fn timed_fork() -> String {
    let start = "kind = \"active\"\ninitial = true\naction = \"fork\"";
    let fixture = include_str!("../../../worker/tests/fixtures/fork.toml");
    assert!(
        fixture.contains(start),
        "the fixture's START runs the fork action"
    );
    fixture.replace(
        start,
        "kind = \"waiting\"\ninitial = true\ntimeout = { after_ms = 1, event = \"GO\" }",
    )
}

/// Registers the timed fork and enqueues one run of it; the root's id.
pub async fn enqueue_timed_fork(store: &rein_store::Store) -> uuid::Uuid {
    let def = rein_core::Definition::parse(
        &timed_fork(),
        rein_core::Format::Toml,
        &rein_core::GuardRegistry::new(),
    )
    .expect("definition");
    store.register_definition(&def).await.expect("register");
    store
        .enqueue(rein_store::EnqueueRequest::new(def, serde_json::json!({})))
        .await
        .expect("enqueue")
        .run_id
}

/// LOGIN users made for one test, members of Rein's groups; dropped when the value is
/// dropped (a panic included), after the test's processes, which are declared later.
pub struct Logins {
    admin_url: String,
    names: Vec<String>,
}

impl Logins {
    pub fn new(admin_url: &str) -> Logins {
        Logins {
            admin_url: admin_url.to_owned(),
            names: Vec::new(),
        }
    }

    /// Creates a login member of `group` with a name unique to this test run; its URL.
    pub async fn create(&mut self, admin: &rein_store::Store, label: &str, group: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .subsec_nanos();
        let name = format!("rein_t_{label}_{}_{nanos}", std::process::id());
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE ROLE {name} LOGIN IN ROLE {group}"
        )))
        .execute(admin.pool())
        .await
        .expect("create a login role");
        self.names.push(name.clone());
        as_user(&self.admin_url, &name)
    }
}

impl Drop for Logins {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = Command::new("psql")
                .arg(&self.admin_url)
                .args(["-q", "-c", &format!("DROP ROLE IF EXISTS {name}")])
                .output();
        }
    }
}

/// The same URL with another user (no password: the test server trusts local logins).
pub fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let host_part = rest.split_once('@').map_or(rest, |(_, h)| h);
    format!("{scheme}://{user}@{host_part}")
}
