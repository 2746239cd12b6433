//! Who sends an event to a run, and what each may send (SPEC Z3). The reducer cannot see
//! who writes and must replay old logs as they are, so the rule is enforced here, where
//! every event from outside enters.

use rein_core::{Definition, EngineEvent, RunState};
use serde_json::Value;

use crate::StoreError;

/// Longest sender name recorded with an event.
pub const SENDER_BYTES_MAX: usize = 256;
/// How an API token's requests name their sender: this prefix, then the token's subject.
pub const API_SENDER_PREFIX: &str = "api:";

/// The writer of an event that did not come from the worker holding the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sender {
    /// A caller outside the engine: an API token (`api:SUBJECT`), `rein send --as`,
    /// `rein cancel`. It sends CANCEL and the definition's external events; an approval
    /// event among them only when it may decide approvals (the approve scope): then
    /// `approver` is the identity recorded as the event's approver (the token's subject).
    Outside {
        name: String,
        approver: Option<String>,
    },
    /// A person who decided an approval: the approval request's decision (`rein approve`,
    /// `rein deny`, the approvals API) or a simulated approver. It sends the definition's
    /// approval events, and what an outside caller may.
    Approver(String),
    /// An operator settling a run's in-doubt call (`rein resolve`): the call's result or
    /// ACTION_NOT_APPLIED, naming the pending call; and what an outside caller may.
    Operator(String),
    /// The engine itself (a scheduler delivering a run's budget event): anything the run
    /// takes.
    Engine(String),
}

impl Sender {
    /// An outside caller that may not decide approvals.
    pub fn outside(name: impl Into<String>) -> Sender {
        Sender::Outside {
            name: name.into(),
            approver: None,
        }
    }

    /// An outside caller that may decide approvals as `approver`.
    pub fn outside_approver(name: impl Into<String>, approver: impl Into<String>) -> Sender {
        Sender::Outside {
            name: name.into(),
            approver: Some(approver.into()),
        }
    }

    /// The identity this sender decides approvals as, if it may.
    fn approver(&self) -> Option<&str> {
        match self {
            Sender::Outside { approver, .. } => approver.as_deref(),
            Sender::Approver(name) => Some(name),
            Sender::Operator(_) | Sender::Engine(_) => None,
        }
    }

    /// `payload` as it is recorded: an approval event's `approver` (and that of the
    /// `data.last_approval` it merges into the run) is the sender's own identity, whatever
    /// the caller wrote there (SPEC Z1, H1). Other events are recorded as sent.
    pub(crate) fn recorded_payload(&self, def: &Definition, kind: &str, payload: Value) -> Value {
        let Some(approver) = self.approver().filter(|_| def.is_approval_event(kind)) else {
            return payload;
        };
        let mut payload = match payload {
            Value::Null => Value::Object(Default::default()),
            other => other,
        };
        if let Value::Object(fields) = &mut payload {
            fields.insert("approver".into(), approver.into());
            if let Some(Value::Object(last)) = fields
                .get_mut("data")
                .and_then(|data| data.get_mut("last_approval"))
            {
                last.insert("approver".into(), approver.into());
            }
        }
        payload
    }

    pub fn name(&self) -> &str {
        match self {
            Sender::Outside { name, .. }
            | Sender::Approver(name)
            | Sender::Operator(name)
            | Sender::Engine(name) => name,
        }
    }

    /// The person behind an outside caller or an approver, as runs record who enqueued
    /// them: an API token's subject, the CLI's `--as` name. None for operators and the
    /// engine.
    pub fn person(&self) -> Option<&str> {
        match self {
            Sender::Outside { name, .. } => {
                Some(name.strip_prefix(API_SENDER_PREFIX).unwrap_or(name))
            }
            Sender::Approver(name) => Some(name),
            Sender::Operator(_) | Sender::Engine(_) => None,
        }
    }

    /// Who the event records as its sender: nobody for the engine's own events (the writer
    /// column says which process wrote them).
    pub fn recorded(&self) -> Option<&str> {
        match self {
            Sender::Engine(_) => None,
            other => Some(other.name()),
        }
    }

    fn describe(&self) -> String {
        match self {
            Sender::Outside { name, .. } => format!("an outside caller ({name})"),
            Sender::Approver(name) => format!("an approver ({name})"),
            Sender::Operator(name) => format!("an operator ({name})"),
            Sender::Engine(name) => format!("the engine ({name})"),
        }
    }

    pub(crate) fn check_name(&self) -> Result<(), StoreError> {
        let name = self.name();
        crate::input::check_text("sender", name)?;
        crate::input::check_printable("sender", name)?;
        if name.trim().is_empty() || name.len() > SENDER_BYTES_MAX {
            return Err(StoreError::InvalidField {
                field: "sender".into(),
                reason: format!("the sender's name must be 1..={SENDER_BYTES_MAX} bytes"),
            });
        }
        Ok(())
    }

    /// Whether this sender may send `kind` with `payload` to a run of `def` in `state`.
    pub(crate) fn may_send(
        &self,
        def: &Definition,
        state: &RunState,
        kind: &str,
        payload: &Value,
    ) -> Result<(), StoreError> {
        let refuse = |reason: String| StoreError::NotAllowed {
            event: kind.to_owned(),
            sender: self.describe(),
            reason,
        };
        let may_approve = match self {
            Sender::Engine(_) => return Ok(()),
            Sender::Operator(_)
                if def.is_call_result(kind) || kind == EngineEvent::ActionNotApplied.as_str() =>
            {
                return match (
                    state.pending_call(),
                    payload.get("call_id").and_then(Value::as_str),
                ) {
                    (None, _) => Err(refuse(
                        "no call of the run is pending: there is nothing to resolve".into(),
                    )),
                    (Some(pending), None) => Err(refuse(format!(
                        "an operator's result must name the pending call {pending} in `call_id`"
                    ))),
                    // The reducer refuses a call id that is not the pending one.
                    (Some(_), Some(_)) => Ok(()),
                };
            }
            Sender::Approver(_) if def.is_approval_event(kind) => return Ok(()),
            Sender::Outside { approver, .. } => approver.is_some(),
            Sender::Approver(_) => true,
            Sender::Operator(_) => false,
        };
        if kind == EngineEvent::Cancel.as_str() {
            return Ok(());
        }
        if EngineEvent::is_reserved(kind) {
            return Err(refuse(
                "it is an engine event: only the engine writes it".into(),
            ));
        }
        if def.is_call_result(kind) {
            return Err(refuse(
                "it is a call result: only the worker that dispatched the call writes it, with \
                 its call id (an operator settles an in-doubt call with `rein resolve`)"
                    .into(),
            ));
        }
        if !def.accepts_from_outside(kind) {
            let listed: Vec<&str> = def.external_events().map(String::as_str).collect();
            return Err(refuse(format!(
                "definition {} v{} takes only CANCEL{} from outside callers (its external_events)",
                def.name(),
                def.version(),
                if listed.is_empty() {
                    String::new()
                } else {
                    format!(" and {}", listed.join(", "))
                }
            )));
        }
        if def.is_approval_event(kind) && !may_approve {
            return Err(StoreError::NeedsApprover {
                event: kind.to_owned(),
            });
        }
        Ok(())
    }
}
