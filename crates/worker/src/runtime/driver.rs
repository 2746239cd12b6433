//! Driving one claimed run: its steps, the node action of each, lost answers, the
//! inbox, and admission through the rate limits.

use super::tools::{in_doubt_event, with_call_id};
use super::*;

pub(super) async fn drive(inner: Arc<Inner>, claimed: ClaimedRun) {
    let run_id = claimed.run_id;
    let def = match definition(&inner, &claimed.definition, claimed.version).await {
        Ok(def) => def,
        Err(e) => {
            error!(%run_id, error = %e, "cannot load the run's definition; leaving the lease to lapse");
            return;
        }
    };
    let held = Arc::new(Held {
        token: claimed.token,
        lost: inner.hard_stop.child_token(),
        interrupt: CancellationToken::new(),
        inbox_pending: AtomicBool::new(claimed.inbox_pending),
        releasing: AtomicBool::new(false),
    });
    if let Ok(mut map) = inner.held.lock()
        && let Some(superseded) = map.insert(run_id, held.clone())
    {
        // This worker claimed the run again after losing it: the old action must stop.
        superseded.lost.cancel();
    }
    let mut driver = Driver {
        inner: inner.clone(),
        def,
        run_id,
        token: claimed.token,
        state: claimed.state,
        held,
        direct: false,
        blobs: Vec::new(),
    };
    debug!(%run_id, token = driver.token, queued_ms = claimed.queued_ms, "claimed");
    let _ = driver.run().await;
    if let Ok(mut map) = inner.held.lock()
        && map
            .get(&run_id)
            .is_some_and(|h| Arc::ptr_eq(h, &driver.held))
    {
        map.remove(&run_id);
    }
}

/// The run's definition, compiled once per worker. A lookup that fails leaves the entry
/// empty, so the next run of that version asks the database again.
pub(super) async fn definition(
    inner: &Inner,
    name: &str,
    version: u32,
) -> Result<Definition, StoreError> {
    let cell = inner
        .definitions
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .entry((name.to_owned(), version))
        .or_default()
        .clone();
    cell.get_or_try_init(|| inner.store.load_definition(name, Some(version)))
        .await
        .cloned()
}

impl Driver {
    pub(super) async fn run(&mut self) -> Stop {
        let mut steps = 0u32;
        loop {
            if self.held.lost.is_cancelled() {
                return Stop::Lost;
            }
            if self.held.inbox_pending.swap(false, Ordering::AcqRel)
                && let Err(stop) = self.apply_inbox().await
            {
                return stop;
            }
            let status = self.state.status(&self.def);
            let hand_back = steps >= self.inner.config.steps_per_claim_max
                || self.inner.draining.is_cancelled();
            if status != RunStatus::Runnable || hand_back {
                return self.release().await;
            }
            steps += 1;
            let span = tracing::info_span!(
                "rein.step",
                rein.run.id = %self.run_id,
                rein.definition = %self.def.name(),
                rein.state = %self.state.state,
                rein.sequence = self.state.sequence,
                rein.attempt = self.state.attempt,
                rein.worker.id = %self.inner.config.worker_id,
                rein.fencing_token = self.token,
            );
            crate::trace::parent_to_run(&span, self.run_id);
            let step_result = self.step().instrument(span).await;
            if let Err(stop) = step_result {
                return stop;
            }
        }
    }

    /// One node action: reconcile an in-doubt call, or run the state's action and commit
    /// its outcome.
    pub(super) async fn step(&mut self) -> Result<(), Stop> {
        let Some(spec) = self.def.state(&self.state.state).cloned() else {
            return self
                .operator_required("the run is in a state its definition does not declare")
                .await;
        };
        let Some(action) = spec.action.clone() else {
            return self
                .operator_required("this active state declares no action")
                .await;
        };
        let Some(handler) = self.inner.registry.get(&action) else {
            return self
                .operator_required(&format!(
                    "no handler registered for action `{action}` on this worker"
                ))
                .await;
        };
        let node = self.state.state.clone();

        // A call dispatched by an earlier holder and never answered is in doubt (SPEC X7).
        if let Some(slot) = self.state.action.clone()
            && matches!(
                slot.status,
                ActionStatus::Dispatched | ActionStatus::InDoubt
            )
        {
            let call_id = slot.call_id.clone().unwrap_or_default();
            if slot.status == ActionStatus::Dispatched {
                self.commit(vec![in_doubt_event(
                    &call_id,
                    retry_kind::IN_DOUBT,
                    "found dispatched without a result after takeover",
                )])
                .await?;
            }
            let ctx = self.context(&slot.node, slot.step, &slot.action_id, &call_id);
            // A tool call dispatched on a model's decision is reconciled by that tool.
            let handler = match slot.tool.as_deref() {
                Some(tool) => match self.inner.registry.get(&format!("tool:{tool}")) {
                    Some(h) => h,
                    None => {
                        return self
                            .operator_required(&format!(
                                "in-doubt call of tool `{tool}`, which has no handler on this worker"
                            ))
                            .await;
                    }
                },
                None => handler,
            };
            let Some(hook) = handler.reconcile(ctx) else {
                return self
                    .operator_required("in-doubt action and its tool has no reconcile hook")
                    .await;
            };
            return match hook.await {
                Ok(Reconciled::Applied(candidates)) => {
                    let candidates = with_call_id(candidates, &call_id);
                    self.commit_decision(candidates, Some(&node)).await
                }
                Ok(Reconciled::NotApplied) => self.not_applied(&slot, &call_id).await,
                Err(e) => {
                    // Pause before handing the run back, so an endpoint that keeps failing
                    // is not asked again at once by whoever claims it next.
                    warn!(run_id = %self.run_id, error = %e, "reconcile failed; handing the run back after a pause");
                    tokio::select! {
                        _ = self.held.lost.cancelled() => return Err(Stop::Lost),
                        _ = tokio::time::sleep(RECONCILE_PAUSE) => {}
                    }
                    Err(self.release().await)
                }
            };
        }

        // The open step's identity is reused by its retries (same idempotency key).
        let (step, action_id) = match &self.state.action {
            Some(slot) if slot.status == ActionStatus::Failed && slot.node == node => {
                (slot.step, slot.action_id.clone())
            }
            _ => {
                let step = self.state.steps_completed + 1;
                (step, format!("step-{step}"))
            }
        };
        // A call a person approved runs as approved: the engine dispatches exactly that call
        // itself (SPEC H2); the model is never asked to make it again.
        if let Some((call, grant)) = self.approved_call(&node).await? {
            info!(run_id = %self.run_id, tool = %call.tool, approval_id = ?grant, "running the approved call");
            return self.call_tool(call, &node, step, &action_id, grant).await;
        }
        let permit = self.admit(&node, None).await?;
        let call_id = Uuid::now_v7().to_string();
        let ctx = self.context(&node, step, &action_id, &call_id);
        let side_effect = handler.side_effect(&ctx);
        if side_effect {
            self.direct = permit.limited();
            self.commit(vec![
                NewEvent::new(
                    EngineEvent::ActionDispatched.as_str(),
                    json!({
                        "action_id": action_id,
                        "call_id": call_id,
                        "node": node,
                        "step": step,
                        "idempotency_key": ctx.idempotency_key,
                    }),
                )
                .at_node(Some(&node)),
            ])
            .await?;
        }
        let timeout = spec
            .timeout
            .as_ref()
            .map(|t| Duration::from_millis(t.after_ms))
            .unwrap_or(Duration::from_secs(3600));
        let cancel = ctx.cancel.clone();
        let in_flight = rein_store::metrics::InFlight::start();
        let attempt_span = tracing::info_span!("rein.action", rein.node = %node,
            rein.action = %action, rein.step = self.state.steps_completed + 1,
            rein.attempt = self.state.attempt);
        let ctx = self.resolved(ctx).await;
        let outcome = tokio::select! {
            outcome = handler.run(ctx).instrument(attempt_span.clone()) => Some(outcome),
            _ = self.held.lost.cancelled() => { cancel.cancel(); return Err(Stop::Lost) }
            _ = self.held.interrupt.cancelled() => { cancel.cancel(); None }
            _ = tokio::time::sleep(timeout) => {
                cancel.cancel();
                if side_effect {
                    Some(Outcome::TimedOut(format!(
                        "execution timeout after {} ms, after the call was sent",
                        timeout.as_millis()
                    )))
                } else {
                    let event = spec.timeout.as_ref().map(|t| t.event.clone()).unwrap_or_default();
                    let failure = Failure::transient(
                        retry_kind::TIMEOUT,
                        &format!("execution timeout after {} ms", timeout.as_millis()),
                    );
                    Some(Outcome::event(&event, json!({ "reason": "timeout", "error": failure.to_json() })))
                }
            }
        };
        if let Some(outcome) = &outcome {
            crate::trace::record_outcome(&attempt_span, outcome);
        }
        drop(attempt_span);
        drop(in_flight);
        if let Some(Outcome::Model(reply)) = &outcome
            && let Some(used) = reply.replied["usage"]["tokens"].as_u64()
        {
            self.inner.limiter.settle_tokens(&permit, used).await;
        }
        drop(permit);
        self.inner.stats.steps.fetch_add(1, Ordering::Relaxed);
        let Some(outcome) = outcome else {
            return self.interrupted(side_effect, &call_id).await;
        };
        match outcome {
            Outcome::Events(candidates) => {
                let candidates = if side_effect {
                    with_call_id(candidates, &call_id)
                } else {
                    candidates
                };
                self.commit_decision(candidates, Some(&node)).await
            }
            Outcome::Decision(decision) => {
                self.commit_model_decision(decision, &node, step, &action_id)
                    .await
            }
            Outcome::Model(reply) => {
                self.commit_model_reply(reply, &node, step, &action_id)
                    .await
            }
            Outcome::InDoubt(reason) => {
                self.answer_lost(side_effect, &call_id, retry_kind::IN_DOUBT, &reason)
                    .await
            }
            Outcome::TimedOut(reason) => {
                self.answer_lost(side_effect, &call_id, retry_kind::TIMEOUT, &reason)
                    .await
            }
        }
    }

    /// No answer came back (`kind` says why): a dispatched call is in doubt; anything else
    /// was never recorded as sent, so only an operator can tell what happened.
    pub(super) async fn answer_lost(
        &mut self,
        dispatched: bool,
        call_id: &str,
        kind: &str,
        reason: &str,
    ) -> Result<(), Stop> {
        if !dispatched {
            return self.operator_required(reason).await;
        }
        self.commit(vec![in_doubt_event(call_id, kind, reason)])
            .await
    }

    /// An in-doubt call its reconcile hook found not applied: recorded, and followed in the
    /// same commit by the state's failure event, so dispatching it again is a retry on the
    /// definition's retry path (attempt counted, backoff and Retry-After waited, the
    /// exhausted path at the end) rather than an immediate re-dispatch.
    pub(super) async fn not_applied(
        &mut self,
        slot: &rein_core::ActionSlot,
        call_id: &str,
    ) -> Result<(), Stop> {
        let record = NewEvent::new(
            EngineEvent::ActionNotApplied.as_str(),
            json!({ "call_id": call_id, "by": "reconcile" }),
        );
        // The fine class of why the answer was lost (e.g. `timeout`), as the in-doubt record
        // kept it.
        let lost = slot.lost.as_deref().unwrap_or(retry_kind::IN_DOUBT);
        let failure = Failure::transient(
            lost,
            "the call's answer was lost and its reconcile found it not applied",
        );
        let mut events = vec![record];
        if let Some((kind, mut payload)) = rein_core::retry::lost_attempt_event(
            &self.def,
            &self.state,
            (&events[0].kind, &events[0].payload),
            LostAttempt::NotApplied,
            &failure,
        ) {
            let tool = slot.tool.as_deref();
            if tool
                .and_then(|t| self.def.tool(&slot.node, t))
                .is_some_and(|t| !t.retryable)
            {
                payload["error"]["retryable"] = json!(false);
            }
            events.push(NewEvent::new(kind, payload).at_node(Some(&slot.node)));
        }
        self.commit(events).await
    }

    /// `ctx` with the blob references among the run's results replaced by the values they
    /// name (SPEC E5), newest first, while the content read stays within
    /// [`RESOLVED_BYTES_MAX`]: a handler gets what the tools returned, not where it is
    /// stored. Only a reference the run (or a run it was forked from) recorded when it
    /// stored the blob is read. A reference past the bound, one the run did not record, or
    /// one whose content cannot be read or does not match its hash, stays as it is (and the
    /// latter two are logged).
    pub(super) async fn resolved(&self, mut ctx: ActionContext) -> ActionContext {
        let mut left = RESOLVED_BYTES_MAX;
        for result in ctx.run.results.iter_mut().rev() {
            let Some(value) = result.get_mut("value") else {
                continue;
            };
            let Some(blob) = rein_core::blob::reference_of(value) else {
                continue;
            };
            if blob.bytes > left {
                continue;
            }
            match self.inner.store.read_blob_of(self.run_id, &blob).await {
                Ok(Some(read)) => {
                    *value = read;
                    left -= blob.bytes;
                }
                Ok(None) => {
                    warn!(run_id = %self.run_id, sha256 = %blob.sha256,
                        "a result refers to a blob this run did not store; the handler gets its reference");
                }
                Err(e) => {
                    warn!(run_id = %self.run_id, sha256 = %blob.sha256, error = %e,
                        "a result's blob cannot be read; the handler gets its reference");
                }
            }
        }
        ctx
    }

    pub(super) fn context(
        &self,
        node: &str,
        step: u32,
        action_id: &str,
        call_id: &str,
    ) -> ActionContext {
        ActionContext {
            run_id: self.run_id,
            definition: self.def.clone(),
            node: node.to_owned(),
            run: self.state.clone(),
            step,
            action_id: action_id.to_owned(),
            idempotency_key: rein_core::hash::idempotency_key(
                &self.run_id.to_string(),
                node,
                action_id,
            ),
            call_id: call_id.to_owned(),
            args: json!({}),
            fencing_token: self.token,
            worker_id: self.inner.config.worker_id.clone(),
            cancel: self.held.lost.child_token(),
            deltas: self.inner.deltas.clone(),
        }
    }

    /// An action stopped by a CANCEL waiting in the inbox: the inbox applies it; a call that
    /// was dispatched is recorded as in doubt, since it may have been applied.
    pub(super) async fn interrupted(
        &mut self,
        dispatched: bool,
        call_id: &str,
    ) -> Result<(), Stop> {
        self.held.inbox_pending.store(true, Ordering::Release);
        if dispatched {
            self.commit(vec![in_doubt_event(
                call_id,
                retry_kind::IN_DOUBT,
                "cancelled while running",
            )])
            .await?;
        }
        Ok(())
    }

    pub(super) async fn operator_required(&mut self, reason: &str) -> Result<(), Stop> {
        error!(run_id = %self.run_id, state = %self.state.state, reason, "run needs an operator");
        self.commit(vec![NewEvent::new(
            EngineEvent::OperatorRequired.as_str(),
            json!({ "reason": rein_core::text::storable(reason) }),
        )])
        .await
    }

    /// Applies inbox entries the current state accepts; records expired ones.
    pub(super) async fn apply_inbox(&mut self) -> Result<(), Stop> {
        let entries = match self.inner.store.inbox(self.run_id).await {
            Ok(e) => e,
            Err(e) => {
                warn!(run_id = %self.run_id, error = %e, "cannot read the inbox; will try at the next commit point");
                self.held.inbox_pending.store(true, Ordering::Release);
                return Ok(());
            }
        };
        let (events, consumed) = rein_store::plan_inbox(&self.def, &self.state, entries);
        if events.is_empty() {
            return Ok(());
        }
        self.commit_with(events, consumed, false, None, None).await
    }

    /// What a call of the model node at `node` books against `tpm` limits before it starts:
    /// its `max_tokens` (the reply's ceiling), else [`MODEL_TOKENS_BOOKED_DEFAULT`]; 0 for
    /// any other action.
    pub(super) fn model_tokens_booked(&self, node: &str) -> u64 {
        match self.def.state(node).and_then(|s| s.model.as_ref()) {
            Some(model) => model
                .max_tokens
                .map_or(MODEL_TOKENS_BOOKED_DEFAULT, u64::from),
            None => 0,
        }
    }

    /// Waits for the fleet-wide limits of the action at `node` (SPEC K1) — the call of `tool`
    /// when given, else the state's own action — at most the configured time. When they will
    /// not allow it by then, records ACTION_DEFERRED and hands the run back until they will:
    /// not a failure, no retry counted, no worker slot held meanwhile.
    pub(super) async fn admit(
        &mut self,
        node: &str,
        tool: Option<&str>,
    ) -> Result<rein_accel::limits::Permit, Stop> {
        if !self.inner.limiter.any(self.def.limits()) {
            return Ok(rein_accel::limits::Permit::default());
        }
        let keys = match tool {
            Some(tool) => vec![format!("tool:{tool}")],
            None => self.def.limit_keys(node, None),
        };
        let holder = format!("{}/{}", self.inner.config.worker_id, self.run_id);
        // A model call books its reply's ceiling against `tpm` limits; the reply's usage
        // corrects it (see `settle_tokens`).
        let tokens = match tool {
            None => self.model_tokens_booked(node),
            Some(_) => 0,
        };
        let admission = self
            .inner
            .limiter
            .admit(&keys, self.def.limits(), &holder, tokens, &self.held.lost)
            .await;
        if self.held.lost.is_cancelled() {
            return Err(Stop::Lost);
        }
        let (key, limit, wait_ms) = match admission {
            rein_accel::limits::Admission::Go(permit) => return Ok(permit),
            rein_accel::limits::Admission::Defer {
                key,
                limit,
                wait_ms,
            } => (key, limit, wait_ms),
        };
        debug!(run_id = %self.run_id, key, limit, wait_ms, "action deferred by a fleet-wide limit");
        let deferred = NewEvent::new(
            EngineEvent::ActionDeferred.as_str(),
            json!({ "key": key, "limit": limit, "wait_ms": wait_ms, "node": node }),
        )
        .at_node(Some(node));
        let outcome = self
            .commit_with(vec![deferred], Vec::new(), true, None, Some(wait_ms))
            .await;
        // This worker looks again when the run is due, without waiting for its poll.
        let wakeups = self.inner.wakeups.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(wait_ms)).await;
            wakeups.notify_one();
        });
        match outcome {
            Ok(()) => Err(Stop::Released),
            Err(stop) => Err(stop),
        }
    }
}
