//! Checkpoints (SPEC E4, C10) and explicit state migrations between definition versions
//! (SPEC V1). A checkpoint is only a shortcut: the log is the truth, and a checkpoint is
//! used only when it is bound to the definition version that will reduce the tail.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::definition::Definition;
use crate::event::Event;
use crate::reducer::{InvalidTransition, replay};
use crate::state::RunState;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub sequence: u64,
    pub definition: String,
    pub version: u32,
    pub state: RunState,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RecoveryError {
    #[error(
        "checkpoint is bound to {found_name}@v{found_version} but the run uses {expected_name}@v{expected_version}; migrate it explicitly"
    )]
    VersionMismatch {
        found_name: String,
        found_version: u32,
        expected_name: String,
        expected_version: u32,
    },
    #[error("checkpoint says sequence {checkpoint} but its state is at {state}")]
    Inconsistent { checkpoint: u64, state: u64 },
    #[error("the tail does not continue the checkpoint: {0}")]
    Tail(InvalidTransition),
    #[error("no migration from {definition}@v{from} to v{to}")]
    NoMigration {
        definition: String,
        from: u32,
        to: u32,
    },
    #[error("migration {definition} v{from} -> v{to} failed: {message}")]
    MigrationFailed {
        definition: String,
        from: u32,
        to: u32,
        message: String,
    },
}

impl Checkpoint {
    pub fn of(state: &RunState) -> Checkpoint {
        Checkpoint {
            sequence: state.sequence,
            definition: state.definition.clone(),
            version: state.version,
            state: state.clone(),
        }
    }

    /// State after the checkpoint plus `tail` (events with sequence > checkpoint.sequence),
    /// reduced with `def`, which must be the version the checkpoint is bound to.
    pub fn recover<'e>(
        &self,
        def: &Definition,
        tail: impl IntoIterator<Item = &'e Event>,
    ) -> Result<RunState, RecoveryError> {
        if self.definition != def.name() || self.version != def.version() {
            return Err(RecoveryError::VersionMismatch {
                found_name: self.definition.clone(),
                found_version: self.version,
                expected_name: def.name().to_owned(),
                expected_version: def.version(),
            });
        }
        if self.state.sequence != self.sequence {
            return Err(RecoveryError::Inconsistent {
                checkpoint: self.sequence,
                state: self.state.sequence,
            });
        }
        replay(def, self.state.clone(), tail).map_err(|(_, e)| RecoveryError::Tail(e))
    }
}

/// A migration of run state from one version of a definition to the next.
pub type MigrationFn = Arc<dyn Fn(RunState) -> Result<RunState, String> + Send + Sync>;

/// Registered migrations, chained v -> v+1 -> ... as needed. Nothing is ever assumed
/// compatible: a missing step is an error.
#[derive(Clone, Default)]
pub struct Migrations {
    steps: HashMap<(String, u32), MigrationFn>,
}

impl Migrations {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the migration of `definition` from `from` to `from + 1`.
    pub fn register(
        &mut self,
        definition: &str,
        from: u32,
        f: impl Fn(RunState) -> Result<RunState, String> + Send + Sync + 'static,
    ) -> &mut Self {
        self.steps
            .insert((definition.to_owned(), from), Arc::new(f));
        self
    }

    pub fn migrate(&self, checkpoint: &Checkpoint, to: u32) -> Result<Checkpoint, RecoveryError> {
        let mut state = checkpoint.state.clone();
        let mut version = checkpoint.version;
        while version < to {
            let step = self
                .steps
                .get(&(checkpoint.definition.clone(), version))
                .ok_or_else(|| RecoveryError::NoMigration {
                    definition: checkpoint.definition.clone(),
                    from: version,
                    to: version + 1,
                })?;
            state = step(state).map_err(|message| RecoveryError::MigrationFailed {
                definition: checkpoint.definition.clone(),
                from: version,
                to: version + 1,
                message,
            })?;
            version += 1;
            state.version = version;
        }
        if version != to {
            return Err(RecoveryError::NoMigration {
                definition: checkpoint.definition.clone(),
                from: version,
                to,
            });
        }
        Ok(Checkpoint {
            sequence: checkpoint.sequence,
            definition: checkpoint.definition.clone(),
            version,
            state,
        })
    }
}
