//! Renewing the leases this worker holds, and noticing the ones it lost.

use super::*;

pub(super) async fn renewer(inner: Arc<Inner>) {
    let period = Duration::from_millis((inner.config.lease_ttl_ms / 3).max(100));
    loop {
        tokio::time::sleep(period).await;
        let held: Vec<(Uuid, i64)> = match inner.held.lock() {
            Ok(h) => h.iter().map(|(id, held)| (*id, held.token)).collect(),
            Err(_) => return,
        };
        if held.is_empty() {
            continue;
        }
        // Concurrency slots live as long as the leases of the actions holding them.
        let limiter = inner.limiter.clone();
        tokio::spawn(async move { limiter.refresh().await });
        let asked = held;
        match inner
            .store
            .renew(&inner.config.worker_id, &asked, inner.config.lease_ttl_ms)
            .await
        {
            Ok(renewed) => {
                metrics::counter!(rein_store::metrics::LEASE_RENEWALS)
                    .increment(renewed.len() as u64);
                let renewed: HashMap<Uuid, rein_store::Renewed> =
                    renewed.into_iter().map(|r| (r.run_id, r)).collect();
                let Ok(map) = inner.held.lock() else { return };
                // Only the leases this renewal asked for: a run claimed since the snapshot
                // was not in it, and a run released since then is no longer held.
                for (run_id, token) in &asked {
                    let Some(held) = map
                        .get(run_id)
                        .filter(|h| h.token == *token && !h.releasing.load(Ordering::Acquire))
                    else {
                        continue;
                    };
                    match renewed.get(run_id) {
                        Some(r) => {
                            if r.inbox_pending {
                                held.inbox_pending.store(true, Ordering::Release);
                            }
                            if r.cancel_pending {
                                held.interrupt.cancel();
                            }
                        }
                        None => {
                            warn!(%run_id, token = held.token, "lease lost; cancelling its action");
                            inner.stats.leases_lost.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!(rein_store::metrics::LEASES_LOST).increment(1);
                            held.lost.cancel();
                        }
                    }
                }
            }
            // Cannot tell whether the leases still stand; the commit check will say.
            Err(e) => warn!(error = %e, "lease renewal failed"),
        }
    }
}
