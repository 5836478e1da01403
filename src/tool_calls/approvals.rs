//! Approvals: `request_tool_approval` creates a call waiting for a person's decision,
//! `resolve_approval` records it.

use super::claim::apply;
use super::decisions::{self, Refusal};
use super::lookup::{find_locked, tombstone};
use super::record::create_waiting;
use super::{arguments, identity, outcome, ApprovalRequest};
use crate::audit;
use crate::db;
use crate::error::{raise, Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::redaction::{free_text, redacted_object};
use crate::rows;
use crate::scope::{self, Scope};
use ledger_model::args::{optional_label, required, required_id};
use ledger_model::events::{ApprovalResolved, AuditKind, Event};
use ledger_model::tool_calls::{approval_expiry, lease_seconds, ApprovalStatus};
use pgrx::prelude::*;
use serde_json::json;

/// Creates a tool call that waits for a human decision, and its approval request. A known call
/// answers its current outcome (never claims it).
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn request_tool_approval(
    run_id: Option<&str>,
    tool_ref: Option<&str>,
    arguments: Option<Jsonb>,
    tool_call_id: default!(Option<&str>, "NULL"),
    idempotency_key: default!(Option<&str>, "NULL"),
    title: default!(Option<&str>, "NULL"),
    policy_ref: default!(Option<&str>, "NULL"),
    details: default!(Option<Jsonb>, "NULL"),
    run_token: default!(Option<i64>, "NULL"),
    expires_in_seconds: default!(Option<i32>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        let scope = scope::current()?;
        let who = identity(run_id, tool_ref, tool_call_id, idempotency_key)?;
        let args = self::arguments(arguments)?;
        let request = ApprovalRequest {
            details: redacted_object("details", details)?,
            title: free_text(title),
            policy_ref: optional_label("policy_ref", policy_ref)?.map(str::to_owned),
            expires_in_seconds: expires_in_seconds
                .map(|s| approval_expiry(s.into()))
                .transpose()?,
        };
        let run = rows::lock_run(&scope, "run_id", who.run_id)?;
        run.fence(run_token)?;
        if tombstone(&scope, &who, &args)?.is_some() {
            raise(
                LedgerError::new(Code::ToolCallPurged, "this tool call was purged")
                    .with("idempotency_key", who.idempotency_key.as_str()),
            );
        }
        if let Some(found) = find_locked(&scope, &run, &who, &args)? {
            return Ok(apply(&scope, &run, &who, found, &args, None)?.json(&scope)?);
        }
        run.ensure_live("tool calls")?;
        let rec = create_waiting(&scope, &run, &who, &args, None, lease_seconds(0)?, &request)?;
        Ok(outcome(&scope, &rec.id, "waiting_approval", None)?)
    })
}

/// Decides a pending approval: `approved` (the next claim of the call gets `claimed`) or
/// `rejected` (the call is rejected and its step canceled). Past its deadline no one may.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn resolve_approval(
    approval_id: Option<&str>,
    decision: Option<&str>,
    actor: default!(Option<&str>, "NULL"),
    note: default!(Option<&str>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        let scope = scope::current()?;
        let approval_id = required_id("approval_id", approval_id)?;
        let decision = match required("decision", decision)? {
            "approved" => ApprovalStatus::Approved,
            "rejected" => ApprovalStatus::Rejected,
            other => raise(
                LedgerError::new(
                    Code::DecisionUnknown,
                    "decision must be approved or rejected",
                )
                .with("decision", other),
            ),
        };
        let actor = free_text(optional_label("actor", actor)?);
        let actor = actor.as_deref();
        let note = free_text(note);
        let (run, approval) = rows::lock_approval(&scope, approval_id)?;
        let (run_id, status, record_id) = (
            approval.run_id,
            approval.status,
            approval.tool_call_record_id,
        );
        let current = ApprovalStatus::from_name(&status)
            .ok_or_else(|| LedgerError::internal("unknown approval status"))?;
        // The deadline passed: the decision came too late, whether or not a sweep expired the
        // approval yet (it does, and the call is rejected; the run's feed tells it).
        if current == ApprovalStatus::Expired || approval.due {
            raise(
                LedgerError::new(
                    Code::ApprovalExpired,
                    format!("approval {approval_id} expired before it was decided"),
                )
                .with("approval_id", approval_id),
            );
        }
        if current != ApprovalStatus::Pending {
            if current == decision {
                return Ok(approval_json(&scope, approval_id)?);
            }
            raise(
                LedgerError::new(
                    Code::ApprovalResolved,
                    format!("approval {approval_id} is already {status}"),
                )
                .with("status", status),
            );
        }
        decisions::decide(&scope, approval_id, decision, actor, note.as_deref())?;
        let resolved = Event::ApprovalResolved(ApprovalResolved {
            approval_id,
            decision: decision.as_str(),
            actor,
            tool_call_record_id: record_id.as_deref(),
        });
        feed::append(&scope, run.held(), None, &resolved)?;
        audit::write(
            &scope,
            Some(&run_id),
            None,
            AuditKind::ApprovalDecision,
            decision.as_str(),
            actor,
            json!({"approval_id": approval_id, "tool_call_record_id": record_id, "note": note}),
        )?;
        if let (ApprovalStatus::Rejected, Some(record_id)) = (decision, record_id) {
            decisions::reject_call(&scope, &run, &record_id, approval_id, Refusal::Rejected)?;
        }
        Ok(approval_json(&scope, approval_id)?)
    })
}

fn approval_json(scope: &Scope, approval_id: &str) -> Result<Jsonb> {
    db::select_one(
        "SELECT to_jsonb(a) - 'tenant_id' - 'workspace_id' FROM ledger.approval_requests a \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([approval_id.into()]),
        |r| db::req::<Jsonb>(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found(Code::ApprovalNotFound, "approval", approval_id))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, running_run, set_scope};
    use crate::tool_calls::tests::{field, outcome, record, request_pay, sent, step_status};
    use pgrx::prelude::*;

    /// `claim_tool_call` with an approval, for call `pay` of run `r`.
    fn claim_approved(args: &str) -> serde_json::Value {
        one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('r', 'wire_money', '{args}', tool_call_id => 'pay', \
                 approval => '{{\"title\": \"Pay 100\", \"policy_ref\": \"payments/v2\", \
                               \"details\": {{\"api_key\": \"sk-live-0123456789abcdefghij\", \"why\": \"refund\"}}}}')"
        ))
        .0
    }

    #[pg_test]
    fn approvals_gate_the_call() {
        running_run("t-tc-approval");
        let req = "SELECT ledger.request_tool_approval('r', 'wire_money', '{\"amount\": 100}', tool_call_id => 'pay', title => 'Pay supplier')";
        let out = one::<pgrx::JsonB>(req).0;
        assert_eq!(out["outcome"], "waiting_approval");
        let approval = out["approval"]["id"].as_str().unwrap().to_owned();
        assert_eq!(out["approval"]["status"], "pending");
        assert_eq!(step_status("pay"), "waiting_approval");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.pending_approvals"),
            1
        );
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.outbox WHERE event_type = 'approval.requested'"
            ),
            1
        );
        // Idempotent request; other arguments are a conflict (the hash is compared, never overwritten).
        assert_eq!(
            one::<String>(&(req.replace("SELECT ", "SELECT (") + ")->>'outcome'")),
            "waiting_approval"
        );
        let pay = |args: &str| {
            format!(
                "SELECT ledger.claim_tool_call('r', 'wire_money', '{args}', tool_call_id => 'pay')"
            )
        };
        assert_error(&pay("{\"amount\": 999}"), "23505", "IDEMPOTENCY_MISMATCH");
        assert_eq!(
            one::<String>(&format!("{}->>'outcome'", pay("{\"amount\": 100}"))),
            "waiting_approval"
        );
        assert_error(
            &format!("SELECT ledger.resolve_approval('{approval}', 'maybe')"),
            "22023",
            "DECISION_UNKNOWN",
        );
        Spi::run(&format!(
            "SELECT ledger.resolve_approval('{approval}', 'approved', actor => 'cfo')"
        ))
        .unwrap();
        Spi::run(&format!(
            "SELECT ledger.resolve_approval('{approval}', 'approved', actor => 'cfo')"
        ))
        .unwrap();
        assert_error(
            &format!("SELECT ledger.resolve_approval('{approval}', 'rejected')"),
            "55000",
            "APPROVAL_RESOLVED",
        );
        let claimed = one::<pgrx::JsonB>(&pay("{\"amount\": 100}")).0;
        assert_eq!(
            (
                claimed["outcome"].as_str(),
                claimed["tool_call"]["attempt"].as_i64()
            ),
            (Some("claimed"), Some(1))
        );
        let id = record("pay");
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        assert_eq!(step_status("pay"), "running");

        // A rejected approval rejects the call and cancels its step.
        let out = one::<pgrx::JsonB>(
            "SELECT ledger.request_tool_approval('r', 'delete_repo', '{}', tool_call_id => 'rm')",
        )
        .0;
        let approval = out["approval"]["id"].as_str().unwrap().to_owned();
        Spi::run(&format!(
            "SELECT ledger.resolve_approval('{approval}', 'rejected', note => 'no')"
        ))
        .unwrap();
        assert_eq!(one::<String>("SELECT ledger.claim_tool_call('r', 'delete_repo', '{}', tool_call_id => 'rm')->>'outcome'"), "rejected");
        assert_eq!(field("rm", "error_code"), "TOOL_APPROVAL_REJECTED");
        assert_eq!(step_status("rm"), "canceled");
        assert_error(
            "SELECT ledger.resolve_approval('apr_nope', 'approved')",
            "P0002",
            "APPROVAL_NOT_FOUND",
        );
    }

    #[pg_test]
    fn a_claim_with_an_approval_is_right_in_every_state_of_the_call() {
        running_run("t-tc-claim-approval");
        let args = "{\"amount\": 100}";
        // Unknown: created waiting, exactly as request_tool_approval creates it.
        let out = claim_approved(args);
        assert_eq!(out["outcome"], "waiting_approval");
        assert_eq!(out["tool_call"]["status"], "waiting_approval");
        assert_eq!(out["tool_call"]["attempt"], 0);
        let approval = &out["approval"];
        assert_eq!(
            (
                approval["status"].as_str(),
                approval["title"].as_str(),
                approval["policy_ref"].as_str()
            ),
            (Some("pending"), Some("Pay 100"), Some("payments/v2"))
        );
        assert_eq!(approval["details"]["api_key"], "[REDACTED]");
        assert_eq!(approval["details"]["why"], "refund");
        assert_eq!(approval["details"]["tool_call_id"], "pay");
        assert_eq!(step_status("pay"), "waiting_approval");
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.outbox WHERE event_type = 'approval.requested'"
            ),
            1
        );
        let approval_id = approval["id"].as_str().unwrap().to_owned();
        // Every resume: the current outcome, never TOOL_CALL_STATE.
        assert_eq!(claim_approved(args)["outcome"], "waiting_approval");
        assert_eq!(request_pay(args)["outcome"], "waiting_approval");
        Spi::run(&format!(
            "SELECT ledger.resolve_approval('{approval_id}', 'approved', actor => 'cfo')"
        ))
        .unwrap();
        // Approved: an approval request does not claim it, the claim does.
        let out = request_pay(args);
        assert_eq!(
            (out["outcome"].as_str(), out["approval"]["status"].as_str()),
            (Some("waiting_approval"), Some("approved"))
        );
        let out = claim_approved(args);
        assert_eq!(
            (
                out["outcome"].as_str(),
                out["tool_call"]["attempt"].as_i64()
            ),
            (Some("claimed"), Some(1))
        );
        // A worker that died and resumes while the lease lives is told busy, by either function.
        assert_eq!(claim_approved(args)["outcome"], "busy");
        assert_eq!(request_pay(args)["outcome"], "busy");
        let id = record("pay");
        sent(&id, "'succeeded', '{\"wire\": \"w-1\"}'");
        for out in [claim_approved(args), request_pay(args)] {
            assert_eq!(out["outcome"], "replayed");
            assert_eq!(out["response"]["result"]["wire"], "w-1");
        }
        assert_eq!(field("pay", "attempt"), "1", "executed once");
        // Another request under the key still refuses.
        let e = assert_error(
            "SELECT ledger.request_tool_approval('r', 'wire_money', '{\"amount\": 999}', tool_call_id => 'pay')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(e.detail["request_hash_matches"], false);

        // Rejected stays rejected; an in-doubt call stays in doubt.
        let out = one::<pgrx::JsonB>(
            "SELECT ledger.claim_tool_call('r', 'rm', '{}', tool_call_id => 'rm', approval => '{}')",
        )
        .0;
        Spi::run(&format!(
            "SELECT ledger.resolve_approval('{}', 'rejected')",
            out["approval"]["id"].as_str().unwrap()
        ))
        .unwrap();
        assert_eq!(
            one::<String>("SELECT ledger.claim_tool_call('r', 'rm', '{}', tool_call_id => 'rm', approval => '{}')->>'outcome'"),
            "rejected"
        );
        outcome("{}", "doubt");
        let id = record("doubt");
        sent(&id, "'unknown'");
        assert_eq!(
            one::<String>("SELECT ledger.claim_tool_call('r', 'search', '{}', tool_call_id => 'doubt', approval => '{}')->>'outcome'"),
            "in_doubt"
        );
        assert_eq!(
            one::<String>("SELECT ledger.request_tool_approval('r', 'search', '{}', tool_call_id => 'doubt')->>'outcome'"),
            "in_doubt"
        );
    }

    #[pg_test]
    fn a_bad_approval_is_refused_and_writes_nothing() {
        running_run("t-tc-bad-approval");
        for (approval, state, code) in [
            ("'[1]'", "22023", "APPROVAL_INVALID"),
            ("'{\"titel\": \"x\"}'", "22023", "APPROVAL_INVALID"),
            ("'{\"title\": 1}'", "22023", "APPROVAL_INVALID"),
            ("'{\"details\": [1]}'", "22023", "APPROVAL_INVALID"),
            (
                "'{\"policy_ref\": \"a\\u202eb\"}'",
                "22023",
                "LABEL_INVALID",
            ),
        ] {
            assert_error(
                &format!(
                    "SELECT ledger.claim_tool_call('r', 'pay', '{{}}', approval => {approval})"
                ),
                state,
                code,
            );
        }
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            0
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.approval_requests"),
            0
        );
    }

    /// Moves every deadline of the scope's pending approvals into the past.
    fn deadlines_pass() {
        Spi::run(
            "UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second' \
              WHERE expires_at IS NOT NULL",
        )
        .unwrap();
    }

    fn count(query: &str) -> i64 {
        one::<i64>(&format!("SELECT count(*) FROM {query}"))
    }

    /// An approval no one decided in time expires: no one may decide it any more, its call is
    /// rejected and never runs, its step expires, and the run's feed and the outbox say so.
    #[pg_test]
    fn an_approval_past_its_deadline_expires_and_its_call_never_runs() {
        running_run("t-tc-approval-expiry");
        let out = one::<pgrx::JsonB>(
            "SELECT ledger.request_tool_approval('r', 'wire_money', '{\"amount\": 100}', \
                 tool_call_id => 'pay', expires_in_seconds => 3600)",
        )
        .0;
        let approval = out["approval"]["id"].as_str().unwrap().to_owned();
        assert!(one::<bool>(&format!(
            "SELECT expires_at BETWEEN now() + interval '59 minutes' AND now() + interval '61 minutes' \
               FROM ledger.approval_requests WHERE id = '{approval}'"
        )));
        assert_eq!(
            count("ledger.pending_approvals WHERE expires_at IS NOT NULL"),
            1
        );
        // Before the deadline nothing expires.
        assert_eq!(one::<i32>("SELECT ledger.sweep_tool_calls()"), 0);

        deadlines_pass();
        // Past it, people no longer see it and cannot decide it, even before a sweep.
        assert_eq!(count("ledger.pending_approvals"), 0);
        let late =
            format!("SELECT ledger.resolve_approval('{approval}', 'approved', actor => 'cfo')");
        assert_error(&late, "55000", "APPROVAL_EXPIRED");
        assert_eq!(
            one::<String>(&format!(
                "SELECT status FROM ledger.approval_requests WHERE id = '{approval}'"
            )),
            "pending"
        );
        assert_eq!(one::<i32>("SELECT ledger.sweep_tool_calls()"), 1);
        assert_eq!(one::<i32>("SELECT ledger.sweep_tool_calls()"), 0);
        assert_eq!(
            one::<String>(&format!(
                "SELECT concat_ws(':', status, actor IS NULL, decided_at IS NOT NULL) \
                   FROM ledger.approval_requests WHERE id = '{approval}'"
            )),
            "expired:t:t"
        );
        assert_eq!(
            (
                field("pay", "status"),
                field("pay", "error_code"),
                step_status("pay")
            ),
            (
                "rejected".into(),
                "TOOL_APPROVAL_EXPIRED".into(),
                "expired".into()
            )
        );
        assert_error(&late, "55000", "APPROVAL_EXPIRED");
        assert_error(
            &format!("SELECT ledger.resolve_approval('{approval}', 'rejected')"),
            "55000",
            "APPROVAL_EXPIRED",
        );
        assert_eq!(
            one::<String>(
                "SELECT ledger.claim_tool_call('r', 'wire_money', '{\"amount\": 100}', tool_call_id => 'pay')->>'outcome'"
            ),
            "rejected"
        );
        assert_eq!(
            one::<String>(
                "SELECT string_agg(event_type, ' ' ORDER BY seq) FROM ledger.run_events \
                  WHERE event_type LIKE 'approval.%' OR event_type = 'tool_call.rejected'"
            ),
            "approval.requested approval.expired tool_call.rejected"
        );
        assert_eq!(
            one::<String>(
                "SELECT payload->>'approval_id' || ':' || (payload->>'tool_call_id') FROM ledger.outbox \
                  WHERE event_type = 'approval.expired'"
            ),
            format!("{approval}:pay")
        );
        assert_eq!(
            count("ledger.audit_events WHERE gateway_type = 'approval.decision' AND outcome = 'expired' AND actor IS NULL"),
            1
        );
    }

    /// The next claim of a call whose approval's deadline passed expires it then (no sweep ran),
    /// and a run waiting only for such an approval may be claimed again.
    #[pg_test]
    fn a_claim_finds_an_expired_approval_without_a_sweep() {
        set_scope("t-tc-approval-lazy", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r'); SELECT ledger.claim_run('w')")
            .unwrap();
        let ask = "SELECT ledger.claim_tool_call('r', 'wire_money', '{}', tool_call_id => 'pay', \
                     run_token => {token}, approval => '{\"title\": \"Pay\", \"expires_in_seconds\": 60}')->>'outcome'";
        assert_eq!(
            one::<String>(&ask.replace("{token}", "1")),
            "waiting_approval"
        );
        Spi::run("SELECT ledger.release_run('r', 1)").unwrap();
        let claim = "SELECT coalesce((SELECT run_id FROM ledger.claim_run('w')), 'none')";
        assert_eq!(one::<String>(claim), "none");
        deadlines_pass();
        assert_eq!(one::<String>(claim), "r");
        assert_eq!(one::<String>(&ask.replace("{token}", "2")), "rejected");
        assert_eq!(
            (
                count("ledger.approval_requests WHERE status = 'expired'"),
                step_status("pay")
            ),
            (1, "expired".into())
        );
        assert_eq!(
            count("ledger.outbox WHERE event_type = 'approval.expired'"),
            1
        );
    }

    /// A deadline is 1 second to a year; anything else is refused before anything is written.
    #[pg_test]
    fn a_deadline_out_of_range_is_refused() {
        running_run("t-tc-approval-deadline");
        for seconds in ["0", "-5", "31622401"] {
            assert_error(
                &format!(
                    "SELECT ledger.request_tool_approval('r', 'pay', '{{}}', expires_in_seconds => {seconds})"
                ),
                "22023",
                "TIMEOUT_INVALID",
            );
        }
        assert_error(
            "SELECT ledger.claim_tool_call('r', 'pay', '{}', approval => '{\"expires_in_seconds\": \"1h\"}')",
            "22023",
            "APPROVAL_INVALID",
        );
        assert_eq!(count("ledger.approval_requests"), 0);
        assert_eq!(count("ledger.run_step_tool_calls"), 0);
    }

    /// A run that ends has no approval left pending: no one decides for it, and no sweep writes
    /// to its feed after its end when the deadline passes.
    #[pg_test]
    fn a_run_that_ends_cancels_its_pending_approvals() {
        running_run("t-tc-approval-run-ended");
        Spi::run(
            "SELECT ledger.request_tool_approval('r', 'wire_money', '{}', tool_call_id => 'pay', \
                 expires_in_seconds => 60); \
             SELECT ledger.transition_run('r', 'canceled')",
        )
        .unwrap();
        assert_eq!(
            one::<String>(
                "SELECT status || ':' || (decided_at IS NOT NULL) FROM ledger.approval_requests"
            ),
            "canceled:true"
        );
        assert_eq!(
            (field("pay", "status"), field("pay", "error_code")),
            ("rejected".into(), "TOOL_APPROVAL_CANCELED".into())
        );
        assert_eq!(count("ledger.pending_approvals"), 0);
        deadlines_pass();
        assert_eq!(one::<i32>("SELECT ledger.sweep_tool_calls()"), 0);
        assert!(one::<bool>(
            "SELECT ends_run FROM ledger.events_since('r') ORDER BY seq DESC LIMIT 1"
        ));
    }
}
