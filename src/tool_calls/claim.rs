//! `claim_tool_call`: hands a call out for execution, replays a finished one, or says why not.

use super::decisions;
use super::lookup::{find_locked, tombstone, Found};
use super::record::{
    announce_claim, arm, create_waiting, insert, mark_in_doubt, replay_response, replayed_into,
};
use super::{
    approval_argument, arguments, identity, outcome, ApprovalRequest, Arguments, Identity,
};
use crate::budgets;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::rows::{self, LockedRun, ToolCall};
use crate::scope::{self, Scope};
use ledger_model::args::optional_id;
use ledger_model::budgets::Meter;
use ledger_model::tool_calls::{decide, lease_seconds, ApprovalStatus, CallStatus, Decision};
use pgrx::prelude::*;
use serde_json::json;

/// One call's claim, checked before anything is locked or written.
pub(super) struct Claim<'a> {
    pub(super) who: Identity<'a>,
    args: Arguments,
    step_id: Option<&'a str>,
    lease: i32,
    retry_failed: bool,
    approval: Option<ApprovalRequest>,
}

impl<'a> Claim<'a> {
    /// Checks `claim_tool_call`'s per-call arguments (`arguments` and `approval` parsed by
    /// the caller's way of taking them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        run_id: Option<&'a str>,
        tool_ref: Option<&'a str>,
        arguments: impl FnOnce() -> Result<Arguments>,
        tool_call_id: Option<&'a str>,
        idempotency_key: Option<&'a str>,
        step_id: Option<&'a str>,
        timeout_seconds: Option<i32>,
        retry_failed: Option<bool>,
        approval: impl FnOnce() -> Result<Option<ApprovalRequest>>,
    ) -> Result<Claim<'a>> {
        let who = identity(run_id, tool_ref, tool_call_id, idempotency_key)?;
        let args = arguments()?;
        let lease = lease_seconds(
            timeout_seconds.ok_or_else(|| LedgerError::required("timeout_seconds"))?,
        )?;
        Ok(Claim {
            who,
            args,
            step_id,
            lease,
            retry_failed: retry_failed.unwrap_or(false),
            approval: approval()?,
        })
    }
}

/// The lease owner of a claim: the caller's, else `tool:<run_id>`.
pub(super) fn claim_owner(lease_owner: Option<&str>, run_id: &str) -> Result<String> {
    Ok(optional_id("lease_owner", lease_owner)?
        .map_or_else(|| format!("tool:{run_id}"), str::to_owned))
}

/// What a claim or an approval request answers.
pub(super) enum Answer {
    /// The outcome of the record `id` (with the response of a replay).
    Of(String, &'static str, Option<Jsonb>),
    /// A purged call's tombstone.
    Purged(Jsonb),
    /// The caller now holds the call (a new attempt), in the run this transaction holds.
    Claimed(Box<(LockedRun, ToolCall)>),
    /// A budget that applies is used up (the budget): no execution was handed out, for the
    /// record `id` if the call has one.
    Exhausted(Option<String>, Jsonb),
}

impl Answer {
    fn of(rec: &ToolCall, outcome: &'static str) -> Answer {
        Answer::Of(rec.id.clone(), outcome, None)
    }

    /// `{"outcome", "tool_call", "approval", "response"}`, the record read as it is now.
    pub(super) fn json(self, scope: &Scope) -> Result<Jsonb> {
        match self {
            Answer::Of(id, how, response) => outcome(scope, &id, how, response),
            Answer::Purged(tombstone) => Ok(tombstone),
            Answer::Claimed(held) => outcome(scope, &held.1.id, "claimed", None),
            Answer::Exhausted(id, budget) => {
                let mut answer = match id {
                    Some(id) => outcome(scope, &id, "budget_exhausted", None)?.value()?,
                    None => json!({"outcome": "budget_exhausted", "tool_call": null,
                                   "approval": null, "response": null}),
                };
                answer["budget"] = budget.value()?;
                Ok(Jsonb::from(&answer))
            }
        }
    }
}

/// Claims a tool call for execution, or says why not. With `approval`, an unknown call is created
/// waiting for it (as `request_tool_approval` does) and a known one answers its current outcome.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn claim_tool_call(
    run_id: Option<&str>,
    tool_ref: Option<&str>,
    arguments: default!(Option<Jsonb>, "'{}'"),
    tool_call_id: default!(Option<&str>, "NULL"),
    idempotency_key: default!(Option<&str>, "NULL"),
    step_id: default!(Option<&str>, "NULL"),
    lease_owner: default!(Option<&str>, "NULL"),
    timeout_seconds: default!(Option<i32>, 30),
    retry_failed: default!(Option<bool>, false),
    approval: default!(Option<Jsonb>, "NULL"),
    run_token: default!(Option<i64>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        let scope = scope::current()?;
        let call = Claim::new(
            run_id,
            tool_ref,
            || self::arguments(arguments),
            tool_call_id,
            idempotency_key,
            step_id,
            timeout_seconds,
            retry_failed,
            || approval_argument(approval),
        )?;
        let owner = claim_owner(lease_owner, call.who.run_id)?;
        let run = rows::lock_run(&scope, "run_id", call.who.run_id)?;
        run.fence(run_token)?;
        Ok(claim(&scope, &run, &call, &owner)?.json(&scope)?)
    })
}

/// Claims one call in the run this transaction holds (locked and fenced by the caller).
pub(super) fn claim(scope: &Scope, run: &LockedRun, call: &Claim, owner: &str) -> Result<Answer> {
    let (who, args, step_id) = (&call.who, &call.args, call.step_id);
    // Twice at most: an insert that lost a race to a concurrent claim finds its record next time.
    for _ in 0..2 {
        if let Some(found) = find_locked(scope, run, who, args)? {
            return apply(
                scope,
                run,
                who,
                found,
                args,
                Some((owner, call.lease, call.retry_failed)),
            );
        }
        if let Some(purged) = tombstone(scope, who, args)? {
            return Ok(Answer::Purged(purged));
        }
        run.ensure_live("tool calls")?;
        if let Some(approval) = &call.approval {
            let rec = create_waiting(scope, run, who, args, step_id, call.lease, approval)?;
            return Ok(Answer::of(&rec, "waiting_approval"));
        }
        if let Some(budget) = budgets::decide(scope, run, Meter::ToolCalls)? {
            budgets::park(scope, run, "tool_call", Some(&who.tool_call_id), &budget)?;
            return Ok(Answer::Exhausted(None, budget));
        }
        if let Some(mut rec) = insert(
            scope,
            run,
            who,
            args,
            step_id,
            CallStatus::Claimed,
            Some(owner),
            call.lease,
            None,
        )? {
            rec.attempt = 1;
            announce_claim(scope, run, &rec, owner, call.lease)?;
            return Ok(Answer::Claimed(Box::new((run.clone(), rec))));
        }
        if let Some(step) = step_id {
            return Err(LedgerError::new(
                Code::StepHasToolCall,
                "the step already has a tool call",
            )
            .with("step_id", step));
        }
    }
    Err(LedgerError::internal(
        "claim did not settle after a concurrent insert",
    ))
}

/// What a claim (`terms`: its lease owner, lease and `retry_failed`) or an approval request
/// (`terms` None: it never hands out execution) of the calling run `caller` does with the
/// record it found. Only a record
/// whose run this transaction holds is written: another run's call to take over answers `busy`
/// and one whose request left answers `in_doubt` unmarked (the next claim or sweep marks it).
pub(super) fn apply(
    scope: &Scope,
    caller: &LockedRun,
    who: &Identity,
    found: Found,
    args: &Arguments,
    terms: Option<(&str, i32, bool)>,
) -> Result<Answer> {
    let (run, mut rec) = match found {
        Found::Held(run, rec) => (Some(run), rec),
        Found::Unheld(rec) => (None, rec),
        Found::Purging(rec) => return Ok(Answer::of(&rec, "busy")),
    };
    // An approval past its deadline is expired by the first claim that holds the call's run, so
    // the worker learns it now rather than after the next sweep.
    if let (Some(run), Some(ApprovalStatus::Expired), CallStatus::WaitingApproval, Some(id)) =
        (&run, rec.approval, rec.status, rec.approval_id.as_deref())
    {
        if decisions::expire(scope, run, id)? {
            rec.status = CallStatus::Rejected;
        }
    }
    let retry_failed = terms.is_some_and(|(_, _, retry)| retry);
    let decision = decide(&rec.existing(), who.tool_ref, &args.hash, retry_failed)
        .map_err(|_| rec.reused(who, &args.hash))?;
    Ok(match (decision, run, terms) {
        (Decision::Replay, _, _) => {
            let response = replay_response(scope, &rec)?;
            if who.run_id != rec.run_id {
                replayed_into(scope, caller, &rec)?;
            }
            Answer::Of(rec.id, "replayed", Some(response))
        }
        (Decision::InDoubt { mark }, run, _) => {
            if let (true, Some(run)) = (mark, &run) {
                mark_in_doubt(scope, run, &mut rec, None)?;
            }
            Answer::of(&rec, "in_doubt")
        }
        (Decision::WaitingApproval, _, _) => Answer::of(&rec, "waiting_approval"),
        (Decision::Rejected, _, _) => Answer::of(&rec, "rejected"),
        (Decision::Claim, Some(run), Some((owner, lease, _))) => {
            if let Some(budget) = budgets::decide(scope, &run, Meter::ToolCalls)? {
                budgets::park(scope, &run, "tool_call", Some(&rec.tool_call_id), &budget)?;
                return Ok(Answer::Exhausted(Some(rec.id), budget));
            }
            arm(scope, &run, &mut rec, owner, lease, &args.summary)?;
            Answer::Claimed(Box::new((run, rec)))
        }
        // An approved call waits for its claim; an approval request does not claim it.
        (Decision::Claim, _, None) if rec.status == CallStatus::WaitingApproval => {
            Answer::of(&rec, "waiting_approval")
        }
        (Decision::Busy | Decision::Claim, _, _) => Answer::of(&rec, "busy"),
    })
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, error_of, one, running_run};
    use crate::tool_calls::tests::{claim, expire, field, outcome, record, step_status};
    use pgrx::prelude::*;

    #[pg_test]
    fn a_finished_call_replays_its_result_without_a_new_attempt() {
        running_run("t-tc-replay");
        outcome(r#"{"q": 1}"#, "c1");
        let id = record("c1");
        assert_eq!(
            one::<String>(&format!(
                "SELECT ledger.begin_tool_call('{id}', 1)->>'outcome'"
            )),
            "running"
        );
        assert_eq!(step_status("c1"), "running");
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{\"hits\": [1, 2]}}', metadata => '{{\"latency_ms\": 12}}')"
        ))
        .unwrap();
        assert_eq!(step_status("c1"), "succeeded");
        let out = one::<pgrx::JsonB>(&claim(r#"{"q": 1}"#, "c1")).0;
        assert_eq!(out["outcome"], "replayed");
        assert_eq!(
            out["response"]["result"],
            serde_json::json!({"hits": [1, 2]})
        );
        assert_eq!(out["response"]["success"], true);
        assert_eq!(
            out["response"]["metadata"],
            serde_json::json!({"latency_ms": 12, "idempotent_replay": true})
        );
        assert_eq!(out["tool_call"]["attempt"], 1);
        // The same key under another tool_call_id is the same call: a replay, not a unique violation.
        let again = one::<String>(
            "SELECT ledger.claim_tool_call('r', 'search', '{\"q\": 1}', tool_call_id => 'other', idempotency_key => 'tool:r:c1')->>'outcome'",
        );
        assert_eq!(again, "replayed");
        // Replays within the call's own run are no news for its feed.
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.run_events WHERE event_type = 'tool_call.replayed'"
            ),
            0
        );
        // Completing again returns it unchanged.
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'failed', error_message => 'late')"
        ))
        .unwrap();
        assert_eq!(field("c1", "status"), "succeeded");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            1
        );
    }

    #[pg_test]
    fn an_expired_claim_whose_request_never_left_is_taken_over_and_the_old_attempt_fenced() {
        running_run("t-tc-takeover");
        outcome("{}", "c1");
        let id = record("c1");
        expire("c1");
        let out = one::<pgrx::JsonB>(&claim("{}", "c1")).0;
        assert_eq!(
            (
                out["outcome"].as_str(),
                out["tool_call"]["attempt"].as_i64()
            ),
            (Some("claimed"), Some(2))
        );
        for late in [
            format!("SELECT ledger.begin_tool_call('{id}', 1)"),
            format!("SELECT ledger.heartbeat_tool_call('{id}', 1)"),
            format!("SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{}}')"),
        ] {
            let e = assert_error(&late, "40001", "LEASE_STALE");
            assert_eq!(e.detail["current_attempt"], 2);
        }
        assert_eq!(field("c1", "status"), "claimed");
    }

    #[pg_test]
    fn an_expired_call_whose_request_left_is_in_doubt_and_never_claimed_again() {
        running_run("t-tc-doubt");
        outcome("{}", "c1");
        let id = record("c1");
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        expire("c1");
        assert_eq!(outcome("{}", "c1"), "in_doubt");
        assert_eq!(field("c1", "status"), "in_doubt");
        assert_eq!(step_status("c1"), "paused");
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.outbox WHERE event_type = 'tool_call.in_doubt'"
            ),
            1
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.tool_calls_in_doubt"),
            1
        );
        // Whatever the caller asks, it stays in doubt; nothing is re-armed.
        assert_eq!(outcome("{}", "c1"), "in_doubt");
        assert_eq!(
            one::<String>("SELECT ledger.claim_tool_call('r', 'search', '{}', tool_call_id => 'c1', retry_failed => true)->>'outcome'"),
            "in_doubt"
        );
        assert_eq!(field("c1", "attempt"), "1");
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.outbox WHERE event_type = 'tool_call.in_doubt'"
            ),
            1
        );
        // The executor of the current attempt still knows the answer: it is accepted.
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{\"sent\": true}}')"
        ))
        .unwrap();
        assert_eq!(field("c1", "status"), "succeeded");
        assert_eq!(step_status("c1"), "succeeded");
        assert_eq!(outcome("{}", "c1"), "replayed");
    }

    #[pg_test]
    fn bad_tool_call_input_is_refused_and_writes_nothing() {
        running_run("t-tc-bad");
        for (sql, state, code) in [
            (
                "SELECT ledger.claim_tool_call('r', 'search', '[1]')",
                "22023",
                "ARGUMENTS_NOT_OBJECT",
            ),
            (
                "SELECT ledger.claim_tool_call('r', 'search', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.claim_tool_call('r', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.claim_tool_call('r', 'search', timeout_seconds => -1)",
                "22023",
                "TIMEOUT_INVALID",
            ),
            (
                "SELECT ledger.claim_tool_call('r', 'search', idempotency_key => 'a b')",
                "22023",
                "ID_INVALID",
            ),
            (
                "SELECT ledger.claim_tool_call('r', 'search', lease_owner => 'worker 1')",
                "22023",
                "ID_INVALID",
            ),
            (
                "SELECT ledger.begin_tool_call('', 1)",
                "22023",
                "ID_INVALID",
            ),
            (
                "SELECT ledger.claim_tool_call('nope', 'search')",
                "P0002",
                "RUN_NOT_FOUND",
            ),
            (
                "SELECT ledger.begin_tool_call('tc_nope', 1)",
                "P0002",
                "TOOL_CALL_NOT_FOUND",
            ),
            (
                "SELECT ledger.begin_tool_call('tc_nope', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.complete_tool_call('tc_nope', 1, 'maybe')",
                "22023",
                "OUTCOME_UNKNOWN",
            ),
            (
                "SELECT ledger.heartbeat_tool_call('tc_nope', 1, 0)",
                "P0002",
                "TOOL_CALL_NOT_FOUND",
            ),
            (
                "SELECT ledger.resolve_tool_call('tc_nope', 'retry')",
                "P0002",
                "TOOL_CALL_NOT_FOUND",
            ),
        ] {
            assert_error(sql, state, code);
        }
        let deep = "('{\"a\": ' || repeat('[', 150) || '1' || repeat(']', 150) || '}')::jsonb";
        assert_error(
            &format!("SELECT ledger.claim_tool_call('r', 'search', {deep})"),
            "22023",
            "INPUT_TOO_DEEP",
        );
        // 100,000 deep cannot even become a jsonb value: PostgreSQL refuses it before the ledger runs.
        let e = error_of("SELECT ledger.claim_tool_call('r', 'search', ('{\"a\": ' || repeat('[', 100000) || repeat(']', 100000) || '}')::jsonb)");
        assert!(["54001", "22023"].contains(&e.sqlstate.as_str()), "{e:?}");
        // Hostile keys are just keys.
        let hostile = r#"{"\u202eevil": 1, "": 2, "a\"b": 3, "\\": 4, "🦀🦀": {"PASSWORD": "x"}}"#;
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('r', 'search', '{hostile}', tool_call_id => 'h')"
        ))
        .0;
        assert_eq!(
            out["tool_call"]["arguments"]["🦀🦀"]["PASSWORD"],
            "[REDACTED]"
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            1
        );
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_steps"), 1);
        // A call on a finished run, or on a step that is not a tool step, is refused.
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 'llm-step')").unwrap();
        assert_error(
            "SELECT ledger.claim_tool_call('r', 'search', step_id => 'llm-step')",
            "22023",
            "STEP_NOT_TOOL",
        );
        Spi::run("SELECT ledger.transition_run('r', 'succeeded')").unwrap();
        assert_error(
            "SELECT ledger.claim_tool_call('r', 'search', '{\"new\": 1}')",
            "55000",
            "RUN_TERMINAL",
        );
        // ... but an existing call of it still replays or reports.
        assert_eq!(
            one::<String>(&format!("{}->>'outcome'", claim(hostile, "h"))),
            "busy"
        );
    }
}
