//! Calls in doubt: `sweep_tool_calls` moves expired leases to in_doubt (or back to claimable),
//! and `resolve_tool_call` records a person's decision on one.

use super::decisions;
use super::record::{finish, mark_in_doubt};
use super::{event, outcome};
use crate::audit;
use crate::db;
use crate::error::{raise, Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::notifier;
use crate::redaction::free_text;
use crate::rows;
use crate::scope::{self, Scope};
use ledger_model::args::{optional_label, required, required_id};
use ledger_model::events::{AuditKind, Event, ToolCallResolved};
use ledger_model::tool_calls::{CallStatus, Resolution};
use pgrx::prelude::*;
use serde_json::json;

/// The human decision on an in-doubt call: `succeeded` / `failed` with the evidence as result,
/// or `retry` (the next claim executes again with attempt + 1). Writes an audit event.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn resolve_tool_call(
    tool_call_record_id: Option<&str>,
    decision: Option<&str>,
    result: default!(Option<Jsonb>, "NULL"),
    actor: default!(Option<&str>, "NULL"),
    note: default!(Option<&str>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        let scope = scope::current()?;
        let id = required_id("tool_call_record_id", tool_call_record_id)?;
        let resolution = Resolution::parse(required("decision", decision)?)?;
        let actor = free_text(optional_label("actor", actor)?);
        let actor = actor.as_deref();
        let note = free_text(note);
        let note = note.as_deref();
        let (run, mut rec) = rows::lock_tool_call_by_id(&scope, id)?;
        // A person's decision lets the run go on (nothing is sent if this fails).
        notifier::runs_ready();
        if rec.status != CallStatus::InDoubt {
            raise(
                LedgerError::new(
                    Code::ToolCallNotInDoubt,
                    format!(
                        "only an in_doubt tool call can be resolved; this one is {}",
                        rec.status.as_str()
                    ),
                )
                .with("status", rec.status.as_str()),
            );
        }
        let metadata = json!({"decision": resolution.as_str(), "actor": actor, "note": note});
        match resolution {
            Resolution::Succeeded => {
                finish(&scope, &run, &mut rec, true, result, None, None, &metadata)?
            }
            Resolution::Failed => finish(
                &scope,
                &run,
                &mut rec,
                false,
                result,
                note,
                Some("RESOLVED_FAILED"),
                &metadata,
            )?,
            Resolution::Retry => {
                db::execute(
                    include_str!("../../sql/queries/release_tool_call_for_retry.sql"),
                    &scope.args([id.into()]),
                )?;
                rec.status = CallStatus::Claimed;
            }
        }
        audit::write(
            &scope,
            Some(&rec.run_id),
            Some(&rec.step_id),
            AuditKind::ToolCallResolve,
            resolution.as_str(),
            actor,
            json!({"tool_call": rec.ids(), "decision": resolution.as_str(), "note": note}),
        )?;
        let resolved = Event::ToolCallResolved(ToolCallResolved {
            call: rec.ids(),
            decision: resolution.as_str(),
            actor,
        });
        event(&scope, &run, &rec, &resolved)?;
        Ok(outcome(&scope, id, rec.status.as_str(), None)?)
    })
}

/// Moves every expired lease in the scope to in_doubt (the request left) or back to claimable
/// (it did not), and expires every pending approval past its deadline (its call is rejected);
/// returns how many. Never waits: rows and runs that are busy are left for the next sweep.
/// With `any_scope` (members of ledger_operator only), every scope's (every granted one's, when
/// the login role is bound), each in its own scope, which is taken back after.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn sweep_tool_calls(
    any_scope: default!(Option<bool>, false),
) -> std::result::Result<i32, SqlError> {
    if !any_scope.unwrap_or(false) {
        return Ok(sweep(&scope::current()?)?);
    }
    Ok(scope::across(
        "SELECT tenant_id, workspace_id FROM ledger_dispatch.expired_tool_call_scopes()",
        sweep,
    )?)
}

fn sweep(scope: &Scope) -> Result<i32> {
    feed::collected(|| {
        let candidates = db::select(
            "SELECT id, run_id FROM ledger.run_step_tool_calls \
              WHERE tenant_id = $1 AND workspace_id = $2 AND completed_at IS NULL \
                AND status IN ('claimed', 'running') AND lease_expires_at <= clock_timestamp() \
              ORDER BY lease_expires_at",
            &scope.args([]),
            |r| Ok((db::req::<String>(r, 1)?, db::req::<String>(r, 2)?)),
        )?;
        let mut swept = 0;
        for (id, run_id) in candidates {
            let Some(run) = rows::try_lock_run(scope, &run_id)? else {
                continue;
            };
            // Still expired once locked: a concurrent sweep may have released the lease (NULL,
            // which `lease_live` does not tell from expired) or a claim renewed it since the
            // candidates were read.
            let Some(mut rec) = rows::try_lock_expired_tool_call(scope, &run, &id)? else {
                continue;
            };
            if !matches!(rec.status, CallStatus::Claimed | CallStatus::Running) || rec.lease_live {
                continue;
            }
            if rec.outbound_started {
                mark_in_doubt(scope, &run, &mut rec, None)?;
            } else {
                db::execute(
                    "UPDATE ledger.run_step_tool_calls \
                        SET lease_owner = NULL, lease_expires_at = NULL, updated_at = now() \
                      WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
                    &scope.args([id.as_str().into()]),
                )?;
                event(scope, &run, &rec, &Event::ToolCallLeaseExpired(rec.ids()))?;
            }
            swept += 1;
        }
        // Approvals past their deadline: the call will not run.
        let due = db::select(
            "SELECT id, run_id FROM ledger.approval_requests \
              WHERE tenant_id = $1 AND workspace_id = $2 AND status = 'pending' \
                AND expires_at <= clock_timestamp() \
              ORDER BY expires_at",
            &scope.args([]),
            |r| Ok((db::req::<String>(r, 1)?, db::req::<String>(r, 2)?)),
        )?;
        for (id, run_id) in due {
            let Some(run) = rows::try_lock_run(scope, &run_id)? else {
                continue;
            };
            if decisions::expire(scope, &run, &id)? {
                swept += 1;
            }
        }
        Ok(swept)
    })
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, running_run};
    use crate::tool_calls::tests::{claim, expire, field, outcome, record, step_status};
    use pgrx::prelude::*;

    #[pg_test]
    fn unknown_outcomes_go_to_in_doubt_and_only_a_resolution_leaves_it() {
        running_run("t-tc-resolve");
        outcome("{}", "c1");
        let id = record("c1");
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        assert_error(
            &format!("SELECT ledger.resolve_tool_call('{id}', 'succeeded')"),
            "55000",
            "TOOL_CALL_NOT_IN_DOUBT",
        );
        Spi::run(&format!("SELECT ledger.complete_tool_call('{id}', 1, 'unknown', error_message => 'timed out after sending')")).unwrap();
        assert_eq!(field("c1", "status"), "in_doubt");
        assert_eq!(field("c1", "error_message"), "timed out after sending");
        assert_error(
            &format!("SELECT ledger.resolve_tool_call('{id}', 'maybe')"),
            "22023",
            "DECISION_UNKNOWN",
        );
        Spi::run(&format!(
            "SELECT ledger.resolve_tool_call('{id}', 'succeeded', '{{\"order\": 7}}', note => 'seen in the CRM', actor => 'ops@acme')"
        ))
        .unwrap();
        assert_eq!(field("c1", "status"), "succeeded");
        assert_eq!(
            one::<String>("SELECT concat_ws('|', gateway_type, outcome, actor, payload->>'note') FROM ledger.audit_events WHERE gateway_type = 'tool_call.resolve'"),
            "tool_call.resolve|succeeded|ops@acme|seen in the CRM"
        );
        let out = one::<pgrx::JsonB>(&claim("{}", "c1")).0;
        assert_eq!(out["response"]["result"], serde_json::json!({"order": 7}));
        assert_eq!(out["response"]["metadata"]["actor"], "ops@acme");
    }

    #[pg_test]
    fn a_retry_resolution_executes_again_with_the_next_attempt() {
        running_run("t-tc-retry");
        outcome("{}", "c1");
        let id = record("c1");
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'unknown')"
        ))
        .unwrap();
        Spi::run(&format!(
            "SELECT ledger.resolve_tool_call('{id}', 'retry', actor => 'ops')"
        ))
        .unwrap();
        let out = one::<pgrx::JsonB>(&claim("{}", "c1")).0;
        assert_eq!(
            (
                out["outcome"].as_str(),
                out["tool_call"]["attempt"].as_i64()
            ),
            (Some("claimed"), Some(2))
        );
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 2)")).unwrap();
        assert_eq!(step_status("c1"), "running");
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 2, 'succeeded', '{{}}')"
        ))
        .unwrap();
        assert_eq!(step_status("c1"), "succeeded");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.audit_events WHERE outcome = 'retry'"),
            1
        );
    }

    #[pg_test]
    fn sweep_moves_expired_leases_by_whether_the_request_left() {
        running_run("t-tc-sweep");
        outcome("{}", "quiet");
        outcome("{\"x\": 1}", "sent");
        Spi::run(&format!(
            "SELECT ledger.begin_tool_call('{}', 1)",
            record("sent")
        ))
        .unwrap();
        outcome("{\"x\": 2}", "live");
        expire("quiet");
        expire("sent");
        assert_eq!(one::<i32>("SELECT ledger.sweep_tool_calls()"), 2);
        assert_eq!(field("sent", "status"), "in_doubt");
        assert_eq!(
            field("quiet", "status") + "|" + &field("quiet", "lease_expires_at"),
            "claimed|(null)"
        );
        assert_eq!(field("live", "status"), "claimed");
        assert_eq!(one::<i32>("SELECT ledger.sweep_tool_calls()"), 0);
        // The swept claim is claimable again, with the next attempt.
        assert_eq!(
            one::<String>(&format!(
                "{}->'tool_call'->>'attempt'",
                claim("{}", "quiet")
            )),
            "2"
        );
    }

    #[pg_test]
    fn a_five_second_tool_whose_worker_died_after_begin_is_in_doubt_ten_seconds_later() {
        running_run("t-tc-short-lease");
        let out = one::<pgrx::JsonB>(
            "SELECT ledger.claim_tool_call('r', 'search', '{}', tool_call_id => 'fast', timeout_seconds => 5)",
        )
        .0;
        assert_eq!(out["tool_call"]["lease_seconds"], 10);
        let id = record("fast");
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        // begin restarted the lease: it ends 10 s from now, not a minute.
        assert!(one::<bool>(
            "SELECT lease_expires_at BETWEEN clock_timestamp() + interval '9 seconds' \
                                      AND clock_timestamp() + interval '10 seconds' \
               FROM ledger.run_step_tool_calls WHERE tool_call_id = 'fast'"
        ));
        // A heartbeat extends it by the lease again.
        let before = field("fast", "lease_expires_at");
        Spi::run("SELECT pg_sleep(0.01)").unwrap();
        Spi::run(&format!("SELECT ledger.heartbeat_tool_call('{id}', 1)")).unwrap();
        assert!(one::<bool>(&format!(
            "SELECT lease_expires_at > '{before}' FROM ledger.run_step_tool_calls WHERE tool_call_id = 'fast'"
        )));
        // The worker dies; while the lease lives a sweep leaves the call alone ...
        assert_eq!(one::<i32>("SELECT ledger.sweep_tool_calls()"), 0);
        // ... and once its 10 s have passed (moved back by the lease, not slept) it is in doubt.
        Spi::run(
            "UPDATE ledger.run_step_tool_calls \
                SET lease_expires_at = lease_expires_at - make_interval(secs => lease_seconds) \
              WHERE tool_call_id = 'fast'",
        )
        .unwrap();
        assert_eq!(one::<i32>("SELECT ledger.sweep_tool_calls()"), 1);
        assert_eq!(field("fast", "status"), "in_doubt");
        // A call waiting for approval gets the floor, 10 s.
        let out = one::<pgrx::JsonB>(
            "SELECT ledger.request_tool_approval('r', 'pay', '{}', tool_call_id => 'wait')",
        )
        .0;
        assert_eq!(out["tool_call"]["lease_seconds"], 10);
    }
}
