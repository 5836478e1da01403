//! Tool calls (replay #3: the same key twice returns the recorded result): claim, lease,
//! fencing, in-doubt, idempotent replay and approvals. Outcomes are returned as data, never raised, because state written before an
//! ERROR would roll back (an in-doubt marking must stick).
//!
//! Lock order, as everywhere: the run first, then the record, then its step. A claim (or an
//! approval request) waits only for the calling run: a record of another run (a re-run passing
//! its source's keys) is locked with its run only when no one holds that run, else read as it is
//! (`Found::Unheld`), so two claims naming each other's keys never deadlock.

use crate::artifacts;
use crate::db;
use crate::error::{raise, Class, LedgerError, Result, SqlError};
use crate::feed;
use crate::guc;
use crate::jsonb::Jsonb;
use crate::redaction::{free_text, free_text_within, redacted_json, redacted_object};
use crate::rows::{self, By, LockedRun, ToolCall};
use crate::scope::{self, Scope};
use crate::steps::{self, NewStep, StepChange};
use ledger_model::args::{optional_id, optional_label, required, required_id, required_label};
use ledger_model::events::{
    ApprovalResolved, Event, ToolCallApproval, ToolCallClaimed, ToolCallCompleted, ToolCallIds,
    ToolCallReplayed, ToolCallResolved,
};
use ledger_model::status::Status;
use ledger_model::tool_calls::{
    approval_ask, check_fence, decide, extend_seconds, identity_reused, lease_seconds, wrong_state,
    ApprovalStatus, CallStatus, Decision, Existing, Outcome, Resolution,
};
use ledger_model::{ids, json, redaction, run_leases};
use pgrx::prelude::*;
use serde_json::{json, Value};

mod batch;

/// Results whose canonical JSON is longer than this are stored as an artifact.
pub const INLINE_RESULT_BYTES: usize = 8192;

/// A tool step's `output_summary` is the start of its result's text, this many characters: the
/// result itself is the call's. A whole copy wrote every result twice, and a step row grown past
/// 2 KB is compressed and moved at every completion.
const TOOL_SUMMARY_CHARS: usize = 256;

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
    .ok_or_else(|| LedgerError::not_found("TOOL_CALL_NOT_FOUND", "tool call", record_id))
}

/// Appends an event about the call to `run_id`'s feed (the call's own run, or the run that
/// replayed it); it names the call's step only in the call's own run.
fn event(scope: &Scope, run_id: &str, rec: &ToolCall, event: &Event) -> Result<()> {
    let step = (run_id == rec.run_id).then_some(rec.step_id.as_str());
    feed::append(scope, run_id, step, event)
}

/// The ledger's own audit record of tool activity (evidence `audit_record`), redacted like every
/// audit. One insert: claims, begins and completions are the write hot path.
fn audit(
    scope: &Scope,
    run_id: &str,
    step_id: Option<&str>,
    gateway_type: &str,
    outcome: &str,
    actor: Option<&str>,
    payload: Value,
) -> Result<()> {
    let payload = redaction::redact(&guc::redaction_rules(), payload);
    db::execute(
        include_str!("../sql/queries/insert_audit.sql"),
        &scope.args([
            ids::new_id("aud").into(),
            run_id.into(),
            step_id.into(),
            gateway_type.into(),
            outcome.into(),
            actor.into(),
            Jsonb::from(&payload).into(),
        ]),
    )
}

/// What a claim that hands out execution writes: the step to preparing, `tool_call.claimed` and
/// its audit record.
fn announce_claim(
    scope: &Scope,
    run: &LockedRun,
    rec: &ToolCall,
    lease_owner: &str,
    lease: i32,
) -> Result<()> {
    steps::follow(
        scope,
        run,
        &rec.step_id,
        Status::Preparing,
        StepChange::default(),
    )?;
    let claimed = Event::ToolCallClaimed(ToolCallClaimed {
        call: rec.ids(),
        lease_owner,
    });
    event(scope, &rec.run_id, rec, &claimed)?;
    audit(
        scope,
        &rec.run_id,
        Some(&rec.step_id),
        "tool_call.claim",
        "claimed",
        Some(lease_owner),
        json!({"tool_call": rec.ids(), "lease_seconds": lease}),
    )
}

/// Moves the record to in_doubt (its step to paused) and tells the outbox.
fn mark_in_doubt(
    scope: &Scope,
    run: &LockedRun,
    rec: &mut ToolCall,
    error: Option<&str>,
) -> Result<()> {
    db::execute(
        include_str!("../sql/queries/mark_tool_call_in_doubt.sql"),
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
    feed::enqueue(
        scope,
        &in_doubt,
        Some(&rec.run_id),
        None,
        &format!("tool_call:{}", rec.id),
    )?;
    event(scope, &rec.run_id, rec, &in_doubt)
}

/// Starts a new attempt: the caller now holds the lease and `attempt` is its fencing token.
fn arm(
    scope: &Scope,
    run: &LockedRun,
    rec: &mut ToolCall,
    lease_owner: &str,
    lease: i32,
    arguments: &Value,
) -> Result<()> {
    rec.attempt = db::write_one(
        include_str!("../sql/queries/arm_tool_call.sql"),
        &scope.args([
            rec.id.as_str().into(),
            lease_owner.into(),
            lease.into(),
            Jsonb::from(arguments).into(),
        ]),
        |r| db::req::<i64>(r, 1),
    )?
    .ok_or_else(|| LedgerError::internal("tool call vanished under its lock"))?;
    rec.status = CallStatus::Claimed;
    rec.lease_owner = Some(lease_owner.to_owned());
    (rec.lease_held, rec.lease_live) = (true, true);
    announce_claim(scope, run, rec, lease_owner, lease)
}

/// Records the final result of the call (inline, or as an artifact when large).
#[allow(clippy::too_many_arguments)]
fn finish(
    scope: &Scope,
    run: &LockedRun,
    rec: &mut ToolCall,
    success: bool,
    result: Option<Jsonb>,
    error: Option<&str>,
    error_code: Option<&str>,
    metadata: &Value,
) -> Result<()> {
    let canonical = match &result {
        Some(r) => Some(json::canonical(&redacted_json(r)?)),
        None => None,
    };
    let (inline, artifact, size, sha) = match &canonical {
        Some(c) if c.len() > INLINE_RESULT_BYTES => {
            let meta = json!({"kind": "tool_result", "tool_call_id": rec.tool_call_id, "tool_call_record_id": rec.id});
            let (id, sha) = artifacts::put_bytes(
                scope,
                &rec.run_id,
                Some(&rec.step_id),
                c.as_bytes(),
                "json",
                Some("application/json"),
                &meta,
            )?;
            (None, Some(id), Some(c.len() as i64), Some(sha))
        }
        Some(c) => {
            let size = c.len() as i64;
            (Some(Jsonb(c.clone())), None, Some(size), None)
        }
        None => (None, None, None, None),
    };
    let status = if success {
        CallStatus::Succeeded
    } else {
        CallStatus::Failed
    };
    db::execute(
        include_str!("../sql/queries/finish_tool_call.sql"),
        &scope.args([
            rec.id.as_str().into(),
            status.as_str().into(),
            inline.into(),
            artifact.clone().into(),
            size.into(),
            sha.into(),
            Jsonb::from(metadata).into(),
            error_code.into(),
            free_text(error).into(),
        ]),
    )?;
    rec.status = status;
    let step_status = if success {
        Status::Succeeded
    } else {
        Status::Failed
    };
    let metrics = json!({"tool_call": {"tool_call_id": rec.tool_call_id, "tool_ref": rec.tool_ref, "attempt": rec.attempt, "replayed": false}});
    let summary = free_text_within(canonical.as_deref(), TOOL_SUMMARY_CHARS);
    steps::follow(
        scope,
        run,
        &rec.step_id,
        step_status,
        StepChange {
            output_summary: summary.as_deref(),
            metrics: Some(Jsonb::from(&metrics)),
            error_code,
            error_message: error,
            error_details: None,
        },
    )?;
    let completed = Event::ToolCallCompleted(ToolCallCompleted {
        call: rec.ids(),
        status: status.as_str(),
        result_artifact_id: artifact.as_deref(),
    });
    event(scope, &rec.run_id, rec, &completed)
}

/// `{result, success, error, metadata}` of a finished call, with `metadata.idempotent_replay`.
/// A result held as an artifact is loaded, its owner checked and its sha256 verified.
fn replay_response(scope: &Scope, rec: &ToolCall) -> Result<Jsonb> {
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
    .ok_or_else(|| LedgerError::not_found("TOOL_CALL_NOT_FOUND", "tool call", &rec.id))?;
    let result_text = match &rec.result_artifact_id {
        None => result.map_or_else(|| "null".to_owned(), |r| r.0),
        Some(artifact_id) => {
            let mismatch = || {
                LedgerError::new(
                    Class::Privilege,
                    "ARTIFACT_SCOPE_MISMATCH",
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
    LedgerError::invalid("ARGUMENTS_NOT_OBJECT", "arguments must be a JSON object")
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

/// The record an identity names, and how far this transaction holds it.
enum Found {
    /// Its run is locked by this transaction, the record read under that lock.
    Held(LockedRun, ToolCall),
    /// Another run's record while a concurrent transaction holds that run: read, not locked.
    /// Waiting for that run while holding the calling run could close a cycle (40P01), so the
    /// claim answers from what it read and writes nothing to that run.
    Unheld(ToolCall),
    /// Another run's record while a purge is deleting its run: the tombstone answers once the
    /// purge commits.
    Purging(ToolCall),
}

impl Found {
    fn record(&self) -> &ToolCall {
        match self {
            Found::Held(_, rec) | Found::Unheld(rec) | Found::Purging(rec) => rec,
        }
    }
}

/// Finds the record an identity names (by idempotency key first, then by run and tool_call_id).
/// A record of `run`, the calling run (already locked), is read under its lock; one of another run
/// only once its run is locked too, which is tried only if no one else holds that run, never
/// waited for.
fn find_locked(scope: &Scope, run: &LockedRun, who: &Identity) -> Result<Option<Found>> {
    let found = match rows::find_tool_call(scope, By::Key(&who.idempotency_key))? {
        Some(r) => Some(r),
        None => rows::find_tool_call(scope, By::RunCall(who.run_id, &who.tool_call_id))?,
    };
    let Some(found) = found else { return Ok(None) };
    let record_run = if found.run_id == run.id {
        Some(run.clone())
    } else {
        rows::try_lock_run(scope, &found.run_id)?
    };
    // A purge may have removed it meanwhile: then its tombstone answers.
    let found = match record_run {
        Some(record_run) => rows::held_tool_call(scope, &record_run, &found.id)?
            .map(|rec| Found::Held(record_run, rec)),
        None => {
            let stays = rows::try_key_share_run(scope, &found.run_id)?;
            rows::find_tool_call(scope, By::Id(&found.id))?.map(|rec| {
                if stays {
                    Found::Unheld(rec)
                } else {
                    Found::Purging(rec)
                }
            })
        }
    };
    if let Some(rec) = found.as_ref().map(Found::record) {
        if rec.idempotency_key != who.idempotency_key {
            // Found by (run_id, tool_call_id) under another key.
            return Err(identity_reused().with("tool_call_id", who.tool_call_id.as_str()));
        }
    }
    Ok(found)
}

/// The tombstone of a purged call with this key: `{"outcome": "purged", ...}`, never a new
/// execution (a different tool or request under the key is still a conflict).
fn tombstone(scope: &Scope, who: &Identity, args: &Arguments) -> Result<Option<Jsonb>> {
    let Some((tool_ref, hash, record)) = db::select_one(
        "SELECT tool_ref, request_hash, to_jsonb(t) - 'tenant_id' - 'workspace_id' \
           FROM ledger.tool_call_tombstones t \
          WHERE tenant_id = $1 AND workspace_id = $2 AND idempotency_key = $3",
        &scope.args([who.idempotency_key.as_str().into()]),
        |r| {
            Ok((
                db::req::<String>(r, 1)?,
                db::req::<String>(r, 2)?,
                db::req::<Jsonb>(r, 3)?,
            ))
        },
    )?
    else {
        return Ok(None);
    };
    if tool_ref != who.tool_ref || hash != args.hash {
        return Err(identity_reused().with("purged", true));
    }
    Ok(Some(Jsonb(format!(
        r#"{{"outcome":"purged","tool_call":{},"approval":null,"response":null}}"#,
        record.0
    ))))
}

/// Checks a caller-given step: a `tool` step of this run (one tool call per step).
fn given_step(scope: &Scope, run_id: &str, step_id: &str) -> Result<()> {
    ids::validate("step_id", step_id)?;
    let step_type = rows::step_of_run(scope, step_id, run_id)?.step_type;
    if step_type != "tool" {
        return Err(LedgerError::invalid(
            "STEP_NOT_TOOL",
            "a tool call's step must have step_type tool",
        )
        .with("step_id", step_id)
        .with("step_type", step_type));
    }
    Ok(())
}

/// Inserts a new record (and its step unless given); returns the record, read under the run's lock.
#[allow(clippy::too_many_arguments)]
fn insert(
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
        None => steps::create(
            scope,
            run,
            &NewStep {
                step_type: "tool",
                step_key: Some(&who.tool_call_id),
                node_id: None,
                input_summary: Some(&format!("tool={}", who.tool_ref)),
                status: Status::Queued,
                step_id: None,
            },
        )?,
    };
    let id = ids::new_id("tc");
    let claimed = status == CallStatus::Claimed;
    let inserted = db::write_one(
        include_str!("../sql/queries/insert_tool_call.sql"),
        &scope.args([
            id.as_str().into(),
            who.run_id.into(),
            step_id.as_str().into(),
            who.tool_call_id.as_str().into(),
            who.tool_ref.into(),
            who.idempotency_key.as_str().into(),
            args.hash.as_str().into(),
            Jsonb::from(&args.summary).into(),
            status.as_str().into(),
            claimed.into(),
            lease_owner.into(),
            lease.into(),
            approval_id.into(),
        ]),
        |r| db::req::<String>(r, 1),
    )?;
    if inserted.is_none() {
        // The step already has a record; a concurrent claim from another run took the key.
        return Ok(None);
    }
    rows::held_tool_call(scope, run, &id)
}

/// One call's claim, checked before anything is locked or written.
struct Claim<'a> {
    who: Identity<'a>,
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
    fn new(
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
fn claim_owner(lease_owner: Option<&str>, run_id: &str) -> Result<String> {
    Ok(optional_id("lease_owner", lease_owner)?
        .map_or_else(|| format!("tool:{run_id}"), str::to_owned))
}

/// What a claim or an approval request answers.
enum Answer {
    /// The outcome of the record `id` (with the response of a replay).
    Of(String, &'static str, Option<Jsonb>),
    /// A purged call's tombstone.
    Purged(Jsonb),
    /// The caller now holds the call (a new attempt), in the run this transaction holds.
    Claimed(Box<(LockedRun, ToolCall)>),
}

impl Answer {
    fn of(rec: &ToolCall, outcome: &'static str) -> Answer {
        Answer::Of(rec.id.clone(), outcome, None)
    }

    /// `{"outcome", "tool_call", "approval", "response"}`, the record read as it is now.
    fn json(self, scope: &Scope) -> Result<Jsonb> {
        match self {
            Answer::Of(id, how, response) => outcome(scope, &id, how, response),
            Answer::Purged(tombstone) => Ok(tombstone),
            Answer::Claimed(held) => outcome(scope, &held.1.id, "claimed", None),
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
fn claim(scope: &Scope, run: &LockedRun, call: &Claim, owner: &str) -> Result<Answer> {
    let (who, args, step_id) = (&call.who, &call.args, call.step_id);
    // Twice at most: an insert that lost a race to a concurrent claim finds its record next time.
    for _ in 0..2 {
        if let Some(found) = find_locked(scope, run, who)? {
            return apply(
                scope,
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
                Class::Duplicate,
                "STEP_HAS_TOOL_CALL",
                "the step already has a tool call",
            )
            .with("step_id", step));
        }
    }
    Err(LedgerError::internal(
        "claim did not settle after a concurrent insert",
    ))
}

/// What a claim (`claim`: its lease owner, lease and `retry_failed`) or an approval request
/// (`claim` None: it never hands out execution) does with the record it found. Only a record
/// whose run this transaction holds is written: another run's call to take over answers `busy`
/// and one whose request left answers `in_doubt` unmarked (the next claim or sweep marks it).
fn apply(
    scope: &Scope,
    who: &Identity,
    found: Found,
    args: &Arguments,
    claim: Option<(&str, i32, bool)>,
) -> Result<Answer> {
    let (run, mut rec) = match found {
        Found::Held(run, rec) => (Some(run), rec),
        Found::Unheld(rec) => (None, rec),
        Found::Purging(rec) => return Ok(Answer::of(&rec, "busy")),
    };
    let retry_failed = claim.is_some_and(|(_, _, retry)| retry);
    let decision = decide(&rec.existing(), who.tool_ref, &args.hash, retry_failed)?;
    Ok(match (decision, run, claim) {
        (Decision::Replay, _, _) => {
            let response = replay_response(scope, &rec)?;
            if who.run_id != rec.run_id {
                replayed_into(scope, who.run_id, &rec)?;
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

/// A finished call of another run reused by `run_id` (a retry or replay passing its source's
/// keys): the first reuse writes `tool_call.replayed` to that run's feed and an audit record,
/// which are that run's evidence of where the result came from. A reuse within the call's own
/// run (a resuming worker) writes nothing: the run already holds the call.
fn replayed_into(scope: &Scope, run_id: &str, rec: &ToolCall) -> Result<()> {
    let known = db::select_one(
        "SELECT 1 FROM ledger.run_events \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 \
            AND event_type = 'tool_call.replayed' AND payload->>'tool_call_record_id' = $4",
        &scope.args([run_id.into(), rec.id.as_str().into()]),
        |_| Ok(()),
    )?;
    if known.is_some() {
        return Ok(());
    }
    let replayed = Event::ToolCallReplayed(ToolCallReplayed {
        call: rec.ids(),
        source_run_id: &rec.run_id,
    });
    event(scope, run_id, rec, &replayed)?;
    audit(
        scope,
        run_id,
        None,
        "tool_call.replay",
        "replayed",
        None,
        json!({"tool_call": rec.ids(), "source_run_id": rec.run_id}),
    )
}

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
fn start(scope: &Scope, run: &LockedRun, rec: &mut ToolCall) -> Result<()> {
    db::execute(
        include_str!("../sql/queries/begin_tool_call.sql"),
        &scope.args([rec.id.as_str().into()]),
    )?;
    rec.status = CallStatus::Running;
    steps::follow(
        scope,
        run,
        &rec.step_id,
        Status::Running,
        StepChange::default(),
    )?;
    event(scope, &rec.run_id, rec, &Event::ToolCallRunning(rec.ids()))
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
            SET lease_expires_at = clock_timestamp() + make_interval(secs => $4), \
                updated_at = now() \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([id.into(), seconds.into()]),
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
        audit(
            &scope,
            &rec.run_id,
            Some(&rec.step_id),
            "tool_call.complete",
            reported,
            rec.lease_owner.as_deref(),
            json!({"tool_call": rec.ids(), "status": rec.status.as_str()}),
        )?;
        Ok(self::outcome(&scope, id, rec.status.as_str(), None)?)
    })
}

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
        if rec.status != CallStatus::InDoubt {
            raise(
                LedgerError::new(
                    Class::WrongState,
                    "TOOL_CALL_NOT_IN_DOUBT",
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
                    include_str!("../sql/queries/release_tool_call_for_retry.sql"),
                    &scope.args([id.into()]),
                )?;
                rec.status = CallStatus::Claimed;
            }
        }
        audit(
            &scope,
            &rec.run_id,
            Some(&rec.step_id),
            "tool_call.resolve",
            resolution.as_str(),
            actor,
            json!({"tool_call": rec.ids(), "decision": resolution.as_str(), "note": note}),
        )?;
        let resolved = Event::ToolCallResolved(ToolCallResolved {
            call: rec.ids(),
            decision: resolution.as_str(),
            actor,
        });
        event(&scope, &rec.run_id, &rec, &resolved)?;
        Ok(outcome(&scope, id, rec.status.as_str(), None)?)
    })
}

/// Moves every expired lease in the scope to in_doubt (the request left) or back to claimable
/// (it did not); returns how many. Never waits: rows and runs that are busy are left for the next sweep.
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
    run_leases::check_any_scope(scope::is_operator()?, None)?;
    let scopes = db::select(
        "SELECT tenant_id, workspace_id FROM ledger_dispatch.expired_tool_call_scopes()",
        &[],
        |r| {
            Ok(Scope {
                tenant: db::req(r, 1)?,
                workspace: db::req(r, 2)?,
            })
        },
    )?;
    let mut swept = 0;
    for scope in scopes {
        swept += scope::within(&scope, || sweep(&scope))?;
    }
    Ok(swept)
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
                event(
                    scope,
                    &run_id,
                    &rec,
                    &Event::ToolCallLeaseExpired(rec.ids()),
                )?;
            }
            swept += 1;
        }
        Ok(swept)
    })
}

/// An approval request as stored: the title free text, the policy a label, the details redacted.
struct ApprovalRequest {
    title: Option<String>,
    policy_ref: Option<String>,
    details: Value,
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
    })
}

/// Creates a call waiting for a human decision, and its approval request, in the locked live run
/// (the identity is unknown).
#[allow(clippy::too_many_arguments)]
fn create_waiting(
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
            (tenant_id, workspace_id, id, run_id, title, policy_ref, details) \
     VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &scope.args([
            approval_id.as_str().into(),
            who.run_id.into(),
            title.into(),
            policy_ref.into(),
            Jsonb::from(&full_details).into(),
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
    .ok_or_else(identity_reused)?;
    db::execute(
        "UPDATE ledger.approval_requests SET step_id = $4, tool_call_record_id = $5 \
      WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([
            approval_id.as_str().into(),
            rec.step_id.as_str().into(),
            rec.id.as_str().into(),
        ]),
    )?;
    steps::follow(
        scope,
        run,
        &rec.step_id,
        Status::Preparing,
        StepChange::default(),
    )?;
    steps::follow(
        scope,
        run,
        &rec.step_id,
        Status::WaitingApproval,
        StepChange::default(),
    )?;
    let requested = Event::ApprovalRequested(ToolCallApproval {
        call: rec.ids(),
        approval_id: &approval_id,
        title,
    });
    feed::enqueue(
        scope,
        &requested,
        Some(who.run_id),
        None,
        &format!("approval:{approval_id}"),
    )?;
    event(scope, who.run_id, &rec, &requested)?;
    audit(
        scope,
        who.run_id,
        Some(&rec.step_id),
        "approval.request",
        "pending",
        None,
        json!({"tool_call": rec.ids(), "approval_id": approval_id, "title": title, "policy_ref": policy_ref}),
    )?;
    Ok(rec)
}

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
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        let scope = scope::current()?;
        let who = identity(run_id, tool_ref, tool_call_id, idempotency_key)?;
        let args = self::arguments(arguments)?;
        let request = ApprovalRequest {
            details: redacted_object("details", details)?,
            title: free_text(title),
            policy_ref: optional_label("policy_ref", policy_ref)?.map(str::to_owned),
        };
        let run = rows::lock_run(&scope, "run_id", who.run_id)?;
        run.fence(run_token)?;
        if tombstone(&scope, &who, &args)?.is_some() {
            raise(
                LedgerError::new(
                    Class::WrongState,
                    "TOOL_CALL_PURGED",
                    "this tool call was purged",
                )
                .with("idempotency_key", who.idempotency_key.as_str()),
            );
        }
        if let Some(found) = find_locked(&scope, &run, &who)? {
            return Ok(apply(&scope, &who, found, &args, None)?.json(&scope)?);
        }
        run.ensure_live("tool calls")?;
        let rec = create_waiting(&scope, &run, &who, &args, None, lease_seconds(0)?, &request)?;
        Ok(outcome(&scope, &rec.id, "waiting_approval", None)?)
    })
}

/// Decides a pending approval: `approved` (the next claim of the call gets `claimed`) or
/// `rejected` (the call is rejected and its step canceled).
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
                LedgerError::invalid("DECISION_UNKNOWN", "decision must be approved or rejected")
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
        let current = ApprovalStatus::parse(&status)
            .ok_or_else(|| LedgerError::internal("unknown approval status"))?;
        if current != ApprovalStatus::Pending {
            if current == decision {
                return Ok(approval_json(&scope, approval_id)?);
            }
            raise(
                LedgerError::new(
                    Class::WrongState,
                    "APPROVAL_RESOLVED",
                    format!("approval {approval_id} is already {status}"),
                )
                .with("status", status),
            );
        }
        db::execute(
            include_str!("../sql/queries/decide_approval.sql"),
            &scope.args([
                approval_id.into(),
                decision.as_str().into(),
                actor.into(),
                note.as_deref().into(),
            ]),
        )?;
        let resolved = Event::ApprovalResolved(ApprovalResolved {
            approval_id,
            decision: decision.as_str(),
            actor,
            tool_call_record_id: record_id.as_deref(),
        });
        feed::append(&scope, &run_id, None, &resolved)?;
        audit(
            &scope,
            &run_id,
            None,
            "approval.decision",
            decision.as_str(),
            actor,
            json!({"approval_id": approval_id, "tool_call_record_id": record_id, "note": note}),
        )?;
        if let (ApprovalStatus::Rejected, Some(record_id)) = (decision, record_id) {
            if let Some(mut rec) = rows::held_tool_call(&scope, &run, &record_id)? {
                if rec.status == CallStatus::WaitingApproval {
                    db::execute(
                        include_str!("../sql/queries/reject_tool_call.sql"),
                        &scope.args([record_id.as_str().into()]),
                    )?;
                    rec.status = CallStatus::Rejected;
                    steps::follow(
                        &scope,
                        &run,
                        &rec.step_id,
                        Status::Canceled,
                        StepChange {
                            error_code: Some("TOOL_APPROVAL_REJECTED"),
                            ..StepChange::default()
                        },
                    )?;
                    let rejected = Event::ToolCallRejected(ToolCallApproval {
                        call: rec.ids(),
                        approval_id,
                        title: None,
                    });
                    event(&scope, &run_id, &rec, &rejected)?;
                }
            }
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
    .ok_or_else(|| LedgerError::not_found("APPROVAL_NOT_FOUND", "approval", approval_id))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, error_of, one, running_run};
    use pgrx::prelude::*;

    fn claim(args: &str, call: &str) -> String {
        format!("SELECT ledger.claim_tool_call('r', 'search', '{args}', tool_call_id => '{call}')")
    }

    fn outcome(args: &str, call: &str) -> String {
        one::<String>(&format!("{}->>'outcome'", claim(args, call)))
    }

    fn record(call: &str) -> String {
        one::<String>(&format!(
            "SELECT id FROM ledger.run_step_tool_calls WHERE tool_call_id = '{call}'"
        ))
    }

    fn field(call: &str, column: &str) -> String {
        one::<String>(&format!("SELECT coalesce({column}::text, '(null)') FROM ledger.run_step_tool_calls WHERE tool_call_id = '{call}'"))
    }

    fn step_status(call: &str) -> String {
        one::<String>(&format!(
            "SELECT s.status FROM ledger.run_steps s JOIN ledger.run_step_tool_calls t ON t.step_id = s.id AND t.tenant_id = s.tenant_id \
              WHERE t.tool_call_id = '{call}'"
        ))
    }

    /// Makes the lease of a call expire now (as if its time had passed).
    fn expire(call: &str) {
        Spi::run(&format!(
            "UPDATE ledger.run_step_tool_calls SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE tool_call_id = '{call}'"
        ))
        .unwrap();
    }

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
    fn a_reused_identity_with_other_input_is_a_conflict() {
        running_run("t-tc-identity");
        outcome(r#"{"q": 1}"#, "c1");
        let e = assert_error(&claim(r#"{"q": 2}"#, "c1"), "23505", "IDEMPOTENCY_MISMATCH");
        assert_eq!(
            e.message,
            "ledger: Tool call identity was reused with different input"
        );
        assert_error(
            "SELECT ledger.claim_tool_call('r', 'fetch', '{\"q\": 1}', tool_call_id => 'c1')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        // The same tool_call_id under another key is a conflict too.
        assert_error(
            "SELECT ledger.claim_tool_call('r', 'search', '{\"q\": 1}', tool_call_id => 'c1', idempotency_key => 'k2')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            1
        );
        assert_eq!(field("c1", "attempt"), "1");
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

    #[pg_test]
    fn a_replayed_run_gets_its_tool_results_from_the_ledger() {
        running_run("t-tc-replay-run");
        let key = "SELECT ledger.claim_tool_call('{run}', 'lookup', '{\"order\": 7}', idempotency_key => 'order-7:lookup')";
        let id = one::<String>(&format!(
            "{}->'tool_call'->>'id'",
            key.replace("{run}", "r")
        ));
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{\"eta\": 2}}')"
        ))
        .unwrap();
        Spi::run("SELECT ledger.transition_run('r', 'succeeded')").unwrap();
        let again = one::<String>("SELECT id FROM ledger.replay_run('r')");
        let out = one::<pgrx::JsonB>(&key.replace("{run}", &again)).0;
        assert_eq!(out["outcome"], "replayed");
        assert_eq!(out["response"]["result"], serde_json::json!({"eta": 2}));
        assert_eq!(out["tool_call"]["attempt"], 1);
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.run_step_tool_calls"),
            1,
            "nothing claimed twice"
        );
        // Resuming the re-run reuses it again, and records the reuse once.
        let out = one::<pgrx::JsonB>(&key.replace("{run}", &again)).0;
        assert_eq!(out["outcome"], "replayed");
        assert_eq!(
            one::<i64>(&format!("SELECT count(*) FROM ledger.events_since('{again}') WHERE event_type = 'tool_call.replayed'")),
            1
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT string_agg(gateway_type || ':' || (payload->>'source_run_id'), ',')                    FROM ledger.audit_events WHERE run_id = '{again}'"
            )),
            "tool_call.replay:r"
        );
    }

    /// Begins attempt 1 of record `id` and completes it with `completion` (outcome and rest).
    fn sent(id: &str, completion: &str) {
        Spi::run(&format!("SELECT ledger.begin_tool_call('{id}', 1)")).unwrap();
        Spi::run(&format!(
            "SELECT ledger.complete_tool_call('{id}', 1, {completion})"
        ))
        .unwrap();
    }

    /// `claim_tool_call` with an approval, for call `pay` of run `r`.
    fn claim_approved(args: &str) -> serde_json::Value {
        one::<pgrx::JsonB>(&format!(
            "SELECT ledger.claim_tool_call('r', 'wire_money', '{args}', tool_call_id => 'pay', \
                 approval => '{{\"title\": \"Pay 100\", \"policy_ref\": \"payments/v2\", \
                               \"details\": {{\"api_key\": \"sk-live-0123456789abcdefghij\", \"why\": \"refund\"}}}}')"
        ))
        .0
    }

    fn request_pay(args: &str) -> serde_json::Value {
        one::<pgrx::JsonB>(&format!(
            "SELECT ledger.request_tool_approval('r', 'wire_money', '{args}', tool_call_id => 'pay')"
        ))
        .0
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

    #[pg_test]
    fn redaction_and_hashing_are_exposed_for_clients() {
        assert_eq!(
            one::<String>(
                r#"SELECT ledger.redact('{"X-API-Key": "a", "token_count": 3, "auth": "Bearer abcdefghijk"}')::text"#
            ),
            r#"{"auth": "[REDACTED]", "X-API-Key": "[REDACTED]", "token_count": 3}"#
        );
        Spi::run("SET LOCAL ledger.redact_keys = 'customerSsn, internal-note'").unwrap();
        Spi::run("SET LOCAL ledger.redact_values = off").unwrap();
        assert_eq!(
            one::<String>(
                r#"SELECT ledger.redact('{"customer_ssn": "1", "InternalNote": "2", "header": "Bearer abcdefghijk"}')::text"#
            ),
            r#"{"header": "Bearer abcdefghijk", "InternalNote": "[REDACTED]", "customer_ssn": "[REDACTED]"}"#
        );
        assert_eq!(
            one::<String>(r#"SELECT ledger.canonical_json('{"b": [1.0, {}], "a": "é"}')"#),
            r#"{"a":"é","b":[1.0,{}]}"#
        );
        assert_eq!(
            one::<String>("SELECT ledger.request_hash('{}')"),
            "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        assert!(one::<bool>("SELECT ledger.redact(NULL) IS NULL"));
    }
}
