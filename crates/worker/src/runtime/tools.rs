//! Decisions and tool calls: what a model or a scripted agent decided, validated and
//! committed; approval requests; the approved call the engine runs itself; tool results.

use super::*;

/// ACTION_RESULT_IN_DOUBT of `call_id`, with why the answer was lost as its error (class
/// `in_doubt`, fine class `kind`).
pub(super) fn in_doubt_event(call_id: &str, kind: &str, reason: &str) -> NewEvent {
    let failure = Failure::in_doubt(kind, reason);
    NewEvent::new(
        EngineEvent::ActionResultInDoubt.as_str(),
        json!({ "call_id": call_id, "reason": failure.message, "error": failure.to_json() }),
    )
}

/// The failures among a tool's result candidates, marked not retryable: the tool declares
/// `retryable = false` (SPEC X6), so its run takes the exhausted path, not a retry.
pub(super) fn not_retryable(candidates: Vec<(String, Value)>) -> Vec<(String, Value)> {
    candidates
        .into_iter()
        .map(|(kind, mut payload)| {
            if let Some(Value::Object(error)) = payload.get_mut("error") {
                error.insert("retryable".into(), Value::Bool(false));
            }
            (kind, payload)
        })
        .collect()
}

pub(super) fn with_call_id(
    candidates: Vec<(String, Value)>,
    call_id: &str,
) -> Vec<(String, Value)> {
    candidates
        .into_iter()
        .map(|(kind, mut payload)| {
            if !payload.is_object() {
                payload = json!({ "value": payload });
            }
            if let Value::Object(map) = &mut payload {
                map.insert("call_id".into(), Value::String(call_id.to_owned()));
            }
            (kind, payload)
        })
        .collect()
}

impl Driver {
    /// Commits the strongest candidate the definition accepts (SPEC M6); when none is
    /// accepted, records DECISION_REJECTED and asks for an operator.
    pub(super) async fn commit_decision(
        &mut self,
        candidates: Vec<(String, Value)>,
        node: Option<&str>,
    ) -> Result<(), Stop> {
        match rein_core::decide(&self.def, &self.state, &candidates) {
            Ok((i, _)) => {
                let (kind, payload) = candidates[i].clone();
                self.commit(vec![NewEvent::new(kind, payload).at_node(node)])
                    .await
            }
            Err(rejections) => {
                for r in &rejections {
                    rein_store::metrics::transition_refused(
                        self.def.name(),
                        self.run_id,
                        r,
                        node.unwrap_or("handler"),
                    );
                }
                let reasons: Vec<Value> = rejections
                    .iter()
                    .map(|r| json!({ "event": r.event, "reason": r.reason.to_string(), "code": r.reason.code() }))
                    .collect();
                self.commit(vec![
                    NewEvent::new(
                        EngineEvent::DecisionRejected.as_str(),
                        json!({ "step": "transition", "rejections": reasons }),
                    ),
                    NewEvent::new(
                        EngineEvent::OperatorRequired.as_str(),
                        json!({ "reason": "no candidate event was accepted" }),
                    ),
                ])
                .await
            }
        }
    }

    /// Validates a model's decision (SPEC D1) and commits what it leads to: a rejection
    /// (DECISION_REJECTED, then the state's `on_rejected_decision` or an operator), a proposed
    /// event the reducer still judges, an approval request, or a tool call.
    pub(super) async fn commit_model_decision(
        &mut self,
        decision: Value,
        node: &str,
        step: u32,
        action_id: &str,
    ) -> Result<(), Stop> {
        let mut validated = rein_core::decision::validate(&self.def, &self.state, &decision);
        if matches!(validated, Ok(Valid::Call(_))) && self.state.pending_call().is_some() {
            // The node's own call (an `http` node is dispatched) is still open: one step
            // cannot hold two calls.
            validated = Err(rein_core::decision::Rejection {
                step: rein_core::decision::Step::Tool,
                reason: "this node's own call is still open: a node dispatched as a call cannot also call a tool in the same step; let a side-effect-free model node decide".into(),
            });
        }
        let call = match validated {
            Err(rejection) => return self.commit_rejection(&rejection, &decision, node).await,
            Ok(Valid::Event { kind, payload }) => {
                return self
                    .commit_decision(vec![(kind, payload)], Some(node))
                    .await;
            }
            Ok(Valid::Call(call)) => call,
        };
        let mut approval = None;
        if call.needs_approval {
            match self
                .inner
                .store
                .granted_approval(self.run_id, &call.action_hash)
                .await
            {
                Ok(Some(grant)) => approval = Some(grant.approval_id),
                Ok(None) => return self.ask_for_approval(&call, node).await,
                Err(e) => {
                    warn!(run_id = %self.run_id, error = %e, "cannot read approvals; handing the run back");
                    return Err(self.release().await);
                }
            }
        }
        self.call_tool(call, node, step, action_id, approval).await
    }

    /// The call a person approved at `node` that the engine is to run now, with the grant the
    /// dispatch uses up: the run's newest decision granted an unused request of this node
    /// (`Some(grant)`), or an approved call failed in a way that may be retried and its step
    /// is open again (`None`: the same call under the same key, no new approval). The call
    /// is validated again in the current state and must hash to what was approved; anything
    /// else leaves the step to the node's own action.
    pub(super) async fn approved_call(
        &mut self,
        node: &str,
    ) -> Result<Option<(ToolCall, Option<Uuid>)>, Stop> {
        let store = self.inner.store.clone();
        let found = match &self.state.action {
            Some(slot) if slot.status == ActionStatus::Failed && slot.node == node => {
                match (&slot.tool, &slot.action_hash) {
                    (Some(_), Some(hash)) => store
                        .spent_grant(self.run_id, hash)
                        .await
                        .map(|a| a.map(|a| (a, None))),
                    _ => Ok(None),
                }
            }
            Some(_) => Ok(None),
            None => {
                let last = &self.state.data["last_approval"];
                match last["approval_id"]
                    .as_str()
                    .and_then(|id| id.parse::<Uuid>().ok())
                {
                    Some(id) if last["granted"] == json!(true) => match store.approval(id).await {
                        Ok(a) => Ok(Some((a, Some(id)))),
                        Err(StoreError::Invalid(_)) => Ok(None),
                        Err(e) => Err(e),
                    },
                    _ => Ok(None),
                }
            }
        };
        let (approval, grant) = match found {
            Ok(Some(found)) => found,
            Ok(None) => return Ok(None),
            Err(e) => {
                warn!(run_id = %self.run_id, error = %e, "cannot read approvals; handing the run back");
                return Err(self.release().await);
            }
        };
        let unused = approval.status == "granted" && approval.consumed_at.is_none();
        if approval.run_id != self.run_id || approval.node != node || (grant.is_some() && !unused) {
            return Ok(None);
        }
        let decision = json!({
            "decision": rein_core::decision::CALL_TOOL,
            "tool": approval.tool,
            "args": approval.args,
        });
        match rein_core::decision::validate(&self.def, &self.state, &decision) {
            Ok(Valid::Call(call)) if call.action_hash == approval.action_hash => {
                Ok(Some((call, grant)))
            }
            _ => {
                warn!(run_id = %self.run_id, approval_id = %approval.approval_id,
                    "the approved call no longer validates to what was approved; the node decides again");
                Ok(None)
            }
        }
    }

    /// Records a refused decision (DECISION_REJECTED with its step), then the state's
    /// `on_rejected_decision` or an operator request.
    pub(super) async fn commit_rejection(
        &mut self,
        rejection: &rein_core::decision::Rejection,
        decision: &Value,
        node: &str,
    ) -> Result<(), Stop> {
        warn!(run_id = %self.run_id, step = rejection.step.as_str(), reason = %rejection.reason, "decision rejected");
        let next = self
            .def
            .state(&self.state.state)
            .and_then(|s| s.on_rejected_decision.clone());
        let reason = format!(
            "the model's decision failed at `{}`: {}",
            rejection.step.as_str(),
            rejection.reason
        );
        let follow = match next {
            Some(event) => NewEvent::new(
                event,
                json!({ "reason": reason, "error": { "class": "decision", "step": rejection.step.as_str() } }),
            ),
            None => NewEvent::new(
                EngineEvent::OperatorRequired.as_str(),
                json!({ "reason": reason }),
            ),
        };
        self.commit(vec![
            NewEvent::new(
                EngineEvent::DecisionRejected.as_str(),
                rejection.payload(decision),
            )
            .at_node(Some(node)),
            follow.at_node(Some(node)),
        ])
        .await
    }

    /// A `model` action's reply: MODEL_REPLIED first (prompt by hash, reply, model, usage —
    /// the run's budgets see the usage there, and a budget it exhausts ends the step), then
    /// the decision it carried on the one decision path, or its rejection at step `parse`.
    pub(super) async fn commit_model_reply(
        &mut self,
        reply: crate::handler::ModelReply,
        node: &str,
        step: u32,
        action_id: &str,
    ) -> Result<(), Stop> {
        self.blobs = reply.blobs;
        let said = reply.replied.get("reply").cloned().unwrap_or(Value::Null);
        self.commit(vec![
            NewEvent::new(EngineEvent::ModelReplied.as_str(), reply.replied).at_node(Some(node)),
        ])
        .await?;
        if self.state.state != node || self.state.status(&self.def) != RunStatus::Runnable {
            return Ok(());
        }
        match reply.decision {
            Ok(decision) => {
                self.commit_model_decision(decision, node, step, action_id)
                    .await
            }
            Err(reason) => {
                let rejection = rein_core::decision::Rejection {
                    step: rein_core::decision::Step::Parse,
                    reason,
                };
                self.commit_rejection(&rejection, &said, node).await
            }
        }
    }

    /// Opens (or reuses) a request for exactly this call and takes the run to its approval
    /// wait; any request for a different action of the run becomes void (SPEC H2).
    pub(super) async fn ask_for_approval(
        &mut self,
        call: &ToolCall,
        node: &str,
    ) -> Result<(), Stop> {
        let ask = rein_store::ApprovalAsk {
            run_id: self.run_id,
            node,
            tool: &call.tool,
            args: &call.args,
            action_hash: &call.action_hash,
            risk: if call.side_effect { "high" } else { "normal" },
            expires_after_ms: call.approval_expires_after_ms.unwrap_or(3_600_000),
        };
        let request = match self.inner.store.request_approval(ask).await {
            Ok(r) => r,
            Err(e) => {
                warn!(run_id = %self.run_id, error = %e, "cannot open an approval request; handing the run back");
                return Err(self.release().await);
            }
        };
        info!(run_id = %self.run_id, approval_id = %request.approval_id, tool = %call.tool, "approval requested");
        self.commit(vec![
            NewEvent::new(
                EngineEvent::ApprovalRequested.as_str(),
                json!({
                    "approval_id": request.approval_id,
                    "action_hash": call.action_hash,
                    "tool": call.tool,
                    "args": call.args,
                    "expires_at": request.expires_at,
                }),
            )
            .at_node(Some(node)),
            NewEvent::new(
                call.approval_event.clone(),
                json!({ "tool": call.tool, "args": call.args, "approval_id": request.approval_id }),
            )
            .at_node(Some(node)),
        ])
        .await
    }

    /// Runs a validated tool call: recorded as dispatched first when it has side effects or
    /// uses a grant (the grant is used up by that same commit), then executed outside any
    /// transaction, then its result events committed.
    pub(super) async fn call_tool(
        &mut self,
        call: ToolCall,
        node: &str,
        step: u32,
        action_id: &str,
        approval: Option<Uuid>,
    ) -> Result<(), Stop> {
        let Some(handler) = self.inner.registry.get(&format!("tool:{}", call.tool)) else {
            return self
                .operator_required(&format!(
                    "no handler for tool `{}` on this worker",
                    call.tool
                ))
                .await;
        };
        let permit = self.admit(node, Some(&call.tool)).await?;
        let call_id = Uuid::now_v7().to_string();
        let mut ctx = self.context(node, step, action_id, &call_id);
        ctx.args = call.args.clone();
        let dispatched = call.side_effect || approval.is_some();
        if dispatched {
            self.direct = permit.limited();
            self.commit_with(
                vec![
                    NewEvent::new(
                        EngineEvent::ActionDispatched.as_str(),
                        json!({
                            "action_id": action_id,
                            "call_id": call_id,
                            "node": node,
                            "step": step,
                            "idempotency_key": ctx.idempotency_key,
                            "tool": call.tool,
                            "action_hash": call.action_hash,
                            "approval_id": approval,
                        }),
                    )
                    .at_node(Some(node)),
                ],
                Vec::new(),
                false,
                approval,
                None,
            )
            .await?;
        }
        let timeout = Duration::from_millis(call.timeout_ms.unwrap_or(3_600_000));
        let cancel = ctx.cancel.clone();
        let in_flight = rein_store::metrics::InFlight::start();
        let attempt_span = tracing::info_span!("rein.action", rein.tool = %call.tool,
            rein.step = self.state.steps_completed + 1, rein.attempt = self.state.attempt);
        let ctx = self.resolved(ctx).await;
        let outcome = tokio::select! {
            outcome = handler.run(ctx).instrument(attempt_span.clone()) => outcome,
            _ = self.held.lost.cancelled() => { cancel.cancel(); return Err(Stop::Lost) }
            _ = self.held.interrupt.cancelled() => {
                cancel.cancel();
                return self.interrupted(dispatched, &call_id).await;
            }
            _ = tokio::time::sleep(timeout) => {
                cancel.cancel();
                Outcome::TimedOut(format!("tool `{}` timed out after {} ms", call.tool, timeout.as_millis()))
            }
        };
        crate::trace::record_outcome(&attempt_span, &outcome);
        drop(attempt_span);
        drop(in_flight);
        drop(permit);
        self.inner.stats.steps.fetch_add(1, Ordering::Relaxed);
        match outcome {
            Outcome::Events(candidates) => {
                let candidates = if dispatched {
                    with_call_id(candidates, &call_id)
                } else {
                    candidates
                };
                let candidates = if call.retryable {
                    candidates
                } else {
                    not_retryable(candidates)
                };
                self.commit_decision(candidates, Some(node)).await
            }
            Outcome::InDoubt(reason) => {
                self.answer_lost(dispatched, &call_id, retry_kind::IN_DOUBT, &reason)
                    .await
            }
            Outcome::TimedOut(reason) => {
                self.answer_lost(dispatched, &call_id, retry_kind::TIMEOUT, &reason)
                    .await
            }
            Outcome::Decision(_) | Outcome::Model(_) => {
                self.operator_required(&format!(
                    "tool `{}` answered with a decision; tools answer with events",
                    call.tool
                ))
                .await
            }
        }
    }
}
