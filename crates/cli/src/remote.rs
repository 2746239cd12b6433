//! Where operator commands go: the Rein API when `REIN_URL` is set (with `REIN_TOKEN` or
//! `--api-token-file`), the database otherwise. Either way a command gets the same JSON
//! document back — the database side runs the very operations the API handlers run
//! ([`rein_ops::service`]) — so its output, `--json` or human, does not depend on the route.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rein_accel::limits::KeyState;
use rein_core::Format;
use rein_store::{RunFilter, Sender, Store};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE};
use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;

use rein_ops::recovery::{self, BriefView, ResolveBody, ResolveResponse, VerifyView};
use rein_ops::service::{self, EnqueueBody, NEXT_AFTER, NEXT_CURSOR, PAGE_TRUNCATED, Publisher};
use rein_ops::{Code, Error};
use rein_process::{DbArgs, exit};

/// Longest API URL accepted.
const URL_BYTES_MAX: usize = 2048;
/// Largest response body read from the API, and largest event of a run's stream.
pub const RESPONSE_BYTES_MAX: usize = 64 * 1024 * 1024;
/// A run's stream silent for this long is taken as broken (the server sends a comment every
/// 15 s) and opened again.
const STREAM_SILENCE_MAX: Duration = Duration::from_secs(60);
/// Who a client key belongs to when the CLI enqueues on the database itself.
pub const DB_CALLER: &str = "cli";
/// Largest token file read: a token is one line of well under this.
pub const TOKEN_FILE_BYTES_MAX: u64 = 4096;
/// The environment variable holding the API token.
const TOKEN_ENV: &str = "REIN_TOKEN";

/// One page of a list: its rows, the cursor of the next page, and whether the page's byte
/// bound cut it short.
pub struct Page {
    pub rows: Value,
    pub next: Option<String>,
    pub truncated: bool,
}

/// How an operator command reaches Rein.
#[derive(clap::Args, Clone)]
pub struct Conn {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub api: ApiConn,
}

/// How a command reaches the Rein API, when it goes through one.
#[derive(clap::Args, Clone)]
pub struct ApiConn {
    /// Go through this Rein API (e.g. http://127.0.0.1:7878) instead of the database.
    #[arg(long = "api-url", env = "REIN_URL", value_name = "URL")]
    pub url: Option<String>,
    /// Bearer token for the API (`rein tokens create` prints one). A flag's value shows in
    /// `ps` and shell history: prefer the REIN_TOKEN environment variable, which is read
    /// when neither this nor --api-token-file is given, or --api-token-file.
    #[arg(long = "api-token", value_name = "TOKEN")]
    pub token: Option<String>,
    /// Read the bearer token from this file (the line `rein tokens create` printed; a
    /// trailing newline is ignored), e.g. a mounted secret.
    #[arg(long = "api-token-file", value_name = "PATH", conflicts_with = "token")]
    pub token_file: Option<PathBuf>,
}

impl ApiConn {
    /// The API token and where it came from: --api-token-file, --api-token, or REIN_TOKEN.
    fn api_token(&self) -> Result<Option<(String, String)>, String> {
        if let Some(path) = &self.token_file {
            let token = read_token_file(path)?;
            return Ok(Some((token, format!("the token in {}", path.display()))));
        }
        if let Some(token) = self.token.clone().filter(|t| !t.is_empty()) {
            return Ok(Some((token, "--api-token".to_owned())));
        }
        Ok(std::env::var(TOKEN_ENV)
            .ok()
            .filter(|t| !t.is_empty())
            .map(|t| (t, TOKEN_ENV.to_owned())))
    }

    /// A client of the API when a URL is given; errors are printed and returned as exit
    /// codes.
    pub fn client(&self) -> Result<Option<Client>, u8> {
        if self.token.is_some() {
            // Any user of the machine can read another's command line.
            eprintln!(
                "warning: --api-token puts the token in the process list (`ps`) and shell \
                 history; set REIN_TOKEN or use --api-token-file PATH instead"
            );
        }
        let Some(url) = self.url.as_deref().filter(|u| !u.is_empty()) else {
            return Ok(None);
        };
        let token = self.api_token().map_err(|message| {
            eprintln!("error: {message}");
            exit::INPUT
        })?;
        Client::new(url, token).map(Some).map_err(|message| {
            eprintln!("error: {message}");
            exit::INPUT
        })
    }
}

/// The token in the file at `path`: its content without trailing newlines. An empty,
/// unreadable or oversized file is refused, naming the file.
pub fn read_token_file(path: &Path) -> Result<String, String> {
    let shown = path.display();
    let file = std::fs::File::open(path)
        .map_err(|e| format!("cannot read --api-token-file {shown}: {e}"))?;
    let mut bytes = Vec::new();
    file.take(TOKEN_FILE_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read --api-token-file {shown}: {e}"))?;
    if bytes.len() as u64 > TOKEN_FILE_BYTES_MAX {
        return Err(format!(
            "--api-token-file {shown} is larger than {TOKEN_FILE_BYTES_MAX} bytes; it should hold \
             only the token `rein tokens create` printed"
        ));
    }
    let text = String::from_utf8(bytes).map_err(|_| {
        format!("--api-token-file {shown} is not text; it should hold only the token")
    })?;
    let token = text.trim_end_matches(['\n', '\r']);
    if token.trim().is_empty() {
        return Err(format!(
            "--api-token-file {shown} is empty; put the token `rein tokens create` printed in it"
        ));
    }
    Ok(token.to_owned())
}

/// The API over HTTP.
pub struct Client {
    http: reqwest::Client,
    /// For answers that last as long as a run does (`GET /v1/runs/{id}/stream`): no bound on
    /// the whole answer, one on a silence longer than the server's keep-alives.
    streaming: reqwest::Client,
    base: reqwest::Url,
    token: Option<String>,
}

pub enum Backend {
    Db(Store),
    Api(Client),
}

impl Backend {
    /// The API when a URL is given, the database otherwise; errors are printed and returned
    /// as exit codes.
    pub async fn open(conn: &Conn) -> Result<Backend, u8> {
        if let Some(client) = conn.api.client()? {
            return Ok(Backend::Api(client));
        }
        // This process is the one that refuses what the database route refuses (an invalid
        // transition): its warnings go to stderr like a role's.
        rein_process::init_logging_at(false, "warn,sqlx=error");
        rein_process::connect(&conn.db, false)
            .await
            .map(Backend::Db)
    }

    pub fn is_api(&self) -> bool {
        matches!(self, Backend::Api(_))
    }

    /// Creates a run. A client key belongs to the caller: the token's subject through the
    /// API, [`DB_CALLER`] on the database. The run records who enqueued it: the token's
    /// subject through the API, `by` on the database.
    pub async fn enqueue(
        &self,
        body: EnqueueBody,
        key: Option<String>,
        by: &str,
    ) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => {
                to_value(service::enqueue(store, body, key, (DB_CALLER, by), None, None).await?)
            }
            Backend::Api(c) => {
                let mut request = c
                    .request(reqwest::Method::POST, &["v1", "runs"])
                    .json(&body);
                if let Some(key) = key {
                    request = request.header("idempotency-key", key);
                }
                c.send(request).await.map(|(v, _)| v)
            }
        }
    }

    pub async fn run(&self, run: Uuid) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => service::run(store, run).await,
            Backend::Api(c) => c.get(&["v1", "runs", &run.to_string()], &[]).await,
        }
    }

    /// A page of runs (with their data when `data`) and the cursor of the next one.
    pub async fn runs(
        &self,
        filter: RunFilter,
        cursor: Option<String>,
        limit: i64,
        data: bool,
    ) -> Result<Page, Error> {
        match self {
            Backend::Db(store) => {
                let shape = (data, service::PAGE_BYTES_MAX_DEFAULT);
                let page =
                    service::runs(store, filter, cursor.as_deref(), Some(limit), shape).await?;
                Ok(Page {
                    rows: Value::Array(page.runs),
                    next: page.next,
                    truncated: page.truncated,
                })
            }
            Backend::Api(c) => {
                let mut query = vec![("limit", limit.to_string())];
                if data {
                    query.push(("data", "true".to_owned()));
                }
                query.extend(filter.status.map(|s| ("status", s)));
                query.extend(filter.definition.map(|d| ("definition", d)));
                query.extend(
                    filter
                        .created_after
                        .map(|t| ("created_after", t.to_rfc3339())),
                );
                query.extend(
                    filter
                        .created_before
                        .map(|t| ("created_before", t.to_rfc3339())),
                );
                query.extend(filter.state.map(|s| ("state", s)));
                query.extend(filter.queue.map(|q| ("queue", q)));
                query.extend(filter.parent.map(|p| ("parent", p.to_string())));
                query.extend(cursor.map(|c| ("cursor", c)));
                let request = c
                    .request(reqwest::Method::GET, &["v1", "runs"])
                    .query(&query);
                let (rows, headers) = c.send(request).await?;
                Ok(Page::of(rows, &headers, NEXT_CURSOR))
            }
        }
    }

    /// One page of the run's events after sequence `after`.
    async fn events(&self, run: Uuid, after: i64, limit: i64) -> Result<Page, Error> {
        match self {
            Backend::Db(store) => {
                let bytes_max = service::PAGE_BYTES_MAX_DEFAULT;
                let page = service::events(store, run, Some(after), Some(limit), bytes_max).await?;
                Ok(Page {
                    rows: to_value(page.events)?,
                    next: page.next.map(|n| n.to_string()),
                    truncated: page.truncated,
                })
            }
            Backend::Api(c) => {
                let query = [("after", after.to_string()), ("limit", limit.to_string())];
                let request = c
                    .request(
                        reqwest::Method::GET,
                        &["v1", "runs", &run.to_string(), "events"],
                    )
                    .query(&query);
                let (rows, headers) = c.send(request).await?;
                Ok(Page::of(rows, &headers, NEXT_AFTER))
            }
        }
    }

    /// The run's whole log in sequence order, read a page at a time.
    pub async fn history(&self, run: Uuid) -> Result<Value, Error> {
        let mut events = Vec::new();
        let mut after = 0;
        loop {
            let page = self.events(run, after, service::PAGE_MAX).await?;
            if let Value::Array(rows) = page.rows {
                events.extend(rows);
            }
            let Some(next) = page.next else {
                return Ok(Value::Array(events));
            };
            // Each page starts past the one before; a server that says otherwise would
            // have this loop forever.
            match next.parse::<i64>() {
                Ok(next) if next > after => after = next,
                _ => {
                    return Err(Error::new(
                        Code::Internal,
                        format!(
                            "the API named page `{next}` after page {after} of run {run}'s events"
                        ),
                    ));
                }
            }
        }
    }

    /// Sends `kind` to the run as an outside caller. Through the API the sender is the
    /// token's subject and its scopes say whether it may send an approval event; on the
    /// database it is `sender`, who may (database access holds every right). Either way an
    /// approval event records that sender as its approver. With `key`, a repeat returns
    /// what became of the first send.
    pub async fn send(
        &self,
        run: Uuid,
        (kind, payload): (&str, Value),
        sender: &str,
        key: Option<&str>,
    ) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => {
                let sender = Sender::outside_approver(sender, sender);
                to_value(service::send(store, run, kind, payload, &sender, key, None).await?)
            }
            Backend::Api(c) => {
                let mut request = c
                    .request(
                        reqwest::Method::POST,
                        &["v1", "runs", &run.to_string(), "events"],
                    )
                    .json(&json!({ "type": kind, "payload": payload }));
                if let Some(key) = key {
                    request = request.header("idempotency-key", key);
                }
                c.send(request).await.map(|(v, _)| v)
            }
        }
    }

    /// Runs a finished run again, enqueued by the token's subject through the API and by
    /// `by` on the database.
    pub async fn rerun(&self, run: Uuid, by: &str) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => to_value(service::rerun(store, run, by, None).await?),
            Backend::Api(c) => {
                let request = c.request(
                    reqwest::Method::POST,
                    &["v1", "runs", &run.to_string(), "rerun"],
                );
                c.send(request).await.map(|(v, _)| v)
            }
        }
    }

    /// Moves (or lists) the runs of `name` between versions (`rein definitions migrate`).
    pub async fn migrate(
        &self,
        name: &str,
        body: &rein_ops::moves::MigrateBody,
        by: &str,
        progress: &(dyn Fn(&rein_ops::moves::MigratedRun) + Sync),
    ) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => to_value(
                rein_ops::moves::migrate(
                    store,
                    name,
                    body,
                    by,
                    &rein_core::checkpoint::Migrations::new(),
                    progress,
                )
                .await?,
            ),
            Backend::Api(c) => {
                let request = c
                    .request(
                        reqwest::Method::POST,
                        &["v1", "definitions", name, "migrate"],
                    )
                    .json(body);
                c.send(request).await.map(|(v, _)| v)
            }
        }
    }

    /// Forks `run` (`rein fork`).
    pub async fn fork(
        &self,
        run: Uuid,
        body: &rein_ops::moves::ForkBody,
        by: &str,
    ) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => {
                to_value(rein_ops::moves::fork(store, run, body, by, None).await?)
            }
            Backend::Api(c) => {
                let request = c
                    .request(
                        reqwest::Method::POST,
                        &["v1", "runs", &run.to_string(), "fork"],
                    )
                    .json(body);
                c.send(request).await.map(|(v, _)| v)
            }
        }
    }

    pub async fn workers(&self) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => to_value(service::workers(store).await?),
            Backend::Api(c) => c.get(&["v1", "workers"], &[]).await,
        }
    }

    pub async fn approvals(
        &self,
        all: bool,
        run: Option<Uuid>,
        limit: i64,
    ) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => to_value(service::approvals(store, all, run, Some(limit)).await?),
            Backend::Api(c) => {
                let mut query = vec![("all", all.to_string()), ("limit", limit.to_string())];
                query.extend(run.map(|r| ("run", r.to_string())));
                c.get(&["v1", "approvals"], &query).await
            }
        }
    }

    /// Grants or denies. Through the API the approver is the token's subject, not `approver`.
    pub async fn decide(
        &self,
        approval: Uuid,
        grant: bool,
        approver: &str,
        comment: Option<&str>,
    ) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => {
                to_value(service::decide(store, approval, grant, approver, comment, None).await?)
            }
            Backend::Api(c) => {
                let verb = if grant { "grant" } else { "deny" };
                let request = c
                    .request(
                        reqwest::Method::POST,
                        &["v1", "approvals", &approval.to_string(), verb],
                    )
                    .json(&json!({ "comment": comment }));
                c.send(request).await.map(|(v, _)| v)
            }
        }
    }

    pub async fn definitions(&self) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => to_value(service::definitions(store).await?),
            Backend::Api(c) => c.get(&["v1", "definitions"], &[]).await,
        }
    }

    pub async fn definition(&self, name: &str, version: Option<u32>) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => to_value(service::definition(store, name, version).await?),
            Backend::Api(c) => {
                let query: Vec<(&str, String)> = version
                    .map(|v| ("version", v.to_string()))
                    .into_iter()
                    .collect();
                c.get(&["v1", "definitions", name], &query).await
            }
        }
    }

    /// Registers a definition version, published by the token's subject through the API
    /// and by `publisher.by` on the database.
    pub async fn register(
        &self,
        text: String,
        format: Format,
        publisher: Publisher<'_>,
    ) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => {
                to_value(service::register(store, &text, format, publisher).await?)
            }
            Backend::Api(c) => {
                let (format, content_type) = match format {
                    Format::Toml => ("toml", "application/toml"),
                    Format::Json => ("json", "application/json"),
                    Format::Yaml => ("yaml", "application/yaml"),
                };
                let request = c
                    .request(reqwest::Method::POST, &["v1", "definitions"])
                    .query(&[
                        ("format", format.to_owned()),
                        ("make_current", publisher.make_current.to_string()),
                        ("allow_builtin", publisher.allow_builtin.to_string()),
                    ])
                    .header(CONTENT_TYPE, content_type)
                    .body(text);
                c.send(request).await.map(|(v, _)| v)
            }
        }
    }

    /// Points definition `name` at `version`, moved by the token's subject through the API
    /// and by `by` on the database.
    pub async fn set_current(
        &self,
        name: &str,
        version: u32,
        (by, allow_builtin): (&str, bool),
    ) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => {
                to_value(service::set_current(store, name, version, (by, allow_builtin)).await?)
            }
            Backend::Api(c) => {
                let request = c
                    .request(
                        reqwest::Method::POST,
                        &["v1", "definitions", name, "current"],
                    )
                    .json(&json!({ "version": version, "allow_builtin": allow_builtin }));
                c.send(request).await.map(|(v, _)| v)
            }
        }
    }

    pub async fn why(&self, run: Uuid) -> Result<Value, Error> {
        match self {
            Backend::Db(store) => service::why(store, run).await,
            Backend::Api(c) => c.get(&["v1", "runs", &run.to_string(), "why"], &[]).await,
        }
    }

    /// The blob named `sha256` (SPEC E5): through the API, if a run the token may read
    /// refers to it; on the database, if any run does.
    pub async fn blob(&self, sha256: &str) -> Result<Value, Error> {
        let sha256 = service::blob_hash(sha256)?;
        match self {
            Backend::Db(store) => service::blob(store, sha256, None, None)
                .await
                .map(|view| json!(view)),
            Backend::Api(c) => c.get(&["v1", "blobs", sha256], &[]).await,
        }
    }

    /// The resume brief of `run` (SPEC D3).
    pub async fn brief(&self, run: Uuid) -> Result<BriefView, Error> {
        match self {
            Backend::Db(store) => recovery::brief(store, run).await,
            Backend::Api(c) => typed(
                c.get(&["v1", "runs", &run.to_string(), "brief"], &[])
                    .await?,
            ),
        }
    }

    /// What `run`'s model calls used, by model and in all.
    pub async fn usage(&self, run: Uuid) -> Result<rein_ops::usage::UsageView, Error> {
        match self {
            Backend::Db(store) => rein_ops::usage::usage(store, run).await,
            Backend::Api(c) => typed(
                c.get(&["v1", "runs", &run.to_string(), "usage"], &[])
                    .await?,
            ),
        }
    }

    /// Whether `run`'s log replays to what is stored.
    pub async fn verify(&self, run: Uuid) -> Result<VerifyView, Error> {
        match self {
            Backend::Db(store) => recovery::verify(store, run).await,
            Backend::Api(c) => typed(
                c.get(&["v1", "runs", &run.to_string(), "verify"], &[])
                    .await?,
            ),
        }
    }

    /// Settles `run`'s in-doubt call; `by` names the operator on the database route (the API
    /// records its token's subject).
    pub async fn resolve(
        &self,
        run: Uuid,
        body: ResolveBody,
        by: &str,
    ) -> Result<ResolveResponse, Error> {
        match self {
            Backend::Db(store) => recovery::resolve(store, run, body, by, None).await,
            Backend::Api(c) => {
                let request = c
                    .request(
                        reqwest::Method::POST,
                        &["v1", "runs", &run.to_string(), "resolve"],
                    )
                    .json(&body);
                typed(c.send(request).await?.0)
            }
        }
    }
}

impl Page {
    /// A page as the API answered it: `next_header` names the next page.
    fn of(rows: Value, headers: &reqwest::header::HeaderMap, next_header: &str) -> Page {
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Page {
            rows,
            next: text(next_header),
            truncated: text(PAGE_TRUNCATED).is_some(),
        }
    }
}

/// An API answer as the view the database route returns.
pub fn typed<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, Error> {
    serde_json::from_value(value).map_err(|e| {
        Error::new(
            Code::Internal,
            format!(
                "the API answered a document this CLI cannot read ({e}); are both the same version?"
            ),
        )
    })
}

fn to_value(value: impl Serialize) -> Result<Value, Error> {
    serde_json::to_value(value).map_err(|e| {
        Error::new(
            Code::Internal,
            format!("cannot encode the result as JSON: {e}"),
        )
    })
}

impl Client {
    /// A client of the API at `url`, with a token and where it came from.
    fn new(url: &str, token: Option<(String, String)>) -> Result<Client, String> {
        if url.len() > URL_BYTES_MAX {
            return Err(format!("REIN_URL is longer than {URL_BYTES_MAX} bytes"));
        }
        let base = reqwest::Url::parse(url).map_err(|e| {
            format!("REIN_URL `{url}` is not a URL ({e}); e.g. http://127.0.0.1:7878")
        })?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(format!(
                "REIN_URL `{url}` must be an http:// or https:// address of `rein api`"
            ));
        }
        if let Some((t, from)) = &token
            && (t.len() > 1024 || t.chars().any(|c| c.is_control() || c == ' '))
        {
            return Err(format!(
                "{from} is not a token (too long, or has spaces or control characters); use the line `rein tokens create` printed"
            ));
        }
        let token = token.map(|(t, _)| t);
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| format!("cannot set up an HTTP client: {e}"))?;
        let streaming = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .read_timeout(STREAM_SILENCE_MAX)
            .build()
            .map_err(|e| format!("cannot set up an HTTP client: {e}"))?;
        Ok(Client {
            http,
            streaming,
            base,
            token,
        })
    }

    /// A request to the base URL plus `segments` (each percent-encoded).
    fn request(&self, method: reqwest::Method, segments: &[&str]) -> reqwest::RequestBuilder {
        self.request_with(&self.http, method, segments)
    }

    fn request_with(
        &self,
        http: &reqwest::Client,
        method: reqwest::Method,
        segments: &[&str],
    ) -> reqwest::RequestBuilder {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        let request = http.request(method, url);
        match &self.token {
            Some(token) => request.header(AUTHORIZATION, format!("Bearer {token}")),
            None => request,
        }
    }

    /// `GET /v1/limits`: the fleet-wide limits' state, as the API's Redis holds it.
    pub async fn limits(&self, keys: &[String]) -> Result<Vec<KeyState>, Error> {
        let query: Vec<(&str, String)> = if keys.is_empty() {
            Vec::new()
        } else {
            vec![("keys", keys.join(","))]
        };
        typed(self.get(&["v1", "limits"], &query).await?)
    }

    /// Opens `GET /v1/runs/{run}/stream` after sequence `after`: the answer whose body is the
    /// event stream, or the API's error.
    pub async fn stream(&self, run: Uuid, after: i64) -> Result<reqwest::Response, Error> {
        let mut request = self
            .request_with(
                &self.streaming,
                reqwest::Method::GET,
                &["v1", "runs", &run.to_string(), "stream"],
            )
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if after > 0 {
            request = request.header("last-event-id", after.to_string());
        }
        let response = request.send().await.map_err(|e| self.unreachable(e))?;
        let status = response.status();
        if status.is_success() {
            let is_stream = response
                .headers()
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            if !is_stream {
                return Err(Error::new(
                    Code::Internal,
                    format!(
                        "the API at {} answered the run's stream with something else than text/event-stream; is it a Rein API of this version?",
                        self.base
                    ),
                ));
            }
            return Ok(response);
        }
        let body = self.read_body(response).await?;
        Err(remote_error(
            status,
            serde_json::from_slice(&body).ok(),
            &self.base,
        ))
    }

    fn unreachable(&self, e: reqwest::Error) -> Error {
        Error::new(
            Code::Unavailable,
            format!(
                "cannot reach the Rein API at {}: {e} (is `rein api` running there? check REIN_URL)",
                self.base
            ),
        )
    }

    /// A response's body, at most [`RESPONSE_BYTES_MAX`] bytes of it.
    async fn read_body(&self, mut response: reqwest::Response) -> Result<Vec<u8>, Error> {
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| self.unreachable(e))? {
            if body.len() + chunk.len() > RESPONSE_BYTES_MAX {
                return Err(Error::new(
                    Code::Internal,
                    format!("the API answered more than {RESPONSE_BYTES_MAX} bytes"),
                ));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    async fn get(&self, segments: &[&str], query: &[(&str, String)]) -> Result<Value, Error> {
        let request = self.request(reqwest::Method::GET, segments).query(query);
        self.send(request).await.map(|(v, _)| v)
    }

    /// Sends and reads a JSON body; an error response becomes the API's own error.
    async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<(Value, reqwest::header::HeaderMap), Error> {
        let response = request.send().await.map_err(|e| self.unreachable(e))?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = self.read_body(response).await?;
        let value: Option<Value> = serde_json::from_slice(&body).ok();
        if status.is_success() {
            return value.map(|v| (v, headers)).ok_or_else(|| {
                Error::new(
                    Code::Internal,
                    format!(
                        "the API answered {status} without a JSON body; is {} a Rein API?",
                        self.base
                    ),
                )
            });
        }
        Err(remote_error(status, value, &self.base))
    }
}

/// The API's error document as an [`Error`]; anything else as an error naming the status.
fn remote_error(status: reqwest::StatusCode, body: Option<Value>, base: &reqwest::Url) -> Error {
    let error = body.as_ref().and_then(|b| b.get("error"));
    let Some(error) = error else {
        return Error::new(
            Code::Internal,
            format!("the API at {base} answered {status} without an error document"),
        );
    };
    let code = error.get("code").and_then(Value::as_str).unwrap_or("");
    let code = Code::parse(code).unwrap_or(Code::Internal);
    let mut message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("no message")
        .to_owned();
    if code == Code::Unauthorized {
        message.push_str(" (set REIN_TOKEN to a token from `rein tokens create`)");
    }
    let mut e = Error::new(code, message);
    if let Some(details) = error.get("details").filter(|d| !d.is_null()) {
        e = e.with_details(details.clone());
    }
    e
}
