//! The API's HTTP/1.1 server: hyper's connection driver with the bounds a server reachable by
//! untrusted clients needs (SPEC Z2). `axum::serve` has no deadline on a request head and no
//! cap on connections, so one client holding half-sent requests open could take every file
//! descriptor. Here:
//!
//! - every connection counts against `--max-connections` and, per client address, against
//!   `--max-connections-per-client`; one past either is answered with the API's JSON error
//!   (503 or 429, `Retry-After: 1`) and closed at once;
//! - a connection that sends nothing, or whose response the client stops reading, is closed
//!   after `--idle-timeout-ms`; once the first byte of a request head has arrived, the whole
//!   head must follow within `--header-read-timeout-ms`. Both clocks stop while a request is
//!   being answered; the body has its own deadline, checked where it is read
//!   (`--body-read-timeout-ms`, in `mod.rs`);
//! - hyper answers a request it cannot parse (400, 414, 431) itself, with an empty body;
//!   those answers are replaced on the wire by the API's JSON error shape;
//! - every request carries [`Stopping`], so that a run's stream ends when the server stops
//!   instead of holding the drain open.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::http::StatusCode;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::ApiError;

/// Largest request line plus headers accepted, in bytes (as sent: `NAME: VALUE\r\n` per
/// header): room for the longest URI HTTP/1.1 parsing takes (65,534 bytes, so a longer one
/// is answered 414 rather than 431) and a few headers. hyper reads at most this much before
/// it gives up on a head, but a head that arrives in one read may pass it by up to a read's
/// size; [`head_bytes`] holds every request to it exactly.
pub const HEAD_BYTES_MAX: usize = 80 * 1024;
pub const HEADER_READ_TIMEOUT_MS_DEFAULT: u64 = 10_000;
pub const BODY_READ_TIMEOUT_MS_DEFAULT: u64 = 30_000;
pub const IDLE_TIMEOUT_MS_DEFAULT: u64 = 60_000;
pub const CONNECTIONS_PER_CLIENT_MAX_DEFAULT: usize = 64;
/// The connection cap when the file-descriptor limit leaves room for more.
pub const CONNECTIONS_MAX_CEILING: usize = 1024;
/// Descriptors kept for everything but client connections: the listener, stdio, Redis,
/// telemetry, and slack for a connection being refused. The database pool comes on top.
const DESCRIPTORS_RESERVED: usize = 32;
/// After an accept fails for lack of descriptors, wait this long before the next one.
const ACCEPT_RETRY_MS: u64 = 50;
/// After answering a refusal, a connection reads what the client still sends for this long
/// (or this many bytes) before it closes: closing with unread bytes resets the connection,
/// and a reset can destroy the answer before the client has read it.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES_MAX: usize = 4 * 1024 * 1024;

/// How long a connection may take and how many there may be.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub connections_max: usize,
    pub connections_per_client_max: usize,
}

/// The default connection cap: what the process's file-descriptor limit leaves after the
/// database pool and [`DESCRIPTORS_RESERVED`], at most [`CONNECTIONS_MAX_CEILING`], at
/// least 1.
pub fn connections_max_default(db_pool_max: u32) -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes only the struct it is given.
    let descriptors = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
    } else {
        256
    };
    descriptors
        .saturating_sub(DESCRIPTORS_RESERVED + db_pool_max as usize)
        .clamp(1, CONNECTIONS_MAX_CEILING)
}

/// Serves `app` on `listener` until `stop`, then stops accepting, lets each connection finish
/// the request it is answering, and returns once every connection has closed.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    stop: CancellationToken,
) {
    let open = Arc::new(Semaphore::new(limits.connections_max));
    let clients = Clients::default();
    let (closing, closed) = watch::channel(false);
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors (or a connection reset before it was taken): the
                    // next accept may succeed once a connection closes.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            refuse(
                stream,
                peer,
                StatusCode::SERVICE_UNAVAILABLE,
                "connections_max",
            );
            continue;
        };
        let Some(slot) = clients.take(peer.ip(), limits.connections_per_client_max) else {
            refuse(stream, peer, StatusCode::TOO_MANY_REQUESTS, "per_client");
            continue;
        };
        tokio::spawn(connection(
            stream,
            peer,
            app.clone(),
            limits,
            closed.clone(),
            (permit, slot),
        ));
    }
    drop(listener);
    closing.send_replace(true);
    // Each connection holds one permit until it closes.
    let all = u32::try_from(limits.connections_max).unwrap_or(u32::MAX);
    let _ = open.acquire_many(all).await;
}

/// Metric: connections answered and closed at a limit, by limit (`connections_max`,
/// `per_client`).
pub(crate) const CONNECTIONS_REFUSED: &str = "rein_api_connections_refused_total";

/// The help text of the connection metrics, and their series at 0.
pub fn register_metrics() {
    metrics::describe_counter!(
        CONNECTIONS_REFUSED,
        "Connections refused at a connection limit, by limit"
    );
    for limit in ["connections_max", "per_client"] {
        metrics::counter!(CONNECTIONS_REFUSED, "limit" => limit).increment(0);
    }
}

/// Answers a connection over a limit with the API's JSON error and closes it. Whatever the
/// client already sent is read first, so that closing does not reset the connection before
/// the answer is read.
fn refuse(stream: TcpStream, peer: SocketAddr, status: StatusCode, limit: &'static str) {
    tracing::debug!(%peer, limit, "connection refused at a limit");
    metrics::counter!(CONNECTIONS_REFUSED, "limit" => limit).increment(1);
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match stream.try_read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
    let _ = stream.try_write(&ApiError::transport(status, None).http_bytes("HTTP/1.1"));
    if let Ok(stream) = stream.into_std() {
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
}

/// Live connections per client. A client is an IPv4 address or an IPv6 /64 (one host's
/// usual allocation, so a client cannot pass the limit by cycling its own addresses).
#[derive(Clone, Default)]
struct Clients(Arc<Mutex<HashMap<IpAddr, usize>>>);

/// One connection's place in [`Clients`]; given back when dropped.
struct ClientSlot {
    clients: Clients,
    client: IpAddr,
}

impl Clients {
    fn take(&self, ip: IpAddr, max: usize) -> Option<ClientSlot> {
        let client = client_of(ip);
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(client).or_insert(0);
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(ClientSlot {
            clients: self.clone(),
            client,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.clients.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.client);
            }
        }
    }
}

fn client_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(prefix.into())
        }
        v4 => v4,
    }
}

/// Serves one connection until it closes, or, once the server stops, until the request it is
/// answering is done.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    app: axum::Router,
    limits: ConnLimits,
    mut closing: watch::Receiver<bool>,
    _held: (OwnedSemaphorePermit, ClientSlot),
) {
    let _ = stream.set_nodelay(true);
    let answering = Arc::new(Answering::default());
    let io = TokioIo::new(Watched::new(stream, answering.clone(), limits));
    let server_stopping = Stopping(closing.clone());
    let stopping = {
        let answering = answering.clone();
        async move {
            let _ = closing.wait_for(|closing| *closing).await;
            answering.closing.store(true, Ordering::SeqCst);
        }
    };
    let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
        let app = app.clone();
        let answer = Answer::begin(&answering);
        request.extensions_mut().insert(server_stopping.clone());
        let too_large = head_bytes(&request) > HEAD_BYTES_MAX;
        async move {
            let response = if too_large {
                Ok(head_too_large())
            } else {
                app.oneshot(request).await
            };
            drop(answer);
            response
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .max_buf_size(HEAD_BYTES_MAX)
        // The deadlines are the socket's (`Watched`), which knows when a head begins.
        .header_read_timeout(None)
        .serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    let ended = tokio::select! {
        ended = conn.as_mut() => ended,
        () = stopping => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = ended {
        tracing::debug!(%peer, error = %e, "connection ended");
    }
}

/// The size of `request`'s line and headers as a client sends them: `METHOD URI VERSION\r\n`,
/// `NAME: VALUE\r\n` per header and the empty line.
pub fn head_bytes<B>(request: &hyper::Request<B>) -> usize {
    let target = request
        .uri()
        .path_and_query()
        .map_or(request.uri().path().len(), |p| p.as_str().len());
    let line = request.method().as_str().len() + 1 + target + 1 + "HTTP/1.1".len() + 2;
    let headers: usize = request
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + 2 + value.len() + 2)
        .sum();
    line + headers + 2
}

/// The answer to a head over [`HEAD_BYTES_MAX`]: 431 with the API's error body, the
/// connection closed (its body, if any, is not read).
fn head_too_large() -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut response = ApiError::from(rein_ops::Error::new(
        rein_ops::Code::HeadersTooLarge,
        format!(
            "the request line and headers are larger than this server accepts ({HEAD_BYTES_MAX} bytes); \
             send large values in the request body"
        ),
    ))
    .into_response();
    response.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
}

/// Given to every request: resolves once the server stops, so that an answer that would
/// go on as long as it likes (a run's stream) ends, and the drain does not wait on it.
#[derive(Clone)]
pub struct Stopping(watch::Receiver<bool>);

impl Stopping {
    pub async fn wait(mut self) {
        // A dropped sender means the server is gone: stopping too.
        let _ = self.0.wait_for(|closing| *closing).await;
    }
}

/// What a connection's requests are doing, shared by its socket and its service.
#[derive(Default)]
struct Answering {
    /// Requests handed to the router and not answered yet.
    in_flight: AtomicUsize,
    /// Requests answered so far: each answer starts a new idle period.
    answered: AtomicU64,
    /// The server is stopping: a connection with no request in flight and no answer left to
    /// send closes at its next read.
    closing: std::sync::atomic::AtomicBool,
}

/// A request being answered; answered when dropped.
struct Answer(Arc<Answering>);

impl Answer {
    fn begin(answering: &Arc<Answering>) -> Answer {
        answering.in_flight.fetch_add(1, Ordering::SeqCst);
        Answer(answering.clone())
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        // Counted before it leaves the flight, so a socket that sees no request in flight
        // also sees this answer.
        self.0.answered.fetch_add(1, Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A client socket with the connection's deadlines: reading or writing fails with
/// `TimedOut` once the current one passes, which ends the connection.
struct Watched {
    stream: TcpStream,
    answering: Arc<Answering>,
    limits: ConnLimits,
    timer: Pin<Box<Sleep>>,
    /// When the first byte of the request head now arriving came.
    head_since: Option<Instant>,
    /// When bytes last moved while no request was being answered.
    idle_since: Instant,
    answered_seen: u64,
    /// An answer of hyper's own being replaced by the API's.
    rewrite: Option<Rewrite>,
    /// The last answer refused the request: the client may still be sending it.
    refused: bool,
    /// Bytes were written and not flushed yet: an answer is still on its way out.
    unflushed: bool,
    /// Bytes read after the connection's write side was shut, while lingering; `None`
    /// before.
    lingered: Option<usize>,
}

impl Watched {
    fn new(stream: TcpStream, answering: Arc<Answering>, limits: ConnLimits) -> Watched {
        let now = Instant::now();
        Watched {
            stream,
            answering,
            limits,
            timer: Box::pin(tokio::time::sleep_until(now + limits.idle_timeout)),
            head_since: None,
            idle_since: now,
            answered_seen: 0,
            rewrite: None,
            refused: false,
            unflushed: false,
            lingered: None,
        }
    }

    /// Notes whether `buf`, the start of a write, begins an answer that refuses its request.
    fn note_answer(&mut self, buf: &[u8]) {
        if let Some(class) = ["HTTP/1.1 ", "HTTP/1.0 "]
            .into_iter()
            .find(|v| buf.starts_with(v.as_bytes()))
            .and_then(|v| buf.get(v.len()))
        {
            self.refused = matches!(class, b'4' | b'5');
        }
    }

    /// Whether a request is being answered (no deadline runs then); notes the answers
    /// given since the last look.
    fn busy(&mut self) -> bool {
        let answered = self.answering.answered.load(Ordering::SeqCst);
        if answered != self.answered_seen {
            self.answered_seen = answered;
            self.head_since = None;
            self.idle_since = Instant::now();
        }
        if self.answering.in_flight.load(Ordering::SeqCst) > 0 {
            self.head_since = None;
            return true;
        }
        false
    }

    /// Bytes moved: a read while idle starts a request head.
    fn moved(&mut self, read: bool) {
        if self.busy() {
            return;
        }
        let now = Instant::now();
        if read && self.head_since.is_none() {
            self.head_since = Some(now);
        }
        self.idle_since = now;
    }

    /// Whether the server is stopping and this connection has nothing left to do: no request
    /// in flight (a half-received one is dropped) and no answer on its way out.
    fn stopping(&mut self) -> bool {
        self.answering.closing.load(Ordering::SeqCst) && !self.busy() && !self.unflushed
    }

    /// Makes the current deadline wake the connection. Needed after an answer is written:
    /// hyper may then wait for the socket to become readable without reading again, and a
    /// read that came back pending while the request was being answered set no deadline.
    fn arm(&mut self, cx: &mut Context<'_>) {
        // A deadline that passed is reported by the next read or write.
        let _ = self.wait(cx);
    }

    /// For I/O that is pending: stays pending until the current deadline passes, then fails.
    fn wait(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if self.busy() {
            return Poll::Pending;
        }
        let (deadline, why) = match self.head_since {
            Some(since) => (
                since + self.limits.header_read_timeout,
                "the request head did not arrive within --header-read-timeout-ms",
            ),
            None => (
                self.idle_since + self.limits.idle_timeout,
                "nothing moved for --idle-timeout-ms",
            ),
        };
        if self.timer.deadline() != deadline {
            self.timer.as_mut().reset(deadline);
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, why)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.moved(true);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending if this.stopping() => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the server is stopping",
            ))),
            Poll::Pending => this.wait(cx).map(Err),
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        // hyper answers a head it cannot parse itself, before any request is in flight.
        if this.rewrite.is_none() && !this.busy() {
            this.note_answer(buf);
            this.rewrite = Rewrite::of(buf);
        }
        if let Some(rewrite) = &mut this.rewrite {
            return match rewrite.drain(&mut this.stream, cx) {
                Poll::Ready(Ok(stands_for)) => {
                    this.rewrite = None;
                    this.moved(false);
                    this.unflushed = true;
                    Poll::Ready(Ok(stands_for.min(buf.len())))
                }
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => this.wait(cx).map(Err),
            };
        }
        match Pin::new(&mut this.stream).poll_write(cx, buf) {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    this.moved(false);
                    this.unflushed = true;
                }
                this.arm(cx);
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.wait(cx).map(Err),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(Pin::new(&mut this.stream).poll_flush(cx))?;
        this.unflushed = false;
        this.arm(cx);
        Poll::Ready(Ok(()))
    }

    /// Shuts the write side; after a refusal, then reads and drops what the client still
    /// sends, until it closes, [`LINGER_BYTES_MAX`] or [`LINGER`].
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.lingered.is_none() {
            ready!(Pin::new(&mut this.stream).poll_shutdown(cx))?;
            if !this.refused {
                return Poll::Ready(Ok(()));
            }
            this.lingered = Some(0);
            this.timer.as_mut().reset(Instant::now() + LINGER);
        }
        let mut scratch = [0u8; 8192];
        while let Some(lingered) = this.lingered.filter(|n| *n < LINGER_BYTES_MAX) {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.stream).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    this.lingered = Some(lingered + buf.filled().len());
                }
                Poll::Ready(_) => break,
                Poll::Pending => {
                    return match this.timer.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(Ok(())),
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// The API's JSON answer written in place of one of hyper's own: a 400, 414 or 431 without a
/// `Content-Type` (every answer of the API's has one) and without a body.
struct Rewrite {
    bytes: Vec<u8>,
    written: usize,
    /// How many bytes of hyper's the replacement stands for: its whole answer.
    stands_for: usize,
}

impl Rewrite {
    fn of(buf: &[u8]) -> Option<Rewrite> {
        let version = ["HTTP/1.1 ", "HTTP/1.0 "]
            .into_iter()
            .find(|v| buf.starts_with(v.as_bytes()))?;
        let status = buf.get(version.len()..version.len() + 3)?;
        if !matches!(status, b"400" | b"414" | b"431") {
            return None;
        }
        let head_len = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        let head = std::str::from_utf8(&buf[..head_len]).ok()?;
        let ours_or_with_body = head.split("\r\n").any(|line| {
            let line = line.to_ascii_lowercase();
            line.starts_with("content-type:")
                || line.starts_with("transfer-encoding:")
                || line
                    .strip_prefix("content-length:")
                    .is_some_and(|n| n.trim() != "0")
        });
        if ours_or_with_body {
            return None;
        }
        let status = StatusCode::from_bytes(status).ok()?;
        tracing::debug!(%status, "answering a request that is not well-formed HTTP");
        Some(Rewrite {
            bytes: ApiError::transport(status, None).http_bytes(version.trim_end()),
            written: 0,
            stands_for: head_len,
        })
    }

    /// Writes what is left of the replacement; how many of hyper's bytes it stands for.
    fn drain(&mut self, stream: &mut TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        while self.written < self.bytes.len() {
            let n = ready!(Pin::new(&mut *stream).poll_write(cx, &self.bytes[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        Poll::Ready(Ok(self.stands_for))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_bodiless_parse_errors_are_rewritten_and_the_apis_answers_are_not() {
        let hyper_414 = b"HTTP/1.1 414 URI Too Long\r\ncontent-length: 0\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\n\r\n";
        let rewrite = Rewrite::of(hyper_414).expect("rewritten");
        assert_eq!(rewrite.stands_for, hyper_414.len());
        let text = String::from_utf8(rewrite.bytes).unwrap();
        assert!(text.starts_with("HTTP/1.1 414 URI Too Long\r\n"), "{text}");
        let body: serde_json::Value =
            serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body["error"]["code"], "uri_too_long");
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        assert!(Rewrite::of(ours).is_none());
        let with_body = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 5\r\n\r\nhello";
        assert!(Rewrite::of(with_body).is_none());
        assert!(Rewrite::of(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(
            Rewrite::of(b"HTTP/1.1 431 Request Header").is_none(),
            "a partial head"
        );
    }

    #[test]
    fn ipv6_clients_are_counted_by_their_64_prefix() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::2".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(client_of(a), client_of(b));
        assert_ne!(client_of(a), client_of(other));
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert_eq!(client_of(mapped), "192.0.2.7".parse::<IpAddr>().unwrap());
        let clients = Clients::default();
        let first = clients.take(a, 1).expect("the first connection");
        assert!(clients.take(b, 1).is_none(), "the same /64");
        assert!(clients.take(other, 1).is_some());
        drop(first);
        assert!(clients.take(b, 1).is_some(), "given back when it closes");
    }
}
