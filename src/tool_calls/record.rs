//! Writing a tool call's record: a new call (claimed, or waiting for an approval), a new
//! attempt, in doubt, its result; and reading a finished call's result back for a replay.

use super::{event, identity_reused_by, step_to, ApprovalRequest, Arguments, Identity};
use crate::artifacts;
use crate::audit;
use crate::db;
use crate::error::{Code, LedgerError, Result};
use crate::jsonb::Jsonb;
use crate::outbox;
use crate::redaction::{free_text, free_text_within, redacted_json};
use crate::rows::{self, LockedRun, ToolCall};
use crate::scope::Scope;
use crate::steps::{self, NewStep, StepChange};
use ledger_model::events::{
    AuditKind, Event, ToolCallApproval, ToolCallClaimed, ToolCallCompleted, ToolCallReplayed,
};
use ledger_model::status::Status;
use ledger_model::tool_calls::CallStatus;
use ledger_model::{ids, json};
use pgrx::datum::DatumWithOid;
use serde_json::{json, Value};

/// Results whose canonical JSON is longer than this are stored as an artifact.
pub const INLINE_RESULT_BYTES: usize = 8192;

/// A tool step's `output_summary` is the start of its result's text, this many characters: the
/// result itself is the call's. A whole copy wrote every result twice, and a step row grown past
/// 2 KB is compressed and moved at every completion.
const TOOL_SUMMARY_CHARS: usize = 256;

/// What a claim that hands out execution writes: the step to preparing, `tool_call.claimed` and
/// its audit record.
pub(super) fn announce_claim(
    scope: &Scope,
    run: &LockedRun,
    rec: &ToolCall,
    lease_owner: &str,
    lease: i32,
) -> Result<()> {
    step_to(scope, run, rec, Status::Preparing)?;
    let claimed = Event::ToolCallClaimed(ToolCallClaimed {
        call: rec.ids(),
        lease_owner,
    });
    event(scope, run, rec, &claimed)?;
    audit::write(
        scope,
        Some(&rec.run_id),
        Some(&rec.step_id),
        AuditKind::ToolCallClaim,
        "claimed",
        Some(lease_owner),
        json!({"tool_call": rec.ids(), "lease_seconds": lease}),
    )
}

/// Moves the record to in_doubt (its step to paused) and tells the outbox.
pub(super) fn mark_in_doubt(
    scope: &Scope,
    run: &LockedRun,
    rec: &mut ToolCall,
    error: Option<&str>,
) -> Result<()> {
    db::execute(
        include_str!("../../sql/queries/mark_tool_call_in_doubt.sql"),
        &scope.args([rec.id.as_str().into(), free_text(error).into()]),
    )?;
    rec.status = CallStatus::InDoubt;
    steps::follow(
        scope,
        run,
        &rec.step_id,
        Status::Paused,
        StepChange {
            metrics: Some(Jsonb::from(
                &json!({"tool_call": {"operational_status": "in_doubt", "attempt": rec.attempt}}),
            )),
            ..StepChange::default()
        },
    )?;
    let in_doubt = Event::ToolCallInDoubt(rec.ids());
    outbox::enqueue(
        scope,
        &in_doubt,
        Some(&rec.run_id),
        None,
        &format!("tool_call:{}", rec.id),
    )?;
    event(scope, run, rec, &in_doubt)
}

/// Starts a new attempt: the caller now holds the lease and `attempt` is its fencing token.
pub(super) fn arm(
    scope: &Scope,
    run: &LockedRun,
    rec: &mut ToolCall,
    lease_owner: &str,
    lease: i32,
    arguments: &Value,
) -> Result<()> {
    rec.attempt = db::write_one(
        include_str!("../../sql/queries/arm_tool_call.sql"),
        &scope.args([
            rec.id.as_str().into(),
            lease_owner.into(),
            lease.into(),
            Jsonb::from(arguments).into(),
            db::clock_plus(lease.into())?.into(),
        ]),
        |r| db::req::<i64>(r, 1),
    )?
    .ok_or_else(|| LedgerError::internal("tool call vanished under its lock"))?;
    rec.status = CallStatus::Claimed;
    rec.lease_owner = Some(lease_owner.to_owned());
    (rec.lease_held, rec.lease_live) = (true, true);
    announce_claim(scope, run, rec, lease_owner, lease)
}

/// A result as a record stores it: inline up to `INLINE_RESULT_BYTES` of canonical JSON, else as
/// a `json` artifact of the call's step.
pub(super) struct StoredResult {
    inline: Option<Jsonb>,
    artifact: Option<String>,
    size: Option<i64>,
    sha: Option<String>,
}

impl StoredResult {
    pub(super) fn artifact(&self) -> Option<&str> {
        self.artifact.as_deref()
    }

    /// The columns `result, result_artifact_id, result_size_bytes, result_sha256`, in order.
    pub(super) fn columns(&self) -> [DatumWithOid<'static>; 4] {
        [
            self.inline.clone().into(),
            self.artifact.clone().into(),
            self.size.into(),
            self.sha.clone().into(),
        ]
    }
}

/// The canonical JSON of a result as recorded (redacted), if any.
pub(super) fn canonical_result(result: Option<&Jsonb>) -> Result<Option<String>> {
    result
        .map(|r| Ok(json::canonical(&redacted_json(r)?)))
        .transpose()
}

/// Stores a result's canonical JSON for the record (its id and step known) in the run this
/// transaction holds.
pub(super) fn store_result(
    scope: &Scope,
    run: &LockedRun,
    rec: &ToolCall,
    canonical: Option<&str>,
) -> Result<StoredResult> {
    Ok(match canonical {
        Some(c) if c.len() > INLINE_RESULT_BYTES => {
            let meta = json!({"kind": "tool_result", "tool_call_id": rec.tool_call_id, "tool_call_record_id": rec.id});
            let (id, sha) = artifacts::put_bytes(
                scope,
                run.held(),
                Some(&rec.step_id),
                c.as_bytes(),
                "json",
                Some("application/json"),
                &meta,
            )?;
            StoredResult {
                inline: None,
                artifact: Some(id),
                size: Some(c.len() as i64),
                sha: Some(sha),
            }
        }
        Some(c) => StoredResult {
            inline: Some(Jsonb(c.to_owned())),
            artifact: None,
            size: Some(c.len() as i64),
            sha: None,
        },
        None => StoredResult {
            inline: None,
            artifact: None,
            size: None,
            sha: None,
        },
    })
}

/// What a finished call's tool step shows: the start of the result's text as its summary
/// (the whole result is the call's) and the call in its metrics.
pub(super) fn finished_step(rec: &ToolCall, canonical: Option<&str>) -> (Option<String>, Jsonb) {
    let metrics = json!({"tool_call": {"tool_call_id": rec.tool_call_id, "tool_ref": rec.tool_ref, "attempt": rec.attempt, "replayed": false}});
    (
        free_text_within(canonical, TOOL_SUMMARY_CHARS),
        Jsonb::from(&metrics),
    )
}

/// Records the final result of the call (inline, or as an artifact when large).
#[allow(clippy::too_many_arguments)]
pub(super) fn finish(
    scope: &Scope,
    run: &LockedRun,
    rec: &mut ToolCall,
    success: bool,
    result: Option<Jsonb>,
    error: Option<&str>,
    error_code: Option<&str>,
    metadata: &Value,
) -> Result<()> {
    let canonical = canonical_result(result.as_ref())?;
    let stored = store_result(scope, run, rec, canonical.as_deref())?;
    let status = if success {
        CallStatus::Succeeded
    } else {
        CallStatus::Failed
    };
    let mut args = scope.args([rec.id.as_str().into(), status.as_str().into()]);
    args.extend(stored.columns());
    args.extend([
        Jsonb::from(metadata).into(),
        error_code.into(),
        free_text(error).into(),
    ]);
    db::execute(
        include_str!("../../sql/queries/finish_tool_call.sql"),
        &args,
    )?;
    rec.status = status;
    let step_status = if success {
        Status::Succeeded
    } else {
        Status::Failed
    };
    let (summary, metrics) = finished_step(rec, canonical.as_deref());
    steps::follow(
        scope,
        run,
        &rec.step_id,
        step_status,
        StepChange {
            output_summary: summary.as_deref(),
            metrics: Some(metrics),
            error_code,
            error_message: error,
            error_details: None,
        },
    )?;
    let completed = Event::ToolCallCompleted(ToolCallCompleted {
        call: rec.ids(),
        status: status.as_str(),
        result_artifact_id: stored.artifact(),
    });
    event(scope, run, rec, &completed)
}

/// `{result, success, error, metadata}` of a finished call, with `metadata.idempotent_replay`.
/// A result held as an artifact is loaded, its owner checked and its sha256 verified.
pub(super) fn replay_response(scope: &Scope, rec: &ToolCall) -> Result<Jsonb> {
    let (result, metadata, error) = db::select_one(
        "SELECT result, metadata, error_message FROM ledger.run_step_tool_calls \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([rec.id.as_str().into()]),
        |r| {
            Ok((
                db::opt::<Jsonb>(r, 1)?,
                db::req::<Jsonb>(r, 2)?,
                db::opt::<String>(r, 3)?,
            ))
        },
    )?
    .ok_or_else(|| LedgerError::not_found(Code::ToolCallNotFound, "tool call", &rec.id))?;
    let result_text = match &rec.result_artifact_id {
        None => result.map_or_else(|| "null".to_owned(), |r| r.0),
        Some(artifact_id) => {
            let mismatch = || {
                LedgerError::new(
                    Code::ArtifactScopeMismatch,
                    "Tool result artifact scope mismatch",
                )
                .with("artifact_id", artifact_id.as_str())
                .with("tool_call_record_id", rec.id.as_str())
            };
            let artifact = artifacts::load(scope, artifact_id)?.ok_or_else(mismatch)?;
            if artifact.run_id != rec.run_id
                || artifact.step_id.as_deref() != Some(rec.step_id.as_str())
            {
                return Err(mismatch());
            }
            if let Some(expected) = &rec.result_sha256 {
                if *expected != artifact.sha256 {
                    return Err(artifacts::hash_mismatch(
                        artifact_id,
                        expected,
                        &artifact.sha256,
                    ));
                }
            }
            let bytes = artifacts::bytes(scope, artifact_id, &artifact)?;
            String::from_utf8(bytes)
                .map_err(|_| artifacts::hash_mismatch(artifact_id, &artifact.sha256, "not UTF-8"))?
        }
    };
    let mut meta = match json::parse(metadata.as_str())? {
        Value::Object(m) => m,
        _ => serde_json::Map::new(),
    };
    meta.insert("idempotent_replay".into(), Value::Bool(true));
    if let Some(a) = &rec.result_artifact_id {
        meta.insert("result_artifact_id".into(), Value::from(a.as_str()));
    }
    Ok(Jsonb(format!(
        r#"{{"result":{result_text},"success":{},"error":{},"metadata":{}}}"#,
        rec.status == CallStatus::Succeeded,
        Value::from(error),
        Value::Object(meta)
    )))
}

/// Checks a caller-given step: a `tool` step of this run (one tool call per step).
fn given_step(scope: &Scope, run_id: &str, step_id: &str) -> Result<()> {
    ids::validate("step_id", step_id)?;
    let step_type = rows::step_of_run(scope, step_id, run_id)?.step_type;
    if step_type != "tool" {
        return Err(LedgerError::new(
            Code::StepNotTool,
            "a tool call's step must have step_type tool",
        )
        .with("step_id", step_id)
        .with("step_type", step_type));
    }
    Ok(())
}

/// Creates the `tool` step of a new call (`step_key` its `tool_call_id`), in `status`, holding
/// `ended` when it is created finished.
pub(super) fn tool_step(
    scope: &Scope,
    run: &LockedRun,
    who: &Identity,
    status: Status,
    ended: StepChange,
) -> Result<String> {
    steps::create(
        scope,
        run,
        &NewStep {
            step_type: "tool",
            step_key: Some(&who.tool_call_id),
            node_id: None,
            input_summary: Some(&format!("tool={}", who.tool_ref)),
            status,
            step_id: None,
            ended,
        },
    )
}

/// A new record's first columns, in the order both inserts take them: `id, run_id, step_id,
/// tool_call_id, tool_ref, idempotency_key, request_hash, arguments`.
pub(super) fn identity_columns<'a>(
    id: &'a str,
    step_id: &'a str,
    who: &'a Identity,
    args: &'a Arguments,
) -> [DatumWithOid<'a>; 8] {
    [
        id.into(),
        who.run_id.into(),
        step_id.into(),
        who.tool_call_id.as_str().into(),
        who.tool_ref.into(),
        who.idempotency_key.as_str().into(),
        args.hash.as_str().into(),
        Jsonb::from(&args.summary).into(),
    ]
}

/// Inserts a new record (and its step unless given); returns the record, read under the run's lock.
#[allow(clippy::too_many_arguments)]
pub(super) fn insert(
    scope: &Scope,
    run: &LockedRun,
    who: &Identity,
    args: &Arguments,
    step_id: Option<&str>,
    status: CallStatus,
    lease_owner: Option<&str>,
    lease: i32,
    approval_id: Option<&str>,
) -> Result<Option<ToolCall>> {
    let step_id = match step_id {
        Some(s) => {
            given_step(scope, who.run_id, s)?;
            s.to_owned()
        }
        None => tool_step(scope, run, who, Status::Queued, StepChange::default())?,
    };
    let id = ids::new_id("tc");
    let claimed = status == CallStatus::Claimed;
    let inserted = db::write_one(
        include_str!("../../sql/queries/insert_tool_call.sql"),
        &scope.args(
            identity_columns(&id, &step_id, who, args)
                .into_iter()
                .chain([
                    status.as_str().into(),
                    claimed.into(),
                    lease_owner.into(),
                    lease.into(),
                    approval_id.into(),
                    claimed
                        .then(|| db::clock_plus(lease.into()))
                        .transpose()?
                        .into(),
                ]),
        ),
        |r| db::req::<String>(r, 1),
    )?;
    if inserted.is_none() {
        // The step already has a record; a concurrent claim from another run took the key.
        return Ok(None);
    }
    rows::held_tool_call(scope, run, &id)
}

/// Whether run `run_id` already reused the record (its `tool_call.replayed` event).
pub(super) fn reused_before(scope: &Scope, run_id: &str, rec: &ToolCall) -> Result<bool> {
    Ok(db::select_one(
        "SELECT 1 FROM ledger.run_events \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 \
            AND event_type = 'tool_call.replayed' AND payload->>'tool_call_record_id' = $4",
        &scope.args([run_id.into(), rec.id.as_str().into()]),
        |_| Ok(()),
    )?
    .is_some())
}

/// A finished call of another run reused by `run`, the calling run (a retry or replay passing its
/// source's keys): the first reuse writes `tool_call.replayed` to that run's feed and an audit record,
/// which are that run's evidence of where the result came from. A reuse within the call's own
/// run (a resuming worker) writes nothing: the run already holds the call.
pub(super) fn replayed_into(scope: &Scope, run: &LockedRun, rec: &ToolCall) -> Result<()> {
    let run_id = run.id.as_str();
    if reused_before(scope, run_id, rec)? {
        return Ok(());
    }
    let replayed = Event::ToolCallReplayed(ToolCallReplayed {
        call: rec.ids(),
        source_run_id: &rec.run_id,
    });
    event(scope, run, rec, &replayed)?;
    audit::write(
        scope,
        Some(run_id),
        None,
        AuditKind::ToolCallReplay,
        "replayed",
        None,
        json!({"tool_call": rec.ids(), "source_run_id": rec.run_id}),
    )
}

/// Creates a call waiting for a human decision, and its approval request, in the locked live run
/// (the identity is unknown).
#[allow(clippy::too_many_arguments)]
pub(super) fn create_waiting(
    scope: &Scope,
    run: &LockedRun,
    who: &Identity,
    args: &Arguments,
    step_id: Option<&str>,
    lease: i32,
    request: &ApprovalRequest,
) -> Result<ToolCall> {
    // The approval row comes first: the record points at it.
    let approval_id = ids::new_id("apr");
    let mut full_details = json!({"tool_ref": who.tool_ref, "tool_call_id": who.tool_call_id, "arguments": args.summary});
    if let (Value::Object(d), Value::Object(extra)) = (&mut full_details, &request.details) {
        d.extend(extra.clone());
    }
    let title = request.title.as_deref();
    let policy_ref = request.policy_ref.as_deref();
    db::execute(
        "INSERT INTO ledger.approval_requests \
            (tenant_id, workspace_id, id, run_id, title, policy_ref, details, expires_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        &scope.args([
            approval_id.as_str().into(),
            who.run_id.into(),
            title.into(),
            policy_ref.into(),
            Jsonb::from(&full_details).into(),
            request
                .expires_in_seconds
                .map(|s| db::now_plus(s.into()))
                .transpose()?
                .into(),
        ]),
    )?;
    let rec = insert(
        scope,
        run,
        who,
        args,
        step_id,
        CallStatus::WaitingApproval,
        None,
        lease,
        Some(&approval_id),
    )?
    .ok_or_else(|| identity_reused_by(who))?;
    db::execute(
        "UPDATE ledger.approval_requests SET step_id = $4, tool_call_record_id = $5 \
      WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([
            approval_id.as_str().into(),
            rec.step_id.as_str().into(),
            rec.id.as_str().into(),
        ]),
    )?;
    step_to(scope, run, &rec, Status::Preparing)?;
    step_to(scope, run, &rec, Status::WaitingApproval)?;
    let requested = Event::ApprovalRequested(ToolCallApproval {
        call: rec.ids(),
        approval_id: &approval_id,
        title,
    });
    outbox::enqueue(
        scope,
        &requested,
        Some(who.run_id),
        None,
        &format!("approval:{approval_id}"),
    )?;
    event(scope, run, &rec, &requested)?;
    audit::write(
        scope,
        Some(who.run_id),
        Some(&rec.step_id),
        AuditKind::ApprovalRequest,
        "pending",
        None,
        json!({"tool_call": rec.ids(), "approval_id": approval_id, "title": title, "policy_ref": policy_ref}),
    )?;
    Ok(rec)
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use crate::testing::{assert_error, one, running_run};
    use crate::tool_calls::tests::{claim, field, outcome, record, sent, step_status};
    use pgrx::prelude::*;

    #[pg_test]
    fn a_new_claim_records_the_call_with_redacted_arguments() {
        running_run("t-tc-new");
        let out = one::<pgrx::JsonB>(&claim(
            r#"{"q": "shoes", "apiKey": "k-123", "n": 1.50}"#,
            "c1",
        ))
        .0;
        assert_eq!(out["outcome"], "claimed");
        assert_eq!(out["response"], serde_json::Value::Null);
        let tc = &out["tool_call"];
        assert_eq!(tc["attempt"], 1);
        assert_eq!(tc["status"], "claimed");
        assert_eq!(tc["idempotency_key"], "tool:r:c1");
        assert_eq!(tc["arguments"]["apiKey"], "[REDACTED]");
        assert!(tc["id"].as_str().unwrap().starts_with("tc_"));
        // The hash is over the unredacted arguments.
        assert_eq!(
            tc["request_hash"].as_str().unwrap(),
            one::<String>(
                r#"SELECT ledger.request_hash('{"q": "shoes", "apiKey": "k-123", "n": 1.50}')"#
            )
        );
        assert_eq!(step_status("c1"), "preparing");
        assert_eq!(
            one::<String>("SELECT step_type FROM ledger.run_steps"),
            "tool"
        );
        // Not re-entrant: the same claim again is busy, whoever asks.
        assert_eq!(
            outcome(r#"{"q": "shoes", "apiKey": "k-123", "n": 1.50}"#, "c1"),
            "busy"
        );
        assert_eq!(field("c1", "attempt"), "1");
    }

    #[pg_test]
    fn a_fresh_claim_numbers_its_step_and_events_without_gaps_in_order() {
        running_run("t-tc-seq");
        outcome(r#"{"q": 1}"#, "c1");
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 'between')").unwrap();
        outcome(r#"{"q": 2}"#, "c2");
        // Each claim's step.created, step.status and tool_call.claimed follow one another.
        assert_eq!(
            one::<String>(
                "SELECT string_agg(seq || ':' || event_type, ' ' ORDER BY seq) FROM ledger.run_events"
            ),
            "1:run.created 2:run.status 3:step.created 4:step.status 5:tool_call.claimed \
             6:step.created 7:step.created 8:step.status 9:tool_call.claimed"
        );
        // Steps count 1, 2, 3 in creation order, and last_seq is the last seq.
        assert_eq!(
            one::<String>(
                "SELECT string_agg(s.step_no || ':' || e.seq, ' ' ORDER BY s.step_no) FROM ledger.run_steps s \
                   JOIN ledger.run_events e ON e.tenant_id = s.tenant_id AND e.workspace_id = s.workspace_id \
                    AND e.step_id = s.id AND e.event_type = 'step.created'"
            ),
            "1:3 2:6 3:7"
        );
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_steps"), 3);
        assert_eq!(one::<i64>("SELECT last_seq FROM ledger.runs"), 9);
    }

    #[pg_test]
    fn large_results_live_in_a_verified_artifact() {
        running_run("t-tc-large");
        outcome("{}", "c1");
        let id = record("c1");
        let big = "jsonb_build_object('rows', (SELECT jsonb_agg(jsonb_build_object('i', i, 'name', 'row ' || i)) FROM generate_series(1, 2000) i))";
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', {big})"
        ))
        .unwrap();
        assert_eq!(field("c1", "result"), "(null)");
        let artifact = field("c1", "result_artifact_id");
        assert_eq!(
            one::<String>(&format!("SELECT concat_ws('|', artifact_type, mime, meta->>'kind', storage_key LIKE 'blob:sha256:%') FROM ledger.run_artifacts WHERE id = '{artifact}'")),
            "json|application/json|tool_result|t"
        );
        assert!(one::<bool>(&format!(
            "SELECT ({}->'response'->'result') = {big}",
            claim("{}", "c1")
        )));
        assert!(one::<bool>(&format!(
            "SELECT ({}->'response'->'metadata'->>'result_artifact_id') = '{artifact}'",
            claim("{}", "c1")
        )));
        // Tampered bytes are refused.
        Spi::run("UPDATE ledger.blobs SET content = content || '\\x20'::bytea WHERE tenant_id = 't-tc-large'").unwrap();
        assert_error(&claim("{}", "c1"), "XX001", "ARTIFACT_HASH_MISMATCH");
    }

    #[pg_test]
    fn a_result_artifact_of_another_run_is_refused() {
        running_run("t-tc-artifact-owner");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'other')").unwrap();
        outcome("{}", "c1");
        let id = record("c1");
        let big = "jsonb_build_object('text', repeat('x', 10000))";
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', {big})"
        ))
        .unwrap();
        let foreign = one::<String>("SELECT id FROM ledger.put_artifact('other', convert_to(repeat('x', 10), 'UTF8'), 'json')");
        Spi::run(&format!("UPDATE ledger.run_step_tool_calls SET result_artifact_id = '{foreign}' WHERE id = '{id}'")).unwrap();
        let e = assert_error(&claim("{}", "c1"), "42501", "ARTIFACT_SCOPE_MISMATCH");
        assert_eq!(e.message, "ledger: Tool result artifact scope mismatch");
    }

    #[pg_test]
    fn a_resumed_worker_replaying_its_own_calls_writes_no_feed_noise() {
        running_run("t-tc-same-run-replay");
        outcome("{}", "c1");
        let id = record("c1");
        sent(&id, "'succeeded', '{}'");
        let last = one::<i64>("SELECT last_seq FROM ledger.runs WHERE id = 'r'");
        let audits = one::<i64>("SELECT count(*) FROM ledger.audit_events");
        for _ in 0..3 {
            assert_eq!(outcome("{}", "c1"), "replayed");
        }
        assert_eq!(
            one::<i64>("SELECT last_seq FROM ledger.runs WHERE id = 'r'"),
            last,
            "three resumes wrote no event"
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.audit_events"),
            audits
        );
    }
}
