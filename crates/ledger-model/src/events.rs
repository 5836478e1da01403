//! Every event the ledger writes, declared once: the run feed's event types (`run_events`), the
//! outbox's (`outbox`) and the ledger's own entries in a task's history (`task_events`), each
//! with its payload as a typed struct. The event reference in `docs/reference.md` is checked
//! against `EVENT_TYPES` by a test.

use crate::status::{Resource, Status};
use serde::Serialize;
use serde_json::Value;

/// Where an event type is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// A run's feed (`ledger.run_events`, read with `events_since`).
    Feed,
    /// The transactional outbox (`ledger.outbox`, read with `claim_outbox_events`).
    Outbox,
    /// A task's history (`ledger.task_events`).
    Task,
}

/// Declares every event type once: its variant of `Event` with its payload struct, its name and
/// the streams it is written to. Generates `EVENT_TYPES`, `Event` and `Event::event_type`.
macro_rules! events {
    ($($variant:ident($payload:ident) = $name:literal, [$($stream:ident),+];)+) => {
        /// Every event type the ledger writes, with the streams it is written to.
        pub const EVENT_TYPES: &[(&str, &[Stream])] = &[$(($name, &[$(Stream::$stream),+])),+];

        /// One event, its type fixed by its variant; it serialises as its payload alone.
        #[derive(Serialize, Debug)]
        #[serde(untagged)]
        pub enum Event<'a> {
            $($variant($payload<'a>),)+
        }

        impl Event<'_> {
            pub fn event_type(&self) -> &'static str {
                match self {
                    $(Event::$variant(_) => $name,)+
                }
            }
        }
    };
}

events! {
    RunCreated(RunCreated) = "run.created", [Feed, Outbox];
    RunStatus(RunStatus) = "run.status", [Feed];
    RunStatusUpdated(RunStatus) = "run.status.updated", [Outbox];
    RunClaimed(RunClaimed) = "run.claimed", [Feed];
    StepCreated(StepCreated) = "step.created", [Feed];
    StepStatus(StepStatus) = "step.status", [Feed];
    ToolCallClaimed(ToolCallClaimed) = "tool_call.claimed", [Feed];
    ToolCallRunning(ToolCallIds) = "tool_call.running", [Feed];
    ToolCallCompleted(ToolCallCompleted) = "tool_call.completed", [Feed];
    ToolCallInDoubt(ToolCallIds) = "tool_call.in_doubt", [Feed, Outbox];
    ToolCallResolved(ToolCallResolved) = "tool_call.resolved", [Feed];
    ToolCallReplayed(ToolCallReplayed) = "tool_call.replayed", [Feed];
    ToolCallLeaseExpired(ToolCallIds) = "tool_call.lease_expired", [Feed];
    ToolCallRejected(ToolCallApproval) = "tool_call.rejected", [Feed];
    ApprovalRequested(ToolCallApproval) = "approval.requested", [Feed, Outbox];
    ApprovalResolved(ApprovalResolved) = "approval.resolved", [Feed];
    ApprovalExpired(ToolCallApproval) = "approval.expired", [Feed, Outbox];
    ArtifactCreated(ArtifactCreated) = "artifact.created", [Feed];
    CostRecorded(CostRecorded) = "cost.recorded", [Feed, Outbox];
    BudgetWarning(BudgetEvent) = "budget.warning", [Feed, Outbox];
    BudgetExhausted(BudgetEvent) = "budget.exhausted", [Feed, Outbox];
    InputReceived(InputReceived) = "input.received", [Feed];
    AuditRecorded(Recorded) = "audit.recorded", [Feed];
    ResponseEventRecorded(Recorded) = "response_event.recorded", [Feed];
    CitationRecorded(Recorded) = "citation.recorded", [Feed];
    FeedbackRecorded(Recorded) = "feedback.recorded", [Feed];
    TaskCreated(TaskCreated) = "task.created", [Task];
    TaskStatus(TaskStatus) = "task.status", [Task];
    TaskCheckpoint(TaskCheckpoint) = "task.checkpoint", [Task];
    TaskSnapshot(TaskSnapshot) = "task.snapshot", [Task];
    TaskRetried(TaskRetried) = "task.retried", [Outbox];
}

/// The identity every event about a tool call carries.
#[derive(Serialize, Clone, Debug)]
pub struct ToolCallIds<'a> {
    pub tool_call_record_id: &'a str,
    pub tool_call_id: &'a str,
    pub tool_ref: &'a str,
    pub idempotency_key: &'a str,
    pub attempt: i64,
    pub step_id: &'a str,
}

#[derive(Serialize, Debug)]
pub struct RunCreated<'a> {
    pub run_id: &'a str,
    pub status: &'a str,
    pub mode: &'a str,
    pub kind: &'a str,
    pub subject_kind: &'a str,
    pub subject_id: Option<&'a str>,
    pub subject_version_id: Option<&'a str>,
    pub request_id: Option<&'a str>,
    pub parent_run_id: Option<&'a str>,
    pub source_run_id: Option<&'a str>,
    pub root_run_id: &'a str,
    pub attempt_no: i32,
    pub control_action: Option<&'a str>,
}

/// A run's status change: every one in the feed (`run.status`), the terminal ones in the outbox
/// (`run.status.updated`), with the same fields.
#[derive(Serialize, Clone, Debug)]
pub struct RunStatus<'a> {
    pub run_id: &'a str,
    pub mode: &'a str,
    pub from: &'a str,
    pub to: &'a str,
    pub error_code: Option<&'a str>,
    pub error_step_id: Option<&'a str>,
}

/// A worker took a run (`ledger.claim_run`): its fencing token, and whom it took it from.
#[derive(Serialize, Debug)]
pub struct RunClaimed<'a> {
    pub run_id: &'a str,
    pub run_token: i64,
    pub lease_owner: &'a str,
    pub previous_owner: Option<&'a str>,
    pub takeover: bool,
}

#[derive(Serialize, Debug)]
pub struct StepCreated<'a> {
    pub step_id: &'a str,
    pub step_key: Option<&'a str>,
    pub step_type: &'a str,
    pub node_id: Option<&'a str>,
    pub status: &'a str,
}

#[derive(Serialize, Debug)]
pub struct StepStatus<'a> {
    pub step_id: &'a str,
    pub from: &'a str,
    pub to: &'a str,
    pub error_code: Option<&'a str>,
}

#[derive(Serialize, Debug)]
pub struct ToolCallClaimed<'a> {
    #[serde(flatten)]
    pub call: ToolCallIds<'a>,
    pub lease_owner: &'a str,
}

#[derive(Serialize, Debug)]
pub struct ToolCallCompleted<'a> {
    #[serde(flatten)]
    pub call: ToolCallIds<'a>,
    pub status: &'a str,
    pub result_artifact_id: Option<&'a str>,
}

#[derive(Serialize, Debug)]
pub struct ToolCallResolved<'a> {
    #[serde(flatten)]
    pub call: ToolCallIds<'a>,
    pub decision: &'a str,
    pub actor: Option<&'a str>,
}

#[derive(Serialize, Debug)]
pub struct ToolCallReplayed<'a> {
    #[serde(flatten)]
    pub call: ToolCallIds<'a>,
    pub source_run_id: &'a str,
}

/// `approval.requested` (the outbox row also carries the title), `approval.expired` and
/// `tool_call.rejected`.
#[derive(Serialize, Debug)]
pub struct ToolCallApproval<'a> {
    #[serde(flatten)]
    pub call: ToolCallIds<'a>,
    pub approval_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub title: Option<&'a str>,
}

#[derive(Serialize, Debug)]
pub struct ApprovalResolved<'a> {
    pub approval_id: &'a str,
    pub decision: &'a str,
    pub actor: Option<&'a str>,
    pub tool_call_record_id: Option<&'a str>,
}

#[derive(Serialize, Debug)]
pub struct ArtifactCreated<'a> {
    pub artifact_id: &'a str,
    pub artifact_type: &'a str,
    pub size_bytes: i64,
    pub sha256: &'a str,
}

#[derive(Serialize, Debug)]
pub struct CostRecorded<'a> {
    pub cost_id: &'a str,
    pub run_id: &'a str,
    pub step_id: Option<&'a str>,
    pub billing_basis: &'a str,
    /// A decimal string.
    pub amount: Option<&'a str>,
    pub currency: Option<&'a str>,
    pub source_ref: Option<&'a str>,
}

/// An input sent to a run's mailbox (`send_input`); the payload stays in `ledger.run_mailbox`.
#[derive(Serialize, Debug)]
pub struct InputReceived<'a> {
    pub input_id: &'a str,
    pub input_key: &'a str,
    pub sender: Option<&'a str>,
    /// The run was waiting for it (`wait_for_input`) and may be claimed again now.
    pub woke_run: bool,
}

/// A budget that crossed its warning share, or refused a decision to spend (`decision`:
/// `tool_call` or `llm_step`; `subject`: the call's `tool_call_id` or the step's key or id).
#[derive(Serialize, Debug)]
pub struct BudgetEvent<'a> {
    pub run_id: &'a str,
    pub decision: Option<&'a str>,
    pub subject: Option<&'a str>,
    pub budget: &'a Value,
}

/// An evidence record written to its table (`audit_events`, `response_events`, `citations`,
/// `run_feedback`): the feed names the row.
#[derive(Serialize, Debug)]
pub struct Recorded<'a> {
    pub id: &'a str,
    pub table: &'a str,
}

#[derive(Serialize, Debug)]
pub struct TaskCreated<'a> {
    pub task_id: &'a str,
    pub task_type: &'a str,
    pub run_id: Option<&'a str>,
    pub status: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replayed_from_task_id: Option<&'a str>,
}

#[derive(Serialize, Debug)]
pub struct TaskStatus<'a> {
    pub task_id: &'a str,
    pub from: &'a str,
    pub to: &'a str,
    pub error_code: Option<&'a str>,
    /// The progress merged by this transition, if any.
    pub progress: Option<&'a Value>,
}

#[derive(Serialize, Debug)]
pub struct TaskCheckpoint<'a> {
    pub task_id: &'a str,
    pub checkpoint_id: &'a str,
    pub checkpoint_no: i64,
}

#[derive(Serialize, Debug)]
pub struct TaskSnapshot<'a> {
    pub task_id: &'a str,
    /// The snapshot's top-level keys.
    pub keys: Vec<&'a str>,
}

#[derive(Serialize, Debug)]
pub struct TaskRetried<'a> {
    pub task_id: &'a str,
    pub task_type: &'a str,
    pub run_id: Option<&'a str>,
    pub from: &'a str,
    pub attempt_count: i32,
}

impl Event<'_> {
    /// The payload as stored (a JSON object).
    pub fn payload(&self) -> Value {
        // Structs of strings and integers always serialise; an empty object would still be a
        // valid payload.
        serde_json::to_value(self).unwrap_or_else(|_| Value::Object(serde_json::Map::new()))
    }
}

/// Whether callers may write this type to a task's history themselves (the ledger's own are
/// reserved).
pub fn task_event_reserved(event_type: &str) -> bool {
    EVENT_TYPES
        .iter()
        .any(|(t, streams)| *t == event_type && streams.contains(&Stream::Task))
}

/// Whether a feed event ended its run: a `run.status` whose `to` is terminal. Nothing changes
/// the run's status after it, so a follower may stop there (`events_since`'s `ends_run`).
/// `payload` is the event's JSON text; only a `run.status` one is read.
pub fn ends_run(event_type: &str, payload: &str) -> bool {
    event_type == "run.status"
        && serde_json::from_str::<Value>(payload)
            .ok()
            .and_then(|p| {
                p.get("to")
                    .and_then(Value::as_str)
                    .and_then(|to| Status::parse(Resource::Run, to).ok())
            })
            .is_some_and(Status::is_terminal)
}

/// The audit records the ledger writes itself (`ledger.audit_events`), beside the events: their
/// `gateway_type`s, which docs/reference.md lists under "Audit records the ledger writes"
/// (`tests/reference.rs` compares them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuditKind {
    ToolCallClaim,
    ToolCallComplete,
    ToolCallResolve,
    ToolCallReplay,
    ToolCallRecord,
    ApprovalRequest,
    ApprovalDecision,
    OutboxReplay,
    BudgetSet,
    InputSend,
    ScheduleSet,
}

impl AuditKind {
    pub const ALL: &'static [AuditKind] = &[
        AuditKind::ToolCallClaim,
        AuditKind::ToolCallComplete,
        AuditKind::ToolCallResolve,
        AuditKind::ToolCallReplay,
        AuditKind::ToolCallRecord,
        AuditKind::ApprovalRequest,
        AuditKind::ApprovalDecision,
        AuditKind::OutboxReplay,
        AuditKind::BudgetSet,
        AuditKind::InputSend,
        AuditKind::ScheduleSet,
    ];

    pub fn gateway_type(self) -> &'static str {
        match self {
            AuditKind::ToolCallClaim => "tool_call.claim",
            AuditKind::ToolCallComplete => "tool_call.complete",
            AuditKind::ToolCallResolve => "tool_call.resolve",
            AuditKind::ToolCallReplay => "tool_call.replay",
            AuditKind::ToolCallRecord => "tool_call.record",
            AuditKind::ApprovalRequest => "approval.request",
            AuditKind::ApprovalDecision => "approval.decision",
            AuditKind::OutboxReplay => "outbox.replay",
            AuditKind::BudgetSet => "budget.set",
            AuditKind::InputSend => "input.send",
            AuditKind::ScheduleSet => "schedule.set",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_run_status_to_a_terminal_status_ends_the_run() {
        for (event_type, payload, ends) in [
            ("run.status", r#"{"from":"running","to":"succeeded"}"#, true),
            ("run.status", r#"{"from":"running","to":"canceled"}"#, true),
            ("run.status", r#"{"from":"queued","to":"running"}"#, false),
            (
                "step.status",
                r#"{"from":"running","to":"succeeded"}"#,
                false,
            ),
            ("run.status", r#"{"to":"skipped"}"#, false),
            ("run.status", "not json", false),
        ] {
            assert_eq!(
                ends_run(event_type, payload),
                ends,
                "{event_type} {payload}"
            );
        }
    }

    fn call() -> ToolCallIds<'static> {
        ToolCallIds {
            tool_call_record_id: "tc_1",
            tool_call_id: "call-1",
            tool_ref: "crm.lookup",
            idempotency_key: "tool:r:call-1",
            attempt: 2,
            step_id: "step_1",
        }
    }

    #[test]
    fn every_event_type_is_declared_once() {
        let mut names: Vec<&str> = EVENT_TYPES.iter().map(|(t, _)| *t).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n);
    }

    #[test]
    fn tool_call_payloads_flatten_the_identity() {
        let e = Event::ToolCallClaimed(ToolCallClaimed {
            call: call(),
            lease_owner: "w-1",
        });
        assert_eq!(e.event_type(), "tool_call.claimed");
        let p = e.payload();
        assert_eq!(p["tool_call_record_id"], "tc_1");
        assert_eq!(p["attempt"], 2);
        assert_eq!(p["lease_owner"], "w-1");
        assert!(EVENT_TYPES.iter().any(|(t, _)| *t == e.event_type()));
    }

    #[test]
    fn the_feed_and_the_outbox_say_the_same_about_a_status_change() {
        let s = || RunStatus {
            run_id: "r",
            mode: "agent",
            from: "running",
            to: "failed",
            error_code: None,
            error_step_id: None,
        };
        assert_eq!(
            Event::RunStatus(s()).payload(),
            Event::RunStatusUpdated(s()).payload()
        );
        assert_eq!(Event::RunStatus(s()).payload()["from"], "running");
    }

    #[test]
    fn the_ledgers_task_events_are_reserved() {
        assert!(task_event_reserved("task.status"));
        assert!(!task_event_reserved("task.retried"));
        assert!(!task_event_reserved("my.progress"));
    }
}
