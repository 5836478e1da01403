//! Steps of a run: creation and transitions.

use crate::budgets;
use crate::db;
use crate::error::{raise, Code, LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::redaction::{free_text, redacted_json};
use crate::rows::{self, LockedRun};
use crate::scope::{self, Scope};
use crate::transition;
use ledger_model::args::{optional_id, optional_label, required, required_id, required_label};
use ledger_model::budgets::Meter;
use ledger_model::events::{Event, StepCreated, StepStatus};
use ledger_model::ids;
use ledger_model::status::{check_transition, Resource, Status};
use pgrx::prelude::*;

fn row(scope: &Scope, step_id: &str) -> Result<pgrx::composite_type!('static, "ledger.run_steps")> {
    rows::scoped_row(
        scope,
        "ledger.run_steps",
        step_id,
        Code::StepNotFound,
        "step",
    )
}

/// What a new step is made of.
pub struct NewStep<'a> {
    pub step_type: &'a str,
    pub step_key: Option<&'a str>,
    pub node_id: Option<&'a str>,
    pub input_summary: Option<&'a str>,
    pub status: Status,
    pub step_id: Option<&'a str>,
    /// What a step created finished already holds (a repeatable tool call recorded at once).
    pub ended: StepChange<'a>,
}

/// Creates a step of the locked run (or returns the existing one for a repeated caller
/// `step_id` or `step_key`); returns its id.
pub fn create(scope: &Scope, run: &LockedRun, new: &NewStep) -> Result<String> {
    run.ensure_live("steps")?;
    // A caller's step_id, and a step_key within the run, are keys: the same step again returns
    // it (checked under the run's lock, before a seq is spent), so a resuming loop that creates
    // its steps again by key creates nothing twice.
    let by_key = match new.step_key {
        Some(key) => db::select_one(
            "SELECT id, step_type FROM ledger.run_steps \
              WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 AND step_key = $4",
            &scope.args([run.id.as_str().into(), key.into()]),
            |r| Ok((db::req::<String>(r, 1)?, db::req::<String>(r, 2)?)),
        )?,
        None => None,
    };
    let mismatch = |field: &str, message: &str| {
        LedgerError::new(Code::IdempotencyMismatch, message)
            .with("fields", vec![field])
            .with("step_id", new.step_id)
            .with("step_key", new.step_key)
    };
    if let Some(id) = new.step_id {
        if let Some(other) = rows::find_step(scope, id)? {
            if other.run_id != run.id || other.step_type != new.step_type {
                let field = if other.run_id != run.id {
                    "run_id"
                } else {
                    "step_type"
                };
                return Err(mismatch(
                    field,
                    "step_id was reused for a different run or step type",
                ));
            }
            if by_key.as_ref().is_some_and(|(key_id, _)| key_id != id) {
                return Err(mismatch(
                    "step_key",
                    "step_key names another step of the run",
                ));
            }
            return again(scope, run, new, id.to_owned());
        }
    }
    if let Some((key_id, step_type)) = by_key {
        if step_type != new.step_type {
            return Err(mismatch(
                "step_type",
                "step_key was reused for a different step type",
            ));
        }
        if new.step_id.is_some_and(|id| id != key_id) {
            return Err(mismatch(
                "step_id",
                "step_key names another step of the run",
            ));
        }
        return again(scope, run, new, key_id);
    }
    let id = new
        .step_id
        .map_or_else(|| ids::new_id("step"), str::to_owned);
    // An llm step is a decision to spend: while a budget that applies is used up, it is created
    // paused with the budget, and the run parks.
    let refused = if new.step_type == LLM {
        budgets::decide(scope, run, Meter::LlmSteps)?
    } else {
        None
    };
    let (status, error_code, error_message, error_details) = match &refused {
        Some(budget) => (
            Status::Paused,
            Some(budgets::EXHAUSTED),
            Some(REFUSED),
            Some(budget.clone()),
        ),
        None => (
            new.status,
            new.ended.error_code,
            new.ended.error_message,
            new.ended.error_details.clone(),
        ),
    };
    let seq = feed::next_seq(scope, run.held())?;
    db::execute(
        include_str!("../sql/queries/insert_step.sql"),
        &scope.args([
            id.as_str().into(),
            run.id.as_str().into(),
            new.step_key.into(),
            new.step_type.into(),
            new.node_id.into(),
            status.as_str().into(),
            free_text(new.input_summary).into(),
            status.is_started().into(),
            status.is_terminal().into(),
            db::now()?.into(),
            free_text(new.ended.output_summary).into(),
            new.ended.metrics.clone().into(),
            error_code.into(),
            free_text(error_message).into(),
            error_details.into(),
        ]),
    )?;
    let created = Event::StepCreated(StepCreated {
        step_id: &id,
        step_key: new.step_key,
        step_type: new.step_type,
        node_id: new.node_id,
        status: status.as_str(),
    });
    feed::insert(scope, run.held(), seq, Some(&id), &created)?;
    if let Some(budget) = refused {
        budgets::park(
            scope,
            run,
            "llm_step",
            Some(new.step_key.unwrap_or(&id)),
            &budget,
        )?;
    }
    Ok(id)
}

/// The step type whose creation is a decision to spend (a model call).
const LLM: &str = "llm";

/// The error message of an llm step refused by a budget.
const REFUSED: &str = "a budget that applies to the run is used up";

/// An existing step asked for again: an llm step refused by a budget is decided again, and
/// once no budget stops it, its refusal is cleared (still paused: the worker moves it on).
fn again(scope: &Scope, run: &LockedRun, new: &NewStep, id: String) -> Result<String> {
    if new.step_type != LLM {
        return Ok(id);
    }
    let refused = db::select_one(
        "SELECT status = 'paused' AND error_code IS NOT DISTINCT FROM $4 FROM ledger.run_steps \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([id.as_str().into(), budgets::EXHAUSTED.into()]),
        |r| db::req::<bool>(r, 1),
    )?;
    if refused != Some(true) {
        return Ok(id);
    }
    match budgets::decide(scope, run, Meter::LlmSteps)? {
        Some(budget) => {
            budgets::park(scope, run, "llm_step", Some(new.step_key.unwrap_or(&id)), &budget)?;
        }
        None => db::execute(
            "UPDATE ledger.run_steps SET error_code = NULL, error_message = NULL, error_details = NULL \
              WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
            &scope.args([id.as_str().into()]),
        )?,
    }
    Ok(id)
}

/// Adds a step to a run that exists in scope and is not terminal (55000 `RUN_TERMINAL`).
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn create_step(
    run_id: Option<&str>,
    step_type: Option<&str>,
    step_key: default!(Option<&str>, "NULL"),
    node_id: default!(Option<&str>, "NULL"),
    input_summary: default!(Option<&str>, "NULL"),
    status: default!(Option<&str>, "'queued'"),
    step_id: default!(Option<&str>, "NULL"),
    run_token: default!(Option<i64>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.run_steps"), SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    let new = NewStep {
        step_type: required_label("step_type", step_type)?,
        step_key: optional_label("step_key", step_key)?,
        node_id: optional_label("node_id", node_id)?,
        input_summary,
        status: Status::parse(Resource::Step, required("status", status)?)?,
        step_id: optional_id("step_id", step_id)?,
        ended: StepChange::default(),
    };
    let run = rows::lock_run(&scope, "run_id", run_id)?;
    run.fence(run_token)?;
    let id = create(&scope, &run, &new)?;
    Ok(row(&scope, &id)?)
}

/// The optional fields a step transition may set.
#[derive(Default)]
pub struct StepChange<'a> {
    pub output_summary: Option<&'a str>,
    pub metrics: Option<Jsonb>,
    pub error_code: Option<&'a str>,
    pub error_message: Option<&'a str>,
    pub error_details: Option<Jsonb>,
}

/// Moves a step under the status machine, fenced by the run's `run_token` when given; returns
/// false when it already was at `to` (nothing written).
pub fn transition(
    scope: &Scope,
    step_id: &str,
    to: Status,
    expected: Option<Status>,
    change: StepChange,
    run_token: Option<i64>,
) -> Result<bool> {
    let Some((run, step)) = rows::lock_step_by_id(scope, step_id)? else {
        return Err(LedgerError::not_found(Code::StepNotFound, "step", step_id));
    };
    run.fence(run_token)?;
    let Some(from) = check_transition(Resource::Step, step_id, step.status, expected, to)? else {
        return Ok(false);
    };
    write_transition(scope, &run, step_id, from, to, change)?;
    Ok(true)
}

/// Moves a tool's step along with its tool call, where the status table allows it: directly, or
/// through one intermediate status (`running` out of `paused`, `retrying` out of a terminal
/// status). Otherwise the step stays where it is. The caller holds the lock of the step's run,
/// which every writer of a step takes first, so the step is read, not locked (a row lock would
/// only add a WAL record); the transition's UPDATE still checks the status it was read in.
pub fn follow(
    scope: &Scope,
    run: &LockedRun,
    step_id: &str,
    to: Status,
    change: StepChange,
) -> Result<()> {
    let current = rows::step_of_run(scope, step_id, &run.id)?.status;
    if current == to {
        return Ok(());
    }
    if Resource::Step.allows(current, to) {
        return write_transition(scope, run, step_id, current, to, change);
    }
    for via in [Status::Running, Status::Retrying] {
        if Resource::Step.allows(current, via) && Resource::Step.allows(via, to) {
            write_transition(scope, run, step_id, current, via, StepChange::default())?;
            return write_transition(scope, run, step_id, via, to, change);
        }
    }
    Ok(())
}

/// The conditional update of a locked step from `from` to `to`, and its `step.status` event.
fn write_transition(
    scope: &Scope,
    run: &LockedRun,
    step_id: &str,
    from: Status,
    to: Status,
    change: StepChange,
) -> Result<()> {
    let status = Event::StepStatus(StepStatus {
        step_id,
        from: from.as_str(),
        to: to.as_str(),
        error_code: change.error_code,
    });
    feed::append(scope, run.held(), Some(step_id), &status)?;
    transition::write(
        scope,
        &ledger_model::transition::STEP,
        step_id,
        from,
        to,
        vec![
            free_text(change.output_summary).into(),
            change.metrics.into(),
            change.error_code.into(),
            free_text(change.error_message).into(),
            change.error_details.into(),
        ],
    )
}

/// Moves a step to `to_status` under the status machine; `metrics` are merged (top-level keys).
#[allow(clippy::too_many_arguments)]
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn transition_step(
    step_id: Option<&str>,
    to_status: Option<&str>,
    expected_status: default!(Option<&str>, "NULL"),
    output_summary: default!(Option<&str>, "NULL"),
    metrics: default!(Option<Jsonb>, "NULL"),
    error_code: default!(Option<&str>, "NULL"),
    error_message: default!(Option<&str>, "NULL"),
    error_details: default!(Option<Jsonb>, "NULL"),
    run_token: default!(Option<i64>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.run_steps"), SqlError> {
    let scope = scope::current()?;
    let step_id = required_id("step_id", step_id)?;
    let to = Status::parse(Resource::Step, required("to_status", to_status)?)?;
    let error_code = optional_label("error_code", error_code)?;
    let expected = expected_status
        .map(|s| Status::parse(Resource::Step, s))
        .transpose()?;
    let metrics = match metrics {
        Some(m) if !m.is_object() => raise(LedgerError::new(
            Code::MetricsNotObject,
            "metrics must be a JSON object",
        )),
        // Parsed (depth-bounded) and redacted: metrics are evidence run_evidence walks later.
        Some(m) => Some(Jsonb::from(&redacted_json(&m)?)),
        None => None,
    };
    let error_details = error_details
        .map(|d| redacted_json(&d).map(|v| Jsonb::from(&v)))
        .transpose()?;
    let change = StepChange {
        output_summary,
        metrics,
        error_code,
        error_message,
        error_details,
    };
    transition(&scope, step_id, to, expected, change, run_token)?;
    Ok(row(&scope, step_id)?)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    #[pg_test]
    fn steps_are_created_in_order_on_live_runs_only() {
        set_scope("t-steps", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        for key in ["plan", "call", "answer"] {
            Spi::run(&format!(
                "SELECT ledger.create_step('r', 'llm', step_key => '{key}')"
            ))
            .unwrap();
        }
        assert_eq!(
            one::<String>(
                "SELECT string_agg(step_key, ',' ORDER BY step_no) FROM ledger.run_steps"
            ),
            "plan,call,answer"
        );
        assert!(one::<bool>("SELECT bool_and(id LIKE 'step\\_%' AND status = 'queued' AND started_at IS NULL) FROM ledger.run_steps"));
        let s =
            one::<String>("SELECT id FROM ledger.create_step('r', 'tool', status => 'running')");
        assert!(one::<bool>(&format!(
            "SELECT started_at IS NOT NULL FROM ledger.run_steps WHERE id = '{s}'"
        )));
        assert_error(
            "SELECT ledger.create_step('r', 'llm', status => 'bogus')",
            "22023",
            "STATUS_UNKNOWN",
        );
        assert_error(
            "SELECT ledger.create_step('r', NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error(
            "SELECT ledger.create_step('nope', 'llm')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        Spi::run("SELECT ledger.transition_run('r', 'canceled')").unwrap();
        assert_error(
            "SELECT ledger.create_step('r', 'llm')",
            "55000",
            "RUN_TERMINAL",
        );
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_steps"), 4);
        // Seqs stayed gapless through the refusals.
        assert!(one::<bool>(
            "SELECT max(seq) = count(*) FROM ledger.run_events"
        ));
    }

    #[pg_test]
    fn caller_step_ids_are_idempotent() {
        set_scope("t-step-ids", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r'), ledger.create_run('chat', run_id => 'r2')").unwrap();
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 's1')").unwrap();
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 's1')").unwrap();
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_steps"), 1);
        assert_error(
            "SELECT ledger.create_step('r2', 'llm', step_id => 's1')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_error(
            "SELECT ledger.create_step('r', 'tool', step_id => 's1')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_error(
            "SELECT ledger.create_step('r', 'llm', step_id => E'a\\tb')",
            "22023",
            "ID_INVALID",
        );
    }

    #[pg_test]
    fn a_step_key_finds_the_step_again_and_steps_count_from_one() {
        set_scope("t-step-keys", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r'), ledger.create_run('chat', run_id => 'r2')").unwrap();
        let plan =
            one::<String>("SELECT id FROM ledger.create_step('r', 'llm', step_key => 'plan')");
        Spi::run(&format!(
            "SELECT ledger.transition_step('{plan}', 'running')"
        ))
        .unwrap();
        let last = one::<i64>("SELECT last_seq FROM ledger.runs WHERE id = 'r'");
        // A resuming loop creates its step again: the same step, as it is now, nothing written.
        assert_eq!(
            one::<String>("SELECT id || ':' || status || ':' || step_no FROM ledger.create_step('r', 'llm', step_key => 'plan')"),
            format!("{plan}:running:1")
        );
        assert_eq!(
            one::<i64>("SELECT last_seq FROM ledger.runs WHERE id = 'r'"),
            last
        );
        Spi::run(
            "SELECT ledger.create_step('r', 'tool', step_key => 'search', step_id => 'search')",
        )
        .unwrap();
        Spi::run(
            "SELECT ledger.create_step('r', 'tool', step_key => 'search', step_id => 'search')",
        )
        .unwrap();
        Spi::run("SELECT ledger.create_step('r', 'llm', step_key => 'answer')").unwrap();
        // Keys are per run.
        Spi::run("SELECT ledger.create_step('r2', 'llm', step_key => 'plan')").unwrap();
        assert_eq!(
            one::<String>("SELECT string_agg(run_id || ':' || step_no || ':' || step_key, ' ' ORDER BY run_id, step_no) FROM ledger.run_steps"),
            "r:1:plan r:2:search r:3:answer r2:1:plan"
        );
        for (sql, field) in [
            (
                "SELECT ledger.create_step('r', 'tool', step_key => 'plan')",
                "step_type",
            ),
            (
                "SELECT ledger.create_step('r', 'llm', step_key => 'plan', step_id => 'other')",
                "step_id",
            ),
            (
                "SELECT ledger.create_step('r', 'tool', step_key => 'plan', step_id => 'search')",
                "step_key",
            ),
        ] {
            let e = assert_error(sql, "23505", "IDEMPOTENCY_MISMATCH");
            assert_eq!(e.detail["fields"], serde_json::json!([field]), "{sql}");
        }
        // A tool call's own step is keyed by its tool_call_id, so the same rule holds for it.
        let e = assert_error(
            "SELECT ledger.claim_tool_call('r', 'search', tool_call_id => 'answer')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_eq!(e.detail["fields"], serde_json::json!(["step_type"]));
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_steps"), 4);
        // The index backs it: no second step under a key, whoever writes.
        assert!(crate::testing::error_of(
            "INSERT INTO ledger.run_steps (tenant_id, workspace_id, id, run_id, step_key, step_type, step_no) \
             VALUES ('t-step-keys', 'w', 'dup', 'r', 'plan', 'llm', 9)"
        )
        .message
        .contains("run_steps_step_key_idx"));
    }

    #[pg_test]
    fn step_transitions_merge_metrics_and_follow_the_table() {
        set_scope("t-step-transitions", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 's')").unwrap();
        Spi::run(
            "SELECT ledger.transition_step('s', 'running', metrics => '{\"a\": 1, \"b\": 1}')",
        )
        .unwrap();
        assert_error(
            "SELECT ledger.transition_step('s', 'skipped')",
            "55000",
            "TRANSITION_INVALID",
        );
        assert_error(
            "SELECT ledger.transition_step('s', 'succeeded', metrics => '[1]')",
            "22023",
            "METRICS_NOT_OBJECT",
        );
        assert_error(
            "SELECT ledger.transition_step('s', 'succeeded', expected_status => 'queued')",
            "40001",
            "TRANSITION_CONFLICT",
        );
        assert_error(
            "SELECT ledger.transition_step('nope', 'running')",
            "P0002",
            "STEP_NOT_FOUND",
        );
        Spi::run("SELECT ledger.transition_step('s', 'succeeded', metrics => '{\"b\": 2, \"c\": 3}', output_summary => 'ok')").unwrap();
        assert_eq!(
            one::<String>("SELECT concat_ws('|', status, metrics::text, output_summary, ended_at IS NOT NULL, duration_ms >= 0) FROM ledger.run_steps"),
            "succeeded|{\"a\": 1, \"b\": 2, \"c\": 3}|ok|t|t"
        );
        assert_error(
            "SELECT ledger.transition_step('s', 'retrying')",
            "55000",
            "TRANSITION_INVALID",
        );
        // queued -> skipped is allowed for steps.
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 's2')").unwrap();
        Spi::run("SELECT ledger.transition_step('s2', 'skipped')").unwrap();
        assert_eq!(
            one::<String>("SELECT string_agg(event_type || ':' || coalesce(payload->>'to', payload->>'status'), ',' ORDER BY seq) FROM ledger.run_events WHERE step_id IS NOT NULL"),
            "step.created:queued,step.status:running,step.status:succeeded,step.created:queued,step.status:skipped"
        );
    }
}
