//! `rein runs watch RUN` and `rein enqueue --wait`: a run followed to its end. Through
//! `REIN_URL` the command reads the API's `GET /v1/runs/{id}/stream` (server-sent events,
//! resumed with `Last-Event-ID` when the connection breaks); on the database it runs the same
//! follower the API runs (`rein_ops::stream::follow`), with the run's deltas from Redis when
//! `--redis-url` is given. Either way it sees the committed events in sequence order, the
//! deltas in between, and the run's end, and exits by how the run ended.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use rein_ops::stream::{Item, RunEnd};
use rein_ops::{Code, Error};
use rein_process::{RedisArgs, exit};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::print::{fail, print_history_header, print_history_row, printable};
use crate::remote::{Backend, Client, Conn, RESPONSE_BYTES_MAX};

/// Longest `--timeout`: a week.
pub const TIMEOUT_S_MAX: u64 = 7 * 24 * 3600;
/// Times in a row a broken stream is opened again before the command gives up.
const RECONNECTS_MAX: u32 = 5;
/// Pause before opening a broken stream again.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

#[derive(clap::Args)]
pub struct WatchArgs {
    #[command(flatten)]
    conn: Conn,
    run: Uuid,
    /// One JSON object per line (NDJSON): `{"event": "committed"|"delta"|"end", "data": ...}`,
    /// as the API's stream names them.
    #[arg(long)]
    json: bool,
    /// Give up after this many seconds, saying the run is still going (exit 6).
    #[arg(long, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=TIMEOUT_S_MAX))]
    timeout: Option<u64>,
    // On the database, the run's live deltas come from Redis; through REIN_URL, from the
    // API's.
    #[command(flatten)]
    redis: RedisArgs,
}

/// What a watch shows as it goes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Show {
    /// Each committed event as a row of `rein runs history`, deltas inline on a terminal.
    Rows,
    /// Each item as a JSON line.
    Json,
    /// Nothing: only the end counts (`enqueue --wait`).
    Quiet,
}

/// How watching ended.
pub enum Watched {
    Ended(RunEnd),
    /// `--timeout` passed first.
    TimedOut,
}

/// What a follower yields, whichever route it came by.
enum Seen {
    Committed(Value),
    Delta(Value),
    End(RunEnd),
}

/// `rein runs watch`.
pub async fn watch(args: WatchArgs) -> u8 {
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let show = if args.json { Show::Json } else { Show::Rows };
    let timeout = args.timeout.map(Duration::from_secs);
    let watched = follow_run(&backend, args.run, &args.redis, show, timeout).await;
    finish(&backend, args.run, watched, timeout, |end| {
        if show == Show::Rows {
            println!("{}", ended_line(end));
        }
    })
    .await
}

/// The exit code of a watch, with what is said about it: `say_end` prints the end.
pub async fn finish(
    backend: &Backend,
    run: Uuid,
    watched: Result<Watched, Error>,
    timeout: Option<Duration>,
    say_end: impl FnOnce(&RunEnd),
) -> u8 {
    match watched {
        Ok(Watched::Ended(end)) => {
            say_end(&end);
            exit_code(&end)
        }
        Ok(Watched::TimedOut) => {
            let now = match backend.run(run).await {
                Ok(row) => format!(
                    " (state {}, status {})",
                    printable(crate::print::text(&row, "state")),
                    crate::print::text(&row, "status")
                ),
                Err(_) => String::new(),
            };
            eprintln!(
                "gave up after {} s: run {run} is still going{now}; watch it again with `rein runs watch {run}`",
                timeout.map_or(0, |t| t.as_secs())
            );
            exit::TIMED_OUT
        }
        Err(e) => fail(&e),
    }
}

/// 0 for a run that succeeded, [`exit::RUN_FAILED`] for one that failed or was cancelled.
pub fn exit_code(end: &RunEnd) -> u8 {
    if end.succeeded() {
        exit::OK
    } else {
        exit::RUN_FAILED
    }
}

/// `run R ended succeeded in state done`, with its terminal reason.
pub fn ended_line(end: &RunEnd) -> String {
    let reason = end
        .terminal_reason
        .as_deref()
        .filter(|r| !r.is_empty())
        .map(|r| format!(" ({})", printable(r)))
        .unwrap_or_default();
    format!(
        "run {} ended {} in state {} at sequence {}{reason}",
        end.run_id,
        end.outcome,
        printable(&end.state),
        end.sequence
    )
}

/// Follows `run` to its end (or `timeout`), showing what it sees as `show` says.
pub async fn follow_run(
    backend: &Backend,
    run: Uuid,
    redis: &RedisArgs,
    show: Show,
    timeout: Option<Duration>,
) -> Result<Watched, Error> {
    let mut printer = Printer::new(show);
    let following = async {
        match backend {
            Backend::Db(store) => follow_db(store, run, redis, &mut printer).await,
            Backend::Api(client) => follow_api(client, run, &mut printer).await,
        }
    };
    let ended = match timeout {
        Some(after) => tokio::time::timeout(after, following).await.ok(),
        None => Some(following.await),
    };
    match ended {
        Some(ended) => ended.map(Watched::Ended),
        None => {
            printer.close_line();
            Ok(Watched::TimedOut)
        }
    }
}

async fn follow_db(
    store: &rein_store::Store,
    run: Uuid,
    redis: &RedisArgs,
    printer: &mut Printer,
) -> Result<RunEnd, Error> {
    store.run(run).await?;
    let deltas = match redis.config() {
        Some(config) => match rein_accel::stream::subscribe_run(&config, &run.to_string()).await {
            Ok(s) => Some(Box::pin(s) as rein_ops::stream::Deltas),
            Err(e) => {
                eprintln!(
                    "warning: cannot subscribe to the run's deltas in Redis ({e}); showing committed events only"
                );
                None
            }
        },
        None => None,
    };
    let (tx, mut rx) = mpsc::channel(rein_ops::stream::BUFFER);
    let follower = tokio::spawn(rein_ops::stream::follow(
        store.clone(),
        run,
        0,
        deltas,
        Duration::from_millis(rein_ops::stream::POLL_INTERVAL_MS_DEFAULT),
        tx,
    ));
    let _stop = AbortOnDrop(follower);
    let mut last = 0;
    while let Some(item) = rx.recv().await {
        let seen = match item? {
            Item::Committed(event) => Seen::Committed(json!(event)),
            Item::Delta(delta) => Seen::Delta(delta),
            Item::End(end) => Seen::End(end),
        };
        if let Some(end) = printer.show(seen, &mut last, run)? {
            return Ok(end);
        }
    }
    Err(Error::new(
        Code::Internal,
        format!("following run {run} stopped before it ended"),
    ))
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads the API's stream of `run`, opening it again after the last event read when it
/// breaks before the run's end.
async fn follow_api(client: &Client, run: Uuid, printer: &mut Printer) -> Result<RunEnd, Error> {
    let mut last = 0;
    let mut failures = 0;
    loop {
        let broke = match client.stream(run, last).await {
            Ok(mut response) => {
                let mut parser = SseParser::default();
                let at = last;
                let broke = loop {
                    let chunk = match response.chunk().await {
                        Ok(Some(chunk)) => chunk,
                        Ok(None) => {
                            break "the API ended the stream before the run's end".to_owned();
                        }
                        Err(e) => break format!("the stream broke: {e}"),
                    };
                    for event in parser.feed(&chunk)? {
                        let Some(seen) = seen_of(event)? else {
                            continue;
                        };
                        if let Some(end) = printer.show(seen, &mut last, run)? {
                            return Ok(end);
                        }
                    }
                };
                if last > at {
                    failures = 0;
                }
                broke
            }
            // Refusals (a token, a run, the stream cap aside) do not pass by asking again.
            Err(e) if e.code != Code::Unavailable => return Err(e),
            Err(e) => e.message,
        };
        failures += 1;
        if failures > RECONNECTS_MAX {
            return Err(Error::new(
                Code::Unavailable,
                format!(
                    "following run {run} through the API failed {RECONNECTS_MAX} times in a row: {broke}"
                ),
            ));
        }
        tracing::debug!(%run, %broke, after = last, "opening the run's stream again");
        tokio::time::sleep(RECONNECT_PAUSE).await;
    }
}

/// One server-sent event as the API frames a run's stream.
#[derive(Debug, Default, PartialEq)]
struct SseEvent {
    event: String,
    data: String,
    id: Option<String>,
}

/// What an event of the API's stream says; `None` for a kind this client does not know (a
/// later server's).
fn seen_of(event: SseEvent) -> Result<Option<Seen>, Error> {
    let data = || -> Result<Value, Error> {
        serde_json::from_str(&event.data).map_err(|e| {
            Error::new(
                Code::Internal,
                format!(
                    "the API sent a `{}` event that is not JSON: {e}",
                    event.event
                ),
            )
        })
    };
    Ok(Some(match event.event.as_str() {
        "committed" => Seen::Committed(data()?),
        "delta" => Seen::Delta(data()?),
        "end" => Seen::End(crate::remote::typed(data()?)?),
        "error" => {
            let body = data()?;
            let error = &body["error"];
            let code = error["code"]
                .as_str()
                .and_then(Code::parse)
                .unwrap_or(Code::Internal);
            let message = error["message"].as_str().unwrap_or("no message");
            return Err(Error::new(
                code,
                format!("the API stopped the run's stream: {message}"),
            ));
        }
        _ => return Ok(None),
    }))
}

/// Reads server-sent events (the `text/event-stream` format) from a byte stream: `event:`,
/// `data:` (joined by newlines) and `id:` fields, comments (`:`) skipped, an event ended by
/// an empty line. An event longer than [`RESPONSE_BYTES_MAX`] is refused.
#[derive(Default)]
struct SseParser {
    line: Vec<u8>,
    event: SseEvent,
    has_data: bool,
}

impl SseParser {
    fn feed(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, Error> {
        let mut done = Vec::new();
        for &b in bytes {
            if b != b'\n' {
                self.line.push(b);
                if self.line.len() + self.event.data.len() > RESPONSE_BYTES_MAX {
                    return Err(Error::new(
                        Code::Internal,
                        format!("the API sent an event larger than {RESPONSE_BYTES_MAX} bytes"),
                    ));
                }
                continue;
            }
            if self.line.last() == Some(&b'\r') {
                self.line.pop();
            }
            let line = std::mem::take(&mut self.line);
            let line = String::from_utf8_lossy(&line);
            if line.is_empty() {
                if self.has_data {
                    done.push(std::mem::take(&mut self.event));
                }
                self.event = SseEvent::default();
                self.has_data = false;
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line.as_ref(), ""),
            };
            match field {
                "event" => self.event.event = value.to_owned(),
                "data" => {
                    if self.has_data {
                        self.event.data.push('\n');
                    }
                    self.event.data.push_str(value);
                    self.has_data = true;
                }
                "id" => self.event.id = Some(value.to_owned()),
                _ => {}
            }
        }
        Ok(done)
    }
}

/// Shows what a watch sees, and checks that the committed events come without a gap.
struct Printer {
    show: Show,
    /// Deltas are shown (a person at a terminal, or `--json`).
    deltas: bool,
    header: bool,
    /// A delta line is open: the next row starts on a new line.
    open_line: bool,
}

impl Printer {
    fn new(show: Show) -> Printer {
        Printer {
            show,
            deltas: match show {
                Show::Rows => std::io::stdout().is_terminal(),
                Show::Json => true,
                Show::Quiet => false,
            },
            header: false,
            open_line: false,
        }
    }

    /// Shows `seen`; the run's end once it comes. `last` is the sequence of the last
    /// committed event seen.
    fn show(&mut self, seen: Seen, last: &mut i64, run: Uuid) -> Result<Option<RunEnd>, Error> {
        match seen {
            Seen::Committed(event) => {
                let sequence = event["sequence"].as_i64().unwrap_or(-1);
                rein_ops::stream::check_next(*last, sequence, run)?;
                *last = sequence;
                match self.show {
                    Show::Rows => {
                        self.close_line();
                        if !self.header {
                            print_history_header();
                            self.header = true;
                        }
                        print_history_row(&event);
                    }
                    Show::Json => {
                        println!("{}", json!({ "event": "committed", "data": event }));
                    }
                    Show::Quiet => {}
                }
            }
            Seen::Delta(delta) if self.deltas => match self.show {
                Show::Json => println!("{}", json!({ "event": "delta", "data": delta })),
                _ => self.inline(&delta),
            },
            Seen::Delta(_) => {}
            Seen::End(end) => {
                self.close_line();
                if self.show == Show::Json {
                    println!("{}", json!({ "event": "end", "data": end }));
                }
                return Ok(Some(end));
            }
        }
        Ok(None)
    }

    /// A delta inline: a reply's text as it comes, a tool call's arguments after its name.
    fn inline(&mut self, delta: &Value) {
        let text = match delta["type"].as_str() {
            Some("delta") => delta["content"].as_str().unwrap_or("").to_owned(),
            Some("tool_call_delta") => {
                let name = delta["name"].as_str().unwrap_or("");
                let arguments = delta["arguments"].as_str().unwrap_or("");
                if name.is_empty() {
                    arguments.to_owned()
                } else {
                    format!("{name} {arguments}")
                }
            }
            Some("reply_done") => {
                self.close_line();
                return;
            }
            _ => return,
        };
        if text.is_empty() {
            return;
        }
        // Newlines of a reply stay newlines; other control characters show escaped.
        let shown: String = text
            .split('\n')
            .map(|part| printable(part).into_owned())
            .collect::<Vec<_>>()
            .join("\n");
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "{shown}");
        let _ = out.flush();
        self.open_line = !shown.ends_with('\n');
    }

    fn close_line(&mut self) {
        if self.open_line {
            println!();
            self.open_line = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_sent_events_are_read_across_chunks_with_comments_and_crlf() {
        let mut p = SseParser::default();
        let text = ": keep-alive\n\nevent: committed\nid: 1\ndata: {\"sequence\":1}\n\nevent: del";
        let first = p.feed(text.as_bytes()).unwrap();
        assert_eq!(
            first,
            vec![SseEvent {
                event: "committed".into(),
                data: "{\"sequence\":1}".into(),
                id: Some("1".into()),
            }]
        );
        let rest = p.feed(b"ta\r\ndata: a\r\ndata:b\r\n\r\n").unwrap();
        assert_eq!(
            rest,
            vec![SseEvent {
                event: "delta".into(),
                data: "a\nb".into(),
                id: None,
            }]
        );
        assert!(p.feed(b"event: end\n").unwrap().is_empty(), "not ended yet");
    }

    #[test]
    fn a_stream_error_event_becomes_the_apis_error() {
        let event = SseEvent {
            event: "error".into(),
            data: r#"{"error":{"code":"internal","message":"events are missing"}}"#.into(),
            id: None,
        };
        let Err(e) = seen_of(event) else {
            panic!("an error event is an error")
        };
        assert_eq!(e.code, Code::Internal);
        assert!(e.message.contains("events are missing"), "{}", e.message);
    }

    #[test]
    fn a_watch_refuses_a_committed_event_that_skips_one() {
        let mut printer = Printer::new(Show::Quiet);
        let mut last = 0;
        let run = Uuid::nil();
        let event = |n: i64| Seen::Committed(json!({ "sequence": n }));
        assert!(printer.show(event(1), &mut last, run).unwrap().is_none());
        assert!(printer.show(event(2), &mut last, run).unwrap().is_none());
        let gap = printer.show(event(4), &mut last, run);
        assert!(gap.is_err(), "event 3 is missing");
        assert_eq!(last, 2);
    }

    #[test]
    fn failed_and_cancelled_runs_exit_apart_from_succeeded_ones() {
        let end = |outcome: &str| RunEnd {
            run_id: Uuid::nil(),
            outcome: outcome.into(),
            status: "terminal".into(),
            state: "done".into(),
            sequence: 3,
            terminal_reason: None,
        };
        assert_eq!(exit_code(&end("succeeded")), exit::OK);
        assert_eq!(exit_code(&end("failed")), exit::RUN_FAILED);
        assert_eq!(exit_code(&end("cancelled")), exit::RUN_FAILED);
        for code in [exit::RUN_FAILED, exit::TIMED_OUT] {
            assert!(
                ![
                    exit::OK,
                    exit::INPUT,
                    exit::REFUSED,
                    exit::DATABASE,
                    exit::AUTH
                ]
                .contains(&code),
                "{code} is its own"
            );
        }
        assert_ne!(exit::RUN_FAILED, exit::TIMED_OUT);
    }
}
