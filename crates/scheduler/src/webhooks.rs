//! Webhook delivery: every scheduler (leader or not) claims due deliveries for a while by the
//! database clock, POSTs each signed body outside any transaction and records the answer.
//! A 2xx delivers; anything else is retried after an exponential backoff with jitter until
//! the attempts are used up. A scheduler that dies mid-post leaves its claim to run out, and
//! another posts again: delivery is at least once, and receivers deduplicate by the id.
//!
//! A scheduler has at most `batch` posts in flight and claims more as soon as one ends, so a
//! receiver that hangs holds one slot until its post's timeout, not the deliveries behind
//! it. At most `per_webhook` of those posts go to one webhook ([`PER_WEBHOOK_DEFAULT`],
//! `rein scheduler --webhook-posts-per-webhook`): a webhook's further due deliveries are
//! left due, not claimed, so one receiver with many deliveries that all hang cannot take
//! every slot, and the other webhooks' deliveries go on being posted. A refusing receiver's answer is described (status, how many bytes), never quoted:
//! operators read it, and a receiver is whoever registered a URL. At most
//! [`ERROR_BODY_BYTES_READ_MAX`] bytes of it are read.
//!
//! Every URL passes the scheduler's egress policy ([`rein_egress`], `rein scheduler
//! --webhook-allow`) before a post and again for each address its host resolves to: a
//! webhook it refuses (a metadata address, the scheduler's own database or Redis, a host
//! outside the allow list) is disabled with the refusal as its reason, and its pending
//! deliveries fail. Webhooks stored before the rules are judged this way when one of their
//! deliveries is next due; the rules are the scheduler's, so no migration can judge them.
//!
//! Signature: `Rein-Signature: v1=HEX(HMAC-SHA256(secret, "TIMESTAMP.BODY"))`, where
//! TIMESTAMP is `Rein-Timestamp` (unix seconds) and BODY the exact bytes posted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{KeyInit, Mac};
use rein_egress::{Caller, Policy, Refused};
use rein_store::{AttemptFailed, DueDelivery, Store};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use uuid::Uuid;

type HmacSha256 = hmac::Hmac<hmac_sha2::Sha256>;

/// Deliveries by outcome: `delivered`, `retried` (an attempt failed, another is due) and
/// `failed` (the attempts are used up).
pub const WEBHOOK_DELIVERIES: &str = "rein_webhook_deliveries_total";
/// The first retry's delay; each later one doubles it.
pub const BACKOFF_MS_FIRST: u64 = 1_000;
/// The longest delay between two attempts.
pub const BACKOFF_MS_MAX: u64 = 600_000;
/// Bounds of `--webhook-attempts-max`.
pub const ATTEMPTS_MAX_LIMIT: u32 = 100;
/// Most bytes of a refusing receiver's body read (to say how long it is); the rest is never
/// read, and the connection is closed.
pub const ERROR_BODY_BYTES_READ_MAX: usize = 4096;
/// Most posts one scheduler has in flight to one webhook, unless configured otherwise.
pub const PER_WEBHOOK_DEFAULT: i64 = 4;
/// Most ports a scheduler keeps a pooled client for (its resolver checks addresses for that
/// port); posts to further ports get a client of their own.
const PORT_CLIENTS_MAX: usize = 64;

#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// How long to wait before looking again when nothing is due.
    pub poll_ms: u64,
    /// Attempts before a delivery is failed.
    pub attempts_max: u32,
    /// Most posts in flight at once; a free slot is filled by the next due delivery.
    pub batch: i64,
    /// Most of those posts to one webhook; its further due deliveries are left unclaimed.
    pub per_webhook: i64,
    /// How long a claim keeps other schedulers off a delivery; longer than a post may take.
    pub claim_ms: u64,
    /// How long one post may take, from connecting to the end of the answer read.
    pub timeout_ms: u64,
    /// How long connecting may take.
    pub connect_timeout_ms: u64,
    /// Where deliveries may be posted (`rein scheduler --webhook-allow`).
    pub egress: Arc<Policy>,
}

impl Default for WebhookConfig {
    fn default() -> WebhookConfig {
        WebhookConfig {
            poll_ms: 500,
            attempts_max: 10,
            batch: 16,
            per_webhook: PER_WEBHOOK_DEFAULT,
            claim_ms: 30_000,
            timeout_ms: 10_000,
            connect_timeout_ms: 5_000,
            egress: Arc::new(Policy::new().for_caller(Caller::WEBHOOKS)),
        }
    }
}

/// `v1=` and the hex HMAC-SHA256 under `secret` of `"{timestamp}.{body}"`.
pub fn sign(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    format!(
        "v1={}",
        hex::encode(mac(secret, timestamp, body).finalize().into_bytes())
    )
}

/// Whether `header` (a `Rein-Signature` value) signs `body` at `timestamp` under `secret`;
/// compared in constant time. What a receiver does, besides refusing an old timestamp.
pub fn verify(secret: &[u8], timestamp: i64, body: &[u8], header: &str) -> bool {
    let Some(sig) = header.strip_prefix("v1=").and_then(|h| hex::decode(h).ok()) else {
        return false;
    };
    mac(secret, timestamp, body).verify_slice(&sig).is_ok()
}

fn mac(secret: &[u8], timestamp: i64, body: &[u8]) -> HmacSha256 {
    // An HMAC takes a key of any length.
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC accepts any key length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The delay after failed attempt number `attempts` (1 for the first): 1 s doubling per
/// attempt, capped at 10 minutes, of which the last quarter is jitter (`sample` in [0, 1)),
/// so each delay is longer than the one before until the cap.
pub fn backoff_ms(attempts: u32, sample: f64) -> u64 {
    let doublings = attempts.saturating_sub(1).min(30);
    let full = BACKOFF_MS_FIRST
        .saturating_mul(1u64 << doublings)
        .min(BACKOFF_MS_MAX);
    let sample = sample.clamp(0.0, 1.0);
    full - ((full as f64) * 0.25 * (1.0 - sample)) as u64
}

/// Counters at zero, so the families show on `/metrics` before the first delivery.
pub fn register_metrics() {
    metrics::describe_counter!(
        WEBHOOK_DELIVERIES,
        "Webhook delivery attempts by outcome: delivered, retried (another attempt is due) or failed (attempts used up)"
    );
    for outcome in ["delivered", "retried", "failed"] {
        metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => outcome).increment(0);
    }
}

/// Delivers until `shutdown`: claims what is due while a slot is free, posts each, records
/// each answer; posts in flight finish (each within its timeout) before it returns.
pub async fn deliver(store: Store, config: WebhookConfig, shutdown: CancellationToken) {
    register_metrics();
    let slots = usize::try_from(config.batch.max(1)).unwrap_or(1);
    let clients = Clients::default();
    let in_flight = InFlight::default();
    let mut posts = tokio::task::JoinSet::new();
    while !shutdown.is_cancelled() {
        let free = slots.saturating_sub(posts.len());
        let due = if free == 0 {
            Vec::new()
        } else {
            match store
                .claim_webhook_deliveries(
                    free as i64,
                    config.claim_ms,
                    config.per_webhook,
                    &in_flight.counts(),
                )
                .await
            {
                Ok(due) => due,
                Err(e) => {
                    warn!(error = %e, "cannot claim webhook deliveries; retrying");
                    Vec::new()
                }
            }
        };
        let claimed = due.len();
        for delivery in due {
            let (store, clients, config) = (store.clone(), clients.clone(), config.clone());
            let posting = in_flight.start(delivery.webhook_id);
            posts.spawn(async move {
                attempt(&store, &clients, &config, delivery).await;
                drop(posting);
            });
        }
        if claimed > 0 && claimed == free {
            // Every slot was filled: more may be due as soon as one frees.
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = posts.join_next() => {}
            }
        } else if claimed == 0 {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(_) = posts.join_next(), if !posts.is_empty() => {}
                _ = tokio::time::sleep(Duration::from_millis(config.poll_ms)) => {}
            }
        }
    }
    while posts.join_next().await.is_some() {}
}

/// How many of this scheduler's posts are in flight to each webhook.
#[derive(Clone, Default)]
struct InFlight(Arc<Mutex<HashMap<Uuid, i64>>>);

impl InFlight {
    /// Counts a post to `webhook_id` until the returned guard is dropped (also when its task
    /// panics or is aborted).
    fn start(&self, webhook_id: Uuid) -> Posting {
        *self.lock().entry(webhook_id).or_default() += 1;
        Posting {
            in_flight: self.clone(),
            webhook_id,
        }
    }

    fn counts(&self) -> Vec<(Uuid, i64)> {
        self.lock().iter().map(|(id, n)| (*id, *n)).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, i64>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One post counted in [`InFlight`] while it lives.
struct Posting {
    in_flight: InFlight,
    webhook_id: Uuid,
}

impl Drop for Posting {
    fn drop(&mut self) {
        let mut counts = self.in_flight.lock();
        if let Some(n) = counts.get_mut(&self.webhook_id) {
            *n -= 1;
            if *n <= 0 {
                counts.remove(&self.webhook_id);
            }
        }
    }
}

/// The pooled clients, one per port (see [`PORT_CLIENTS_MAX`]).
#[derive(Clone, Default)]
struct Clients(Arc<Mutex<HashMap<u16, reqwest::Client>>>);

impl Clients {
    fn for_port(&self, config: &WebhookConfig, port: u16) -> Result<reqwest::Client, String> {
        let mut clients = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(&port) {
            return Ok(client.clone());
        }
        let client = rein_egress::client_builder(&config.egress, port)
            .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
            .timeout(Duration::from_millis(config.timeout_ms))
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        if clients.len() < PORT_CLIENTS_MAX {
            clients.insert(port, client.clone());
        }
        Ok(client)
    }
}

/// How one post ended.
enum Posted {
    Delivered(u16),
    Failed(Option<u16>, String),
    Refused(Refused),
}

/// One post of `delivery` and the record of its answer.
async fn attempt(store: &Store, clients: &Clients, config: &WebhookConfig, d: DueDelivery) {
    let posted = match tokio::time::timeout(
        Duration::from_millis(config.timeout_ms),
        post(clients, config, &d),
    )
    .await
    {
        Ok(posted) => posted,
        Err(_) => Posted::Failed(None, format!("no answer within {} ms", config.timeout_ms)),
    };
    let (code, error) = match posted {
        Posted::Delivered(code) => {
            match store.webhook_delivered(d.delivery_id, code).await {
                Ok(_) => {
                    metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => "delivered").increment(1);
                    debug!(delivery_id = %d.delivery_id, kind = %d.kind, "webhook delivered");
                }
                Err(e) => {
                    warn!(delivery_id = %d.delivery_id, error = %e, "webhook delivered but not recorded; it will be posted again")
                }
            }
            return;
        }
        Posted::Refused(refused) => {
            let reason = format!(
                "the egress rules refuse its URL: {} (rule {})",
                refused.reason, refused.rule
            );
            match store.disable_webhook(d.webhook_id, &reason).await {
                Ok(_) => {
                    metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => "failed").increment(1);
                    warn!(webhook_id = %d.webhook_id, url = %d.url, %reason, "webhook disabled: nothing is posted to it");
                }
                Err(e) => {
                    warn!(webhook_id = %d.webhook_id, error = %e, %reason, "cannot disable a webhook the egress rules refuse; nothing was posted")
                }
            }
            return;
        }
        Posted::Failed(code, error) => (code, error),
    };
    let attempts = u32::try_from(d.attempts).unwrap_or(0).saturating_add(1);
    let delay_ms = backoff_ms(attempts, rand::random::<f64>());
    match store
        .webhook_attempt_failed(d.delivery_id, code, &error, delay_ms, config.attempts_max)
        .await
    {
        Ok(AttemptFailed::WillRetry) => {
            metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => "retried").increment(1);
            warn!(delivery_id = %d.delivery_id, kind = %d.kind, url = %d.url, attempts, retry_in_ms = delay_ms, %error, "webhook delivery failed; retrying");
        }
        Ok(AttemptFailed::GaveUp) => {
            metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => "failed").increment(1);
            warn!(delivery_id = %d.delivery_id, kind = %d.kind, url = %d.url, attempts, %error, "webhook delivery failed for good: its attempts are used up");
        }
        Ok(AttemptFailed::NotClaimed) => {}
        Err(e) => {
            warn!(delivery_id = %d.delivery_id, error = %e, "cannot record a failed webhook attempt")
        }
    }
}

/// Posts `d` where the egress policy lets it, and reads at most
/// [`ERROR_BODY_BYTES_READ_MAX`] bytes of a refusal.
async fn post(clients: &Clients, config: &WebhookConfig, d: &DueDelivery) -> Posted {
    let url = match config.egress.check_url(&d.url).await {
        Ok(url) => url,
        Err(refused) => return Posted::Refused(refused),
    };
    let Some(port) = url.port_or_known_default() else {
        return Posted::Failed(None, "the URL names no port".into());
    };
    let client = match clients.for_port(config, port) {
        Ok(client) => client,
        Err(e) => return Posted::Failed(None, e),
    };
    let signature = sign(d.secret.as_bytes(), d.claimed_at_s, d.body.as_bytes());
    let sent = client
        .post(url)
        .header("content-type", "application/json")
        .header("rein-delivery-id", d.delivery_id.to_string())
        .header("rein-event", &d.kind)
        .header("rein-timestamp", d.claimed_at_s.to_string())
        .header("rein-signature", signature)
        .body(d.body.clone())
        .send()
        .await;
    match sent {
        Ok(reply) if reply.status().is_success() => Posted::Delivered(reply.status().as_u16()),
        Ok(mut reply) => {
            let status = reply.status();
            let mut read = 0usize;
            let body = loop {
                match reply.chunk().await {
                    Ok(Some(chunk)) => {
                        read += chunk.len();
                        if read > ERROR_BODY_BYTES_READ_MAX {
                            break format!(
                                "more than {ERROR_BODY_BYTES_READ_MAX} bytes (not read further)"
                            );
                        }
                    }
                    Ok(None) => break format!("{read} bytes"),
                    Err(_) => break format!("{read} bytes before the answer broke off"),
                }
            };
            // Dropping the reply closes the connection on what was not read.
            drop(reply);
            Posted::Failed(
                Some(status.as_u16()),
                format!("the receiver answered {status} with a body of {body} (not shown)"),
            )
        }
        Err(e) => match rein_egress::refusal_in(&e) {
            Some(refused) => Posted::Refused(refused.clone()),
            None if e.is_timeout() => {
                Posted::Failed(None, format!("no answer within {} ms", config.timeout_ms))
            }
            None => Posted::Failed(None, format!("cannot post: {}", error_chain(&e))),
        },
    }
}

/// An error with its causes, which say what a bare "error sending request" does not.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_of_timestamp_dot_body() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let sig = sign(b"Jefe", 0, b"what do ya want for nothing?");
        let mut mac = HmacSha256::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let mut mac = HmacSha256::new_from_slice(b"Jefe").unwrap();
        mac.update(b"0.what do ya want for nothing?");
        assert_eq!(
            sig,
            format!("v1={}", hex::encode(mac.finalize().into_bytes()))
        );
    }

    #[test]
    fn a_planted_or_altered_signature_is_refused() {
        let secret = b"0123456789abcdef-secret";
        let body = br#"{"id":"x","kind":"run.finished"}"#;
        let good = sign(secret, 1_700_000_000, body);
        assert!(verify(secret, 1_700_000_000, body, &good));
        let planted = format!("v1={}", "0".repeat(64));
        assert!(!verify(secret, 1_700_000_000, body, &planted));
        assert!(
            !verify(secret, 1_700_000_001, body, &good),
            "another timestamp"
        );
        assert!(!verify(b"another-secret-of-16", 1_700_000_000, body, &good));
        assert!(!verify(secret, 1_700_000_000, br#"{"id":"y"}"#, &good));
        assert!(!verify(
            secret,
            1_700_000_000,
            body,
            good.trim_start_matches("v1=")
        ));
        assert!(!verify(secret, 1_700_000_000, body, "v1=not-hex"));
    }

    #[test]
    fn backoff_doubles_from_a_second_with_jitter_and_stops_at_ten_minutes() {
        for attempts in 1..=12u32 {
            let full = (1000u64 << (attempts - 1)).min(BACKOFF_MS_MAX);
            for sample in [0.0, 0.3, 0.999] {
                let ms = backoff_ms(attempts, sample);
                assert!(
                    ms <= full && ms >= full * 3 / 4,
                    "{attempts} {sample}: {ms}"
                );
            }
            if 2 * full <= BACKOFF_MS_MAX {
                assert!(backoff_ms(attempts + 1, 0.0) > backoff_ms(attempts, 0.999));
            }
        }
        assert_eq!(backoff_ms(1_000, 0.5), backoff_ms(40, 0.5));
        assert!(backoff_ms(u32::MAX, 1.0) <= BACKOFF_MS_MAX);
    }
}
