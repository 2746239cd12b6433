//! Committing a run's events: the group committer, one run's commit with its blobs and
//! grant, handing a run back.

use super::*;

/// Group commit: takes every job queued right now and commits them in one statement.
pub(super) async fn committer(inner: Arc<Inner>, mut rx: mpsc::Receiver<CommitJob>) {
    let max = if inner.config.commit_batching { 256 } else { 1 };
    let mut jobs = Vec::with_capacity(max);
    let mut held = rein_store::HeldConnection::default();
    while rx.recv_many(&mut jobs, max).await > 0 {
        let (requests, replies): (Vec<CommitRequest>, Vec<_>) =
            jobs.drain(..).map(|j| (j.request, j.reply)).unzip();
        inner
            .stats
            .commit_statements
            .fetch_add(1, Ordering::Relaxed);
        // A statement refused as a whole is retried run by run in there: one run's data
        // PostgreSQL cannot store never costs the others in the batch their results.
        let outcomes = inner
            .store
            .commit_runs_holding(&inner.config.worker_id, &requests, &mut held)
            .await;
        for ((request, reply), outcome) in requests.into_iter().zip(replies).zip(outcomes) {
            let _ = reply.send((request, outcome));
        }
    }
}

/// Moves the large fields of every event's payload to blobs (SPEC E5).
pub(super) fn externalize(
    events: Vec<NewEvent>,
    threshold_bytes: usize,
) -> Result<(Vec<NewEvent>, Vec<rein_core::blob::Blob>), rein_core::blob::PayloadError> {
    let mut blobs: Vec<rein_core::blob::Blob> = Vec::new();
    let mut out = Vec::with_capacity(events.len());
    for mut e in events {
        let (payload, found) = rein_core::blob::externalize(&e.payload, threshold_bytes)?;
        e.payload = payload;
        for b in found {
            if !blobs.iter().any(|x| x.sha256 == b.sha256) {
                blobs.push(b);
            }
        }
        out.push(e);
    }
    Ok((out, blobs))
}

impl Driver {
    pub(super) async fn release(&mut self) -> Stop {
        if self.held.lost.is_cancelled() {
            return Stop::Lost;
        }
        match self
            .commit_with(Vec::new(), Vec::new(), true, None, None)
            .await
        {
            Ok(()) => Stop::Released,
            Err(stop) => stop,
        }
    }

    pub(super) async fn commit(&mut self, events: Vec<NewEvent>) -> Result<(), Stop> {
        self.commit_with(events, Vec::new(), false, None, None)
            .await
    }

    /// Commits under this worker's token, retrying transient database errors until the lease
    /// would have expired (a retry is safe: event ids make it idempotent).
    pub(super) async fn commit_with(
        &mut self,
        events: Vec<NewEvent>,
        consumed: Vec<i64>,
        release: bool,
        approval: Option<Uuid>,
        defer_ms: Option<u64>,
    ) -> Result<(), Stop> {
        let plan = CommitPlan {
            writer: Writer::Leased,
            release,
            jitter_sample: rand::random::<f64>(),
        };
        let (events, blobs) = match externalize(events, self.inner.config.payload_inline_bytes) {
            Ok(split) => split,
            Err(e) => {
                return Box::pin(
                    self.operator_required(&format!("an action's result cannot be recorded: {e}")),
                )
                .await;
            }
        };
        let n_events = events.len() as u64;
        let request = match plan_commit(
            &self.def,
            self.run_id,
            self.token,
            &self.state,
            events,
            consumed,
            plan,
        ) {
            Ok(mut r) => {
                r.approval = approval;
                r.blobs = blobs;
                for b in std::mem::take(&mut self.blobs) {
                    if !r.blobs.iter().any(|x| x.sha256 == b.sha256) {
                        r.blobs.push(b);
                    }
                }
                r.defer_ms = defer_ms;
                r
            }
            Err(e) => {
                warn!(run_id = %self.run_id, state = %e.state, event = %e.event, reason = %e.reason, "rejected transition");
                return Err(self.release_boxed().await);
            }
        };
        if request.release {
            self.held.releasing.store(true, Ordering::Release);
        }
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(self.inner.config.lease_ttl_ms);
        let mut pause = Duration::from_millis(50);
        let mut request = request;
        loop {
            let outcome = if std::mem::take(&mut self.direct) {
                self.inner
                    .stats
                    .commit_statements
                    .fetch_add(1, Ordering::Relaxed);
                self.inner
                    .store
                    .commit_batch(&self.inner.config.worker_id, std::slice::from_ref(&request))
                    .await
                    .map(|mut o| o.pop().unwrap_or(CommitOutcome::RunNotFound))
            } else {
                let (tx, rx) = oneshot::channel();
                let sent = self
                    .inner
                    .commits
                    .send(CommitJob { request, reply: tx })
                    .await;
                match (sent, rx.await) {
                    (Ok(()), Ok((back, outcome))) => {
                        request = back;
                        outcome
                    }
                    _ => return Err(Stop::Lost),
                }
            };
            match outcome {
                Ok(CommitOutcome::Committed(c)) => {
                    let release = request.release;
                    self.after_commit(request, n_events, c.inbox_pending);
                    // A commit into a parked or terminal state released the lease too.
                    return if release { Err(Stop::Released) } else { Ok(()) };
                }
                Ok(CommitOutcome::AlreadyCommitted { .. }) => {
                    let release = request.release;
                    self.after_commit(request, n_events, true);
                    return if release { Err(Stop::Released) } else { Ok(()) };
                }
                Ok(CommitOutcome::Fenced {
                    current_token,
                    owner,
                    reason,
                    ..
                }) => {
                    warn!(run_id = %self.run_id, token = self.token, current_token, owner = ?owner,
                          %reason, "fenced: {reason}; stopping without writing");
                    // Stop the action first; counting may wait on the database.
                    self.held.lost.cancel();
                    self.inner.stats.fenced.fetch_add(1, Ordering::Relaxed);
                    let _ = self
                        .inner
                        .store
                        .add_counter(counters::FENCED_WRITES, 1)
                        .await;
                    return Err(Stop::Lost);
                }
                Ok(CommitOutcome::RunNotFound) => {
                    error!(run_id = %self.run_id, "run vanished");
                    return Err(Stop::Lost);
                }
                Err(e) if e.is_transient() && tokio::time::Instant::now() < deadline => {
                    warn!(run_id = %self.run_id, error = %e, "commit failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => {
                    error!(run_id = %self.run_id, error = %e, "commit failed; the lease will lapse");
                    return Err(Stop::Lost);
                }
            }
        }
    }

    pub(super) async fn release_boxed(&mut self) -> Stop {
        Box::pin(self.release()).await
    }

    pub(super) fn after_commit(
        &mut self,
        request: CommitRequest,
        n_events: u64,
        inbox_pending: bool,
    ) {
        if self.state.state != request.state.state {
            info!(run_id = %self.run_id, from = %self.state.state, to = %request.state.state,
                  sequence = request.state.sequence, token = self.token, "transition");
        }
        let finished = request.status == RunStatus::Terminal;
        self.state = request.state;
        if finished {
            self.inner
                .stats
                .runs_finished
                .fetch_add(1, Ordering::Relaxed);
        }
        self.inner.stats.commits.fetch_add(1, Ordering::Relaxed);
        self.inner
            .stats
            .events_committed
            .fetch_add(n_events, Ordering::Relaxed);
        if inbox_pending {
            self.held.inbox_pending.store(true, Ordering::Release);
        }
    }
}
