//! Runs: creation with lineage and exact inputs, transitions, and reading the inputs back.

use crate::artifacts::blobs;
use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::mailbox;
use crate::notifier;
use crate::outbox;
use crate::redaction::{free_text, redacted_json};
use crate::rows::{self, HeldRun, LockedRun};
use crate::scope::{self, Scope};
use crate::transition;
use ledger_model::args::{optional_id, optional_label, required, required_id};
use ledger_model::events::{Event, RunCreated, RunStatus};
use ledger_model::ids;
use ledger_model::run_leases;
use ledger_model::status::{check_transition, Resource, Status};
use pgrx::prelude::*;

/// Inputs whose JSON text is longer than this are kept in `ledger.blobs`.
pub const INLINE_INPUT_BYTES: usize = 8192;

pub fn row(scope: &Scope, run_id: &str) -> Result<pgrx::composite_type!('static, "ledger.runs")> {
    rows::scoped_row(scope, "ledger.runs", run_id, Code::RunNotFound, "run")
}

/// What a new run is made of.
#[derive(Default)]
pub struct NewRun<'a> {
    pub mode: &'a str,
    pub inputs: Option<Jsonb>,
    pub kind: Option<&'a str>,
    pub subject_kind: Option<&'a str>,
    pub subject_id: Option<&'a str>,
    pub subject_version_id: Option<&'a str>,
    pub request_id: Option<&'a str>,
    pub parent_run_id: Option<&'a str>,
    pub source_run_id: Option<&'a str>,
    pub attempt_no: Option<i32>,
    pub run_id: Option<&'a str>,
    pub user_id: Option<&'a str>,
    pub trace_id: Option<&'a str>,
    pub input_summary: Option<&'a str>,
    pub control_action: Option<&'static str>,
    /// Not claimable before this time (`claim_run`); None: at once.
    pub not_before: Option<TimestampWithTimeZone>,
    /// `claim_run` hands out higher priorities first (-1000 to 1000; None: 0).
    pub priority: Option<i32>,
    /// The key whose concurrency limit the run counts against (`ledger.concurrency_limits`).
    pub concurrency_key: Option<&'a str>,
}

/// Creates a run in status `queued`, or returns the existing run for a repeated `request_id`
/// (or caller `run_id`); returns its id.
pub fn create(scope: &Scope, new: NewRun) -> Result<String> {
    let mode = required("mode", Some(new.mode))?;
    for (argument, label) in [
        ("mode", Some(mode)),
        ("kind", new.kind),
        ("subject_kind", new.subject_kind),
        ("subject_id", new.subject_id),
        ("subject_version_id", new.subject_version_id),
        ("user_id", new.user_id),
        ("trace_id", new.trace_id),
        ("concurrency_key", new.concurrency_key),
    ] {
        optional_label(argument, label)?;
    }
    let request_id = optional_id("request_id", new.request_id)?;
    let priority = run_leases::priority(new.priority)?;
    let id = match optional_id("run_id", new.run_id)? {
        Some(id) => id.to_owned(),
        None => ids::new_id("run"),
    };
    let inputs = match &new.inputs {
        Some(inputs) if !inputs.is_object() => {
            return Err(LedgerError::new(
                Code::InputsNotObject,
                "inputs must be a JSON object",
            ));
        }
        Some(inputs) => Some(Jsonb::from(&redacted_json(inputs)?)),
        None => None,
    };
    if let Some(n) = new.attempt_no {
        if n < 1 {
            return Err(
                LedgerError::new(Code::AttemptInvalid, "attempt_no must be at least 1")
                    .with("attempt_no", n),
            );
        }
    }
    if let Some(parent) = new.parent_run_id {
        rows::referenced_run(scope, "parent_run_id", parent)?;
    }
    let source = new
        .source_run_id
        .map(|s| rows::referenced_run(scope, "source_run_id", s))
        .transpose()?;
    let attempt_no = new.attempt_no.unwrap_or(
        source
            .as_ref()
            .map_or(1, |s| s.attempt_no.saturating_add(1)),
    );
    let root_run_id = source
        .as_ref()
        .map_or(id.clone(), |s| s.root_run_id.clone());
    let kind = new.kind.unwrap_or(mode);
    let subject_kind = new.subject_kind.unwrap_or(mode);

    let input_summary = free_text(new.input_summary.or(inputs.as_ref().map(Jsonb::as_str)));
    let (inline_inputs, inputs_sha256, inputs_size) = match inputs {
        Some(doc) if doc.0.len() > INLINE_INPUT_BYTES => {
            let size = doc.0.len() as i64;
            (None, Some(blobs::put(scope, doc.0.as_bytes())?), Some(size))
        }
        Some(doc) => {
            let size = doc.0.len() as i64;
            (Some(doc), None, Some(size))
        }
        None => (None, None, None),
    };

    // The run's columns, in insert_run.sql's order; run_differences.sql compares them by the same
    // numbers.
    let run_args = || {
        scope.args([
            id.as_str().into(),
            mode.into(),
            kind.into(),
            subject_kind.into(),
            new.subject_id.into(),
            new.subject_version_id.into(),
            new.user_id.into(),
            new.trace_id.into(),
            request_id.into(),
            new.parent_run_id.into(),
            new.source_run_id.into(),
            root_run_id.as_str().into(),
            attempt_no.into(),
            input_summary.as_deref().into(),
            inline_inputs.clone().into(),
            inputs_sha256.as_deref().into(),
            inputs_size.into(),
            new.control_action.into(),
            new.not_before.into(),
            priority.into(),
            new.concurrency_key.into(),
        ])
    };
    let inserted = db::write_one(
        include_str!("../sql/queries/insert_run.sql"),
        &run_args(),
        |r| db::req::<i64>(r, 1),
    )?;

    let Some(last_seq) = inserted else {
        // A run with this request_id (or this run_id) exists: the same request returns it, any
        // other is refused with the fields that differ.
        let mut args = run_args();
        args.push(free_text(new.input_summary).into());
        let (found, differing) = db::select_one(
            include_str!("../sql/queries/run_differences.sql"),
            &args,
            |r| Ok((db::req::<String>(r, 1)?, db::req::<Vec<String>>(r, 2)?)),
        )?
        .ok_or_else(|| LedgerError::internal("insert conflicted but no run was found"))?;
        if !differing.is_empty() {
            let key = if request_id.is_some() {
                "request_id"
            } else {
                "run_id"
            };
            return Err(LedgerError::new(
                Code::IdempotencyMismatch,
                format!("{key} was reused with a different {}", differing.join(", ")),
            )
            .with("run_id", found)
            .with("request_id", request_id)
            .with("fields", differing));
        }
        return Ok(found);
    };

    let created = Event::RunCreated(RunCreated {
        run_id: &id,
        status: "queued",
        mode,
        kind,
        subject_kind,
        subject_id: new.subject_id,
        subject_version_id: new.subject_version_id,
        request_id,
        parent_run_id: new.parent_run_id,
        source_run_id: new.source_run_id,
        root_run_id: &root_run_id,
        attempt_no,
        control_action: new.control_action,
    });
    feed::append(scope, HeldRun { id: &id, last_seq }, None, &created)?;
    outbox::enqueue(scope, &created, Some(&id), None, &format!("run:{id}"))?;
    notifier::runs_ready();
    Ok(id)
}

/// Creates a run in status `queued`, claimable from `not_before` (`claim_run` hands out higher
/// `priority` first, and no more runs of `concurrency_key` than its limit allows). Idempotent on `request_id` (and on a caller-supplied `run_id`): the same
/// key returns the existing run, a different mode or subject fails 23505 `IDEMPOTENCY_MISMATCH`.
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn create_run(
    mode: Option<&str>,
    inputs: default!(Option<Jsonb>, "NULL"),
    kind: default!(Option<&str>, "NULL"),
    subject_kind: default!(Option<&str>, "NULL"),
    subject_id: default!(Option<&str>, "NULL"),
    subject_version_id: default!(Option<&str>, "NULL"),
    request_id: default!(Option<&str>, "NULL"),
    parent_run_id: default!(Option<&str>, "NULL"),
    source_run_id: default!(Option<&str>, "NULL"),
    attempt_no: default!(Option<i32>, "NULL"),
    run_id: default!(Option<&str>, "NULL"),
    user_id: default!(Option<&str>, "NULL"),
    trace_id: default!(Option<&str>, "NULL"),
    input_summary: default!(Option<&str>, "NULL"),
    not_before: default!(Option<TimestampWithTimeZone>, "NULL"),
    priority: default!(Option<i32>, 0),
    concurrency_key: default!(Option<&str>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.runs"), SqlError> {
    let scope = scope::current()?;
    let new = NewRun {
        mode: required("mode", mode)?,
        inputs,
        kind,
        subject_kind,
        subject_id,
        subject_version_id,
        request_id,
        parent_run_id,
        source_run_id,
        attempt_no,
        run_id,
        user_id,
        trace_id,
        input_summary,
        control_action: None,
        not_before,
        priority,
        concurrency_key,
    };
    let id = create(&scope, new)?;
    Ok(row(&scope, &id)?)
}

/// A new attempt of a finished run (replay #4): the source's mode, kind and subject pinned to its
/// subject_version_id, lineage stored, and its exact inputs unless `inputs` overrides them.
fn rerun(
    run_id: Option<&str>,
    inputs: Option<Jsonb>,
    not_before: Option<TimestampWithTimeZone>,
    action: &'static str,
    allowed: fn(Status) -> bool,
) -> Result<pgrx::composite_type!('static, "ledger.runs")> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let source = rows::referenced_run(&scope, "run_id", run_id)?;
    if !allowed(source.status) {
        return Err(LedgerError::new(
            Code::RunNotRerunnable,
            format!(
                "a {} run cannot be {}",
                source.status.as_str(),
                if action == "retry" {
                    "retried"
                } else {
                    "replayed"
                }
            ),
        )
        .with("run_id", run_id)
        .with("status", source.status.as_str())
        .with("control_action", action));
    }
    let (kind, subject_version_id, user_id, trace_id, parent_run_id, input_summary, priority, key) =
        db::select_one(
            "SELECT kind, subject_version_id, user_id, trace_id, parent_run_id, input_summary, \
                    priority, concurrency_key \
           FROM ledger.runs WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
            &scope.args([run_id.into()]),
            |r| {
                Ok((
                    db::req::<String>(r, 1)?,
                    db::opt::<String>(r, 2)?,
                    db::opt::<String>(r, 3)?,
                    db::opt::<String>(r, 4)?,
                    db::opt::<String>(r, 5)?,
                    db::opt::<String>(r, 6)?,
                    db::req::<i32>(r, 7)?,
                    db::opt::<String>(r, 8)?,
                ))
            },
        )?
        .ok_or_else(|| LedgerError::not_found(Code::RunNotFound, "run", run_id))?;
    let overridden = inputs.is_some();
    let inputs = match inputs {
        Some(i) => Some(i),
        None => load_inputs(&scope, run_id)?,
    };
    let id = create(
        &scope,
        NewRun {
            mode: &source.mode,
            inputs,
            kind: Some(&kind),
            subject_kind: Some(&source.subject_kind),
            subject_id: source.subject_id.as_deref(),
            subject_version_id: subject_version_id.as_deref(),
            parent_run_id: parent_run_id.as_deref(),
            source_run_id: Some(run_id),
            user_id: user_id.as_deref(),
            trace_id: trace_id.as_deref(),
            // A run given only a summary keeps it (replay_ready reports its inputs missing).
            input_summary: if overridden {
                None
            } else {
                input_summary.as_deref()
            },
            control_action: Some(action),
            // The new attempt keeps its source's priority and concurrency key, and waits until
            // not_before (a backoff).
            not_before,
            priority: Some(priority),
            concurrency_key: key.as_deref(),
            ..NewRun::default()
        },
    )?;
    row(&scope, &id)
}

/// Retries a failed or canceled run as a new run.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn retry_run(
    run_id: Option<&str>,
    inputs: default!(Option<Jsonb>, "NULL"),
    not_before: default!(Option<TimestampWithTimeZone>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.runs"), SqlError> {
    Ok(rerun(run_id, inputs, not_before, "retry", |s| {
        matches!(s, Status::Failed | Status::Canceled)
    })?)
}

/// Replays a finished run (any terminal status) as a new run.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn replay_run(
    run_id: Option<&str>,
    inputs: default!(Option<Jsonb>, "NULL"),
    not_before: default!(Option<TimestampWithTimeZone>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.runs"), SqlError> {
    Ok(rerun(
        run_id,
        inputs,
        not_before,
        "replay",
        Status::is_terminal,
    )?)
}

/// Moves a run to `to_status` under the status machine (`ledger_model::status`).
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn transition_run(
    run_id: Option<&str>,
    to_status: Option<&str>,
    expected_status: default!(Option<&str>, "NULL"),
    output_summary: default!(Option<&str>, "NULL"),
    error_code: default!(Option<&str>, "NULL"),
    error_message: default!(Option<&str>, "NULL"),
    error_step_id: default!(Option<&str>, "NULL"),
    run_token: default!(Option<i64>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.runs"), SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let to = Status::parse(Resource::Run, required("to_status", to_status)?)?;
    let error_code = optional_label("error_code", error_code)?;
    let expected = expected_status
        .map(|s| Status::parse(Resource::Run, s))
        .transpose()?;
    let current = rows::lock_run(&scope, "run_id", run_id)?;
    current.fence(run_token)?;

    let from = check_transition(Resource::Run, run_id, current.status, expected, to)?;
    let Some(from) = from else {
        // Already there: idempotent, nothing is rewritten.
        return Ok(row(&scope, run_id)?);
    };
    if let Some(step) = error_step_id {
        ids::validate("error_step_id", step)?;
        rows::step_of_run(&scope, step, run_id)?;
    }
    let output_summary = free_text(output_summary);
    let mut error_message = free_text(error_message);
    if to == Status::Failed && error_message.is_none() {
        error_message = output_summary.clone();
    }

    move_run(
        &scope,
        &current,
        from,
        to,
        RunEnd {
            output_summary: output_summary.as_deref(),
            error_code,
            error_message: error_message.as_deref(),
            error_step_id,
        },
    )?;
    Ok(row(&scope, run_id)?)
}

/// What a move of a run writes besides its status.
#[derive(Default)]
pub struct RunEnd<'a> {
    pub output_summary: Option<&'a str>,
    pub error_code: Option<&'a str>,
    pub error_message: Option<&'a str>,
    pub error_step_id: Option<&'a str>,
}

/// Moves the locked run from `from` to `to` (checked by the caller): `run.status` to its feed,
/// the row, and at a terminal status `run.status.updated` to the outbox.
pub fn move_run(
    scope: &Scope,
    run: &LockedRun,
    from: Status,
    to: Status,
    end: RunEnd,
) -> Result<()> {
    let change = RunStatus {
        run_id: &run.id,
        mode: &run.mode,
        from: from.as_str(),
        to: to.as_str(),
        error_code: end.error_code,
        error_step_id: end.error_step_id,
    };
    feed::append(scope, run.held(), None, &Event::RunStatus(change.clone()))?;
    transition::write(
        scope,
        &ledger_model::transition::RUN,
        &run.id,
        from,
        to,
        vec![
            end.output_summary.into(),
            end.error_code.into(),
            end.error_message.into(),
            end.error_step_id.into(),
            to.is_terminal().into(),
        ],
    )?;
    if to.is_terminal() {
        outbox::enqueue(
            scope,
            &Event::RunStatusUpdated(change),
            Some(&run.id),
            None,
            &format!("run:{}", run.id),
        )?;
        // No one decides for a run that has ended: its pending approvals are canceled, so no
        // sweep expires them (and writes to its feed) after its end, and a call still waiting for
        // its approval will not run (it no longer keeps the run from being purged).
        let ended = scope.args([run.id.as_str().into(), db::now()?.into()]);
        db::execute(
            "UPDATE ledger.approval_requests SET status = 'canceled', decided_at = $4, updated_at = $4 \
              WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 AND status = 'pending'",
            &ended,
        )?;
        db::execute(
            "UPDATE ledger.run_step_tool_calls \
                SET status = 'rejected', error_code = 'TOOL_APPROVAL_CANCELED', \
                    error_message = 'The run ended before the call ran', completed_at = $4, updated_at = $4 \
              WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 AND status = 'waiting_approval'",
            &ended,
        )?;
        if let Some(parent) = &run.parent_run_id {
            mailbox::child_ended(scope, parent, &run.id)?;
        }
        // Its place under its concurrency key is free.
        notifier::runs_ready();
    }
    Ok(())
}

/// The exact inputs the run was created with (NULL when it had none).
#[pg_extern(stable, parallel_safe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn run_inputs(run_id: Option<&str>) -> std::result::Result<Option<Jsonb>, SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    ids::validate("run_id", run_id)?;
    Ok(load_inputs(&scope, run_id)?)
}

/// A run's exact inputs, from the row or, verified, from the blob store.
pub fn load_inputs(scope: &Scope, run_id: &str) -> Result<Option<Jsonb>> {
    let (inline, sha) = db::select_one(
        "SELECT inputs, inputs_sha256 FROM ledger.runs \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([run_id.into()]),
        |r| Ok((db::opt::<Jsonb>(r, 1)?, db::opt::<String>(r, 2)?)),
    )?
    .ok_or_else(|| LedgerError::not_found(Code::RunNotFound, "run", run_id))?;
    match (inline, sha) {
        (Some(doc), _) => Ok(Some(doc)),
        (None, Some(sha)) => {
            let bytes = blobs::get(scope, &sha, Code::BlobHashMismatch)?;
            let text = String::from_utf8(bytes).map_err(|_| {
                LedgerError::new(Code::BlobNotUtf8, "stored inputs are not UTF-8")
                    .with("sha256", sha)
            })?;
            Ok(Some(Jsonb(text)))
        }
        (None, None) => Ok(None),
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn count(sql: &str) -> i64 {
        one::<i64>(sql)
    }

    #[pg_test]
    fn create_run_fills_defaults_and_lineage_of_a_first_run() {
        set_scope("t-defaults", "w");
        let id = one::<String>(
            "SELECT id FROM ledger.create_run('chat', '{\"q\": \"hi\", \"n\": 1.50}')",
        );
        assert!(id.starts_with("run_") && id.len() == 30, "{id}");
        let row = one::<String>(&format!(
            "SELECT concat_ws('|', status, kind, subject_kind, attempt_no, root_run_id = id, input_summary, \
                    started_at IS NULL, ended_at IS NULL, queued_at IS NOT NULL) \
               FROM ledger.runs WHERE id = '{id}'"
        ));
        assert_eq!(row, "queued|chat|chat|1|t|{\"n\":1.50,\"q\":\"hi\"}|t|t|t");
        assert_eq!(
            one::<String>(&format!("SELECT ledger.run_inputs('{id}')::text")),
            "{\"n\": 1.50, \"q\": \"hi\"}"
        );
        assert_eq!(count(&format!("SELECT count(*) FROM ledger.run_events WHERE run_id = '{id}' AND event_type = 'run.created' AND seq = 1")), 1);
        assert_eq!(count(&format!("SELECT count(*) FROM ledger.outbox WHERE run_id = '{id}' AND event_type = 'run.created'")), 1);
    }

    #[pg_test]
    fn request_id_makes_creation_idempotent() {
        set_scope("t-request", "w");
        let a = one::<String>(
            "SELECT id FROM ledger.create_run('chat', request_id => 'req-1', subject_id => 's1')",
        );
        let b = one::<String>(
            "SELECT id FROM ledger.create_run('chat', request_id => 'req-1', subject_id => 's1')",
        );
        assert_eq!(a, b);
        assert_error(
            "SELECT ledger.create_run('workflow', request_id => 'req-1', subject_id => 's1')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_error(
            "SELECT ledger.create_run('chat', request_id => 'req-1', subject_id => 's2')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(count("SELECT count(*) FROM ledger.runs"), 1);
        assert_eq!(count("SELECT count(*) FROM ledger.run_events"), 1);
        // A caller run_id behaves the same way.
        one::<String>("SELECT id FROM ledger.create_run('chat', run_id => 'mine')");
        assert_eq!(
            one::<String>("SELECT id FROM ledger.create_run('chat', run_id => 'mine')"),
            "mine"
        );
        assert_error(
            "SELECT ledger.create_run('other', run_id => 'mine')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
    }

    /// The same request_id with other inputs (inline or in the blob store) or another user is
    /// another request: refused, with the differing fields named, and nothing written.
    #[pg_test]
    fn a_reused_request_id_names_the_fields_that_differ() {
        set_scope("t-request-fields", "w");
        let big = |n: i32| format!("jsonb_build_object('doc', repeat('x', 9000), 'n', {n})");
        let a = one::<String>(
            "SELECT id FROM ledger.create_run('chat', '{\"q\": \"hi\", \"n\": 1.50}', request_id => 'req', user_id => 'u1')",
        );
        // Equal JSON (key order, number spelling) is the same request.
        assert_eq!(
            one::<String>("SELECT id FROM ledger.create_run('chat', '{\"n\": 1.5, \"q\": \"hi\"}', request_id => 'req', user_id => 'u1')"),
            a
        );
        let e = assert_error(
            "SELECT ledger.create_run('chat', '{\"q\": \"bye\", \"n\": 1.50}', request_id => 'req', user_id => 'u2')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(e.detail["fields"], serde_json::json!(["user_id", "inputs"]));
        assert_eq!(e.detail["run_id"], a.as_str());
        assert_eq!(e.detail["request_id"], "req");
        assert!(e.message.ends_with("a different user_id, inputs"), "{e:?}");
        let e = assert_error(
            "SELECT ledger.create_run('chat', '{\"q\": \"hi\", \"n\": 1.5}', request_id => 'req', user_id => 'u1', input_summary => 'other')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(e.detail["fields"], serde_json::json!(["input_summary"]));
        let e = assert_error(
            "SELECT ledger.create_run('chat', request_id => 'req', user_id => 'u1')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(e.detail["fields"], serde_json::json!(["inputs"]));
        // Inputs kept in the blob store compare by their hash.
        let b = one::<String>(&format!(
            "SELECT id FROM ledger.create_run('chat', {}, request_id => 'big')",
            big(1)
        ));
        assert_eq!(
            one::<String>(&format!(
                "SELECT id FROM ledger.create_run('chat', {}, request_id => 'big')",
                big(1)
            )),
            b
        );
        let e = assert_error(
            &format!(
                "SELECT ledger.create_run('chat', {}, request_id => 'big')",
                big(2)
            ),
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(e.detail["fields"], serde_json::json!(["inputs"]));
        assert_eq!(count("SELECT count(*) FROM ledger.runs"), 2);
        assert_eq!(count("SELECT count(*) FROM ledger.run_events"), 2);
    }

    #[pg_test]
    fn lineage_is_validated_and_stored() {
        set_scope("t-lineage", "w");
        Spi::run("SELECT ledger.create_run('wf', run_id => 'r1')").unwrap();
        Spi::run("SELECT ledger.create_run('wf', run_id => 'r2', source_run_id => 'r1')").unwrap();
        Spi::run("SELECT ledger.create_run('wf', run_id => 'r3', source_run_id => 'r2', parent_run_id => 'r1')").unwrap();
        assert_eq!(
            one::<String>("SELECT string_agg(concat_ws(':', id, attempt_no, root_run_id, source_run_id, parent_run_id), ' ' ORDER BY id) FROM ledger.runs"),
            "r1:1:r1 r2:2:r1:r1 r3:3:r1:r2:r1"
        );
        let e = assert_error(
            "SELECT ledger.create_run('wf', source_run_id => 'nope')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_eq!(e.detail["argument"], "source_run_id");
        assert_error(
            "SELECT ledger.create_run('wf', parent_run_id => 'nope')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_error(
            "SELECT ledger.create_run('wf', attempt_no => 0)",
            "22023",
            "ATTEMPT_INVALID",
        );
        assert_eq!(count("SELECT count(*) FROM ledger.runs"), 3);
        // Another scope's run does not exist here.
        set_scope("t-lineage-other", "w");
        assert_error(
            "SELECT ledger.create_run('wf', source_run_id => 'r1')",
            "P0002",
            "RUN_NOT_FOUND",
        );
    }

    #[pg_test]
    fn large_inputs_live_in_the_blob_store_and_come_back_exactly() {
        set_scope("t-inputs", "w");
        let doc = "jsonb_build_object('text', repeat('é', 9000), 'n', 1.000, 'nested', jsonb_build_object('a', '[1, 2.50]'::jsonb))";
        let id = one::<String>(&format!(
            "SELECT id FROM ledger.create_run('ingest', {doc})"
        ));
        assert!(one::<bool>(&format!(
            "SELECT ledger.run_inputs('{id}') = {doc}"
        )));
        assert!(one::<bool>(&format!(
            "SELECT ledger.run_inputs('{id}')::text = ({doc})::text"
        )));
        assert!(one::<bool>(&format!("SELECT inputs IS NULL AND inputs_sha256 IS NOT NULL FROM ledger.runs WHERE id = '{id}'")));
        assert_eq!(count("SELECT count(*) FROM ledger.blobs"), 1);
        assert_eq!(
            count(&format!(
                "SELECT char_length(input_summary) FROM ledger.runs WHERE id = '{id}'"
            )),
            8192
        );
        // Tampered bytes are detected.
        Spi::run("UPDATE ledger.blobs SET content = content || '\\x20'::bytea WHERE tenant_id = 't-inputs'").unwrap();
        assert_error(
            &format!("SELECT ledger.run_inputs('{id}')"),
            "XX001",
            "BLOB_HASH_MISMATCH",
        );
    }

    #[pg_test]
    fn deep_inputs_are_refused_and_huge_ones_kept() {
        set_scope("t-deep", "w");
        // Inputs and error details are redacted, so walked: like every JSON argument, deeper
        // than 100 levels they are refused before anything walks them, and nothing is written.
        let deep = "('{\"a\": ' || repeat('[', 5000) || '1' || repeat(']', 5000) || '}')::jsonb";
        crate::testing::assert_error(
            &format!("SELECT ledger.create_run('chat', {deep}, run_id => 'deep')"),
            "22023",
            "INPUT_TOO_DEEP",
        );
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.runs WHERE tenant_id = 't-deep'"),
            0
        );
        Spi::run("SELECT ledger.create_run('chat', run_id => 'deep')").unwrap();
        Spi::run("SELECT ledger.create_step('deep', 'llm', step_id => 's')").unwrap();
        for call in [
            format!("SELECT ledger.transition_step('s', 'running', error_details => {deep})"),
            format!("SELECT ledger.transition_step('s', 'running', metrics => {deep})"),
        ] {
            crate::testing::assert_error(&call, "22023", "INPUT_TOO_DEEP");
        }
        assert_eq!(
            one::<String>("SELECT status FROM ledger.run_steps"),
            "queued"
        );
        let huge = "jsonb_build_object('text', repeat('x', 5000000))";
        Spi::run(&format!(
            "SELECT ledger.create_run('chat', {huge}, run_id => 'huge')"
        ))
        .unwrap();
        assert!(one::<bool>(&format!(
            "SELECT ledger.run_inputs('huge') = {huge}"
        )));
        assert_eq!(
            one::<i32>("SELECT char_length(input_summary) FROM ledger.runs WHERE id = 'huge'"),
            8192
        );
    }

    #[pg_test]
    fn bad_create_arguments_are_refused_and_write_nothing() {
        set_scope("t-bad-create", "w");
        assert_error(
            "SELECT ledger.create_run(NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error("SELECT ledger.create_run('')", "22023", "ARGUMENT_REQUIRED");
        for inputs in ["'[1]'", "'\"x\"'", "'1'", "'null'"] {
            assert_error(
                &format!("SELECT ledger.create_run('chat', {inputs}::jsonb)"),
                "22023",
                "INPUTS_NOT_OBJECT",
            );
        }
        let long = "x".repeat(129);
        assert_error(
            &format!("SELECT ledger.create_run('chat', run_id => '{long}')"),
            "22023",
            "ID_INVALID",
        );
        assert_error(
            "SELECT ledger.create_run('chat', run_id => 'has space')",
            "22023",
            "ID_INVALID",
        );
        assert_error(
            "SELECT ledger.create_run('chat', request_id => '')",
            "22023",
            "ID_INVALID",
        );
        assert_eq!(count("SELECT count(*) FROM ledger.runs"), 0);
        assert_eq!(count("SELECT count(*) FROM ledger.blobs"), 0);
    }

    #[pg_test]
    fn every_function_refuses_to_run_without_scope() {
        Spi::run("SELECT set_config('ledger.tenant_id', '', true), set_config('ledger.workspace_id', '', true)").unwrap();
        for call in [
            "SELECT ledger.create_run('chat')",
            "SELECT ledger.transition_run('r', 'running')",
            "SELECT ledger.run_inputs('r')",
            "SELECT ledger.create_step('r', 'llm')",
            "SELECT ledger.transition_step('s', 'running')",
            "SELECT * FROM ledger.events_since('r')",
            "SELECT ledger.run_channel('r')",
        ] {
            assert_error(call, "42501", "SCOPE_MISSING");
        }
        // Only one half of the scope is not a scope either.
        crate::testing::set_scope("t", "w");
        Spi::run("SELECT set_config('ledger.workspace_id', '', true)").unwrap();
        assert_error("SELECT ledger.create_run('chat')", "42501", "SCOPE_MISSING");
        assert_error(
            "SELECT ledger.set_scope('t', NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error("SELECT ledger.set_scope('t', 'a b')", "22023", "ID_INVALID");
    }

    #[pg_test]
    fn transitions_follow_the_table_and_stamp_times() {
        set_scope("t-transitions", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        let e = assert_error(
            "SELECT ledger.transition_run('r', 'succeeded')",
            "55000",
            "TRANSITION_INVALID",
        );
        assert_eq!(
            (e.detail["from"].as_str(), e.detail["to"].as_str()),
            (Some("queued"), Some("succeeded"))
        );
        assert_error(
            "SELECT ledger.transition_run('r', 'done')",
            "22023",
            "STATUS_UNKNOWN",
        );
        assert_error(
            "SELECT ledger.transition_run('r', 'skipped')",
            "22023",
            "STATUS_UNKNOWN",
        );
        assert_error(
            "SELECT ledger.transition_run('r', 'running', expected_status => 'bogus')",
            "22023",
            "STATUS_UNKNOWN",
        );
        assert_error(
            "SELECT ledger.transition_run('r', NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error(
            "SELECT ledger.transition_run('nope', 'running')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_error(
            "SELECT ledger.transition_run('r', 'running', expected_status => 'preparing')",
            "40001",
            "TRANSITION_CONFLICT",
        );
        assert_eq!(count("SELECT count(*) FROM ledger.run_events"), 1);

        Spi::run("SELECT ledger.transition_run('r', 'running', expected_status => 'queued')")
            .unwrap();
        assert!(one::<bool>(
            "SELECT started_at IS NOT NULL AND ended_at IS NULL FROM ledger.runs"
        ));
        // Same status: idempotent, nothing rewritten, no event.
        let before = one::<String>("SELECT updated_at::text FROM ledger.runs");
        Spi::run("SELECT ledger.transition_run('r', 'running', output_summary => 'ignored')")
            .unwrap();
        assert_eq!(
            one::<String>("SELECT updated_at::text FROM ledger.runs"),
            before
        );
        assert!(one::<bool>(
            "SELECT output_summary IS NULL FROM ledger.runs"
        ));
        assert_eq!(count("SELECT count(*) FROM ledger.run_events"), 2);

        let long = "é".repeat(9000);
        Spi::run(&format!("SELECT ledger.transition_run('r', 'failed', output_summary => '{long}', error_code => 'E1')")).unwrap();
        assert_eq!(
            one::<String>("SELECT concat_ws('|', status, error_code, char_length(output_summary), char_length(error_message), ended_at IS NOT NULL, duration_ms >= 0) FROM ledger.runs"),
            "failed|E1|8192|8192|t|t"
        );
        // A terminal row is not rewritten by a repeat of its status.
        Spi::run("SELECT ledger.transition_run('r', 'failed', error_code => 'E2')").unwrap();
        assert_eq!(one::<String>("SELECT error_code FROM ledger.runs"), "E1");
        assert_eq!(
            count("SELECT count(*) FROM ledger.outbox WHERE event_type = 'run.status.updated'"),
            1
        );
        // Leaving a terminal state clears ended_at and duration.
        Spi::run("SELECT ledger.transition_run('r', 'retrying')").unwrap();
        assert!(one::<bool>(
            "SELECT ended_at IS NULL AND duration_ms IS NULL FROM ledger.runs"
        ));
        assert_eq!(
            count("SELECT count(*) FROM ledger.outbox WHERE event_type = 'run.status.updated'"),
            1
        );
        assert_eq!(
            one::<String>("SELECT string_agg(payload->>'to', ',' ORDER BY seq) FROM ledger.run_events WHERE event_type = 'run.status'"),
            "running,failed,retrying"
        );
    }

    #[pg_test]
    fn retry_and_replay_keep_lineage_pinning_and_exact_inputs() {
        set_scope("t-rerun", "w");
        let big = "jsonb_build_object('doc', repeat('x', 100 * 1024), 'n', 1.50)";
        Spi::run(&format!(
            "SELECT ledger.create_run('workflow', {big}, run_id => 'a1', subject_id => 'wf-1', subject_version_id => 'wf-1@v7', user_id => 'u1')"
        ))
        .unwrap();
        assert_error(
            "SELECT ledger.retry_run('a1')",
            "55000",
            "RUN_NOT_RERUNNABLE",
        );
        assert_error(
            "SELECT ledger.replay_run('a1')",
            "55000",
            "RUN_NOT_RERUNNABLE",
        );
        Spi::run(
            "SELECT ledger.transition_run('a1', 'running'), ledger.transition_run('a1', 'failed')",
        )
        .unwrap();
        let a2 = one::<String>("SELECT id FROM ledger.retry_run('a1')");
        Spi::run(&format!("SELECT ledger.transition_run('{a2}', 'running'), ledger.transition_run('{a2}', 'succeeded')")).unwrap();
        let e = assert_error(
            &format!("SELECT ledger.retry_run('{a2}')"),
            "55000",
            "RUN_NOT_RERUNNABLE",
        );
        assert_eq!(e.detail["status"], "succeeded");
        let a3 = one::<String>(&format!("SELECT id FROM ledger.replay_run('{a2}')"));
        // The chain, by root: attempts 1, 2, 3, each pinned to the same version.
        assert_eq!(
            one::<String>(
                "SELECT string_agg(concat_ws(':', attempt_no, coalesce(control_action, '-'), subject_version_id, user_id, status), ' ' ORDER BY attempt_no) \
                   FROM ledger.runs WHERE root_run_id = 'a1'"
            ),
            "1:-:wf-1@v7:u1:failed 2:retry:wf-1@v7:u1:succeeded 3:replay:wf-1@v7:u1:queued"
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT source_run_id FROM ledger.runs WHERE id = '{a3}'"
            )),
            a2
        );
        // 100 KB of inputs come back byte for byte.
        for id in [&a2, &a3] {
            assert!(one::<bool>(&format!(
                "SELECT ledger.run_inputs('{id}')::text = ({big})::text"
            )));
        }
        // Inputs can be overridden; a run with none stays without.
        let a4 = one::<String>(&format!(
            "SELECT id FROM ledger.replay_run('{a2}', '{{\"n\": 2}}')"
        ));
        assert_eq!(
            one::<String>(&format!("SELECT ledger.run_inputs('{a4}')::text")),
            "{\"n\": 2}"
        );
        assert_error(
            &format!("SELECT ledger.replay_run('{a2}', '[1]')"),
            "22023",
            "INPUTS_NOT_OBJECT",
        );
        assert_error("SELECT ledger.retry_run('nope')", "P0002", "RUN_NOT_FOUND");
        assert_error(
            "SELECT ledger.retry_run(NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
    }

    #[pg_test]
    fn error_step_id_must_be_a_step_of_the_run() {
        set_scope("t-error-step", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r'), ledger.create_run('chat', run_id => 'other')").unwrap();
        Spi::run("SELECT ledger.transition_run('r', 'running')").unwrap();
        Spi::run("SELECT ledger.create_step('other', 'llm', step_id => 's-other')").unwrap();
        assert_error(
            "SELECT ledger.transition_run('r', 'failed', error_step_id => 's-other')",
            "P0002",
            "STEP_NOT_FOUND",
        );
        assert!(one::<bool>(
            "SELECT status = 'running' FROM ledger.runs WHERE id = 'r'"
        ));
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 's')").unwrap();
        Spi::run("SELECT ledger.transition_run('r', 'failed', error_step_id => 's')").unwrap();
        assert_eq!(
            one::<String>("SELECT error_step_id FROM ledger.runs WHERE id = 'r'"),
            "s"
        );
    }
}
