//! The tool-call record's rules: what a claim does with an existing record, the lease length,
//! and attempt fencing. No Postgres here.

pub mod batch;

use serde_json::Value;

use crate::error::{Code, LedgerError, Result};
use crate::ids;
// Declared with the other status vocabularies; named here too, where the rules use them.
pub use crate::status::{ApprovalStatus, CallStatus};

/// What the ledger knows about an existing record when a claim arrives.
#[derive(Clone, Copy, Debug)]
pub struct Existing<'a> {
    pub status: CallStatus,
    pub tool_ref: &'a str,
    pub request_hash: &'a str,
    pub lease_live: bool,
    pub outbound_started: bool,
    pub approval: Option<ApprovalStatus>,
}

/// What a claim of an existing record does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// The record is finished: return its result, execute nothing.
    Replay,
    /// The request may have left and no answer came back. `mark`: the record moves to in_doubt now.
    InDoubt {
        mark: bool,
    },
    /// Someone holds a live lease (whoever it is: claims are not re-entrant).
    Busy,
    WaitingApproval,
    Rejected,
    /// A new attempt: take-over of an expired lease whose request never left, a re-arm of a
    /// failed call with `retry_failed`, an approved call, or an in-doubt call resolved `retry`.
    /// No request of the call can be under way: the repeatable path runs the tool here, and its
    /// record is that next attempt.
    Claim,
}

/// Decides a claim against an existing record with the same identity.
pub fn decide(
    existing: &Existing,
    tool_ref: &str,
    request_hash: &str,
    retry_failed: bool,
) -> Result<Decision> {
    if existing.tool_ref != tool_ref || existing.request_hash != request_hash {
        return Err(identity_reused()
            .with("tool_ref_matches", existing.tool_ref == tool_ref)
            .with(
                "request_hash_matches",
                existing.request_hash == request_hash,
            ));
    }
    Ok(match existing.status {
        CallStatus::Succeeded => Decision::Replay,
        CallStatus::Failed if retry_failed => Decision::Claim,
        CallStatus::Failed => Decision::Replay,
        CallStatus::InDoubt => Decision::InDoubt { mark: false },
        CallStatus::Rejected => Decision::Rejected,
        CallStatus::WaitingApproval => match existing.approval {
            Some(ApprovalStatus::Approved) => Decision::Claim,
            Some(ApprovalStatus::Rejected | ApprovalStatus::Expired | ApprovalStatus::Canceled) => {
                Decision::Rejected
            }
            Some(ApprovalStatus::Pending) | None => Decision::WaitingApproval,
        },
        CallStatus::Claimed | CallStatus::Running if existing.lease_live => Decision::Busy,
        CallStatus::Claimed | CallStatus::Running if existing.outbound_started => {
            Decision::InDoubt { mark: true }
        }
        CallStatus::Claimed | CallStatus::Running => Decision::Claim,
    })
}

/// Whether a re-run's call takes the answer of the record its nearest ancestor holds for the
/// same tool_call_id: a result (`succeeded`), or a request that may have left or may still leave
/// (`in_doubt`, begun, or leased). A call the ancestor never made or that had no effect to keep
/// (`failed`, `rejected`, waiting for an approval, or claimed and never begun past its lease) is
/// the re-run's own to make, under its own record: an ancestor's record never hands out an
/// execution to a descendant.
pub fn answers_descendant(existing: &Existing) -> bool {
    match existing.status {
        CallStatus::Succeeded | CallStatus::InDoubt => true,
        CallStatus::Claimed | CallStatus::Running => {
            existing.lease_live || existing.outbound_started
        }
        CallStatus::Failed | CallStatus::Rejected | CallStatus::WaitingApproval => false,
    }
}

pub fn identity_reused() -> LedgerError {
    LedgerError::new(
        Code::IdempotencyMismatch,
        "Tool call identity was reused with different input",
    )
}

/// The longest timeout a claim accepts (one day).
pub const MAX_TIMEOUT_SECONDS: i32 = 86_400;

/// The shortest lease: a dead worker's call is noticed (in doubt, or claimable again) seconds
/// after its timeout, not a minute later.
pub const MIN_LEASE_SECONDS: i32 = 10;

/// The lease of a claim: the call's own timeout plus a margin of a tenth of it, at least 5
/// seconds, and never under `MIN_LEASE_SECONDS` (a 5 s tool: 10 s; 30 s: 35 s; a day: 26.4 h),
/// for 0 <= timeout <= one day. A slower call extends it with heartbeats.
pub fn lease_seconds(timeout_seconds: i32) -> Result<i32> {
    if !(0..=MAX_TIMEOUT_SECONDS).contains(&timeout_seconds) {
        return Err(LedgerError::new(
            Code::TimeoutInvalid,
            "timeout_seconds must be between 0 and 86400",
        )
        .with("timeout_seconds", timeout_seconds));
    }
    Ok((timeout_seconds + (timeout_seconds / 10).max(5)).max(MIN_LEASE_SECONDS))
}

/// A heartbeat's extension, 1 second to one day.
pub fn extend_seconds(extend: i32) -> Result<i32> {
    if !(1..=MAX_TIMEOUT_SECONDS).contains(&extend) {
        return Err(LedgerError::new(
            Code::TimeoutInvalid,
            "extend_seconds must be between 1 and 86400",
        )
        .with("extend_seconds", extend));
    }
    Ok(extend)
}

/// The attempt is the fencing token: only the current attempt may write (40001 `LEASE_STALE`).
/// A claimed call without a lease is between attempts (a sweep released it before `begin`, or a
/// person resolved it `retry`): its attempt is over too, although no newer one exists yet, so
/// that the old executor cannot revive it under the next claimer's feet.
pub fn check_fence(status: CallStatus, lease_held: bool, current: i64, given: i64) -> Result<()> {
    let released = status == CallStatus::Claimed && !lease_held;
    if current == given && !released {
        return Ok(());
    }
    let message = if current == given {
        format!("attempt {given} is over: its lease was released; claim the call again")
    } else {
        format!("attempt {given} is no longer current (the current attempt is {current})")
    };
    Err(LedgerError::new(Code::LeaseStale, message)
        .with("attempt", given)
        .with("current_attempt", current)
        .with("lease_released", released))
}

/// How an executor reports a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
    /// The request left and no answer came back: the call is in doubt.
    Unknown,
}

impl Outcome {
    pub fn parse(s: &str) -> Result<Outcome> {
        match s {
            "succeeded" => Ok(Outcome::Succeeded),
            "failed" => Ok(Outcome::Failed),
            "unknown" => Ok(Outcome::Unknown),
            _ => Err(LedgerError::new(
                Code::OutcomeUnknown,
                "outcome must be succeeded, failed or unknown",
            )
            .with("outcome", s)),
        }
    }
}

impl Outcome {
    /// The outcome of a call recorded after it returned (`record_tool_call`): `succeeded` or
    /// `failed`; a repeatable call has no `unknown`, it is simply run again.
    pub fn parse_recorded(s: &str) -> Result<Outcome> {
        match Outcome::parse(s) {
            Ok(Outcome::Unknown) | Err(_) => Err(LedgerError::new(
                Code::OutcomeUnknown,
                "outcome must be succeeded or failed",
            )
            .with("outcome", s)),
            ok => ok,
        }
    }
}

/// A human's decision on an in-doubt call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    Succeeded,
    Failed,
    /// Execute again: the next claim gets attempt + 1.
    Retry,
}

impl Resolution {
    pub fn parse(s: &str) -> Result<Resolution> {
        match s {
            "succeeded" => Ok(Resolution::Succeeded),
            "failed" => Ok(Resolution::Failed),
            "retry" => Ok(Resolution::Retry),
            _ => Err(LedgerError::new(
                Code::DecisionUnknown,
                "decision must be succeeded, failed or retry",
            )
            .with("decision", s)),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Succeeded => "succeeded",
            Resolution::Failed => "failed",
            Resolution::Retry => "retry",
        }
    }
}

/// The approval a claim asks for (`claim_tool_call(..., approval => ...)`): what
/// `request_tool_approval` takes as arguments, every key optional.
#[derive(Debug, PartialEq)]
pub struct ApprovalAsk<'a> {
    /// Free text (the SPI layer redacts and cuts it).
    pub title: Option<&'a str>,
    /// A label.
    pub policy_ref: Option<&'a str>,
    /// A JSON object (the SPI layer redacts it).
    pub details: Option<&'a Value>,
    /// How long the approval may stay pending (`approval_expiry`).
    pub expires_in_seconds: Option<i32>,
}

/// The longest an approval may stay pending: a year.
pub const MAX_APPROVAL_SECONDS: i64 = 366 * 86_400;

/// An approval's deadline, 1 second to a year after it is requested (22023 `TIMEOUT_INVALID`).
pub fn approval_expiry(expires_in_seconds: i64) -> Result<i32> {
    if !(1..=MAX_APPROVAL_SECONDS).contains(&expires_in_seconds) {
        return Err(LedgerError::new(
            Code::TimeoutInvalid,
            "expires_in_seconds must be between 1 and 31622400 (a year)",
        )
        .with("expires_in_seconds", expires_in_seconds));
    }
    // The range fits an i32.
    Ok(expires_in_seconds as i32)
}

/// Reads `{"title", "policy_ref", "details"}`; any other key or shape fails 22023
/// `APPROVAL_INVALID` (naming the key), a bad label 22023 `LABEL_INVALID`. A null is absent.
pub fn approval_ask(value: &Value) -> Result<ApprovalAsk<'_>> {
    let invalid = |message: &str, key: &str| {
        LedgerError::new(Code::ApprovalInvalid, message.to_owned()).with("key", key)
    };
    let Value::Object(map) = value else {
        return Err(invalid("approval must be a JSON object", ""));
    };
    if let Some(key) = map
        .keys()
        .find(|k| !["title", "policy_ref", "details", "expires_in_seconds"].contains(&k.as_str()))
    {
        return Err(invalid(
            "approval takes only the keys title, policy_ref, details and expires_in_seconds",
            key,
        ));
    }
    let text = |key: &str| match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(invalid(&format!("approval.{key} must be text"), key)),
    };
    let title = text("title")?;
    let policy_ref = text("policy_ref")?;
    if let Some(p) = policy_ref {
        ids::validate_label("policy_ref", p)?;
    }
    let details = match map.get("details") {
        None | Some(Value::Null) => None,
        Some(d @ Value::Object(_)) => Some(d),
        Some(_) => return Err(invalid("approval.details must be a JSON object", "details")),
    };
    let expires_in_seconds = match map.get("expires_in_seconds") {
        None | Some(Value::Null) => None,
        // A whole number, also when a client's JSON writes it as 3.0.
        Some(Value::Number(n)) => match n.as_i64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() < 1e15)
                .map(|f| f as i64)
        }) {
            Some(seconds) => Some(approval_expiry(seconds)?),
            None => {
                return Err(invalid(
                    "approval.expires_in_seconds must be a whole number of seconds",
                    "expires_in_seconds",
                ))
            }
        },
        Some(_) => {
            return Err(invalid(
                "approval.expires_in_seconds must be a whole number of seconds",
                "expires_in_seconds",
            ))
        }
    };
    Ok(ApprovalAsk {
        title,
        policy_ref,
        details,
        expires_in_seconds,
    })
}

/// The state a call must be in for an operation (55000 `TOOL_CALL_STATE`).
pub fn wrong_state(op: &str, status: CallStatus) -> LedgerError {
    LedgerError::new(
        Code::ToolCallState,
        format!("a tool call cannot {op} from status {}", status.as_str()),
    )
    .with("operation", op)
    .with("status", status.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Class;

    fn existing(status: CallStatus) -> Existing<'static> {
        Existing {
            status,
            tool_ref: "search",
            request_hash: "h",
            lease_live: false,
            outbound_started: false,
            approval: None,
        }
    }

    fn decide_for(e: Existing) -> Decision {
        decide(&e, "search", "h", false).unwrap()
    }

    #[test]
    fn a_recorded_outcome_is_succeeded_or_failed() {
        assert_eq!(
            Outcome::parse_recorded("succeeded").unwrap(),
            Outcome::Succeeded
        );
        assert_eq!(Outcome::parse_recorded("failed").unwrap(), Outcome::Failed);
        for bad in ["unknown", "ok", ""] {
            let e = Outcome::parse_recorded(bad).unwrap_err();
            assert_eq!(e.code, Code::OutcomeUnknown, "{bad}");
        }
    }

    #[test]
    fn finished_calls_replay_and_failed_ones_rearm_only_when_asked() {
        assert_eq!(
            decide_for(existing(CallStatus::Succeeded)),
            Decision::Replay
        );
        assert_eq!(decide_for(existing(CallStatus::Failed)), Decision::Replay);
        assert_eq!(
            decide(&existing(CallStatus::Failed), "search", "h", true).unwrap(),
            Decision::Claim
        );
        assert_eq!(
            decide(&existing(CallStatus::Succeeded), "search", "h", true).unwrap(),
            Decision::Replay
        );
    }

    #[test]
    fn an_expired_lease_is_in_doubt_once_the_request_left_and_never_claimed() {
        for status in [CallStatus::Claimed, CallStatus::Running] {
            let live = Existing {
                lease_live: true,
                outbound_started: true,
                ..existing(status)
            };
            assert_eq!(decide_for(live), Decision::Busy);
            let live = Existing {
                lease_live: true,
                ..existing(status)
            };
            assert_eq!(decide_for(live), Decision::Busy);
            let left = Existing {
                outbound_started: true,
                ..existing(status)
            };
            assert_eq!(decide_for(left), Decision::InDoubt { mark: true });
            assert_eq!(
                decide(&left, "search", "h", true).unwrap(),
                Decision::InDoubt { mark: true }
            );
            assert_eq!(decide_for(existing(status)), Decision::Claim);
        }
        // in_doubt stays in doubt whatever the caller asks.
        assert_eq!(
            decide(&existing(CallStatus::InDoubt), "search", "h", true).unwrap(),
            Decision::InDoubt { mark: false }
        );
    }

    #[test]
    fn a_descendant_takes_an_ancestors_result_or_doubt_and_makes_anything_else_itself() {
        let answers = |status, lease_live, outbound_started| {
            answers_descendant(&Existing {
                lease_live,
                outbound_started,
                ..existing(status)
            })
        };
        assert!(answers(CallStatus::Succeeded, false, true));
        assert!(answers(CallStatus::InDoubt, false, true));
        for status in [CallStatus::Claimed, CallStatus::Running] {
            assert!(answers(status, true, false), "busy while leased");
            assert!(answers(status, false, true), "begun: in doubt");
            assert!(!answers(status, false, false), "never begun");
        }
        for status in [
            CallStatus::Failed,
            CallStatus::Rejected,
            CallStatus::WaitingApproval,
        ] {
            assert!(!answers(status, false, false));
        }
    }

    #[test]
    fn approvals_gate_the_claim() {
        let waiting = existing(CallStatus::WaitingApproval);
        assert_eq!(decide_for(waiting), Decision::WaitingApproval);
        assert_eq!(
            decide_for(Existing {
                approval: Some(ApprovalStatus::Pending),
                ..waiting
            }),
            Decision::WaitingApproval
        );
        assert_eq!(
            decide_for(Existing {
                approval: Some(ApprovalStatus::Approved),
                ..waiting
            }),
            Decision::Claim
        );
        assert_eq!(
            decide_for(Existing {
                approval: Some(ApprovalStatus::Rejected),
                ..waiting
            }),
            Decision::Rejected
        );
        assert_eq!(
            decide_for(existing(CallStatus::Rejected)),
            Decision::Rejected
        );
    }

    #[test]
    fn a_reused_identity_is_a_conflict_in_every_state() {
        for status in CallStatus::ALL {
            for (tool, hash) in [("other", "h"), ("search", "other")] {
                let e = decide(&existing(status), tool, hash, false).unwrap_err();
                assert_eq!(
                    (e.class(), e.code),
                    (Class::Duplicate, Code::IdempotencyMismatch),
                    "{status:?}"
                );
            }
        }
    }

    #[test]
    fn lease_is_the_timeout_plus_a_tenth_at_least_five_seconds_never_under_ten() {
        assert_eq!(lease_seconds(0).unwrap(), 10);
        assert_eq!(lease_seconds(4).unwrap(), 10);
        // The trial's 5 s tool: in doubt 10 s after its claim, not 64 s.
        assert_eq!(lease_seconds(5).unwrap(), 10);
        assert_eq!(lease_seconds(6).unwrap(), 11);
        assert_eq!(lease_seconds(30).unwrap(), 35);
        assert_eq!(lease_seconds(49).unwrap(), 54);
        assert_eq!(lease_seconds(50).unwrap(), 55);
        assert_eq!(lease_seconds(51).unwrap(), 56);
        assert_eq!(lease_seconds(600).unwrap(), 660);
        assert_eq!(lease_seconds(86_400).unwrap(), 95_040);
        for bad in [-1, i32::MIN, 86_401, i32::MAX] {
            assert_eq!(lease_seconds(bad).unwrap_err().code, Code::TimeoutInvalid);
        }
        assert!(extend_seconds(0).is_err() && extend_seconds(1).is_ok());
    }

    #[test]
    fn an_approval_takes_title_policy_ref_details_and_a_deadline_only() {
        use serde_json::json;
        let full =
            json!({"title": "Pay 5 EUR", "policy_ref": "payments/v2", "details": {"amount": 5}});
        let ask = approval_ask(&full).unwrap();
        assert_eq!(
            (ask.title, ask.policy_ref, ask.details),
            (
                Some("Pay 5 EUR"),
                Some("payments/v2"),
                Some(&json!({"amount": 5}))
            )
        );
        let empty = json!({"title": null});
        assert_eq!(
            approval_ask(&empty).unwrap(),
            ApprovalAsk {
                title: None,
                policy_ref: None,
                details: None,
                expires_in_seconds: None,
            }
        );
        let timed = json!({"expires_in_seconds": 3600});
        assert_eq!(approval_ask(&timed).unwrap().expires_in_seconds, Some(3600));
        let whole = json!({"expires_in_seconds": 3.0});
        assert_eq!(approval_ask(&whole).unwrap().expires_in_seconds, Some(3));
        for (bad, key) in [
            (json!({"titel": "x"}), "titel"),
            (json!({"title": 5}), "title"),
            (json!({"policy_ref": ["p"]}), "policy_ref"),
            (json!({"details": "x"}), "details"),
            (json!({"expires_in_seconds": "1h"}), "expires_in_seconds"),
            (json!({"expires_in_seconds": 1.5}), "expires_in_seconds"),
            (json!(["title"]), ""),
        ] {
            let e = approval_ask(&bad).unwrap_err();
            assert_eq!(
                (e.class(), e.code),
                (Class::InvalidParameter, Code::ApprovalInvalid),
                "{bad}"
            );
            assert_eq!(e.detail["key"], key, "{bad}");
        }
        for seconds in [0, -1, MAX_APPROVAL_SECONDS + 1] {
            let e = approval_ask(&json!({"expires_in_seconds": seconds})).unwrap_err();
            assert_eq!(
                (e.class(), e.code, &e.detail["expires_in_seconds"]),
                (
                    Class::InvalidParameter,
                    Code::TimeoutInvalid,
                    &json!(seconds)
                )
            );
        }
        assert_eq!(approval_expiry(MAX_APPROVAL_SECONDS), Ok(31_622_400));
        let e = approval_ask(&json!({"policy_ref": "a\nb"})).unwrap_err();
        assert_eq!(
            (e.code, &e.detail["argument"]),
            (Code::LabelInvalid, &json!("policy_ref"))
        );
    }

    #[test]
    fn only_the_current_attempt_passes_the_fence() {
        let claimed = CallStatus::Claimed;
        assert!(check_fence(claimed, true, 2, 2).is_ok());
        let e = check_fence(claimed, true, 2, 1).unwrap_err();
        assert_eq!((e.class(), e.code), (Class::Conflict, Code::LeaseStale));
        assert_eq!(e.detail["current_attempt"], 2);
        assert!(check_fence(claimed, true, 2, 3).is_err());
        // Released (swept or resolved `retry`): the current number no longer passes.
        let e = check_fence(claimed, false, 2, 2).unwrap_err();
        assert_eq!(
            (e.code, &e.detail["lease_released"]),
            (Code::LeaseStale, &true.into())
        );
        // An in-doubt call has no lease either, and its executor's late answer still counts.
        assert!(check_fence(CallStatus::InDoubt, false, 2, 2).is_ok());
        assert!(check_fence(CallStatus::Running, true, 2, 2).is_ok());
    }

    #[test]
    fn outcomes_and_resolutions_parse_strictly() {
        assert_eq!(Outcome::parse("unknown").unwrap(), Outcome::Unknown);
        assert_eq!(
            Outcome::parse("timeout").unwrap_err().code,
            Code::OutcomeUnknown
        );
        assert_eq!(Resolution::parse("retry").unwrap(), Resolution::Retry);
        assert_eq!(
            Resolution::parse("Retry").unwrap_err().code,
            Code::DecisionUnknown
        );
        for s in CallStatus::ALL {
            assert_eq!(CallStatus::parse(s.as_str()).unwrap(), s);
        }
    }
}
