//! A TCP proxy between one role and PostgreSQL, for `rein chaos`'s network faults: bytes are
//! forwarded as they come, or held for as long as a partition lasts (not refused: the
//! connections stay open and quiet, as on a real network cut), or delayed by a latency, or
//! every open connection is reset at once (SO_LINGER 0, so the peers see RST mid-statement).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What the proxy does with the bytes of its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Forward,
    /// Hold every byte until the mode changes.
    Partition,
    /// Forward each chunk after this delay.
    Latency(Duration),
}

/// One proxy: where a role connects instead of PostgreSQL.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    /// Bumped to reset every open connection.
    resets: watch::Sender<u64>,
    connections: Arc<AtomicU64>,
    stop: CancellationToken,
}

const CHUNK: usize = 16 * 1024;

impl Proxy {
    /// Listens on a free loopback port and forwards each connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, mode_rx) = watch::channel(Mode::Forward);
        let (resets, resets_rx) = watch::channel(0u64);
        let connections = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let (count, until) = (connections.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = until.cancelled() => return,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else { continue };
                let (mode, resets, count) = (mode_rx.clone(), resets_rx.clone(), count.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    count.fetch_add(1, Ordering::Relaxed);
                    relay(client, server, mode, resets).await;
                    count.fetch_sub(1, Ordering::Relaxed);
                });
            }
        });
        Ok(Proxy {
            addr,
            mode,
            resets,
            connections,
            stop,
        })
    }

    /// [`Proxy::start`] from synchronous code inside a tokio runtime.
    pub fn start_in_runtime(upstream: SocketAddr) -> std::io::Result<Proxy> {
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(Proxy::start(upstream))
        })
    }

    pub fn set(&self, mode: Mode) {
        let _ = self.mode.send(mode);
    }

    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    /// Resets every connection open now; later ones are forwarded as the mode says.
    pub fn reset_all(&self) -> u64 {
        let open = self.connections.load(Ordering::Relaxed);
        self.resets.send_modify(|n| *n += 1);
        open
    }

    pub fn open_connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Copies both ways under the mode until either side closes or a reset comes.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    mode: watch::Receiver<Mode>,
    mut resets: watch::Receiver<u64>,
) {
    use std::os::fd::AsRawFd;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let fds = [client.as_raw_fd(), server.as_raw_fd()];
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    resets.mark_unchanged();
    let up = pump(client_read, server_write, mode.clone());
    let down = pump(server_read, client_write, mode);
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = resets.changed() => {
            // The halves still own the sockets here: with linger 0 their close, when the
            // select drops them, is a reset (RST) to both peers, not an orderly FIN.
            for fd in fds {
                zero_linger(fd);
            }
        }
    }
}

fn zero_linger(fd: std::os::fd::RawFd) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `fd` is an open socket owned by a live half; the option struct is valid for
    // the call.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::addr_of!(linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        // Under a partition nothing is read, so nothing moves and the sender's buffers fill.
        while *mode.borrow() == Mode::Partition {
            if mode.changed().await.is_err() {
                return;
            }
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        loop {
            let current = *mode.borrow();
            match current {
                Mode::Forward => break,
                Mode::Latency(d) => {
                    tokio::time::sleep(d).await;
                    break;
                }
                Mode::Partition => {
                    if mode.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream, within: Duration) -> Option<Duration> {
        let at = std::time::Instant::now();
        s.write_all(b"ping").await.ok()?;
        let mut buf = [0u8; 4];
        tokio::time::timeout(within, s.read_exact(&mut buf))
            .await
            .ok()?
            .ok()?;
        Some(at.elapsed())
    }

    #[tokio::test]
    async fn a_partition_holds_bytes_latency_delays_them_and_a_reset_closes_connections() {
        let proxy = Proxy::start(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        assert!(round_trip(&mut s, Duration::from_secs(2)).await.is_some());

        proxy.set(Mode::Partition);
        assert_eq!(
            round_trip(&mut s, Duration::from_millis(300)).await,
            None,
            "held"
        );
        proxy.set(Mode::Forward);
        // The held ping arrives after the heal; then the connection works as before.
        let mut held = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut held))
            .await
            .expect("the held bytes arrive after the heal")
            .unwrap();
        assert!(round_trip(&mut s, Duration::from_secs(2)).await.is_some());

        proxy.set(Mode::Latency(Duration::from_millis(150)));
        let slow = round_trip(&mut s, Duration::from_secs(2)).await.unwrap();
        assert!(slow >= Duration::from_millis(150), "{slow:?}");
        proxy.set(Mode::Forward);

        assert_eq!(proxy.reset_all(), 1);
        let mut buf = [0u8; 4];
        let _ = s.write_all(b"ping").await;
        let read = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "the connection is closed: {read:?}"
        );
        let mut again = TcpStream::connect(proxy.addr).await.unwrap();
        assert!(
            round_trip(&mut again, Duration::from_secs(2))
                .await
                .is_some()
        );
    }
}
