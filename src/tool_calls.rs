//! Tool calls (replay #3: the same key twice returns the recorded result): claim, lease,
//! fencing, in-doubt, idempotent replay and approvals. Outcomes are returned as data, never raised, because state written before an
//! ERROR would roll back (an in-doubt marking must stick).
//!
//! Lock order, as everywhere: the run first, then the record, then its step. A claim (or an
//! approval request) waits only for the calling run: a record of another run (a re-run passing
//! its source's keys) is locked with its run only when no one holds that run, else read as it is
//! (`Found::Unheld`), so two claims naming each other's keys never deadlock.
//!
//! The protocol's steps, a module each: finding a call (`lookup`), writing its record
//! (`record`), claiming it (`claim`), executing it (`execute`: begin, heartbeat, complete),
//! resolving one in doubt (`resolve`), approvals (`approvals`), a turn's calls at once
//! (`batch`) and the single-commit path of calls safe to repeat (`repeatable`). This module holds what they share: the arguments, the identity and the approval a
//! call names, the answer's shape, its events and audit records.

mod approvals;
mod batch;
mod claim;
mod decisions;
mod execute;
mod lookup;
mod record;
mod repeatable;
mod resolve;

use crate::db;
use crate::error::{Code, LedgerError, Result};
use crate::feed;
use crate::guc;
use crate::jsonb::Jsonb;
use crate::redaction::free_text;
use crate::rows::{LockedRun, ToolCall};
use crate::scope::Scope;
use crate::steps::{self, StepChange};
use ledger_model::args::{optional_id, required_id, required_label};
use ledger_model::events::{Event, ToolCallIds};
use ledger_model::ids;
use ledger_model::json;
use ledger_model::redaction;
use ledger_model::status::Status;
use ledger_model::tool_calls::{approval_ask, check_fence, identity_reused, Existing};
use serde_json::{json, Value};

/// What every event and decision about a call reads of its record.
impl ToolCall {
    fn existing(&self) -> Existing<'_> {
        Existing {
            status: self.status,
            tool_ref: &self.tool_ref,
            request_hash: &self.request_hash,
            lease_live: self.lease_live,
            outbound_started: self.outbound_started,
            approval: self.approval,
        }
    }

    /// Only the current attempt, holding its lease, may write (40001 `LEASE_STALE`).
    fn fence(&self, attempt: i64) -> Result<()> {
        check_fence(self.status, self.lease_held, self.attempt, attempt)
    }

    /// 23505 `IDEMPOTENCY_MISMATCH` for a claim `who` (request hash `hash`) that names this
    /// record with other input: the DETAIL names the call, its key and the run holding the record.
    fn reused(&self, who: &Identity, hash: &str) -> LedgerError {
        identity_reused_by(who)
            .with("run_id", self.run_id.as_str())
            .with("tool_ref_matches", self.tool_ref == who.tool_ref)
            .with("request_hash_matches", self.request_hash == hash)
    }

    /// The ids every event and outbox row about the call carries.
    fn ids(&self) -> ToolCallIds<'_> {
        ToolCallIds {
            tool_call_record_id: &self.id,
            tool_call_id: &self.tool_call_id,
            tool_ref: &self.tool_ref,
            idempotency_key: &self.idempotency_key,
            attempt: self.attempt,
            step_id: &self.step_id,
        }
    }
}

/// `{"outcome", "tool_call", "approval", "response"}`: what every tool-call function returns.
fn outcome(
    scope: &Scope,
    record_id: &str,
    outcome: &str,
    response: Option<Jsonb>,
) -> Result<Jsonb> {
    db::select_one(
        include_str!("../sql/queries/tool_call_outcome.sql"),
        &scope.args([record_id.into(), outcome.into(), response.into()]),
        |r| db::req::<Jsonb>(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found(Code::ToolCallNotFound, "tool call", record_id))
}

/// Appends an event about the call to the feed of `run`, held by this transaction (the call's
/// own run, or the run that replayed it); it names the call's step only in the call's own run.
fn event(scope: &Scope, run: &LockedRun, rec: &ToolCall, event: &Event) -> Result<()> {
    let step = (run.id == rec.run_id).then_some(rec.step_id.as_str());
    feed::append(scope, run.held(), step, event)
}

/// Moves the call's step to `to`, changing nothing else of it.
fn step_to(scope: &Scope, run: &LockedRun, rec: &ToolCall, to: Status) -> Result<()> {
    steps::follow(scope, run, &rec.step_id, to, StepChange::default())
}

/// Parsed arguments: their request hash (unredacted) and stored summary (redacted).
struct Arguments {
    hash: String,
    summary: Value,
}

fn arguments(value: Option<Jsonb>) -> Result<Arguments> {
    let value = value.ok_or_else(|| LedgerError::required("arguments"))?;
    // Checked on the text first: a huge non-object is refused without parsing it.
    if !value.is_object() {
        return Err(arguments_not_object());
    }
    parsed_arguments(Some(json::parse_unsized(value.as_str())?))
}

fn arguments_not_object() -> LedgerError {
    LedgerError::new(Code::ArgumentsNotObject, "arguments must be a JSON object")
}

/// `arguments` of a value already parsed (a call of a batch).
fn parsed_arguments(value: Option<Value>) -> Result<Arguments> {
    let parsed = value.ok_or_else(|| LedgerError::required("arguments"))?;
    if !parsed.is_object() {
        return Err(arguments_not_object());
    }
    let hash = json::request_hash(&parsed);
    Ok(Arguments {
        summary: redaction::summarize_arguments(&guc::redaction_rules(), parsed, &hash),
        hash,
    })
}

/// The identity a claim or approval request names.
struct Identity<'a> {
    run_id: &'a str,
    tool_ref: &'a str,
    tool_call_id: String,
    idempotency_key: String,
}

fn identity<'a>(
    run_id: Option<&'a str>,
    tool_ref: Option<&'a str>,
    tool_call_id: Option<&'a str>,
    idempotency_key: Option<&'a str>,
) -> Result<Identity<'a>> {
    let run_id = required_id("run_id", run_id)?;
    let tool_ref = required_label("tool_ref", tool_ref)?;
    let tool_call_id = optional_id("tool_call_id", tool_call_id)?
        .map_or_else(|| ids::new_id("call"), str::to_owned);
    let idempotency_key = match idempotency_key {
        Some(k) => {
            ids::validate_key("idempotency_key", k)?;
            k.to_owned()
        }
        None => format!("tool:{run_id}:{tool_call_id}"),
    };
    Ok(Identity {
        run_id,
        tool_ref,
        tool_call_id,
        idempotency_key,
    })
}

impl Identity<'_> {
    /// The key is `tool:<run_id>:<tool_call_id>`, the one a claim gets when it names none.
    fn default_key(&self) -> bool {
        self.idempotency_key
            .strip_prefix("tool:")
            .and_then(|rest| rest.strip_prefix(self.run_id))
            .and_then(|rest| rest.strip_prefix(':'))
            == Some(self.tool_call_id.as_str())
    }
}

/// 23505 `IDEMPOTENCY_MISMATCH` naming the call and the key a claim or request gave.
fn identity_reused_by(who: &Identity) -> LedgerError {
    identity_reused()
        .with("tool_call_id", who.tool_call_id.as_str())
        .with("idempotency_key", who.idempotency_key.as_str())
}

/// An approval request as stored: the title free text, the policy a label, the details redacted.
struct ApprovalRequest {
    title: Option<String>,
    policy_ref: Option<String>,
    details: Value,
    expires_in_seconds: Option<i32>,
}

/// `claim_tool_call`'s `approval` argument, checked like `request_tool_approval`'s arguments.
fn approval_argument(value: Option<Jsonb>) -> Result<Option<ApprovalRequest>> {
    let Some(value) = value else { return Ok(None) };
    approval_request(&json::parse(value.as_str())?).map(Some)
}

/// The approval a claim asks for, from its parsed JSON.
fn approval_request(parsed: &Value) -> Result<ApprovalRequest> {
    let ask = approval_ask(parsed)?;
    Ok(ApprovalRequest {
        title: free_text(ask.title),
        policy_ref: ask.policy_ref.map(str::to_owned),
        details: ask.details.map_or_else(
            || json!({}),
            |d| redaction::redact(&guc::redaction_rules(), d.clone()),
        ),
        expires_in_seconds: ask.expires_in_seconds,
    })
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use crate::testing::{one, running_run};
    use pgrx::prelude::*;

    pub(super) fn claim(args: &str, call: &str) -> String {
        format!("SELECT ledger.claim_tool_call('r', 'search', '{args}', tool_call_id => '{call}')")
    }

    pub(super) fn outcome(args: &str, call: &str) -> String {
        one::<String>(&format!("{}->>'outcome'", claim(args, call)))
    }

    pub(super) fn record(call: &str) -> String {
        one::<String>(&format!(
            "SELECT id FROM ledger.run_step_tool_calls WHERE tool_call_id = '{call}'"
        ))
    }

    pub(super) fn field(call: &str, column: &str) -> String {
        one::<String>(&format!("SELECT coalesce({column}::text, '(null)') FROM ledger.run_step_tool_calls WHERE tool_call_id = '{call}'"))
    }

    pub(super) fn step_status(call: &str) -> String {
        one::<String>(&format!(
            "SELECT s.status FROM ledger.run_steps s JOIN ledger.run_step_tool_calls t ON t.step_id = s.id AND t.tenant_id = s.tenant_id \
              WHERE t.tool_call_id = '{call}'"
        ))
    }

    /// Makes the lease of a call expire now (as if its time had passed).
    pub(super) fn expire(call: &str) {
        Spi::run(&format!(
            "UPDATE ledger.run_step_tool_calls SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE tool_call_id = '{call}'"
        ))
        .unwrap();
    }

    /// Begins attempt 1 of record `id` and completes it with `completion` (outcome and rest).
    pub(super) fn sent(id: &str, completion: &str) {
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, {completion})"
        ))
        .unwrap();
    }

    pub(super) fn request_pay(args: &str) -> serde_json::Value {
        one::<pgrx::JsonB>(&format!(
            "SELECT ledger.request_tool_approval('r', 'wire_money', '{args}', tool_call_id => 'pay')"
        ))
        .0
    }

    #[pg_test]
    fn large_arguments_are_summarised_and_still_hashed_in_full() {
        running_run("t-tc-bigargs");
        let args = "jsonb_build_object('b', repeat('x', 9000), 'a', 1, 'password', 'hunter2')";
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('r', 'upload', {args}, tool_call_id => 'u')"
        ))
        .0;
        let stored = &out["tool_call"]["arguments"];
        assert_eq!(stored["truncated"], true);
        assert_eq!(
            stored["argument_names"],
            serde_json::json!(["a", "b", "password"])
        );
        assert_eq!(stored["request_hash"], out["tool_call"]["request_hash"]);
        assert!(one::<bool>(&format!(
            "SELECT ledger.request_hash({args}) = '{}'",
            out["tool_call"]["request_hash"].as_str().unwrap()
        )));
        assert!(
            !one::<String>("SELECT arguments::text FROM ledger.run_step_tool_calls")
                .contains("hunter2")
        );
        // 50 MB of arguments: hashed and summarised, not stored.
        let huge = "jsonb_build_object('blob', repeat('y', 50 * 1024 * 1024))";
        let out = one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('r', 'upload', {huge}, tool_call_id => 'huge')"
        ))
        .0;
        assert_eq!(out["outcome"], "claimed");
        assert!(
            one::<i32>("SELECT max(pg_column_size(arguments)) FROM ledger.run_step_tool_calls")
                < 1000
        );
    }

    #[pg_test]
    fn the_ledger_writes_the_audit_records_of_tool_activity_itself() {
        running_run("t-tc-audits");
        let args = r#"{"q": "x", "password": "hunter2"}"#;
        one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('r', 'search', '{args}', tool_call_id => 'c1', lease_owner => 'worker-1')"
        ));
        let id = record("c1");
        sent(&id, "'succeeded', '{}'");
        outcome("{}", "c2");
        let id2 = record("c2");
        sent(&id2, "'unknown'");
        Spi::run(&format!(
            "SELECT ledger.resolve_tool_call('{id2}', 'failed', actor => 'ops')"
        ))
        .unwrap();
        let out = request_pay("{}");
        Spi::run(&format!(
            "SELECT ledger.resolve_approval('{}', 'approved', actor => 'cfo')",
            out["approval"]["id"].as_str().unwrap()
        ))
        .unwrap();
        assert_eq!(
            one::<String>(
                "SELECT string_agg(gateway_type || ':' || outcome || ':' || coalesce(actor, '-'), ' ' \
                                   ORDER BY created_at, id) FROM ledger.audit_events"
            )
            .split(' ')
            .collect::<std::collections::BTreeSet<_>>(),
            [
                "tool_call.claim:claimed:worker-1",
                "tool_call.complete:succeeded:worker-1",
                "tool_call.claim:claimed:tool:r",
                "tool_call.complete:unknown:tool:r",
                "tool_call.resolve:failed:ops",
                "approval.request:pending:-",
                "approval.decision:approved:cfo",
            ]
            .into_iter()
            .collect()
        );
        // Each names its call (and step); none carries the arguments.
        assert!(one::<bool>(&format!(
            "SELECT bool_and(payload->'tool_call'->>'tool_call_record_id' = '{id}' AND step_id IS NOT NULL) \
               FROM ledger.audit_events WHERE payload->'tool_call'->>'tool_call_id' = 'c1'"
        )));
        assert_eq!(
            one::<i64>(
                "SELECT count(*) FROM ledger.audit_events WHERE payload::text LIKE '%hunter2%'"
            ),
            0
        );
        // Replays and busy answers hand out no execution: no audit.
        let audits = one::<i64>("SELECT count(*) FROM ledger.audit_events");
        outcome(args, "c1");
        assert_eq!(outcome("{}", "c3"), "claimed");
        assert_eq!(outcome("{}", "c3"), "busy");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.audit_events"),
            audits + 1
        );
    }
}
