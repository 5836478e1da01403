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
    canonical_result, finish, finished_step, mark_in_doubt, replay_response, replayed_into,
    reused_before, store_result,
};
use super::{arguments as parse_arguments, audit, event, identity, Arguments, Identity};
use crate::db;
use crate::error::{LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::redaction::{free_text, redacted_object};
use crate::rows::{self, LockedRun, ToolCall};
use crate::scope::{self, Scope};
use crate::steps::{self, NewStep, StepChange};
use ledger_model::args::required;
use ledger_model::events::{AuditKind, Event, ToolCallCompleted};
use ledger_model::ids;
use ledger_model::status::Status;
use ledger_model::tool_calls::{decide_repeatable, CallStatus, Outcome, Repeat, MIN_LEASE_SECONDS};
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
            Repeat::Replay => {
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
fn stopped(repeat: Repeat) -> Option<&'static str> {
    match repeat {
        Repeat::InDoubt { .. } => Some("in_doubt"),
        Repeat::Busy => Some("busy"),
        Repeat::WaitingApproval => Some("waiting_approval"),
        Repeat::Rejected => Some("rejected"),
        Repeat::Replay | Repeat::Execute => None,
    }
}

/// The repeatable decision on a record, other input under its identity a mismatch naming it.
fn repeat(rec: &ToolCall, who: &Identity, args: &Arguments, retry_failed: bool) -> Result<Repeat> {
    decide_repeatable(&rec.existing(), who.tool_ref, &args.hash, retry_failed)
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
        (Repeat::Replay, _) => {
            let response = replay_response(scope, &rec)?;
            if who.run_id != rec.run_id {
                replayed_into(scope, caller, &rec)?;
            }
            Answer::Of(rec.id, "replayed", Some(response))
        }
        (Repeat::InDoubt { mark }, held) => {
            if let (true, Some(run)) = (mark, &held) {
                mark_in_doubt(scope, run, &mut rec, None)?;
            }
            Answer::Of(rec.id, "in_doubt", None)
        }
        (Repeat::Execute, Some(run)) => {
            record_again(scope, &run, &mut rec, done)?;
            Answer::Of(rec.id, "recorded", None)
        }
        (Repeat::Execute, None) => Answer::Of(rec.id, "busy", None),
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
    };
    let (summary, metrics) = finished_step(&rec, canonical.as_deref());
    rec.step_id = steps::create(
        scope,
        run,
        &NewStep {
            step_type: "tool",
            step_key: Some(&who.tool_call_id),
            node_id: None,
            input_summary: Some(&format!("tool={}", who.tool_ref)),
            status: if done.success {
                Status::Succeeded
            } else {
                Status::Failed
            },
            step_id: None,
            ended: StepChange {
                output_summary: summary.as_deref(),
                metrics: Some(metrics),
                error_code: done.error_code(),
                error_message: done.error_message,
                error_details: None,
            },
        },
    )?;
    let stored = store_result(
        scope,
        run,
        &rec.step_id,
        &rec.tool_call_id,
        &rec.id,
        canonical.as_deref(),
    )?;
    let mut params = scope.args([
        rec.id.as_str().into(),
        who.run_id.into(),
        rec.step_id.as_str().into(),
        who.tool_call_id.as_str().into(),
        who.tool_ref.into(),
        who.idempotency_key.as_str().into(),
        args.hash.as_str().into(),
        Jsonb::from(&args.summary).into(),
        status.as_str().into(),
        MIN_LEASE_SECONDS.into(),
    ]);
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
    audit(
        scope,
        &rec.run_id,
        Some(&rec.step_id),
        AuditKind::ToolCallRecord,
        rec.status.as_str(),
        None,
        json!({"tool_call": rec.ids()}),
    )
}
