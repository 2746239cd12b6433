//! Whether a run is between steps (SPEC V1, E6): only then may it move to another version
//! or be forked, since a call in flight, an open fan-out or an in-doubt call belong to the
//! state they started in.

use crate::state::RunState;

/// Why a run cannot move now (SPEC V1); [`Unmovable::later`] tells whether it may once it
/// has moved on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unmovable {
    #[error("the run has finished")]
    Terminal,
    #[error("call {0} is in flight; its result must land first")]
    OpenCall(String),
    #[error("the run waits for the branches of a fan-out")]
    OpenFanOut,
    #[error("the run needs an operator (an in-doubt call); resolve it first")]
    NeedsOperator,
    #[error("the run is already on v{0}")]
    AlreadyThere(u32),
    #[error("{0}")]
    Refused(String),
}

impl Unmovable {
    /// A run in this condition may be movable once it has moved on (a result landed).
    pub fn later(&self) -> bool {
        matches!(
            self,
            Unmovable::OpenCall(_) | Unmovable::OpenFanOut | Unmovable::NeedsOperator
        )
    }
}

/// Why `run` cannot be moved or forked as it is: it must be between steps.
pub fn between_steps(run: &RunState) -> Result<(), Unmovable> {
    if run.terminal_reason.is_some() {
        return Err(Unmovable::Terminal);
    }
    if let Some(call) = run.pending_call() {
        return Err(Unmovable::OpenCall(call.to_owned()));
    }
    if run.join.is_some() {
        return Err(Unmovable::OpenFanOut);
    }
    if run.needs_operator {
        return Err(Unmovable::NeedsOperator);
    }
    Ok(())
}
