//! `rein api` against clients that misbehave on the wire, over real sockets to the real
//! binary: half-sent request heads, bodies that stop arriving, connections that never send,
//! one client holding many connections, more connections than the server takes, and
//! requests HTTP parsing refuses. Other clients keep getting answers, and every refusal is
//! the API's JSON error. Bounds on time are generous: each behaviour would otherwise take
//! minutes, or forever.

use crate::common;

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Api, DieWithParent, REIN, code, fresh_store, json_of, token};
use reqwest::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// Far longer than any deadline a test sets, far shorter than the old behaviour (none).
const CLOSED_WITHIN: Duration = Duration::from_secs(20);

fn host(api: &Api) -> String {
    api.base.trim_start_matches("http://").to_owned()
}

/// A connection to `server` from loopback address `ip` (127.0.0.0/8 all reaches this
/// host), so that one test plays several clients.
async fn connect_from(ip: &str, server: &str) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("a socket");
    socket
        .bind(format!("{ip}:0").parse().expect("an address"))
        .expect("bind a loopback address");
    socket
        .connect(server.parse().expect("the server's address"))
        .await
        .expect("connect")
}

/// Everything the server sends until it closes (or resets) the connection; panics when it is
/// still open after `within`.
async fn until_closed(conn: &mut (impl AsyncReadExt + Unpin), within: Duration) -> String {
    let deadline = tokio::time::Instant::now() + within;
    let mut got = Vec::new();
    loop {
        let mut buf = [0u8; 16 * 1024];
        match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
            Err(_) => panic!(
                "the connection is still open after {within:?}; it sent: {}",
                String::from_utf8_lossy(&got)
            ),
            Ok(Ok(0)) | Ok(Err(_)) => return String::from_utf8_lossy(&got).into_owned(),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// A raw HTTP response: status, headers (lowercase names) and JSON body.
fn parse(raw: &str) -> (u16, Vec<(String, String)>, Value) {
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {raw:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {raw:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let body = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("the body is not JSON ({e}): {raw:?}"));
    (status, headers, body)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// Asserts `raw` is the API's JSON error with `status` and `want` as its code.
fn assert_json_error(raw: &str, status: u16, want: &str) -> Vec<(String, String)> {
    let (s, headers, body) = parse(raw);
    assert_eq!(s, status, "{raw}");
    assert!(
        header(&headers, "content-type").is_some_and(|t| t.starts_with("application/json")),
        "{raw}"
    );
    assert_eq!(code(&body), want, "{raw}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{raw}"
    );
    headers
}

/// The API still answers a well-behaved client (from 127.0.0.1).
async fn answers(api: &Api) {
    let reader = api.token("reader", &["read"]);
    let started = Instant::now();
    let (s, v) = json_of(
        api.get("/v1/runs", Some(&reader))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .expect("the API answers another client"),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    println!(
        "another client's request answered in {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_request_head_is_dropped_after_the_header_timeout() {
    let api = Api::start(
        "conn_slow_head",
        &[
            "--header-read-timeout-ms",
            "600",
            "--idle-timeout-ms",
            "60000",
        ],
    )
    .await;
    let server = host(&api);

    // Half a head, then silence.
    let mut silent = connect_from("127.0.0.1", &server).await;
    silent
        .write_all(b"GET /v1/runs HTTP/1.1\r\nHost: rein\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let sent = until_closed(&mut silent, CLOSED_WITHIN).await;
    println!(
        "half-sent head: closed after {:?} (header timeout 600 ms)",
        started.elapsed()
    );
    assert!(sent.is_empty(), "no answer to half a request: {sent}");

    // A head dripping in a byte at a time is moving, but it is still one head: the deadline
    // counts from its first byte, so the idle timeout (60 s) does not keep it open.
    let (mut read, mut write) = connect_from("127.0.0.1", &server).await.into_split();
    let drip = tokio::spawn(async move {
        for byte in b"GET /v1/runs HTTP/1.1\r\nX-Slow: ".iter().cycle() {
            if write.write_all(&[*byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let started = Instant::now();
    until_closed(&mut read, CLOSED_WITHIN).await;
    println!("dripping head: closed after {:?}", started.elapsed());
    drip.abort();
    answers(&api).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_is_answered_408_and_the_connection_closed() {
    let api = Api::start("conn_slow_body", &["--body-read-timeout-ms", "600"]).await;
    let token = api.token("ci", &["enqueue", "read"]);
    let mut conn = connect_from("127.0.0.1", &host(&api)).await;
    let head = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: rein\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"definition\": "
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let raw = until_closed(&mut conn, CLOSED_WITHIN).await;
    println!(
        "stalled body: answered and closed after {:?}",
        started.elapsed()
    );
    let headers = assert_json_error(&raw, 408, "request_timeout");
    assert_eq!(header(&headers, "connection"), Some("close"), "{raw}");
    assert!(
        api.store
            .list_runs(None, None, 10)
            .await
            .unwrap()
            .is_empty(),
        "nothing was enqueued"
    );
    answers(&api).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_with_nothing_to_do_is_closed_after_the_idle_timeout() {
    let api = Api::start(
        "conn_idle",
        &[
            "--idle-timeout-ms",
            "600",
            "--header-read-timeout-ms",
            "60000",
        ],
    )
    .await;
    let server = host(&api);
    // Never sends a byte.
    let mut mute = connect_from("127.0.0.1", &server).await;
    let started = Instant::now();
    assert!(until_closed(&mut mute, CLOSED_WITHIN).await.is_empty());
    println!("mute connection closed after {:?}", started.elapsed());

    // Kept alive after an answer, then idle.
    let mut kept = connect_from("127.0.0.1", &server).await;
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: rein\r\n\r\n")
        .await
        .unwrap();
    let raw = until_closed(&mut kept, CLOSED_WITHIN).await;
    assert!(
        raw.starts_with("HTTP/1.1 200"),
        "answered, then closed: {raw}"
    );
}

/// SIGTERM closes the connections that have nothing in flight, a half-sent request head
/// included, instead of waiting out their deadlines, and the API exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_connections_with_no_request_in_flight_at_once() {
    let mut api = Api::start(
        "conn_sigterm",
        &[
            "--idle-timeout-ms",
            "600000",
            "--header-read-timeout-ms",
            "600000",
        ],
    )
    .await;
    let server = host(&api);
    let mut mute = connect_from("127.0.0.1", &server).await;
    let mut half = connect_from("127.0.0.1", &server).await;
    half.write_all(b"GET /v1/runs HTTP/1.1\r\nHost: rein\r\n")
        .await
        .unwrap();
    // Both are being served before the signal.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let code = api.fleet.terminate("api", CLOSED_WITHIN);
    println!("exited {code:?} {:?} after SIGTERM", started.elapsed());
    assert_eq!(code, Some(0));
    assert!(until_closed(&mut mute, CLOSED_WITHIN).await.is_empty());
    assert!(until_closed(&mut half, CLOSED_WITHIN).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_hold_every_connection() {
    let api = Api::start(
        "conn_per_client",
        &[
            "--max-connections-per-client",
            "4",
            "--header-read-timeout-ms",
            "60000",
        ],
    )
    .await;
    let server = host(&api);
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut conn = connect_from("127.0.0.2", &server).await;
        conn.write_all(b"GET /v1/runs HTTP/1.1\r\n").await.unwrap();
        held.push(conn);
    }
    // The fifth from the same client is refused at once, in the API's shape.
    let mut fifth = connect_from("127.0.0.2", &server).await;
    let raw = until_closed(&mut fifth, CLOSED_WITHIN).await;
    let headers = assert_json_error(&raw, 429, "too_many_requests");
    assert_eq!(header(&headers, "retry-after"), Some("1"), "{raw}");
    // Another client is served meanwhile.
    answers(&api).await;
    // A connection given back is the client's again.
    drop(held.pop());
    common::wait_for(
        "the client's connection to be counted as closed",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            let server = server.clone();
            async move {
                let mut conn = connect_from("127.0.0.2", &server).await;
                conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: rein\r\nConnection: close\r\n\r\n")
                    .await
                    .unwrap();
                until_closed(&mut conn, CLOSED_WITHIN)
                    .await
                    .starts_with("HTTP/1.1 200")
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_a_connection_is_answered_503_and_closed() {
    let api = Api::start(
        "conn_cap",
        &[
            "--max-connections",
            "6",
            "--header-read-timeout-ms",
            "60000",
        ],
    )
    .await;
    let server = host(&api);
    let mut held = Vec::new();
    for i in 0..6 {
        held.push(connect_from(&format!("127.0.0.{}", 10 + i), &server).await);
    }
    let mut seventh = connect_from("127.0.0.20", &server).await;
    let raw = until_closed(&mut seventh, CLOSED_WITHIN).await;
    let headers = assert_json_error(&raw, 503, "unavailable");
    assert_eq!(header(&headers, "retry-after"), Some("1"), "{raw}");
    drop(held);
    common::wait_for(
        "the server to answer once connections are closed",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            reqwest::get(format!("{}/healthz", api.base))
                .await
                .is_ok_and(|r| r.status() == StatusCode::OK)
        },
    )
    .await;
}

/// `rein api` (default limits) in a process allowed `fds` open files, as a container's
/// `ulimit -n` would allow; killed when dropped.
struct Limited {
    child: Child,
    base: String,
}

impl Limited {
    fn start(url: &str, fds: u64) -> Limited {
        use std::io::{BufRead, BufReader};
        let mut cmd = Command::new(REIN);
        cmd.args(["api", "--listen", "127.0.0.1:0", "--database-url", url])
            .env("REIN_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .die_with_parent();
        // SAFETY: setrlimit(2) is async-signal-safe; it runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let limit = libc::rlimit {
                    rlim_cur: fds,
                    rlim_max: fds,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawn rein api");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the bound address");
        assert!(line.starts_with("http://"), "first line: {line}");
        Limited {
            child,
            base: line.trim().to_owned(),
        }
    }
}

impl Drop for Limited {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether the server has neither closed nor reset `conn`: a read that does not wait finds
/// nothing to read yet.
fn still_open(conn: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 1024];
    loop {
        // SAFETY: recv(2) into a buffer of the length given, on a socket this test owns.
        let n = unsafe {
            libc::recv(
                conn.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => return false,
            n if n > 0 => continue,
            _ => return std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock,
        }
    }
}

/// The report's attack: 300 connections that each send half a request head, from one
/// unauthenticated client, against an API allowed 256 open files. The client keeps at most
/// its share of connections, the rest are refused, and another client is answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_half_open_connections_from_one_client_leave_the_api_answering_others() {
    let (url, _store) = fresh_store("conn_fd_limit").await;
    let reader = token(&url, "reader", &["read"]);
    let api = Limited::start(&url, 256);
    let server = api.base.trim_start_matches("http://").to_owned();
    let mut attack = Vec::new();
    for _ in 0..300 {
        let mut conn = connect_from("127.0.0.2", &server).await;
        // A refused connection may already be closed: the write may fail.
        let _ = conn
            .write_all(b"GET /v1/runs HTTP/1.1\r\nHost: rein\r\n")
            .await;
        attack.push(conn);
    }
    let started = Instant::now();
    let answer = reqwest::Client::new()
        .get(format!("{}/v1/runs", api.base))
        .bearer_auth(&reader)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("the API answers another client during the attack");
    assert_eq!(answer.status(), StatusCode::OK);
    println!("answered during the attack in {:?}", started.elapsed());
    // The attacker holds at most its share; every other connection was closed.
    let held = attack.iter().filter(|conn| still_open(conn)).count();
    println!("the attacker holds {held} of its 300 connections");
    assert!(
        (1..=64).contains(&held),
        "at most --max-connections-per-client (64) held: {held}"
    );
}

/// Sends `raw` on a new connection and reads the answer until the server closes.
async fn exchange(server: &str, raw: &[u8]) -> String {
    let mut conn = connect_from("127.0.0.1", server).await;
    let _ = conn.write_all(raw).await;
    until_closed(&mut conn, CLOSED_WITHIN).await
}

/// A request to `/healthz` whose line and headers are exactly `size` bytes, sent at once.
fn head_of(size: usize) -> Vec<u8> {
    let start = "GET /healthz HTTP/1.1\r\nHost: rein\r\nConnection: close\r\nX-Filler: ";
    let end = "\r\n\r\n";
    let head = format!("{start}{}{end}", "a".repeat(size - start.len() - end.len()));
    assert_eq!(head.len(), size);
    head.into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_is_held_to_the_documented_80_kib_exactly() {
    let api = Api::start("conn_head", &[]).await;
    let server = host(&api);
    let max = rein_api::server::HEAD_BYTES_MAX;
    assert_eq!(
        max,
        80 * 1024,
        "the README and the 431's description say 80 KiB"
    );
    let (status, _, _) = parse(&exchange(&server, &head_of(max)).await);
    assert_eq!(status, 200, "a head of exactly 80 KiB is served");
    for over in [max + 1, max + 8 * 1024, max + 40 * 1024] {
        let answer = exchange(&server, &head_of(over)).await;
        assert_json_error(&answer, 431, "headers_too_large");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_refused_below_the_handlers_get_the_json_error_body() {
    let api = Api::start("conn_transport", &["--body-limit-bytes", "4096"]).await;
    let token = api.token("ci", &["admin"]);
    let server = host(&api);
    let auth = format!("Authorization: Bearer {token}\r\n");

    // hyper's own refusals: a URI over 64 KiB, a Content-Length that is not a number, a
    // head larger than the server reads.
    let long = format!(
        "GET /v1/runs?definition={} HTTP/1.1\r\nHost: rein\r\n\r\n",
        "a".repeat(65 * 1024)
    );
    assert_json_error(
        &exchange(&server, long.as_bytes()).await,
        414,
        "uri_too_long",
    );
    let bad_length =
        format!("POST /v1/runs HTTP/1.1\r\nHost: rein\r\n{auth}Content-Length: abc\r\n\r\n{{}}");
    assert_json_error(
        &exchange(&server, bad_length.as_bytes()).await,
        400,
        "bad_request",
    );
    let big_head = format!(
        "GET /healthz HTTP/1.1\r\nHost: rein\r\nX-Filler: {}\r\n\r\n",
        "a".repeat(200 * 1024)
    );
    assert_json_error(
        &exchange(&server, big_head.as_bytes()).await,
        431,
        "headers_too_large",
    );
    let garbage = exchange(&server, b"NOT HTTP AT ALL\r\n\r\n").await;
    assert_json_error(&garbage, 400, "bad_request");

    // The router's and the body limit's.
    let close = "Connection: close\r\n";
    let cases = [
        (
            format!("GET /nowhere HTTP/1.1\r\nHost: rein\r\n{auth}{close}\r\n"),
            404,
            "not_found",
        ),
        (
            format!("DELETE /v1/runs HTTP/1.1\r\nHost: rein\r\n{auth}{close}\r\n"),
            405,
            "method_not_allowed",
        ),
        (
            format!(
                "POST /v1/runs HTTP/1.1\r\nHost: rein\r\n{auth}{close}Content-Length: 8192\r\n\r\n{}",
                "a".repeat(8192)
            ),
            413,
            "payload_too_large",
        ),
    ];
    for (raw, status, want) in cases {
        assert_json_error(&exchange(&server, raw.as_bytes()).await, status, want);
    }
    // Well-formed requests on the same server are still served.
    answers(&api).await;
}
