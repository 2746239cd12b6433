//! Fleet-wide limits (SPEC K1): a rate per key (GCRA, the token bucket kept as one
//! timestamp) and a cap on actions in flight per key (slots in a sorted set that expire when
//! their holder stops refreshing them). Both live in Redis and are decided by Lua scripts on
//! Redis' own clock, so every worker sees one bucket and one set of slots.
//!
//! Without Redis, or while it is unreachable, each process applies every limit on its own
//! (the documented fallback): a run never stops because Redis is gone, and
//! `rein_limit_fallback_total` and one WARN per outage say that limits are per process.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rein_core::LimitSpec;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{Health, RedisConfig};

/// Metric: limit decisions made by a process on its own because Redis was unreachable.
pub const LIMIT_FALLBACK: &str = "rein_limit_fallback_total";
/// Metric: actions a limit deferred (the run was handed back until the limit allows it).
pub const LIMIT_DEFERRED: &str = "rein_limit_deferred_total";
/// Metric: time actions waited in process for a limit, in seconds.
pub const LIMIT_WAIT: &str = "rein_limit_wait_seconds";
/// The `key` values recorded so far: keys are named by definitions, so each family keeps at
/// most [`rein_core::limits::METRIC_LABEL_VALUES_MAX`] of them; the rest count as `other`.
static KEYS: rein_core::labels::LabelValues = rein_core::labels::LabelValues::new();

/// The help text of the limiter's metrics.
pub(crate) fn describe() {
    let capped = rein_core::limits::METRIC_LABEL_VALUES_MAX;
    metrics::describe_counter!(
        LIMIT_FALLBACK,
        format!(
            "Limit decisions made without Redis, by key; at most {capped} distinct keys, later \
             ones count as `other`"
        )
    );
    metrics::describe_counter!(
        LIMIT_DEFERRED,
        format!(
            "Actions a fleet-wide limit deferred, by key and limit; at most {capped} distinct \
             keys, later ones count as `other`"
        )
    );
    metrics::describe_histogram!(LIMIT_WAIT, "Time actions waited in process for a limit");
}
/// Registers at 0 the limiter's families for the keys known at start (the command line's
/// `--limit`s, each with the kinds of limit it sets; fallbacks only with Redis configured). A
/// definition's own keys show up when its first action is limited.
fn register_metrics(with_redis: bool, overrides: &BTreeMap<String, LimitSpec>) {
    let _ = metrics::histogram!(LIMIT_WAIT);
    for (key, spec) in overrides {
        if with_redis {
            metrics::counter!(LIMIT_FALLBACK, "key" => KEYS.value(LIMIT_FALLBACK, "key", key))
                .increment(0);
        }
        let kinds = [
            ("concurrency", spec.concurrency.is_some()),
            ("rate", spec.rate.is_some()),
            ("tpm", spec.tpm.is_some()),
        ];
        for (limit, _) in kinds.iter().filter(|(_, set)| *set) {
            metrics::counter!(LIMIT_DEFERRED,
                "key" => KEYS.value(LIMIT_DEFERRED, "key", key), "limit" => *limit)
            .increment(0);
        }
    }
}

/// How long one Redis call of the limiter may take before it counts as unreachable.
const CALL_TIMEOUT: Duration = Duration::from_millis(500);
/// After a failed call, decisions are local for this long before Redis is tried again, so an
/// outage does not cost every action a timeout.
const RETRY_REDIS_AFTER: Duration = Duration::from_secs(1);
/// First and longest pause between looks at a full concurrency cap.
const SLOT_POLL_FIRST: Duration = Duration::from_millis(20);
const SLOT_POLL_MAX: Duration = Duration::from_millis(250);
/// Longest deferral for a full concurrency cap (slots free when actions end, not on a clock).
const SLOT_DEFER_MAX_MS: u64 = 1_000;

/// The outcome of a rate check, in microseconds (pure GCRA, mirrored by [`RATE_SCRIPT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gcra {
    /// A start was reserved `wait` from now; the bucket's next theoretical arrival is `tat`.
    Reserved { wait: i64, tat: i64 },
    /// The start would be further away than the caller may wait: nothing was reserved. Come
    /// back at `ticket` (spread one interval apart among deferred callers).
    Deferred { ticket: i64 },
}

/// Microseconds between starts and the bucket's tolerance for a limit: `rate` per `per_ms`
/// with bursts of `bucket` starts.
pub fn gcra_params(spec: &LimitSpec) -> Option<(i64, i64)> {
    let rate = i64::from(spec.rate?.max(1));
    let per_us = (spec.per_ms as i64).saturating_mul(1000);
    // Rounded up: a limit is never exceeded by rounding.
    let interval = ((per_us + rate - 1) / rate).max(1);
    let tau = interval * (i64::from(spec.bucket()) - 1);
    Some((interval, tau))
}

/// A minute, in µs: what a `tpm` limit's bucket holds.
const MINUTE_US: i64 = 60_000_000;

/// µs of a `tpm` bucket that `tokens` tokens take (rounded up: a limit is never exceeded by
/// rounding); negative `tokens` give time back.
pub fn token_cost_us(tpm: u32, tokens: i64) -> i64 {
    let tpm = i128::from(tpm.max(1));
    let us = i128::from(tokens) * i128::from(MINUTE_US);
    let cost = if us >= 0 {
        (us + tpm - 1) / tpm
    } else {
        us / tpm
    };
    cost.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// The GCRA step and tolerance of booking `tokens` against a `tpm` limit: the booking takes
/// its share of a minute, and a quiet key holds a minute's tokens in all. A booking larger
/// than a minute's tokens books one minute's (it could never fit otherwise).
pub fn token_params(tpm: u32, tokens: u64) -> (i64, i64) {
    let tokens = tokens.clamp(1, u64::from(tpm.max(1)));
    let cost = token_cost_us(tpm, tokens as i64).max(1);
    (cost, (MINUTE_US - cost).max(0))
}

/// One GCRA decision at `now`: the start is allowed at `tat - tau` (at once when that has
/// passed); it is reserved when that is at most `max_wait` away. `ticket` is the last
/// deferral's return time.
pub fn gcra(
    now: i64,
    tat: Option<i64>,
    ticket: Option<i64>,
    interval: i64,
    tau: i64,
    max_wait: i64,
) -> Gcra {
    let tat = tat.unwrap_or(now).max(now);
    let allow_at = tat - tau;
    let wait = (allow_at - now).max(0);
    if wait <= max_wait {
        return Gcra::Reserved {
            wait,
            tat: tat + interval,
        };
    }
    let ticket = ticket.map_or(allow_at, |t| (t + interval).max(allow_at));
    Gcra::Deferred { ticket }
}

/// [`gcra`] in Redis, on Redis' clock. KEYS: the bucket's arrival time, the deferral ticket.
/// ARGV: interval, tolerance, longest wait (µs). Returns `{1, wait}` or `{0, ticket - now}`.
const RATE_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tau = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local allow_at = tat - tau
local wait = allow_at - now
if wait < 0 then wait = 0 end
if wait <= max_wait then
  local next_tat = tat + interval
  redis.call('SET', KEYS[1], string.format('%d', next_tat), 'PX', math.floor((next_tat - now) / 1000) + 1000)
  return {1, wait}
end
local ticket = tonumber(redis.call('GET', KEYS[2]) or 0)
if ticket + interval > allow_at then ticket = ticket + interval else ticket = allow_at end
redis.call('SET', KEYS[2], string.format('%d', ticket), 'PX', math.floor((ticket - now) / 1000) + 1000)
return {0, ticket - now}
";

/// Corrects a `tpm` booking by what the call really used. KEYS: the bucket's arrival time.
/// ARGV: µs to add (negative: given back; never below now, so nothing is banked).
const SETTLE_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
tat = tat + tonumber(ARGV[1])
if tat <= now then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], string.format('%d', tat), 'PX', math.floor((tat - now) / 1000) + 1000)
return 0
";

/// Takes a concurrency slot. KEYS: the slot set. ARGV: cap, TTL (ms), holder. Expired slots
/// (holders that stopped refreshing) are dropped first. Returns `{1, 0}` or `{0, ms until
/// the first slot expires}`.
const SLOT_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cap = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[3]) or redis.call('ZCARD', KEYS[1]) < cap then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ttl * 2)
  return {1, 0}
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, tonumber(first[2]) - now}
";

/// Pushes the expiry of slots still held. KEYS: the slot set. ARGV: TTL (ms), holders.
const REFRESH_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return 0
";

/// What one key's entries say right now. KEYS: arrival time, ticket, slot set. Returns
/// `{now_us, tat_us or -1, ticket_us or -1, holder, expiry_ms, ...}` (live slots only).
const INSPECT_SCRIPT: &str = r"
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local out = {string.format('%d', now_us), redis.call('GET', KEYS[1]) or '-1', redis.call('GET', KEYS[2]) or '-1'}
local live = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. now_ms, '+inf', 'WITHSCORES')
for i = 1, #live, 2 do
  out[#out + 1] = live[i]
  out[#out + 1] = string.format('%d', tonumber(live[i + 1]) - now_ms)
end
return out
";

/// One key's state in Redis, for operators (`rein limits`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct KeyState {
    pub key: String,
    /// How far ahead the rate's starts are booked (ms): 0 when the bucket is full; a start
    /// waits once this exceeds (burst − 1) intervals.
    pub booked_ahead_ms: f64,
    /// How far ahead deferred runs have been told to come back (ms), if any are.
    pub deferred_until_ms: Option<f64>,
    /// Live concurrency slots: holder (`worker/run/n`) and ms until it expires.
    pub slots: Vec<SlotState>,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SlotState {
    pub holder: String,
    pub expires_in_ms: i64,
}

/// The keys with entries in Redis under `config`'s prefix (SCAN, so it never blocks Redis),
/// at most `max`, sorted.
pub async fn keys_in_use(config: &RedisConfig, max: usize) -> Result<Vec<String>, String> {
    let mut conn = crate::connect_manager(config)
        .await
        .map_err(|e| e.to_string())?;
    let pattern = format!("{}:limit:{{*}}:*", config.prefix);
    let head = format!("{}:limit:{{", config.prefix);
    let mut found = std::collections::BTreeSet::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(500)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        for k in batch {
            if let Some(key) = k
                .strip_prefix(&head)
                .and_then(|rest| rest.rsplit_once("}:"))
            {
                found.insert(key.0.to_owned());
            }
        }
        if next == 0 || found.len() >= max {
            break;
        }
        cursor = next;
    }
    Ok(found.into_iter().take(max).collect())
}

/// The state of each of `keys` in Redis.
pub async fn inspect(config: &RedisConfig, keys: &[String]) -> Result<Vec<KeyState>, String> {
    let mut conn = crate::connect_manager(config)
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        let flat: Vec<String> = redis::cmd("EVAL")
            .arg(INSPECT_SCRIPT)
            .arg(3)
            .arg(config.limit_key(key, "tat"))
            .arg(config.limit_key(key, "ticket"))
            .arg(config.limit_key(key, "slots"))
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        let num = |i: usize| {
            flat.get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(-1.0)
        };
        let now = num(0);
        let ahead_ms = |v: f64| ((v - now) / 1000.0).max(0.0);
        out.push(KeyState {
            key: key.clone(),
            booked_ahead_ms: if num(1) < 0.0 { 0.0 } else { ahead_ms(num(1)) },
            deferred_until_ms: (num(2) >= 0.0 && num(2) > now).then(|| ahead_ms(num(2))),
            slots: flat[3.min(flat.len())..]
                .chunks(2)
                .filter_map(|c| {
                    Some(SlotState {
                        holder: c.first()?.clone(),
                        expires_in_ms: c.get(1)?.parse().ok()?,
                    })
                })
                .collect(),
        });
    }
    Ok(out)
}

/// What [`Limiter::admit`] decided.
#[derive(Debug)]
pub enum Admission {
    /// Go: the slots are held until the permit is dropped.
    Go(Permit),
    /// A limit will not allow the action within the longest wait: hand the run back for
    /// `wait_ms`.
    Defer {
        key: String,
        limit: &'static str,
        wait_ms: u64,
    },
}

/// Concurrency slots held by one action; given back when dropped.
#[derive(Debug, Default)]
pub struct Permit {
    slots: Vec<Slot>,
    limiter: Option<Arc<LimiterInner>>,
    limited: bool,
    /// `tpm` bookings: key, its tokens per minute, tokens booked.
    tokens: Vec<(String, u32, u64)>,
}

#[derive(Debug, Clone)]
struct Slot {
    key: String,
    holder: String,
    /// Taken from the process' own count (Redis was unreachable).
    local: bool,
}

impl Permit {
    /// Whether any limit applied (a rate or a cap), so the action's timing matters.
    pub fn limited(&self) -> bool {
        self.limited
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(limiter) = self.limiter.take() {
            let slots = std::mem::take(&mut self.slots);
            if !slots.is_empty() {
                limiter.release(slots);
            }
        }
    }
}

/// Decides fleet-wide limits for one worker process.
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<LimiterInner>,
}

struct LimiterInner {
    redis: Option<RedisConfig>,
    conn: tokio::sync::Mutex<Option<redis::aio::ConnectionManager>>,
    /// Decisions stay local until then after a failed call.
    local_until: Mutex<Option<Instant>>,
    health: Health,
    /// Limits given on the command line; they override a definition's values for the key.
    overrides: BTreeMap<String, LimitSpec>,
    max_wait: Duration,
    slot_ttl_ms: u64,
    /// Slots held in Redis, by key, for refreshing: holder names.
    held: Mutex<HashMap<String, Vec<String>>>,
    /// The per-process fallback: GCRA state and slots in use, by key.
    local: Mutex<HashMap<String, LocalKey>>,
    started: Instant,
    /// Keys whose "applied per process" WARN was given (no Redis configured).
    warned: Mutex<std::collections::HashSet<String>>,
    serial: AtomicU64,
}

impl std::fmt::Debug for LimiterInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimiterInner")
            .field("redis", &self.redis.is_some())
            .field("overrides", &self.overrides)
            .finish_non_exhaustive()
    }
}

/// Which of a key's buckets a decision is about: its rate (starts) or its `tpm` (tokens).
#[derive(Debug, Clone, Copy)]
enum Bucket {
    Starts,
    Tokens,
}

impl Bucket {
    fn of(limit: &str) -> Bucket {
        if limit == "tpm" {
            Bucket::Tokens
        } else {
            Bucket::Starts
        }
    }

    fn tat(self) -> &'static str {
        match self {
            Bucket::Starts => "tat",
            Bucket::Tokens => "tpm_tat",
        }
    }

    fn ticket(self) -> &'static str {
        match self {
            Bucket::Starts => "ticket",
            Bucket::Tokens => "tpm_ticket",
        }
    }

    /// The key of the per-process fallback's state.
    fn local_key(self, key: &str) -> String {
        match self {
            Bucket::Starts => key.to_owned(),
            Bucket::Tokens => format!("{key}#tpm"),
        }
    }
}

#[derive(Debug, Default)]
struct LocalKey {
    tat: Option<i64>,
    ticket: Option<i64>,
    in_use: u32,
}

impl Limiter {
    /// `redis`: where the fleet's shared limits live (`None`: every limit per process).
    /// `max_wait`: the longest an action waits in process before its run is handed back.
    /// `slot_ttl_ms`: how long a concurrency slot outlives its last refresh (the lease TTL).
    pub fn new(
        redis: Option<RedisConfig>,
        overrides: BTreeMap<String, LimitSpec>,
        max_wait: Duration,
        slot_ttl_ms: u64,
    ) -> Limiter {
        register_metrics(redis.is_some(), &overrides);
        Limiter {
            inner: Arc::new(LimiterInner {
                redis,
                conn: tokio::sync::Mutex::new(None),
                local_until: Mutex::new(None),
                health: Health::default(),
                overrides,
                max_wait,
                slot_ttl_ms: slot_ttl_ms.max(100),
                held: Mutex::new(HashMap::new()),
                local: Mutex::new(HashMap::new()),
                started: Instant::now(),
                warned: Mutex::new(Default::default()),
                serial: AtomicU64::new(0),
            }),
        }
    }

    /// Whether any limit could apply: the command line gives some, or the definition does.
    pub fn any(&self, declared: &BTreeMap<String, LimitSpec>) -> bool {
        !self.inner.overrides.is_empty() || !declared.is_empty()
    }

    /// The limit that applies to `key`: the command line's, else the definition's.
    pub fn spec_for(&self, key: &str, declared: &BTreeMap<String, LimitSpec>) -> Option<LimitSpec> {
        self.inner
            .overrides
            .get(key)
            .or_else(|| declared.get(key))
            .copied()
    }

    /// Waits (at most the longest wait) until every limit of `keys` allows one more action
    /// and takes its concurrency slots, or says how long to hand the run back for. `holder`
    /// names the action in slot sets (worker and run). `tokens` is what the action books
    /// against `tpm` limits (a model call's `max_tokens`; 0 for anything else, which no
    /// `tpm` limit holds back); [`Limiter::settle_tokens`] corrects it once the real usage
    /// is known.
    pub async fn admit(
        &self,
        keys: &[String],
        declared: &BTreeMap<String, LimitSpec>,
        holder: &str,
        tokens: u64,
        cancel: &CancellationToken,
    ) -> Admission {
        let started = Instant::now();
        let limits: Vec<(String, LimitSpec)> = keys
            .iter()
            .filter_map(|k| self.spec_for(k, declared).map(|s| (k.clone(), s)))
            .collect();
        let mut permit = Permit {
            slots: Vec::new(),
            limiter: Some(self.inner.clone()),
            limited: !limits.is_empty(),
            tokens: Vec::new(),
        };
        if limits.is_empty() {
            return Admission::Go(permit);
        }
        let serial = self.inner.serial.fetch_add(1, Ordering::Relaxed);
        let holder = format!("{holder}/{serial}");
        // Slots first: they are given back if a rate then defers; a reserved rate start is
        // used up either way.
        for (key, spec) in &limits {
            let Some(cap) = spec.concurrency else {
                continue;
            };
            match self.take_slot(key, cap, &holder, started, cancel).await {
                Ok(slot) => permit.slots.push(slot),
                Err(wait_ms) => {
                    metrics::counter!(LIMIT_DEFERRED, "key" => KEYS.value(LIMIT_DEFERRED, "key", key), "limit" => "concurrency").increment(1);
                    return Admission::Defer {
                        key: key.clone(),
                        limit: "concurrency",
                        wait_ms,
                    };
                }
            }
        }
        let mut wait_us: i64 = 0;
        let token_limits = limits.iter().filter_map(|(key, spec)| match spec.tpm {
            Some(tpm) if tokens > 0 => {
                let (interval, tau) = token_params(tpm, tokens);
                Some((key, "tpm", interval, tau, Some(tpm)))
            }
            _ => None,
        });
        let rate_limits = limits.iter().filter_map(|(key, spec)| {
            gcra_params(spec).map(|(interval, tau)| (key, "rate", interval, tau, None))
        });
        for (key, limit, interval, tau, tpm) in rate_limits.chain(token_limits) {
            let room = self.inner.max_wait.saturating_sub(started.elapsed());
            match self
                .rate(
                    key,
                    Bucket::of(limit),
                    interval,
                    tau,
                    room.as_micros() as i64,
                )
                .await
            {
                Ok(wait) => {
                    wait_us = wait_us.max(wait);
                    if let Some(tpm) = tpm {
                        permit
                            .tokens
                            .push((key.clone(), tpm, tokens.min(u64::from(tpm))));
                    }
                }
                Err(defer_us) => {
                    metrics::counter!(LIMIT_DEFERRED, "key" => KEYS.value(LIMIT_DEFERRED, "key", key), "limit" => limit)
                        .increment(1);
                    // Bookings already made stand (like a reserved rate start): the run
                    // comes back when this one has room.
                    return Admission::Defer {
                        key: key.clone(),
                        limit,
                        wait_ms: (defer_us.max(0) as u64).div_ceil(1000).max(1),
                    };
                }
            }
        }
        if wait_us > 0 {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(Duration::from_micros(wait_us as u64)) => {}
            }
        }
        metrics::histogram!(LIMIT_WAIT).record(started.elapsed().as_secs_f64());
        Admission::Go(permit)
    }

    /// Pushes back the expiry of every slot this process holds; call it with each lease
    /// renewal, so a slot lives as long as its holder's lease.
    pub async fn refresh(&self) {
        let held: Vec<(String, Vec<String>)> = match self.inner.held.lock() {
            Ok(h) => h.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => return,
        };
        if held.is_empty() || self.inner.use_local() {
            return;
        }
        for (key, holders) in held {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(REFRESH_SCRIPT)
                .arg(1)
                .arg(self.inner.limit_key(&key, "slots"))
                .arg(self.inner.slot_ttl_ms);
            for h in &holders {
                cmd.arg(h);
            }
            if self.inner.call::<i64>(cmd).await.is_none() {
                return;
            }
        }
    }

    /// Corrects the `tpm` bookings of `permit` by the tokens the call really used (a model
    /// reply's `usage`): what it did not use is given back, what it used beyond the booking
    /// (the prompt counts too) is booked on top.
    pub async fn settle_tokens(&self, permit: &Permit, used: u64) {
        for (key, tpm, booked) in &permit.tokens {
            let delta = token_cost_us(*tpm, used as i64 - *booked as i64);
            if delta == 0 {
                continue;
            }
            let bucket = Bucket::Tokens;
            if !self.inner.use_local() {
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(SETTLE_SCRIPT)
                    .arg(1)
                    .arg(self.inner.limit_key(key, bucket.tat()))
                    .arg(delta);
                if self.inner.call::<i64>(cmd).await.is_some() {
                    continue;
                }
            }
            let now = self.inner.started.elapsed().as_micros() as i64;
            if let Ok(mut local) = self.inner.local.lock()
                && let Some(state) = local.get_mut(&bucket.local_key(key))
                && let Some(tat) = state.tat
            {
                state.tat = Some((tat + delta).max(now));
            }
        }
    }

    /// One start of `key` in `bucket`: `Ok(µs to sleep)` when reserved, `Err(µs to defer)`
    /// otherwise.
    async fn rate(
        &self,
        key: &str,
        bucket: Bucket,
        interval: i64,
        tau: i64,
        max_wait: i64,
    ) -> Result<i64, i64> {
        if !self.inner.use_local() {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(RATE_SCRIPT)
                .arg(2)
                .arg(self.inner.limit_key(key, bucket.tat()))
                .arg(self.inner.limit_key(key, bucket.ticket()))
                .arg(interval)
                .arg(tau)
                .arg(max_wait);
            if let Some((ok, n)) = self.inner.call::<(i64, i64)>(cmd).await {
                return if ok == 1 { Ok(n) } else { Err(n) };
            }
        }
        self.inner.fell_back(key);
        let now = self.inner.started.elapsed().as_micros() as i64;
        let Ok(mut local) = self.inner.local.lock() else {
            return Ok(0);
        };
        let state = local.entry(bucket.local_key(key)).or_default();
        match gcra(now, state.tat, state.ticket, interval, tau, max_wait) {
            Gcra::Reserved { wait, tat } => {
                state.tat = Some(tat);
                Ok(wait)
            }
            Gcra::Deferred { ticket } => {
                state.ticket = Some(ticket);
                Err(ticket - now)
            }
        }
    }

    /// Takes a slot of `key`, looking again with growing pauses until the longest wait is
    /// used up; `Err(ms)` says how long to defer.
    async fn take_slot(
        &self,
        key: &str,
        cap: u32,
        holder: &str,
        started: Instant,
        cancel: &CancellationToken,
    ) -> Result<Slot, u64> {
        let mut pause = SLOT_POLL_FIRST;
        loop {
            let hint_ms = match self.try_slot(key, cap, holder).await {
                Ok(slot) => return Ok(slot),
                Err(hint) => hint,
            };
            let left = self.inner.max_wait.saturating_sub(started.elapsed());
            if left.is_zero() || cancel.is_cancelled() {
                // A slot frees when an action ends, which no clock predicts: come back after
                // a short, jittered pause (or when the oldest slot would expire, if sooner).
                let jitter = rand::random::<u64>() % 250;
                return Err(hint_ms.clamp(1, SLOT_DEFER_MAX_MS - 250) + jitter);
            }
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(pause.min(left)) => {}
            }
            pause = (pause * 2).min(SLOT_POLL_MAX);
        }
    }

    async fn try_slot(&self, key: &str, cap: u32, holder: &str) -> Result<Slot, u64> {
        if !self.inner.use_local() {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(SLOT_SCRIPT)
                .arg(1)
                .arg(self.inner.limit_key(key, "slots"))
                .arg(cap)
                .arg(self.inner.slot_ttl_ms)
                .arg(holder);
            if let Some((ok, hint)) = self.inner.call::<(i64, i64)>(cmd).await {
                if ok == 1 {
                    if let Ok(mut held) = self.inner.held.lock() {
                        held.entry(key.to_owned())
                            .or_default()
                            .push(holder.to_owned());
                    }
                    return Ok(Slot {
                        key: key.to_owned(),
                        holder: holder.to_owned(),
                        local: false,
                    });
                }
                return Err(hint.max(1) as u64);
            }
        }
        self.inner.fell_back(key);
        let Ok(mut local) = self.inner.local.lock() else {
            return Err(SLOT_DEFER_MAX_MS);
        };
        let state = local.entry(key.to_owned()).or_default();
        if state.in_use < cap {
            state.in_use += 1;
            Ok(Slot {
                key: key.to_owned(),
                holder: holder.to_owned(),
                local: true,
            })
        } else {
            Err(SLOT_DEFER_MAX_MS)
        }
    }
}

impl LimiterInner {
    fn limit_key(&self, key: &str, part: &str) -> String {
        match &self.redis {
            Some(config) => config.limit_key(key, part),
            // Never sent anywhere: without Redis every decision is local.
            None => format!("local:{key}:{part}"),
        }
    }

    /// Whether decisions are local now: no Redis, or a call failed a moment ago.
    fn use_local(&self) -> bool {
        if self.redis.is_none() {
            return true;
        }
        match self.local_until.lock() {
            Ok(until) => until.is_some_and(|t| Instant::now() < t),
            Err(_) => true,
        }
    }

    /// One decision was made by this process alone.
    fn fell_back(&self, key: &str) {
        if self.redis.is_some() {
            metrics::counter!(LIMIT_FALLBACK, "key" => KEYS.value(LIMIT_FALLBACK, "key", key))
                .increment(1);
        } else if let Ok(mut warned) = self.warned.lock()
            && warned.insert(key.to_owned())
        {
            warn!(
                key,
                "no Redis configured (--redis-url): limit applied per process, not fleet-wide"
            );
        }
    }

    async fn call<T: redis::FromRedisValue>(&self, cmd: redis::Cmd) -> Option<T> {
        let config = self.redis.as_ref()?;
        let mut guard = self.conn.lock().await;
        if guard.is_none() {
            match crate::connect_manager(config).await {
                Ok(c) => *guard = Some(c),
                Err(e) => {
                    self.failed(&e);
                    return None;
                }
            }
        }
        let mut conn = guard.as_ref()?.clone();
        drop(guard);
        match crate::within(CALL_TIMEOUT, "timed out", cmd.query_async::<T>(&mut conn)).await {
            Ok(v) => {
                self.health.up("limits");
                Some(v)
            }
            Err(e) => {
                self.failed(&e);
                None
            }
        }
    }

    fn failed(&self, error: &dyn std::fmt::Display) {
        self.health.down("limits", error);
        if let Ok(mut until) = self.local_until.lock() {
            *until = Some(Instant::now() + RETRY_REDIS_AFTER);
        }
    }

    fn release(self: &Arc<Self>, slots: Vec<Slot>) {
        let mut remote: Vec<Slot> = Vec::new();
        for slot in slots {
            if slot.local {
                if let Ok(mut local) = self.local.lock()
                    && let Some(state) = local.get_mut(&slot.key)
                {
                    state.in_use = state.in_use.saturating_sub(1);
                }
            } else {
                if let Ok(mut held) = self.held.lock()
                    && let Some(holders) = held.get_mut(&slot.key)
                {
                    holders.retain(|h| h != &slot.holder);
                    if holders.is_empty() {
                        held.remove(&slot.key);
                    }
                }
                remote.push(slot);
            }
        }
        if remote.is_empty() {
            return;
        }
        let me = self.clone();
        // Outside the caller: a slot that cannot be given back expires with its TTL.
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        handle.spawn(async move {
            for slot in remote {
                let mut cmd = redis::cmd("ZREM");
                cmd.arg(me.limit_key(&slot.key, "slots")).arg(&slot.holder);
                if me.call::<i64>(cmd).await.is_none() {
                    debug!(key = %slot.key, "slot not given back; it expires with its TTL");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tpm_booking_takes_its_share_of_a_minute_and_a_quiet_key_holds_a_minutes_tokens() {
        // 6000 a minute: 512 tokens take 5.12 s of the bucket.
        assert_eq!(token_params(6000, 512), (5_120_000, 54_880_000));
        // Rounded up, never down: 1 token of 7 a minute is 8.57… s, booked as 8,571,429 µs.
        assert_eq!(token_cost_us(7, 1), 8_571_429);
        // Given back: rounded toward zero, so a correction never gives more than was booked.
        assert_eq!(token_cost_us(7, -1), -8_571_428);
        // A booking bigger than a minute's tokens books one minute's: it still fits, once.
        assert_eq!(token_params(1000, 5000), (60_000_000, 0));
        // A quiet key lets 6000 / 512 = 11 bookings start at once; the 12th waits.
        let (interval, tau) = token_params(6000, 512);
        let (mut tat, mut started) = (None, 0);
        for _ in 0..20 {
            match gcra(0, tat, None, interval, tau, 0) {
                Gcra::Reserved { wait: 0, tat: t } => {
                    tat = Some(t);
                    started += 1;
                }
                _ => break,
            }
        }
        assert_eq!(started, 11);
    }

    fn spec(rate: u32, burst: Option<u32>) -> LimitSpec {
        LimitSpec::parse(&match burst {
            Some(b) => format!("{rate}/s,burst={b}"),
            None => format!("{rate}/s"),
        })
        .unwrap()
    }

    /// Starts at the times GCRA grants them, for callers arriving every `gap` µs that wait
    /// at most `max_wait`; deferred callers are dropped.
    fn starts(spec: &LimitSpec, arrivals: &[i64], max_wait: i64) -> Vec<i64> {
        let (interval, tau) = gcra_params(spec).unwrap();
        let mut tat = None;
        let mut ticket = None;
        let mut out = Vec::new();
        for &now in arrivals {
            match gcra(now, tat, ticket, interval, tau, max_wait) {
                Gcra::Reserved { wait, tat: t } => {
                    tat = Some(t);
                    out.push(now + wait);
                }
                Gcra::Deferred { ticket: t } => ticket = Some(t),
            }
        }
        out.sort_unstable();
        out
    }

    fn most_in_a_second(starts: &[i64]) -> usize {
        starts
            .iter()
            .map(|&a| {
                starts
                    .iter()
                    .filter(|&&s| s >= a && s < a + 1_000_000)
                    .count()
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn no_second_sees_more_than_rate_plus_burst_however_callers_arrive() {
        for (rate, burst) in [(10, None), (10, Some(3)), (60, Some(1)), (1, Some(5))] {
            let s = spec(rate, burst);
            // A flood at once, a steady overload and a late flood.
            let mut arrivals: Vec<i64> = vec![0; 500];
            arrivals.extend((0..2000).map(|i| i * 1_000));
            arrivals.extend(vec![3_500_000; 300]);
            arrivals.sort_unstable();
            let got = starts(&s, &arrivals, 2_000_000);
            let most = most_in_a_second(&got);
            assert!(
                most <= (rate + s.bucket()) as usize,
                "{rate}/s burst {burst:?}: {most} starts in one second"
            );
            assert!(
                most >= rate as usize,
                "{rate}/s: only {most} in the busiest second"
            );
        }
    }

    #[test]
    fn a_deferred_caller_is_told_to_come_back_after_the_earlier_ones() {
        let s = spec(10, None);
        let (interval, tau) = gcra_params(&s).unwrap();
        // 100 ms apart; nobody waits.
        assert_eq!(interval, 100_000);
        let first = gcra(0, None, None, interval, tau, 0);
        assert_eq!(
            first,
            Gcra::Reserved {
                wait: 0,
                tat: 100_000
            }
        );
        let a = gcra(0, Some(100_000), None, interval, tau, 0);
        assert_eq!(a, Gcra::Deferred { ticket: 100_000 });
        let b = gcra(0, Some(100_000), Some(100_000), interval, tau, 0);
        assert_eq!(b, Gcra::Deferred { ticket: 200_000 });
        // Waiting is allowed: the start is reserved for later.
        let c = gcra(0, Some(100_000), None, interval, tau, 150_000);
        assert_eq!(
            c,
            Gcra::Reserved {
                wait: 100_000,
                tat: 200_000
            }
        );
    }

    #[test]
    fn a_period_that_does_not_divide_evenly_rounds_towards_fewer_starts() {
        let (interval, _) = gcra_params(&LimitSpec::parse("3/s").unwrap()).unwrap();
        assert_eq!(interval, 333_334);
        let (interval, tau) = gcra_params(&LimitSpec::parse("60/min,burst=5").unwrap()).unwrap();
        assert_eq!((interval, tau), (1_000_000, 4_000_000));
    }
}
