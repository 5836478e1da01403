//! Executing a claimed call: `begin_tool_call` (the outbound boundary), `heartbeat_tool_call`,
//! `complete_tool_call`, each fenced by the attempt.

use super::record::{finish, mark_in_doubt};
use super::{event, outcome, step_to};
use crate::audit;
use crate::db;
use crate::error::{raise, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::redaction::redacted_object;
use crate::rows::{self, LockedRun, ToolCall};
use crate::scope::{self, Scope};
use ledger_model::args::{required, required_id};
use ledger_model::events::{AuditKind, Event};
use ledger_model::status::Status;
use ledger_model::tool_calls::{extend_seconds, wrong_state, CallStatus, Outcome};
use pgrx::prelude::*;
use serde_json::json;

fn attempt_arg(attempt: Option<i64>) -> Result<i64> {
    attempt.ok_or_else(|| LedgerError::required("attempt"))
}

/// Marks the outbound boundary: the caller COMMITs this before the request leaves the process.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn begin_tool_call(
    tool_call_record_id: Option<&str>,
    attempt: Option<i64>,
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        let scope = scope::current()?;
        let id = required_id("tool_call_record_id", tool_call_record_id)?;
        let attempt = attempt_arg(attempt)?;
        let (run, mut rec) = rows::lock_tool_call_by_id(&scope, id)?;
        rec.fence(attempt)?;
        match rec.status {
            CallStatus::Running => {}
            CallStatus::Claimed => start(&scope, &run, &mut rec)?,
            other => raise(wrong_state("begin", other)),
        }
        Ok(outcome(&scope, id, rec.status.as_str(), None)?)
    })
}

/// Moves a claimed call, fenced by the caller, to running: the outbound boundary.
pub(super) fn start(scope: &Scope, run: &LockedRun, rec: &mut ToolCall) -> Result<()> {
    db::execute(
        include_str!("../../sql/queries/begin_tool_call.sql"),
        &scope.args([
            rec.id.as_str().into(),
            db::clock()?.into(),
            db::clock_plus(rec.lease_seconds.into())?.into(),
        ]),
    )?;
    rec.status = CallStatus::Running;
    step_to(scope, run, rec, Status::Running)?;
    event(scope, run, rec, &Event::ToolCallRunning(rec.ids()))
}

/// Extends the lease of the current attempt.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn heartbeat_tool_call(
    tool_call_record_id: Option<&str>,
    attempt: Option<i64>,
    extend_seconds: default!(Option<i32>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    let scope = scope::current()?;
    let id = required_id("tool_call_record_id", tool_call_record_id)?;
    let attempt = attempt_arg(attempt)?;
    let (_, rec) = rows::lock_tool_call_by_id(&scope, id)?;
    rec.fence(attempt)?;
    if !matches!(rec.status, CallStatus::Claimed | CallStatus::Running) {
        raise(wrong_state("heartbeat", rec.status));
    }
    let seconds = match extend_seconds {
        Some(s) => self::extend_seconds(s)?,
        None => rec.lease_seconds,
    };
    db::execute(
        "UPDATE ledger.run_step_tool_calls \
            SET lease_expires_at = $4, updated_at = now() \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([id.into(), db::clock_plus(seconds.into())?.into()]),
    )?;
    Ok(outcome(&scope, id, rec.status.as_str(), None)?)
}

/// Records how the call ended: `succeeded`, `failed`, or `unknown` (sent, no answer: in_doubt).
/// Fenced by attempt, not by the clock.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn complete_tool_call(
    tool_call_record_id: Option<&str>,
    attempt: Option<i64>,
    outcome: Option<&str>,
    result: default!(Option<Jsonb>, "NULL"),
    error_message: default!(Option<&str>, "NULL"),
    metadata: default!(Option<Jsonb>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        let scope = scope::current()?;
        let id = required_id("tool_call_record_id", tool_call_record_id)?;
        let attempt = attempt_arg(attempt)?;
        let how = Outcome::parse(required("outcome", outcome)?)?;
        let metadata = redacted_object("metadata", metadata)?;
        let (run, mut rec) = rows::lock_tool_call_by_id(&scope, id)?;
        match rec.status {
            // Completing a finished call again changes nothing.
            CallStatus::Succeeded | CallStatus::Failed => {
                return Ok(self::outcome(&scope, id, rec.status.as_str(), None)?)
            }
            CallStatus::WaitingApproval | CallStatus::Rejected => {
                raise(wrong_state("complete", rec.status))
            }
            CallStatus::Claimed | CallStatus::Running | CallStatus::InDoubt => {}
        }
        rec.fence(attempt)?;
        let reported = match how {
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
            Outcome::Unknown => "unknown",
        };
        match how {
            // Already in doubt (a sweep saw the lease expire): nothing new to record.
            Outcome::Unknown if rec.status == CallStatus::InDoubt => {
                return Ok(self::outcome(&scope, id, rec.status.as_str(), None)?)
            }
            Outcome::Unknown => mark_in_doubt(&scope, &run, &mut rec, error_message)?,
            Outcome::Succeeded => finish(
                &scope,
                &run,
                &mut rec,
                true,
                result,
                error_message,
                None,
                &metadata,
            )?,
            Outcome::Failed => finish(
                &scope,
                &run,
                &mut rec,
                false,
                result,
                error_message,
                Some("TOOL_ERROR"),
                &metadata,
            )?,
        }
        audit::write(
            &scope,
            Some(&rec.run_id),
            Some(&rec.step_id),
            AuditKind::ToolCallComplete,
            reported,
            rec.lease_owner.as_deref(),
            json!({"tool_call": rec.ids(), "status": rec.status.as_str()}),
        )?;
        Ok(self::outcome(&scope, id, rec.status.as_str(), None)?)
    })
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, running_run};
    use crate::tool_calls::tests::{claim, expire, field, outcome, record, step_status};
    use pgrx::prelude::*;

    #[pg_test]
    fn begin_and_heartbeats_change_no_indexed_column_and_the_step_keeps_the_start_of_the_result() {
        running_run("t-tc-hot");
        outcome(r#"{"q": 1}"#, "c1");
        let id = record("c1");
        // No index covers what begin and a heartbeat change (its key, expressions or predicate;
        // the sweep finds expired leases through the index of the calls not finished), so both
        // can be HOT updates, which add no index entries.
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid \
                  WHERE i.indrelid = 'ledger.run_step_tool_calls'::regclass \
                    AND a.attname IN ('status', 'lease_expires_at', 'outbound_started_at', \
                                      'updated_at', 'lease_owner') \
                    AND (a.attnum = ANY (i.indkey) \
                         OR coalesce(pg_get_expr(i.indpred, i.indrelid), '') ~ a.attname \
                         OR coalesce(pg_get_expr(i.indexprs, i.indrelid), '') ~ a.attname)"
            ),
            0
        );
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        Spi::run(&format!("SELECT ledger.heartbeat_tool_call('{id}', 1)")).unwrap();
        let result = format!(r#"{{"text": "{}"}}"#, "é".repeat(1000));
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{result}')"
        ))
        .unwrap();
        // The call keeps the whole result; its step's summary is the first 256 characters.
        let whole =
            one::<String>("SELECT ledger.canonical_json(result) FROM ledger.run_step_tool_calls");
        let summary = one::<String>("SELECT output_summary FROM ledger.run_steps");
        assert_eq!(whole.chars().count(), 1011);
        assert_eq!(summary.chars().count(), 256);
        assert!(whole.starts_with(&summary), "{summary}");
    }

    #[pg_test]
    fn a_late_completion_of_the_current_attempt_is_accepted() {
        running_run("t-tc-late");
        outcome("{}", "c1");
        let id = record("c1");
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        expire("c1");
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'failed', error_message => 'HTTP 500')"
        ))
        .unwrap();
        assert_eq!(field("c1", "status"), "failed");
        assert_eq!(field("c1", "error_message"), "HTTP 500");
        assert_eq!(step_status("c1"), "failed");
        // A failed call replays as a failure, and re-arms only when asked.
        let out = one::<pgrx::JsonB>(&claim("{}", "c1")).0;
        assert_eq!(
            (
                out["outcome"].as_str(),
                out["response"]["success"].as_bool()
            ),
            (Some("replayed"), Some(false))
        );
        assert_eq!(out["response"]["error"], "HTTP 500");
        let again = one::<pgrx::JsonB>("SELECT ledger.claim_tool_call('r', 'search', '{}', tool_call_id => 'c1', retry_failed => true)").0;
        assert_eq!(
            (
                again["outcome"].as_str(),
                again["tool_call"]["attempt"].as_i64()
            ),
            (Some("claimed"), Some(2))
        );
        assert_eq!(field("c1", "error_message"), "(null)");
        assert_eq!(step_status("c1"), "preparing");
    }

    #[pg_test]
    fn a_released_attempt_is_over_for_heartbeat_begin_and_complete() {
        running_run("t-tc-released");
        // Swept before begin: the lease is released and the call waits for its next claim.
        outcome("{}", "swept");
        expire("swept");
        assert_eq!(one::<i32>("SELECT ledger.sweep_tool_calls()"), 1);
        let id = record("swept");
        for late in [
            format!("SELECT ledger.heartbeat_tool_call('{id}', 1)"),
            format!("SELECT ledger.heartbeat_tool_call('{id}', 1, 60)"),
            format!("SELECT ledger.begin_tool_call('{id}', 1)"),
            format!("SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{}}')"),
            format!("SELECT ledger.complete_tool_call('{id}', 1, 'unknown')"),
        ] {
            let e = assert_error(&late, "40001", "LEASE_STALE");
            assert_eq!(e.detail["lease_released"], true, "{late}");
        }
        assert_eq!(
            field("swept", "status")
                + "|"
                + &field("swept", "lease_owner")
                + "|"
                + &field("swept", "lease_expires_at"),
            "claimed|(null)|(null)",
            "nothing written"
        );
        // So the next claimer is not told `busy`: it gets the next attempt.
        let out = one::<pgrx::JsonB>(&claim("{}", "swept")).0;
        assert_eq!(
            (
                out["outcome"].as_str(),
                out["tool_call"]["attempt"].as_i64()
            ),
            (Some("claimed"), Some(2))
        );

        // An in-doubt call resolved `retry`: its old attempt is over in the same way.
        outcome("{\"x\": 1}", "doubt");
        let id = record("doubt");
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'unknown')"
        ))
        .unwrap();
        Spi::run(&format!("SELECT ledger.resolve_tool_call('{id}', 'retry')")).unwrap();
        for late in [
            format!("SELECT ledger.heartbeat_tool_call('{id}', 1)"),
            format!("SELECT ledger.begin_tool_call('{id}', 1)"),
            format!("SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{}}')"),
        ] {
            assert_error(&late, "40001", "LEASE_STALE");
        }
        assert_eq!(field("doubt", "status"), "claimed");
        assert_eq!(
            one::<String>(&format!(
                "{}->'tool_call'->>'attempt'",
                claim("{\"x\": 1}", "doubt")
            )),
            "2"
        );
    }
}
