//! Approval requests bound to the exact action (SPEC H1–H4): requested by the worker when a
//! tool call needs a human, decided by a person (CLI now, API later), used up by the commit
//! that dispatches the call (see `approval` in [`crate::CommitRequest`]).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::{Store, StoreError};

#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Approval {
    pub approval_id: Uuid,
    pub run_id: Uuid,
    pub node: String,
    pub tool: String,
    pub args: Value,
    pub action_hash: String,
    pub risk: String,
    pub status: String,
    pub requested_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub decided_by: Option<String>,
    pub decided_at: Option<DateTime<Utc>>,
    pub comment: Option<String>,
    pub consumed_at: Option<DateTime<Utc>>,
    /// Whether the request can still be decided (pending and not expired, by the database
    /// clock).
    pub open: bool,
}

/// What to ask a person to approve.
#[derive(Debug, Clone)]
pub struct ApprovalAsk<'a> {
    pub run_id: Uuid,
    pub node: &'a str,
    pub tool: &'a str,
    pub args: &'a Value,
    pub action_hash: &'a str,
    pub risk: &'a str,
    pub expires_after_ms: u64,
}

const COLUMNS: &str = "approval_id, run_id, node, tool, args, action_hash, risk, status,
    requested_at, expires_at, decided_by, decided_at, comment, consumed_at,
    (status = 'pending' AND expires_at > clock_timestamp()) AS open";

/// The longest comment kept with a decision.
pub const COMMENT_BYTES_MAX: usize = 4096;

impl Store {
    /// Opens a request for this exact action, or returns the open one already asking for it.
    /// Any other open request or unused grant of the run is void: the action changed, so
    /// what was approved no longer applies (SPEC H2).
    pub async fn request_approval(&self, ask: ApprovalAsk<'_>) -> Result<Approval, StoreError> {
        let mut tx = self.pool().begin().await?;
        sqlx::query(
            "UPDATE rein_approvals SET status = 'void',
                 comment = COALESCE(comment || ' ', '') || '(void: the action changed)'
             WHERE run_id = $1 AND action_hash <> $2 AND consumed_at IS NULL
               AND status IN ('pending', 'granted')",
        )
        .bind(ask.run_id)
        .bind(ask.action_hash)
        .execute(&mut *tx)
        .await?;
        let existing: Option<Approval> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM rein_approvals
             WHERE run_id = $1 AND action_hash = $2 AND status = 'pending'
               AND expires_at > clock_timestamp()
             ORDER BY requested_at DESC LIMIT 1"
        )))
        .bind(ask.run_id)
        .bind(ask.action_hash)
        .fetch_optional(&mut *tx)
        .await?;
        let approval = match existing {
            Some(a) => a,
            None => {
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO rein_approvals
                         (approval_id, run_id, node, tool, args, action_hash, risk, expires_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7,
                             clock_timestamp() + $8 * interval '1 millisecond')
                     RETURNING {COLUMNS}"
                )))
                .bind(Uuid::now_v7())
                .bind(ask.run_id)
                .bind(ask.node)
                .bind(ask.tool)
                .bind(ask.args)
                .bind(ask.action_hash)
                .bind(ask.risk)
                .bind(ask.expires_after_ms as i64)
                .fetch_one(&mut *tx)
                .await?
            }
        };
        tx.commit().await?;
        Ok(approval)
    }

    /// The unused grant of this run for exactly this action, if a person granted one.
    pub async fn granted_approval(
        &self,
        run_id: Uuid,
        action_hash: &str,
    ) -> Result<Option<Approval>, StoreError> {
        self.grant_of(run_id, action_hash, false).await
    }

    /// The grant of `run_id`'s call `action_hash` that a dispatch already used: an approved
    /// call retried after a failure runs under it again, with no new approval.
    pub async fn spent_grant(
        &self,
        run_id: Uuid,
        action_hash: &str,
    ) -> Result<Option<Approval>, StoreError> {
        self.grant_of(run_id, action_hash, true).await
    }

    /// The newest grant of the call, used (`spent`) or not.
    async fn grant_of(
        &self,
        run_id: Uuid,
        action_hash: &str,
        spent: bool,
    ) -> Result<Option<Approval>, StoreError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM rein_approvals
             WHERE run_id = $1 AND action_hash = $2 AND status = 'granted'
               AND (consumed_at IS NOT NULL) = $3
             ORDER BY coalesce(consumed_at, decided_at) DESC LIMIT 1"
        )))
        .bind(run_id)
        .bind(action_hash)
        .bind(spent)
        .fetch_optional(self.pool())
        .await?)
    }

    pub async fn approval(&self, approval_id: Uuid) -> Result<Approval, StoreError> {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM rein_approvals WHERE approval_id = $1"
        )))
        .bind(approval_id)
        .fetch_optional(self.pool())
        .await?
        .ok_or_else(|| StoreError::Invalid(format!("no approval request {approval_id}")))
    }

    /// Requests, newest first: the open ones (pending, not expired) unless `all`.
    pub async fn approvals(
        &self,
        all: bool,
        run_id: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<Approval>, StoreError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM rein_approvals
             WHERE ($1 OR (status = 'pending' AND expires_at > clock_timestamp()))
               AND ($2::uuid IS NULL OR run_id = $2)
             ORDER BY requested_at DESC LIMIT $3"
        )))
        .bind(all)
        .bind(run_id)
        .bind(limit.clamp(1, 1000))
        .fetch_all(self.pool())
        .await?)
    }

    /// Records a person's decision and delivers it to the run as the waiting state's
    /// granted or denied event. A request that is unknown, already decided, void or expired
    /// is refused with the reason, and nothing changes.
    pub async fn decide_approval(
        &self,
        approval_id: Uuid,
        grant: bool,
        approver: &str,
        comment: Option<&str>,
    ) -> Result<Approval, StoreError> {
        if approver.trim().is_empty() || approver.len() > 256 {
            return Err(StoreError::Invalid(
                "the approver's name must be 1..=256 bytes".into(),
            ));
        }
        if comment.is_some_and(|c| c.len() > COMMENT_BYTES_MAX) {
            return Err(StoreError::Invalid(format!(
                "the comment is longer than {COMMENT_BYTES_MAX} bytes"
            )));
        }
        crate::input::check_text("approver", approver)?;
        if let Some(comment) = comment {
            crate::input::check_text("comment", comment)?;
        }
        if grant {
            self.check_grant_by(approval_id, approver).await?;
        }
        let decided: Option<Approval> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "UPDATE rein_approvals SET status = $2, decided_by = $3, decided_at = clock_timestamp(),
                 comment = $4
             WHERE approval_id = $1 AND status = 'pending' AND expires_at > clock_timestamp()
             RETURNING {COLUMNS}"
        )))
        .bind(approval_id)
        .bind(if grant { "granted" } else { "denied" })
        .bind(approver)
        .bind(comment)
        .fetch_optional(self.pool())
        .await?;
        let Some(decided) = decided else {
            let a = self.approval(approval_id).await?;
            let why = match a.status.as_str() {
                "pending" => format!(
                    "it expired at {} (the run has taken its expiry path); ask for a new request",
                    a.expires_at
                ),
                "void" => {
                    "it is void: the action it named changed, and a new request was made".to_owned()
                }
                status => format!(
                    "it was already {status} by {} at {}",
                    a.decided_by.as_deref().unwrap_or("?"),
                    a.decided_at.map(|t| t.to_string()).unwrap_or_default()
                ),
            };
            return Err(StoreError::Invalid(format!(
                "approval {approval_id} cannot be decided: {why}"
            )));
        };
        let row = self.run(decided.run_id).await?;
        let def = self
            .load_definition(&row.definition, Some(row.version as u32))
            .await?;
        // The run waits in a state with an approval policy, or is about to: the request is
        // written just before the commit that takes the run there, so a quick decision may
        // arrive first and waits in the inbox for that state.
        let policy = def
            .state(&row.state)
            .and_then(|s| s.approval.clone())
            .or_else(|| {
                def.transitions()
                    .into_iter()
                    .filter(|t| t.from == decided.node)
                    .find_map(|t| def.state(&t.to).and_then(|s| s.approval.clone()))
            })
            .ok_or_else(|| {
                StoreError::Invalid(format!(
                    "run {} is in `{}`, which waits for no approval",
                    decided.run_id, row.state
                ))
            });
        let policy = match policy {
            Ok(p) => p,
            Err(e) => {
                self.undo_decision(approval_id).await?;
                return Err(e);
            }
        };
        let event = if grant {
            policy.granted_event()
        } else {
            policy.denied_event()
        };
        let payload = json!({
            "approval_id": approval_id,
            "action_hash": decided.action_hash,
            "approver": approver,
            "comment": comment,
            "reason": if grant { "approved" } else { "denied by the approver" },
            "data": { "last_approval": {
                "approval_id": approval_id, "action_hash": decided.action_hash,
                "granted": grant, "approver": approver } },
        });
        if let Err(e) = self
            .send(
                decided.run_id,
                event,
                payload,
                &crate::Sender::Approver(approver.to_owned()),
                60_000,
            )
            .await
        {
            self.undo_decision(approval_id).await?;
            return Err(e);
        }
        Ok(decided)
    }

    /// Refuses `approver`'s grant of request `approval_id` when they enqueued its run and
    /// the duties are separated there; an unknown request is left to the decision to report.
    async fn check_grant_by(&self, approval_id: Uuid, approver: &str) -> Result<(), StoreError> {
        let run: Option<(Uuid, Option<String>, String, i32)> = sqlx::query_as(
            "SELECT r.run_id, r.enqueued_by, r.definition, r.version
             FROM rein_approvals a JOIN rein_runs r ON r.run_id = a.run_id
             WHERE a.approval_id = $1",
        )
        .bind(approval_id)
        .fetch_optional(self.pool())
        .await?;
        let Some((run_id, Some(enqueued_by), definition, version)) = run else {
            return Ok(());
        };
        let def = self
            .load_definition(&definition, Some(version as u32))
            .await?;
        self.check_separation(&def, run_id, Some(&enqueued_by), approver)
    }

    /// Refuses a grant by `approver` of run `run_id`, enqueued by `enqueued_by`, when they
    /// are the same person and the definition's policy or this store's deployment rule
    /// separates approving from enqueuing (SPEC H1). Runs that recorded no enqueuer (created
    /// before Rein recorded it) are not refused.
    pub(crate) fn check_separation(
        &self,
        def: &rein_core::Definition,
        run_id: Uuid,
        enqueued_by: Option<&str>,
        approver: &str,
    ) -> Result<(), StoreError> {
        let rule = if def.approver_may_not_be_enqueuer() {
            format!("the policy of definition {} v{}", def.name(), def.version())
        } else if self.approver_separation {
            "this deployment's rule".to_owned()
        } else {
            return Ok(());
        };
        if enqueued_by != Some(approver) {
            return Ok(());
        }
        Err(StoreError::ApproverIsEnqueuer {
            run_id,
            approver: approver.to_owned(),
            rule,
        })
    }

    /// Puts a decision back to pending when it could not be delivered.
    async fn undo_decision(&self, approval_id: Uuid) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE rein_approvals SET status = 'pending', decided_by = NULL, decided_at = NULL,
                 comment = NULL
             WHERE approval_id = $1 AND consumed_at IS NULL",
        )
        .bind(approval_id)
        .execute(self.pool())
        .await?;
        Ok(())
    }
}
