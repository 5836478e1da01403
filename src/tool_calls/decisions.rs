//! What a decision on an approval does: its status recorded, and a call that may no longer run
//! rejected. People decide (`resolve_approval`); the deadline decides when no one did (the sweep,
//! or the next claim of the call, expires the approval).

use super::event;
use crate::audit;
use crate::db;
use crate::error::Result;
use crate::notifier;
use crate::outbox;
use crate::rows::{self, LockedRun};
use crate::scope::Scope;
use crate::steps::{self, StepChange};
use ledger_model::events::{AuditKind, Event, ToolCallApproval};
use ledger_model::status::Status;
use ledger_model::tool_calls::{ApprovalStatus, CallStatus};
use serde_json::json;

/// Expires the approval of `run` (held by this transaction) if it is pending past its deadline:
/// the approval becomes `expired`, its call `rejected` and the call's step `expired`, and
/// `approval.expired` goes to the run's feed and the outbox. Returns whether it expired.
pub(super) fn expire(scope: &Scope, run: &LockedRun, approval_id: &str) -> Result<bool> {
    let Some(approval) = rows::lock_due_approval(scope, run, approval_id)? else {
        return Ok(false);
    };
    decide(scope, approval_id, ApprovalStatus::Expired, None, None)?;
    audit::write(
        scope,
        Some(&approval.run_id),
        None,
        AuditKind::ApprovalDecision,
        ApprovalStatus::Expired.as_str(),
        None,
        json!({"approval_id": approval_id, "tool_call_record_id": approval.tool_call_record_id}),
    )?;
    if let Some(record_id) = approval.tool_call_record_id {
        reject_call(scope, run, &record_id, approval_id, Refusal::Expired)?;
    }
    Ok(true)
}

pub(super) fn decide(
    scope: &Scope,
    approval_id: &str,
    status: ApprovalStatus,
    actor: Option<&str>,
    note: Option<&str>,
) -> Result<()> {
    notifier::runs_ready();
    db::execute(
        include_str!("../../sql/queries/decide_approval.sql"),
        &scope.args([
            approval_id.into(),
            status.as_str().into(),
            actor.into(),
            note.into(),
        ]),
    )
}

/// Why a call waiting for its approval will not run.
#[derive(Clone, Copy)]
pub(super) enum Refusal {
    Rejected,
    Expired,
}

/// Rejects the call of a rejected or expired approval, if it still waits for it: the call is
/// `rejected` and its step canceled (a person said no) or `expired` (no one answered in time).
pub(super) fn reject_call(
    scope: &Scope,
    run: &LockedRun,
    record_id: &str,
    approval_id: &str,
    why: Refusal,
) -> Result<()> {
    let Some(mut rec) = rows::held_tool_call(scope, run, record_id)? else {
        return Ok(());
    };
    if rec.status != CallStatus::WaitingApproval {
        return Ok(());
    }
    let (code, message, step) = match why {
        Refusal::Rejected => (
            "TOOL_APPROVAL_REJECTED",
            "Tool call was rejected",
            Status::Canceled,
        ),
        Refusal::Expired => (
            "TOOL_APPROVAL_EXPIRED",
            "Tool call's approval expired before anyone decided it",
            Status::Expired,
        ),
    };
    db::execute(
        include_str!("../../sql/queries/reject_tool_call.sql"),
        &scope.args([record_id.into(), code.into(), message.into()]),
    )?;
    rec.status = CallStatus::Rejected;
    steps::follow(
        scope,
        run,
        &rec.step_id,
        step,
        StepChange {
            error_code: Some(code),
            ..StepChange::default()
        },
    )?;
    let ids = || ToolCallApproval {
        call: rec.ids(),
        approval_id,
        title: None,
    };
    if let Refusal::Expired = why {
        let expired = Event::ApprovalExpired(ids());
        outbox::enqueue(
            scope,
            &expired,
            Some(&rec.run_id),
            None,
            &format!("approval:{approval_id}:expired"),
        )?;
        event(scope, run, &rec, &expired)?;
    }
    event(scope, run, &rec, &Event::ToolCallRejected(ids()))
}
