//! The repeatable path: tools the caller declares safe to repeat (reads, idempotent APIs) run
//! first and are recorded once after they return, in one statement (`record_tool_call`), after a
//! lookup that writes nothing (`find_tool_call`) so that a repeat gets the recorded result without
//! running the tool. Nothing is leased and nothing is marked begun: running such a tool twice is
//! harmless, so two callers may both run it, and the first record wins. A key whose record holds
//! a side-effecting request that may have left, or may still leave, keeps that call's protocol
//! (`busy`, `in_doubt`, waiting for an approval): the repeatable path never writes over it.

use super::claim::Answer;
use super::lookup::{find, find_locked, tombstone, Found};
use super::record::{
    canonical_result, finish, finished_step, identity_columns, mark_in_doubt, replay_response,
    replayed_into, reused_before, store_result, tool_step,
};
use super::{arguments as parse_arguments, event, identity, step_to, Arguments, Identity};
use crate::audit;
use crate::db;
use crate::error::{LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::redaction::{free_text, redacted_object};
use crate::rows::{self, LockedRun, ToolCall};
use crate::scope::{self, Scope};
use crate::steps::StepChange;
use ledger_model::args::required;
use ledger_model::events::{AuditKind, Event, ToolCallCompleted};
use ledger_model::ids;
use ledger_model::status::Status;
use ledger_model::tool_calls::{decide, CallStatus, Decision, Outcome, MIN_LEASE_SECONDS};
use pgrx::prelude::*;
use serde_json::{json, Value};

/// What a lookup answers for a call that has no record: run the tool, then record it.
const UNRECORDED: &str =
    r#"{"outcome":"unrecorded","tool_call":null,"approval":null,"response":null}"#;

/// What a repeatable call's key holds, before the tool runs: the recorded result (`replayed`),
/// nothing to replay (`unrecorded`: run it, then `record_tool_call`), or a side-effecting call's
/// state. Writes only a re-run's first reuse of its lineage's result, as a claim does.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn find_tool_call(
    run_id: Option<&str>,
    tool_ref: Option<&str>,
    arguments: default!(Option<Jsonb>, "'{}'"),
    tool_call_id: default!(Option<&str>, "NULL"),
    idempotency_key: default!(Option<&str>, "NULL"),
    retry_failed: default!(Option<bool>, false),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        let scope = scope::current()?;
        let who = identity(run_id, tool_ref, tool_call_id, idempotency_key)?;
        if tool_call_id.is_none() && idempotency_key.is_none() {
            // A generated id names no earlier call: the lookup could only say `unrecorded`.
            return Err(LedgerError::required("tool_call_id").into());
        }
        let args = parse_arguments(arguments)?;
        let run = rows::run(&scope, "run_id", who.run_id)?;
        let Some(rec) = find(&scope, &run, &who, &args)? else {
            return Ok(match tombstone(&scope, &who, &args)? {
                Some(purged) => purged,
                None => Jsonb(UNRECORDED.to_owned()),
            });
        };
        let answer = match repeat(&rec, &who, &args, retry_failed.unwrap_or(false))? {
            Decision::Replay => {
                if rec.run_id != run.id && !reused_before(&scope, &run.id, &rec)? {
                    let caller = rows::lock_run(&scope, "run_id", &run.id)?;
                    replayed_into(&scope, &caller, &rec)?;
                }
                let response = replay_response(&scope, &rec)?;
                Answer::Of(rec.id, "replayed", Some(response))
            }
            other => Answer::Of(rec.id, stopped(other).unwrap_or("unrecorded"), None),
        };
        Ok(answer.json(&scope)?)
    })
}

/// The outcome of a record that neither replays nor runs the tool.
fn stopped(decision: Decision) -> Option<&'static str> {
    match decision {
        Decision::InDoubt { .. } => Some("in_doubt"),
        Decision::Busy => Some("busy"),
        Decision::WaitingApproval => Some("waiting_approval"),
        Decision::Rejected => Some("rejected"),
        Decision::Replay | Decision::Claim => None,
    }
}

/// A claim's decision on a record, other input under its identity a mismatch naming it. Where a
/// claim would hand out a new attempt (`Decision::Claim`) no request of the call can be under
/// way: the repeatable path runs the tool, and its record is that attempt.
fn repeat(
    rec: &ToolCall,
    who: &Identity,
    args: &Arguments,
    retry_failed: bool,
) -> Result<Decision> {
    decide(&rec.existing(), who.tool_ref, &args.hash, retry_failed)
        .map_err(|_| rec.reused(who, &args.hash))
}

/// How a repeatable call ended, as its caller reports it.
struct Done<'a> {
    success: bool,
    result: Option<Jsonb>,
    error_message: Option<&'a str>,
    metadata: Value,
}

impl Done<'_> {
    fn status(&self) -> CallStatus {
        if self.success {
            CallStatus::Succeeded
        } else {
            CallStatus::Failed
        }
    }

    fn error_code(&self) -> Option<&'static str> {
        (!self.success).then_some("TOOL_ERROR")
    }
}

/// Records a repeatable call that has run, once: the first record of its key wins, and a
/// later one returns it (`replayed`) writing nothing.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn record_tool_call(
    run_id: Option<&str>,
    tool_ref: Option<&str>,
    arguments: Option<Jsonb>,
    outcome: Option<&str>,
    result: default!(Option<Jsonb>, "NULL"),
    error_message: default!(Option<&str>, "NULL"),
    tool_call_id: default!(Option<&str>, "NULL"),
    idempotency_key: default!(Option<&str>, "NULL"),
    metadata: default!(Option<Jsonb>, "NULL"),
    retry_failed: default!(Option<bool>, false),
    run_token: default!(Option<i64>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        let scope = scope::current()?;
        let who = identity(run_id, tool_ref, tool_call_id, idempotency_key)?;
        let args = parse_arguments(arguments)?;
        let success = Outcome::parse_recorded(required("outcome", outcome)?)? == Outcome::Succeeded;
        let done = Done {
            success,
            result,
            error_message,
            metadata: redacted_object("metadata", metadata)?,
        };
        let run = rows::lock_run(&scope, "run_id", who.run_id)?;
        run.fence(run_token)?;
        let retry_failed = retry_failed.unwrap_or(false);
        Ok(record(&scope, &run, &who, &args, &done, retry_failed)?.json(&scope)?)
    })
}

/// Records the call in the run this transaction holds, or answers the record that wins.
fn record(
    scope: &Scope,
    run: &LockedRun,
    who: &Identity,
    args: &Arguments,
    done: &Done,
    retry_failed: bool,
) -> Result<Answer> {
    // Twice at most: an insert that lost a race to another run's record finds it next time.
    for _ in 0..2 {
        if let Some(found) = find_locked(scope, run, who, args)? {
            return settle(scope, run, who, args, found, done, retry_failed);
        }
        if let Some(purged) = tombstone(scope, who, args)? {
            return Ok(Answer::Purged(purged));
        }
        run.ensure_live("tool calls")?;
        if let Some(id) = insert(scope, run, who, args, done)? {
            return Ok(Answer::Of(id, "recorded", None));
        }
    }
    Err(LedgerError::internal(
        "record did not settle after a concurrent insert",
    ))
}

/// What a record does with the record its key already has. Only a record whose run this
/// transaction holds is written.
fn settle(
    scope: &Scope,
    caller: &LockedRun,
    who: &Identity,
    args: &Arguments,
    found: Found,
    done: &Done,
    retry_failed: bool,
) -> Result<Answer> {
    let (held, mut rec) = match found {
        Found::Held(run, rec) => (Some(run), rec),
        Found::Unheld(rec) => (None, rec),
        Found::Purging(rec) => return Ok(Answer::Of(rec.id, "busy", None)),
    };
    Ok(match (repeat(&rec, who, args, retry_failed)?, held) {
        (Decision::Replay, _) => {
            let response = replay_response(scope, &rec)?;
            if who.run_id != rec.run_id {
                replayed_into(scope, caller, &rec)?;
            }
            Answer::Of(rec.id, "replayed", Some(response))
        }
        (Decision::InDoubt { mark }, held) => {
            if let (true, Some(run)) = (mark, &held) {
                mark_in_doubt(scope, run, &mut rec, None)?;
            }
            Answer::Of(rec.id, "in_doubt", None)
        }
        (Decision::Claim, Some(run)) => {
            record_again(scope, &run, &mut rec, done)?;
            Answer::Of(rec.id, "recorded", None)
        }
        (Decision::Claim, None) => Answer::Of(rec.id, "busy", None),
        (other, _) => Answer::Of(rec.id, stopped(other).unwrap_or("busy"), None),
    })
}

/// A new record: its tool step, created finished, and the call with its result, in one insert
/// each; `tool_call.completed` and a `tool_call.record` audit record. None when a concurrent
/// record of another run took the key first.
fn insert(
    scope: &Scope,
    run: &LockedRun,
    who: &Identity,
    args: &Arguments,
    done: &Done,
) -> Result<Option<String>> {
    let canonical = canonical_result(done.result.as_ref())?;
    let status = done.status();
    let mut rec = ToolCall {
        id: ids::new_id("tc"),
        run_id: who.run_id.to_owned(),
        step_id: String::new(),
        tool_call_id: who.tool_call_id.clone(),
        tool_ref: who.tool_ref.to_owned(),
        idempotency_key: who.idempotency_key.clone(),
        request_hash: args.hash.clone(),
        status,
        attempt: 1,
        lease_seconds: MIN_LEASE_SECONDS,
        lease_held: false,
        lease_live: false,
        outbound_started: false,
        result_artifact_id: None,
        result_sha256: None,
        approval: None,
        lease_owner: None,
        approval_id: None,
    };
    let (summary, metrics) = finished_step(&rec, canonical.as_deref());
    let step_status = if done.success {
        Status::Succeeded
    } else {
        Status::Failed
    };
    let ended = StepChange {
        output_summary: summary.as_deref(),
        metrics: Some(metrics),
        error_code: done.error_code(),
        error_message: done.error_message,
        error_details: None,
    };
    rec.step_id = tool_step(scope, run, who, step_status, ended)?;
    let stored = store_result(scope, run, &rec, canonical.as_deref())?;
    let mut params = scope.args(identity_columns(&rec.id, &rec.step_id, who, args));
    params.extend([status.as_str().into(), MIN_LEASE_SECONDS.into()]);
    params.extend(stored.columns());
    params.extend([
        Jsonb::from(&done.metadata).into(),
        done.error_code().into(),
        free_text(done.error_message).into(),
    ]);
    let inserted = db::write_one(
        include_str!("../../sql/queries/insert_recorded_tool_call.sql"),
        &params,
        |r| db::req::<String>(r, 1),
    )?;
    if inserted.is_none() {
        return Ok(None);
    }
    let completed = Event::ToolCallCompleted(ToolCallCompleted {
        call: rec.ids(),
        status: status.as_str(),
        result_artifact_id: stored.artifact(),
    });
    event(scope, run, &rec, &completed)?;
    audit_record(scope, &rec)?;
    Ok(Some(rec.id))
}

/// Records the outcome over a record whose request never left (or failed, with `retry_failed`)
/// as its next attempt, completed at once.
fn record_again(scope: &Scope, run: &LockedRun, rec: &mut ToolCall, done: &Done) -> Result<()> {
    rec.attempt = db::write_one(
        "UPDATE ledger.run_step_tool_calls SET attempt = attempt + 1, outbound_started_at = NULL \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 RETURNING attempt",
        &scope.args([rec.id.as_str().into()]),
        |r| db::req::<i64>(r, 1),
    )?
    .ok_or_else(|| LedgerError::internal("tool call vanished under its lock"))?;
    // The step runs again first: a failed step reaches its end only through `retrying`.
    step_to(scope, run, rec, Status::Running)?;
    finish(
        scope,
        run,
        rec,
        done.success,
        done.result.clone(),
        done.error_message,
        done.error_code(),
        &done.metadata,
    )?;
    audit_record(scope, rec)
}

/// The audit record of a recorded call (no actor: nothing held a lease).
fn audit_record(scope: &Scope, rec: &ToolCall) -> Result<()> {
    audit::write(
        scope,
        Some(&rec.run_id),
        Some(&rec.step_id),
        AuditKind::ToolCallRecord,
        rec.status.as_str(),
        None,
        json!({"tool_call": rec.ids()}),
    )
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, error_of, one, running_run, set_scope};
    use crate::tool_calls::tests::{
        claim, expire, field, outcome, record, request_pay, step_status,
    };
    use pgrx::prelude::*;
    use serde_json::json;

    fn find(args: &str, call: &str, rest: &str) -> serde_json::Value {
        one::<pgrx::JsonB>(&format!(
            "SELECT ledger.find_tool_call('r', 'search', '{args}', tool_call_id => '{call}'{rest})"
        ))
        .0
    }

    fn record_call(args: &str, call: &str, ending: &str) -> serde_json::Value {
        one::<pgrx::JsonB>(&format!(
            "SELECT ledger.record_tool_call('r', 'search', '{args}', {ending}, tool_call_id => '{call}')"
        ))
        .0
    }

    fn last_seq() -> i64 {
        one::<i64>("SELECT last_seq FROM ledger.runs WHERE id = 'r'")
    }

    fn count(table: &str) -> i64 {
        one::<i64>(&format!("SELECT count(*) FROM ledger.{table}"))
    }

    #[pg_test]
    fn a_repeatable_call_is_recorded_once_in_one_statement_and_replayed_by_key() {
        running_run("t-rep-once");
        let args = r#"{"q": "shoes", "api_key": "sk-live-0123456789abcdefghij"}"#;
        let first = find(args, "c1", "");
        assert_eq!(first["outcome"], "unrecorded");
        assert_eq!(first["tool_call"], serde_json::Value::Null);
        let (seq, audits) = (last_seq(), count("audit_events"));
        let out = record_call(args, "c1", "'succeeded', '{\"hits\": [1, 2]}'");
        assert_eq!(out["outcome"], "recorded");
        let tc = &out["tool_call"];
        assert_eq!(
            (tc["status"].as_str(), tc["attempt"].as_i64()),
            (Some("succeeded"), Some(1))
        );
        assert_eq!(tc["arguments"]["api_key"], "[REDACTED]");
        assert_eq!(
            tc["request_hash"].as_str().unwrap(),
            one::<String>(&format!("SELECT ledger.request_hash('{args}')"))
        );
        assert_eq!(tc["lease_owner"], serde_json::Value::Null);
        assert_eq!(tc["outbound_started_at"], serde_json::Value::Null);
        // The step is created finished; the feed gets its creation and the completion, nothing
        // claimed or begun; one audit record says the call was recorded.
        assert_eq!(step_status("c1"), "succeeded");
        assert_eq!(
            one::<String>("SELECT concat_ws('|', output_summary, metrics->'tool_call'->>'attempt', started_at IS NOT NULL, ended_at IS NOT NULL) FROM ledger.run_steps"),
            r#"{"hits":[1,2]}|1|t|t"#
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT string_agg(event_type || ':' || coalesce(payload->>'status', ''), ' ' ORDER BY seq) FROM ledger.run_events WHERE seq > {seq}"
            )),
            "step.created:succeeded tool_call.completed:succeeded"
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT string_agg(gateway_type || ':' || outcome, ' ') FROM ledger.audit_events WHERE payload->'tool_call'->>'tool_call_record_id' = '{}'",
                tc["id"].as_str().unwrap()
            )),
            "tool_call.record:succeeded"
        );
        assert_eq!(count("audit_events"), audits + 1);
        assert!(!one::<String>("SELECT string_agg(arguments::text || coalesce(result::text, ''), '') FROM ledger.run_step_tool_calls").contains("sk-live"));
        // A repeat is a replay, found without writing; a second record is the first one's.
        let again = find(args, "c1", "");
        assert_eq!(again["outcome"], "replayed");
        assert_eq!(
            again["response"],
            json!({"result": {"hits": [1, 2]}, "success": true, "error": null, "metadata": {"idempotent_replay": true}})
        );
        let seq = last_seq();
        let late = record_call(args, "c1", "'succeeded', '{\"hits\": [3]}'");
        assert_eq!(late["outcome"], "replayed");
        assert_eq!(late["response"]["result"], json!({"hits": [1, 2]}));
        let late = record_call(args, "c1", "'failed', error_message => 'HTTP 500'");
        assert_eq!(late["response"]["success"], true);
        assert_eq!(last_seq(), seq, "nothing written");
        assert_eq!(count("run_step_tool_calls"), 1);
        // The claim path replays it too: one key, one record, whichever path asks.
        assert_eq!(outcome(args, "c1"), "replayed");
        // A large result lives in a verified artifact, as a completion's does.
        let big = "jsonb_build_object('text', repeat('x', 10000))";
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.record_tool_call('r', 'search', '{{}}', 'succeeded', {big}, tool_call_id => 'big')"
        ))
        .0;
        assert!(out["tool_call"]["result_artifact_id"].is_string());
        assert!(one::<bool>(&format!(
            "SELECT (ledger.find_tool_call('r', 'search', '{{}}', tool_call_id => 'big')->'response'->'result') = {big}"
        )));
        // The run's evidence sees the calls and their audit records.
        assert!(one::<bool>(
            "SELECT NOT (ledger.replay_ready('r')->'missing' ?| array['tool_calls', 'audits'])"
        ));
        assert_eq!(
            one::<String>("SELECT string_agg(e->>'status', ',') FROM jsonb_array_elements(ledger.run_evidence('r')) e WHERE e->>'key' IN ('tool_call', 'audit_record')"),
            "pass,pass"
        );
        // The lookup writes nothing, so it answers in a read-only transaction (a hot standby);
        // the record is a write.
        Spi::run("SET LOCAL transaction_read_only = on").unwrap();
        assert_eq!(find(args, "c1", "")["outcome"], "replayed");
        assert_eq!(find("{}", "c9", "")["outcome"], "unrecorded");
        assert_error(
            "SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', tool_call_id => 'c9')",
            "25006",
            "READ_ONLY",
        );
    }

    #[pg_test]
    fn a_recorded_failure_replays_and_is_recorded_over_only_when_asked() {
        running_run("t-rep-failed");
        let out = record_call("{}", "c1", "'failed', error_message => 'HTTP 503'");
        assert_eq!(out["outcome"], "recorded");
        assert_eq!(
            (field("c1", "status"), field("c1", "error_code")),
            ("failed".into(), "TOOL_ERROR".into())
        );
        assert_eq!(step_status("c1"), "failed");
        let replay = find("{}", "c1", "");
        assert_eq!(
            (
                replay["outcome"].as_str(),
                replay["response"]["success"].as_bool()
            ),
            (Some("replayed"), Some(false))
        );
        assert_eq!(replay["response"]["error"], "HTTP 503");
        assert_eq!(
            find("{}", "c1", ", retry_failed => true")["outcome"],
            "unrecorded"
        );
        assert_eq!(
            record_call("{}", "c1", "'succeeded', '{}'")["outcome"],
            "replayed"
        );
        let again = one::<pgrx::JsonB>("SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', '{\"ok\": 1}', tool_call_id => 'c1', retry_failed => true)").0;
        assert_eq!(again["outcome"], "recorded");
        assert_eq!(
            (
                field("c1", "status"),
                field("c1", "attempt"),
                field("c1", "error_code")
            ),
            ("succeeded".into(), "2".into(), "(null)".into())
        );
        assert_eq!(step_status("c1"), "succeeded");
        assert_eq!(
            one::<String>("SELECT string_agg(outcome, ',' ORDER BY created_at, id) FROM ledger.audit_events WHERE gateway_type = 'tool_call.record'"),
            "failed,succeeded"
        );
    }

    #[pg_test]
    fn a_side_effecting_call_under_the_key_keeps_its_in_doubt_protocol() {
        running_run("t-rep-side");
        // Leased by a claim: busy, and nothing written.
        outcome("{}", "c1");
        let id = record("c1");
        assert_eq!(find("{}", "c1", "")["outcome"], "busy");
        assert_eq!(
            record_call("{}", "c1", "'succeeded', '{}'")["outcome"],
            "busy"
        );
        assert_eq!(field("c1", "status"), "claimed");
        // Begun and past its lease: the lookup says in doubt; the record marks it, as a claim.
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        expire("c1");
        assert_eq!(
            find("{}", "c1", ", retry_failed => true")["outcome"],
            "in_doubt"
        );
        assert_eq!(field("c1", "status"), "running", "a lookup marks nothing");
        assert_eq!(
            record_call("{}", "c1", "'succeeded', '{}'")["outcome"],
            "in_doubt"
        );
        assert_eq!(field("c1", "status"), "in_doubt");
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.outbox WHERE event_type = 'tool_call.in_doubt'"
            ),
            1
        );
        assert_eq!(
            record_call("{}", "c1", "'succeeded', '{}'")["outcome"],
            "in_doubt"
        );
        assert_eq!(field("c1", "result"), "(null)");
        // Claimed and never begun past its lease: no request can be under way, so the repeatable
        // path runs it and records its next attempt; the old attempt can no longer begin.
        outcome("{}", "c2");
        let id2 = record("c2");
        expire("c2");
        let found = find("{}", "c2", "");
        assert_eq!(
            (found["outcome"].as_str(), found["tool_call"]["id"].as_str()),
            (Some("unrecorded"), Some(id2.as_str()))
        );
        assert_eq!(
            record_call("{}", "c2", "'succeeded', '{\"n\": 2}'")["outcome"],
            "recorded"
        );
        assert_eq!(
            (
                field("c2", "status"),
                field("c2", "attempt"),
                field("c2", "lease_owner")
            ),
            ("succeeded".into(), "2".into(), "(null)".into())
        );
        assert_eq!(step_status("c2"), "succeeded");
        assert_error(
            &format!("SELECT ledger.begin_tool_call('{id2}', 1)"),
            "40001",
            "LEASE_STALE",
        );
        // Waiting for a person: it waits, whichever path asks.
        request_pay("{}");
        let pay = "ledger.find_tool_call('r', 'wire_money', '{}', tool_call_id => 'pay')";
        assert_eq!(
            one::<String>(&format!("SELECT {pay}->>'outcome'")),
            "waiting_approval"
        );
        assert_eq!(
            one::<String>("SELECT ledger.record_tool_call('r', 'wire_money', '{}', 'succeeded', tool_call_id => 'pay')->>'outcome'"),
            "waiting_approval"
        );
        assert_eq!(field("pay", "status"), "waiting_approval");
        // A claim of a recorded call replays it.
        let replayed = one::<pgrx::JsonB>(&claim("{}", "c2")).0;
        assert_eq!(replayed["response"]["result"], json!({"n": 2}));
    }

    #[pg_test]
    fn bad_repeatable_input_is_refused_and_writes_nothing() {
        running_run("t-rep-bad");
        record_call(r#"{"q": 1}"#, "c1", "'succeeded', '{}'");
        let seq = last_seq();
        for (sql, state, code) in [
            ("SELECT ledger.record_tool_call('r', 'search', '{}', 'unknown', tool_call_id => 'x')", "22023", "OUTCOME_UNKNOWN"),
            ("SELECT ledger.record_tool_call('r', 'search', '{}', NULL, tool_call_id => 'x')", "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.record_tool_call('r', 'search', '[1]', 'succeeded', tool_call_id => 'x')", "22023", "ARGUMENTS_NOT_OBJECT"),
            ("SELECT ledger.record_tool_call('r', 'search', NULL, 'succeeded', tool_call_id => 'x')", "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.record_tool_call('r', NULL, '{}', 'succeeded', tool_call_id => 'x')", "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', metadata => '[1]', tool_call_id => 'x')", "22023", "ARGUMENT_NOT_OBJECT"),
            ("SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', tool_call_id => 'a b')", "22023", "ID_INVALID"),
            ("SELECT ledger.record_tool_call('nope', 'search', '{}', 'succeeded', tool_call_id => 'x')", "P0002", "RUN_NOT_FOUND"),
            ("SELECT ledger.record_tool_call('r', 'search', '{\"q\": 2}', 'succeeded', tool_call_id => 'c1')", "23505", "IDEMPOTENCY_MISMATCH"),
            ("SELECT ledger.record_tool_call('r', 'fetch', '{\"q\": 1}', 'succeeded', tool_call_id => 'c1')", "23505", "IDEMPOTENCY_MISMATCH"),
            ("SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', tool_call_id => 'x', run_token => 7)", "40001", "LEASE_STALE"),
            ("SELECT ledger.find_tool_call('r', 'search', '{}')", "22023", "ARGUMENT_REQUIRED"),
            ("SELECT ledger.find_tool_call('r', 'search', '[]', tool_call_id => 'x')", "22023", "ARGUMENTS_NOT_OBJECT"),
            ("SELECT ledger.find_tool_call('r', 'search', '{\"q\": 2}', tool_call_id => 'c1')", "23505", "IDEMPOTENCY_MISMATCH"),
            ("SELECT ledger.find_tool_call('r', 'search', '{\"q\": 1}', tool_call_id => 'c1', idempotency_key => 'k2')", "23505", "IDEMPOTENCY_MISMATCH"),
            ("SELECT ledger.find_tool_call('nope', 'search', tool_call_id => 'x')", "P0002", "RUN_NOT_FOUND"),
            ("SELECT ledger.find_tool_call('r', 'search', idempotency_key => '')", "22023", "ID_INVALID"),
        ] {
            let e = assert_error(sql, state, code);
            if code == "IDEMPOTENCY_MISMATCH" {
                assert_eq!(e.detail["run_id"], "r", "{sql}");
            }
        }
        assert_eq!(last_seq(), seq);
        assert_eq!(count("run_step_tool_calls"), 1);
        // A finished run takes no new call, but its recorded ones still answer.
        Spi::run("SELECT ledger.transition_run('r', 'succeeded')").unwrap();
        assert_error(
            "SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', tool_call_id => 'x')",
            "55000",
            "RUN_TERMINAL",
        );
        assert_eq!(
            record_call(r#"{"q": 1}"#, "c1", "'succeeded', '{}'")["outcome"],
            "replayed"
        );
        Spi::run("SELECT set_config('ledger.tenant_id', '', true), set_config('ledger.workspace_id', '', true)").unwrap();
        for sql in [
            "SELECT ledger.find_tool_call('r', 'search', tool_call_id => 'c1')",
            "SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', tool_call_id => 'c1')",
        ] {
            assert_error(sql, "42501", "SCOPE_MISSING");
        }
    }

    #[pg_test]
    fn a_rerun_replays_its_lineages_recorded_calls_and_records_the_reuse_once() {
        running_run("t-rep-lineage");
        record_call("{}", "c1", "'succeeded', '{\"v\": 1}'");
        record_call("{}", "c2", "'failed', error_message => 'boom'");
        Spi::run("SELECT ledger.transition_run('r', 'failed')").unwrap();
        let g1 = one::<String>("SELECT id FROM ledger.retry_run('r')");
        let in_g1 = |f: &str, call: &str, ending: &str| {
            one::<pgrx::JsonB>(&format!(
                "SELECT ledger.{f}('{g1}', 'search', '{{}}', {ending}tool_call_id => '{call}')"
            ))
            .0
        };
        let replayed = in_g1("find_tool_call", "c1", "");
        assert_eq!(
            (
                replayed["outcome"].as_str(),
                replayed["tool_call"]["run_id"].as_str()
            ),
            (Some("replayed"), Some("r"))
        );
        assert_eq!(replayed["response"]["result"], json!({"v": 1}));
        for _ in 0..2 {
            assert_eq!(in_g1("find_tool_call", "c1", "")["outcome"], "replayed");
            assert_eq!(
                in_g1("record_tool_call", "c1", "'succeeded', NULL, ")["outcome"],
                "replayed"
            );
        }
        assert_eq!(
            one::<i64>(&format!("SELECT count(*) FROM ledger.events_since('{g1}') WHERE event_type = 'tool_call.replayed'")),
            1,
            "the reuse is written once"
        );
        assert_eq!(
            one::<i64>(&format!("SELECT count(*) FROM ledger.audit_events WHERE run_id = '{g1}' AND gateway_type = 'tool_call.replay'")),
            1
        );
        assert_eq!(
            one::<i32>(&format!(
                "SELECT jsonb_array_length(ledger.replay_bundle('{g1}')->'reused_tool_calls')"
            )),
            1
        );
        // A call that failed in the ancestor is the re-run's own to make.
        assert_eq!(in_g1("find_tool_call", "c2", "")["outcome"], "unrecorded");
        let own = in_g1("record_tool_call", "c2", "'succeeded', '{}', ");
        assert_eq!(
            (own["outcome"].as_str(), own["tool_call"]["run_id"].as_str()),
            (Some("recorded"), Some(g1.as_str()))
        );
        let e = assert_error(
            &format!("SELECT ledger.find_tool_call('{g1}', 'search', '{{\"other\": 1}}', tool_call_id => 'c1')"),
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(e.detail["run_id"], "r");
    }

    #[pg_test]
    fn repeatable_calls_stay_in_their_scope_under_every_role() {
        running_run("t-rep-scope-a");
        Spi::run("SET LOCAL ROLE ledger_writer").unwrap();
        assert_eq!(
            record_call("{}", "c1", "'succeeded', '{\"a\": 1}'")["outcome"],
            "recorded"
        );
        assert_eq!(find("{}", "c1", "")["outcome"], "replayed");
        Spi::run("RESET ROLE").unwrap();
        // A reader may not run them (they may write), nor may a role without a ledger grant.
        Spi::run("CREATE ROLE ledger_rep_nobody").unwrap();
        for role in ["ledger_reader", "ledger_rep_nobody"] {
            Spi::run(&format!("SET LOCAL ROLE {role}")).unwrap();
            for sql in [
                "SELECT ledger.find_tool_call('r', 'search', '{}', tool_call_id => 'c1')",
                "SELECT ledger.record_tool_call('r', 'search', '{}', 'succeeded', tool_call_id => 'c1')",
            ] {
                assert_eq!(error_of(sql).sqlstate, "42501", "{role}: {sql}");
            }
            Spi::run("RESET ROLE").unwrap();
        }
        // Another scope knows neither the run nor the call, and its own key is its own.
        running_run("t-rep-scope-b");
        Spi::run("SET LOCAL ROLE ledger_writer").unwrap();
        let other = find("{}", "c1", "");
        assert_eq!(other["outcome"], "unrecorded");
        assert_eq!(
            record_call("{}", "c1", "'succeeded', '{\"b\": 2}'")["outcome"],
            "recorded"
        );
        assert_eq!(find("{}", "c1", "")["response"]["result"], json!({"b": 2}));
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            1,
            "RLS shows this scope's record only"
        );
        Spi::run("RESET ROLE").unwrap();
        set_scope("t-rep-scope-a", "w");
        assert_eq!(find("{}", "c1", "")["response"]["result"], json!({"a": 1}));
    }
}
