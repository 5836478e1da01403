//! Tasks: the run status machine enforced by conditional updates under the task's row lock (with
//! an unlocked read-modify-write, a concurrent cancel and complete could both "win"), gapless
//! checkpoints, an append-only event history, and re-execution by retry or replay.

use crate::db;
use crate::error::{raise, Code, LedgerError, Result, SqlError};
use crate::jsonb::Jsonb;
use crate::outbox;
use crate::redaction::{free_text, redacted_object};
use crate::rows;
use crate::scope::{self, Scope};
use crate::transition;
use ledger_model::args::{optional_id, optional_label, required, required_id, required_label};
use ledger_model::events::{
    task_event_reserved, Event, TaskCheckpoint, TaskCreated, TaskRetried, TaskSnapshot, TaskStatus,
};
use ledger_model::status::{check_transition, Resource, Status};
use ledger_model::{ids, json};
use pgrx::prelude::*;
use serde_json::{json, Value};

fn row(scope: &Scope, task_id: &str) -> Result<pgrx::composite_type!('static, "ledger.tasks")> {
    rows::scoped_row(scope, "ledger.tasks", task_id, Code::TaskNotFound, "task")
}

type Row = PgHeapTuple<'static, pgrx::AllocatedByRust>;

/// A row of `table` (a task table with a `created_at`) from the values an INSERT was given and
/// the `created_at` it returned: a write statement returns no whole row, whose type on a
/// distributed engine's shard is the shard's own.
fn inserted_row(
    scope: &Scope,
    table: &str,
    created_at: Option<TimestampWithTimeZone>,
    fill: impl FnOnce(&mut Row) -> std::result::Result<(), pgrx::datum::TryFromDatumError>,
) -> Result<Row> {
    let created_at = created_at
        .ok_or_else(|| LedgerError::internal(format!("{table} insert returned no row")))?;
    let built = PgHeapTuple::new_composite_type(table)
        .map_err(|e| LedgerError::internal(format!("{table}: {e}")))
        .and_then(|mut row| {
            row.set_by_name("tenant_id", scope.tenant.as_str())
                .and_then(|()| row.set_by_name("workspace_id", scope.workspace.as_str()))
                .and_then(|()| row.set_by_name("created_at", created_at))
                .and_then(|()| fill(&mut row))
                .map_err(|e| LedgerError::internal(format!("{table}: {e}")))?;
            Ok(row)
        })?;
    Ok(built)
}

/// Appends to the task's history (not the run feed: a task may have no run).
fn event_row(
    scope: &Scope,
    task_id: &str,
    event_type: &str,
    payload: &Value,
) -> Result<pgrx::composite_type!('static, "ledger.task_events")> {
    let id = ids::new_id("tevt");
    let payload = Jsonb::from(payload);
    let created_at = db::write_one(
        "INSERT INTO ledger.task_events (tenant_id, workspace_id, id, task_id, event_type, payload) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING created_at",
        &scope.args([
            id.as_str().into(),
            task_id.into(),
            event_type.into(),
            payload.clone().into(),
        ]),
        |r| db::req(r, 1),
    )?;
    inserted_row(scope, "ledger.task_events", created_at, |row| {
        row.set_by_name("id", id.as_str())?;
        row.set_by_name("task_id", task_id)?;
        row.set_by_name("event_type", event_type)?;
        row.set_by_name("payload", payload)
    })
}

/// Writes one of the ledger's own events to the task's history.
fn ledger_event(scope: &Scope, task_id: &str, event: &Event) -> Result<()> {
    event_row(scope, task_id, event.event_type(), &event.payload())?;
    Ok(())
}

/// A JSON-object argument that may be NULL (then nothing changes), redacted.
fn optional_object(argument: &str, value: Option<Jsonb>) -> Result<Option<Value>> {
    value
        .map(|v| redacted_object(argument, Some(v)))
        .transpose()
}

/// Creates a task in `queued`. A caller `task_id` is idempotent: the same type and run return
/// the task, anything else fails 23505 `IDEMPOTENCY_MISMATCH`.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_tasks"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn create_task(
    task_type: Option<&str>,
    input: default!(Option<Jsonb>, "'{}'"),
    run_id: default!(Option<&str>, "NULL"),
    task_id: default!(Option<&str>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.tasks"), SqlError> {
    let scope = scope::current()?;
    let task_type = required_label("task_type", task_type)?;
    let input = Jsonb::from(&redacted_object("input", input)?);
    let id = match optional_id("task_id", task_id)? {
        Some(id) => id.to_owned(),
        None => ids::new_id("task"),
    };
    if let Some(run) = run_id {
        rows::referenced_run(&scope, "run_id", run)?;
    }
    let inserted = db::write_one(
        "INSERT INTO ledger.tasks (tenant_id, workspace_id, id, run_id, task_type, input) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING RETURNING id",
        &scope.args([
            id.as_str().into(),
            run_id.into(),
            task_type.into(),
            input.into(),
        ]),
        |r| db::req::<String>(r, 1),
    )?;
    if inserted.is_none() {
        let found = rows::task(&scope, &id)?;
        if found.task_type != task_type || found.run_id.as_deref() != run_id {
            raise(
                LedgerError::new(
                    Code::IdempotencyMismatch,
                    "task_id was reused for a different task type or run",
                )
                .with("task_id", id),
            );
        }
        return Ok(row(&scope, &id)?);
    }
    let created = Event::TaskCreated(TaskCreated {
        task_id: &id,
        task_type,
        run_id,
        status: "queued",
        replayed_from_task_id: None,
    });
    ledger_event(&scope, &id, &created)?;
    Ok(row(&scope, &id)?)
}

/// What a transition writes besides the status.
#[derive(Default)]
struct TaskChange<'a> {
    /// Merged into `progress` by top-level key.
    progress: Option<Value>,
    /// Replaces `output`.
    output: Option<Value>,
    error_code: Option<&'a str>,
    error_message: Option<String>,
    retried_as_task_id: Option<&'a str>,
    /// A new attempt (retry): attempt_count + 1, and progress, output, errors and times start over.
    new_attempt: bool,
}

/// The conditional update of a locked task from `from` to `to`, and its `task.status` event.
fn write_transition(
    scope: &Scope,
    task_id: &str,
    from: Status,
    to: Status,
    change: TaskChange,
) -> Result<()> {
    transition::write(
        scope,
        &ledger_model::transition::TASK,
        task_id,
        from,
        to,
        vec![
            change.progress.as_ref().map(Jsonb::from).into(),
            change.output.as_ref().map(Jsonb::from).into(),
            change.error_code.into(),
            change.error_message.into(),
            change.retried_as_task_id.into(),
            change.new_attempt.into(),
        ],
    )?;
    let status = Event::TaskStatus(TaskStatus {
        task_id,
        from: from.as_str(),
        to: to.as_str(),
        error_code: change.error_code,
        progress: change.progress.as_ref(),
    });
    ledger_event(scope, task_id, &status)?;
    Ok(())
}

/// Moves a task to `to_status` under the status machine; `progress` is merged by top-level
/// key, `output` replaced.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_tasks"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn transition_task(
    task_id: Option<&str>,
    to_status: Option<&str>,
    expected_status: default!(Option<&str>, "NULL"),
    progress: default!(Option<Jsonb>, "NULL"),
    output: default!(Option<Jsonb>, "NULL"),
    error_code: default!(Option<&str>, "NULL"),
    error_message: default!(Option<&str>, "NULL"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.tasks"), SqlError> {
    let scope = scope::current()?;
    let task_id = required_id("task_id", task_id)?;
    let to = Status::parse(Resource::Task, required("to_status", to_status)?)?;
    let expected = expected_status
        .map(|s| Status::parse(Resource::Task, s))
        .transpose()?;
    let progress = optional_object("progress", progress)?;
    let output = optional_object("output", output)?;
    let error_code = optional_label("error_code", error_code)?;
    let current = rows::lock_task(&scope, task_id)?;
    // None: already there, idempotent, nothing is rewritten.
    if let Some(from) = check_transition(Resource::Task, task_id, current.status, expected, to)? {
        let change = TaskChange {
            progress,
            output,
            error_code,
            error_message: free_text(error_message),
            ..TaskChange::default()
        };
        write_transition(&scope, task_id, from, to, change)?;
    }
    Ok(row(&scope, task_id)?)
}

/// Adds a checkpoint with the task's next checkpoint_no (1, 2, 3, ... without gaps).
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_tasks"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn add_task_checkpoint(
    task_id: Option<&str>,
    payload: Option<Jsonb>,
) -> std::result::Result<pgrx::composite_type!('static, "ledger.task_checkpoints"), SqlError> {
    let scope = scope::current()?;
    let task_id = required_id("task_id", task_id)?;
    let payload = Jsonb::from(&redacted_object(
        "payload",
        Some(payload.ok_or_else(|| LedgerError::required("payload"))?),
    )?);
    rows::lock_task(&scope, task_id)?.ensure_live("checkpoints")?;
    // Allocated under the row lock taken above: a number is never skipped or reused.
    let checkpoint_no = db::write_one(
        "UPDATE ledger.tasks SET last_checkpoint_no = last_checkpoint_no + 1, updated_at = now() \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 RETURNING last_checkpoint_no",
        &scope.args([task_id.into()]),
        |r| db::req::<i64>(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found(Code::TaskNotFound, "task", task_id))?;
    let id = ids::new_id("tckp");
    let created_at = db::write_one(
        "INSERT INTO ledger.task_checkpoints \
                (tenant_id, workspace_id, id, task_id, checkpoint_no, payload) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING created_at",
        &scope.args([
            id.as_str().into(),
            task_id.into(),
            checkpoint_no.into(),
            payload.clone().into(),
        ]),
        |r| db::req(r, 1),
    )?;
    let checkpoint = inserted_row(&scope, "ledger.task_checkpoints", created_at, |row| {
        row.set_by_name("id", id.as_str())?;
        row.set_by_name("task_id", task_id)?;
        row.set_by_name("checkpoint_no", checkpoint_no)?;
        row.set_by_name("payload", payload)
    })?;
    let added = Event::TaskCheckpoint(TaskCheckpoint {
        task_id,
        checkpoint_id: &id,
        checkpoint_no,
    });
    ledger_event(&scope, task_id, &added)?;
    Ok(checkpoint)
}

/// Records a caller's event in the task's history (any status, terminal included).
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_tasks"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn record_task_event(
    task_id: Option<&str>,
    event_type: Option<&str>,
    payload: default!(Option<Jsonb>, "'{}'"),
) -> std::result::Result<pgrx::composite_type!('static, "ledger.task_events"), SqlError> {
    let scope = scope::current()?;
    let task_id = required_id("task_id", task_id)?;
    let event_type = required_label("event_type", event_type)?;
    if task_event_reserved(event_type) {
        raise(
            LedgerError::new(
                Code::EventTypeReserved,
                format!("event type {event_type} is written only by the ledger"),
            )
            .with("event_type", event_type),
        );
    }
    let payload = redacted_object("payload", payload)?;
    rows::task(&scope, task_id)?;
    Ok(event_row(&scope, task_id, event_type, &payload)?)
}

/// Stores the task's execution snapshot (a JSON object, redacted), which replay_task starts from.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_tasks"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn set_task_snapshot(
    task_id: Option<&str>,
    snapshot: Option<Jsonb>,
) -> std::result::Result<pgrx::composite_type!('static, "ledger.tasks"), SqlError> {
    let scope = scope::current()?;
    let task_id = required_id("task_id", task_id)?;
    let snapshot = redacted_object(
        "snapshot",
        Some(snapshot.ok_or_else(|| LedgerError::required("snapshot"))?),
    )?;
    rows::lock_task(&scope, task_id)?.ensure_live("snapshots")?;
    db::execute(
        "UPDATE ledger.tasks SET snapshot = $4, updated_at = now() \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([task_id.into(), Jsonb::from(&snapshot).into()]),
    )?;
    let keys = snapshot
        .as_object()
        .into_iter()
        .flat_map(|m| m.keys().map(String::as_str))
        .collect();
    ledger_event(
        &scope,
        task_id,
        &Event::TaskSnapshot(TaskSnapshot { task_id, keys }),
    )?;
    Ok(row(&scope, task_id)?)
}

/// Retries a failed, canceled or expired task in place: retrying, then queued, as a new attempt;
/// outbox `task.retried`.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_tasks"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn retry_task(
    task_id: Option<&str>,
) -> std::result::Result<pgrx::composite_type!('static, "ledger.tasks"), SqlError> {
    let scope = scope::current()?;
    let task_id = required_id("task_id", task_id)?;
    let task = rows::lock_task(&scope, task_id)?;
    Resource::Task.check(task.status, Status::Retrying)?;
    // Its work already continues in the replacement; running both would execute it twice.
    if let Some(replacement) = &task.retried_as_task_id {
        raise(
            LedgerError::new(
                Code::TaskReplayed,
                format!("task {task_id} was replayed as {replacement}; retry that one instead"),
            )
            .with("task_id", task_id)
            .with("retried_as_task_id", replacement.as_str()),
        );
    }
    let retry = TaskChange {
        progress: Some(json!({"action": "retry"})),
        new_attempt: true,
        ..TaskChange::default()
    };
    write_transition(&scope, task_id, task.status, Status::Retrying, retry)?;
    let requeue = TaskChange {
        progress: Some(json!({"action": "requeued"})),
        ..TaskChange::default()
    };
    write_transition(&scope, task_id, Status::Retrying, Status::Queued, requeue)?;
    let retried = Event::TaskRetried(TaskRetried {
        task_id,
        task_type: &task.task_type,
        run_id: task.run_id.as_deref(),
        from: task.status.as_str(),
        attempt_count: task.attempt_count.saturating_add(1),
    });
    outbox::enqueue(
        &scope,
        &retried,
        task.run_id.as_deref(),
        Some(task_id),
        &format!("task:{task_id}"),
    )?;
    Ok(row(&scope, task_id)?)
}

/// The snapshot without the old attempt's identifiers: the replay is a new task with no run yet.
fn strip_attempt_ids(mut snapshot: Value) -> Value {
    const ATTEMPT_IDS: [&str; 2] = ["task_id", "run_id"];
    if let Value::Object(top) = &mut snapshot {
        if let Some(Value::Object(payload)) = top.get_mut("payload") {
            for key in ATTEMPT_IDS {
                payload.remove(key);
            }
        }
        for key in ATTEMPT_IDS {
            top.remove(key);
        }
    }
    snapshot
}

/// Replays a task from its snapshot in one transaction: a new queued task, and the old one
/// canceled with `retried_as_task_id`. Returns the new task; a task already replayed returns
/// its replacement.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema", "ledger_tasks"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn replay_task(
    task_id: Option<&str>,
) -> std::result::Result<pgrx::composite_type!('static, "ledger.tasks"), SqlError> {
    let scope = scope::current()?;
    let task_id = required_id("task_id", task_id)?;
    let old = rows::lock_task(&scope, task_id)?;
    if let Some(replacement) = &old.retried_as_task_id {
        return Ok(row(&scope, replacement)?);
    }
    // A terminal task reaches canceled only through retrying; succeeded reaches nothing.
    let first = if old.status.is_terminal() {
        Status::Retrying
    } else {
        Status::Canceled
    };
    Resource::Task.check(old.status, first)?;
    let snapshot = db::select_one(
        "SELECT snapshot FROM ledger.tasks WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([task_id.into()]),
        |r| db::opt::<Jsonb>(r, 1),
    )?
    .flatten()
    .ok_or_else(|| {
        LedgerError::new(
            Code::TaskRetrySnapshotMissing,
            format!("task {task_id} has no persisted execution snapshot to replay"),
        )
        .with("task_id", task_id)
    })?;
    let snapshot = strip_attempt_ids(json::parse(snapshot.as_str())?);

    let new_id = ids::new_id("task");
    db::execute(
        include_str!("../sql/queries/insert_replayed_task.sql"),
        &scope.args([
            task_id.into(),
            new_id.as_str().into(),
            Jsonb::from(&snapshot).into(),
        ]),
    )?;
    let created = Event::TaskCreated(TaskCreated {
        task_id: &new_id,
        task_type: &old.task_type,
        run_id: None,
        status: "queued",
        replayed_from_task_id: Some(task_id),
    });
    ledger_event(&scope, &new_id, &created)?;
    let mut from = old.status;
    if first == Status::Retrying {
        write_transition(&scope, task_id, from, first, TaskChange::default())?;
        from = first;
    }
    let cancel = TaskChange {
        progress: Some(json!({"action": "replayed", "retried_as_task_id": new_id})),
        retried_as_task_id: Some(&new_id),
        ..TaskChange::default()
    };
    write_transition(&scope, task_id, from, Status::Canceled, cancel)?;
    Ok(row(&scope, &new_id)?)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, error_of, one, set_scope};
    use pgrx::prelude::*;

    fn count(sql: &str) -> i64 {
        one::<i64>(sql)
    }

    /// Every task row (with its physical position, so a rewrite shows even within one
    /// transaction, where now() does not move), checkpoint, event and outbox row.
    fn digest() -> String {
        one::<String>(
            "SELECT concat_ws('/', \
                (SELECT md5(coalesce(string_agg(x::text || x.ctid::text, '|' ORDER BY x.id), '')) FROM ledger.tasks x), \
                (SELECT md5(coalesce(string_agg(x::text, '|' ORDER BY x.id), '')) FROM ledger.task_checkpoints x), \
                (SELECT md5(coalesce(string_agg(x::text, '|' ORDER BY x.id), '')) FROM ledger.task_events x), \
                (SELECT md5(coalesce(string_agg(x::text, '|' ORDER BY x.id), '')) FROM ledger.outbox x))",
        )
    }

    /// The task's history as `type:to` (`type` alone when the event has no `to`), oldest first.
    fn history(task_id: &str) -> String {
        one::<String>(&format!(
            "SELECT coalesce(string_agg(event_type || coalesce(':' || (payload->>'to'), ''), ',' \
                                        ORDER BY created_at, id), '') \
               FROM ledger.task_events WHERE task_id = '{task_id}'"
        ))
    }

    fn field(task_id: &str, expr: &str) -> String {
        one::<String>(&format!(
            "SELECT ({expr})::text FROM ledger.tasks WHERE id = '{task_id}'"
        ))
    }

    #[pg_test]
    fn create_task_is_queued_redacted_and_recorded() {
        set_scope("t-task-create", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r')").unwrap();
        let id = one::<String>(
            "SELECT id FROM ledger.create_task('agent.stream', '{\"q\": \"hi\", \"api_key\": \"k\", \"n\": 1.50}', run_id => 'r')",
        );
        assert!(id.starts_with("task_") && id.len() == 31, "{id}");
        assert_eq!(
            field(&id, "concat_ws('|', status, task_type, run_id, input, progress, attempt_count, last_checkpoint_no, \
                       output IS NULL, snapshot IS NULL, started_at IS NULL, ended_at IS NULL)"),
            "queued|agent.stream|r|{\"n\": 1.50, \"q\": \"hi\", \"api_key\": \"[REDACTED]\"}|{}|1|0|t|t|t|t"
        );
        assert_eq!(history(&id), "task.created");
        assert_eq!(
            one::<String>("SELECT payload::text FROM ledger.task_events WHERE event_type = 'task.created'"),
            format!("{{\"run_id\": \"r\", \"status\": \"queued\", \"task_id\": \"{id}\", \"task_type\": \"agent.stream\"}}")
        );
        assert!(one::<bool>(
            "SELECT bool_and(id LIKE 'tevt\\_%') FROM ledger.task_events"
        ));
        // Defaults: input {}, no run; tasks do not write to the run feed or the outbox.
        let bare = one::<String>("SELECT id FROM ledger.create_task('index')");
        assert_eq!(
            field(&bare, "concat_ws('|', input, run_id IS NULL)"),
            "{}|t"
        );
        assert_eq!(count("SELECT count(*) FROM ledger.run_events"), 1);
        assert_eq!(
            count("SELECT count(*) FROM ledger.outbox WHERE event_type LIKE 'task.%'"),
            0
        );
    }

    #[pg_test]
    fn caller_task_ids_are_idempotent() {
        set_scope("t-task-ids", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r'), ledger.create_run('agent', run_id => 'r2')").unwrap();
        let a = one::<String>(
            "SELECT id FROM ledger.create_task('index', '{\"a\": 1}', run_id => 'r', task_id => 'mine')",
        );
        assert_eq!(a, "mine");
        let before = digest();
        assert_eq!(
            one::<String>("SELECT id FROM ledger.create_task('index', '{\"a\": 2}', run_id => 'r', task_id => 'mine')"),
            "mine"
        );
        assert_eq!(digest(), before, "a repeat writes nothing");
        for call in [
            "SELECT ledger.create_task('other', run_id => 'r', task_id => 'mine')",
            "SELECT ledger.create_task('index', run_id => 'r2', task_id => 'mine')",
            "SELECT ledger.create_task('index', task_id => 'mine')",
        ] {
            let e = assert_error(call, "23505", "IDEMPOTENCY_MISMATCH");
            assert_eq!(e.detail["task_id"], "mine");
        }
        assert_eq!(digest(), before);
        // The same id in another scope is another task.
        set_scope("t-task-ids-other", "w");
        assert_eq!(
            one::<String>("SELECT id FROM ledger.create_task('other', task_id => 'mine')"),
            "mine"
        );
    }

    #[pg_test]
    fn bad_create_task_arguments_are_refused_and_write_nothing() {
        set_scope("t-task-bad-create-other", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'theirs')").unwrap();
        set_scope("t-task-bad-create", "w");
        let before = digest();
        assert_error(
            "SELECT ledger.create_task(NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error(
            "SELECT ledger.create_task('')",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        for input in ["'[1]'", "'\"x\"'", "'1'", "'null'"] {
            let e = assert_error(
                &format!("SELECT ledger.create_task('index', {input}::jsonb)"),
                "22023",
                "ARGUMENT_NOT_OBJECT",
            );
            assert_eq!(e.detail["argument"], "input");
        }
        let deep = "('{\"a\": ' || repeat('[', 200) || '1' || repeat(']', 200) || '}')::jsonb";
        assert_error(
            &format!("SELECT ledger.create_task('index', {deep})"),
            "22023",
            "INPUT_TOO_DEEP",
        );
        let long = "x".repeat(129);
        for id in [long.as_str(), "has space", "tab\there"] {
            assert_error(
                &format!("SELECT ledger.create_task('index', task_id => '{id}')"),
                "22023",
                "ID_INVALID",
            );
        }
        let e = assert_error(
            "SELECT ledger.create_task('index', run_id => 'nope')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_eq!(e.detail["argument"], "run_id");
        assert_error(
            "SELECT ledger.create_task('index', run_id => 'a b')",
            "22023",
            "ID_INVALID",
        );
        // Another scope's run is not found either.
        assert_error(
            "SELECT ledger.create_task('index', run_id => 'theirs')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_eq!(digest(), before);
        assert_eq!(count("SELECT count(*) FROM ledger.tasks"), 0);
    }

    #[pg_test]
    fn transitions_follow_the_run_rules() {
        set_scope("t-task-transitions", "w");
        Spi::run("SELECT ledger.create_task('index', task_id => 't')").unwrap();
        let e = assert_error(
            "SELECT ledger.transition_task('t', 'succeeded')",
            "55000",
            "TRANSITION_INVALID",
        );
        assert_eq!(
            (
                e.detail["resource"].as_str(),
                e.detail["from"].as_str(),
                e.detail["to"].as_str()
            ),
            (Some("task"), Some("queued"), Some("succeeded"))
        );
        for (call, state, code) in [
            (
                "SELECT ledger.transition_task('t', 'done')",
                "22023",
                "STATUS_UNKNOWN",
            ),
            (
                "SELECT ledger.transition_task('t', 'skipped')",
                "22023",
                "STATUS_UNKNOWN",
            ),
            (
                "SELECT ledger.transition_task('t', 'running', expected_status => 'bogus')",
                "22023",
                "STATUS_UNKNOWN",
            ),
            (
                "SELECT ledger.transition_task('t', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.transition_task(NULL, 'running')",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.transition_task('a b', 'running')",
                "22023",
                "ID_INVALID",
            ),
            (
                "SELECT ledger.transition_task('nope', 'running')",
                "P0002",
                "TASK_NOT_FOUND",
            ),
            (
                "SELECT ledger.transition_task('t', 'running', expected_status => 'preparing')",
                "40001",
                "TRANSITION_CONFLICT",
            ),
            (
                "SELECT ledger.transition_task('t', 'running', progress => '[1]')",
                "22023",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.transition_task('t', 'running', output => '\"x\"')",
                "22023",
                "ARGUMENT_NOT_OBJECT",
            ),
        ] {
            assert_error(call, state, code);
        }
        assert_eq!(history("t"), "task.created");

        Spi::run("SELECT ledger.transition_task('t', 'running', expected_status => 'queued', progress => '{\"a\": 1, \"b\": 1}')").unwrap();
        assert_eq!(
            field(
                "t",
                "concat_ws('|', status, progress, started_at IS NOT NULL, ended_at IS NULL)"
            ),
            "running|{\"a\": 1, \"b\": 1}|t|t"
        );
        // Same status: idempotent, nothing rewritten, no event, even with a stale expectation.
        let before = digest();
        Spi::run("SELECT ledger.transition_task('t', 'running', expected_status => 'paused', progress => '{\"a\": 9}', error_code => 'X')").unwrap();
        assert_eq!(digest(), before);

        Spi::run("SELECT ledger.transition_task('t', 'paused', progress => '{\"b\": 2, \"c\": {\"token\": \"s\"}}', output => '{\"partial\": true}')").unwrap();
        assert_eq!(
            field("t", "concat_ws('|', progress, output)"),
            "{\"a\": 1, \"b\": 2, \"c\": {\"token\": \"[REDACTED]\"}}|{\"partial\": true}"
        );
        Spi::run("SELECT ledger.transition_task('t', 'running')").unwrap();
        let long = "é".repeat(9000);
        Spi::run(&format!("SELECT ledger.transition_task('t', 'failed', output => '{{\"rows\": 3}}', error_code => 'E1', error_message => '{long}')")).unwrap();
        assert_eq!(
            field("t", "concat_ws('|', status, output, error_code, char_length(error_message), ended_at IS NOT NULL, started_at <= ended_at)"),
            "failed|{\"rows\": 3}|E1|8192|t|t"
        );
        // A terminal task is not rewritten by a repeat of its status.
        let before = digest();
        Spi::run("SELECT ledger.transition_task('t', 'failed', error_code => 'E2')").unwrap();
        assert_eq!(digest(), before);
        assert_error(
            "SELECT ledger.transition_task('t', 'succeeded')",
            "55000",
            "TRANSITION_INVALID",
        );
        // Leaving the terminal status clears ended_at.
        Spi::run("SELECT ledger.transition_task('t', 'retrying')").unwrap();
        assert_eq!(
            field("t", "concat_ws('|', status, ended_at IS NULL, error_code)"),
            "retrying|t|E1"
        );
        assert_eq!(
            history("t"),
            "task.created,task.status:running,task.status:paused,task.status:running,task.status:failed,task.status:retrying"
        );
        assert_eq!(
            one::<String>("SELECT payload->>'error_code' FROM ledger.task_events WHERE payload->>'to' = 'failed'"),
            "E1"
        );
    }

    #[pg_test]
    fn checkpoints_are_numbered_without_gaps() {
        set_scope("t-task-checkpoints", "w");
        Spi::run("SELECT ledger.create_task('index', task_id => 't'), ledger.create_task('index', task_id => 'u')").unwrap();
        for i in 1..=3 {
            let (no, id) = Spi::get_two::<i64, String>(&format!(
                "SELECT checkpoint_no, id FROM ledger.add_task_checkpoint('t', '{{\"i\": {i}}}')"
            ))
            .unwrap();
            assert_eq!(no, Some(i));
            assert!(id.unwrap().starts_with("tckp_"));
        }
        // Refusals spend no number.
        for (call, state, code) in [
            (
                "SELECT ledger.add_task_checkpoint('t', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.add_task_checkpoint('t', '[1]')",
                "22023",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.add_task_checkpoint(NULL, '{}')",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.add_task_checkpoint('nope', '{}')",
                "P0002",
                "TASK_NOT_FOUND",
            ),
        ] {
            assert_error(call, state, code);
        }
        Spi::run("SELECT ledger.add_task_checkpoint('t', '{\"password\": \"p\"}')").unwrap();
        Spi::run("SELECT ledger.add_task_checkpoint('u', '{}')").unwrap();
        assert_eq!(
            one::<String>("SELECT string_agg(checkpoint_no::text, ',' ORDER BY checkpoint_no) FROM ledger.task_checkpoints WHERE task_id = 't'"),
            "1,2,3,4"
        );
        assert_eq!(
            one::<String>("SELECT payload->>'password' FROM ledger.task_checkpoints WHERE task_id = 't' AND checkpoint_no = 4"),
            "[REDACTED]"
        );
        assert_eq!(field("t", "last_checkpoint_no"), "4");
        assert_eq!(field("u", "last_checkpoint_no"), "1");
        assert_eq!(
            one::<String>("SELECT string_agg(payload->>'checkpoint_no', ',' ORDER BY created_at, id) FROM ledger.task_events WHERE task_id = 't' AND event_type = 'task.checkpoint'"),
            "1,2,3,4"
        );
        // A finished task takes no more checkpoints.
        Spi::run("SELECT ledger.transition_task('t', 'canceled')").unwrap();
        let before = digest();
        let e = assert_error(
            "SELECT ledger.add_task_checkpoint('t', '{}')",
            "55000",
            "TASK_TERMINAL",
        );
        assert_eq!(e.detail["status"], "canceled");
        assert_eq!(digest(), before);
    }

    #[pg_test]
    fn callers_record_their_own_events() {
        set_scope("t-task-events", "w");
        Spi::run("SELECT ledger.create_task('index', task_id => 't')").unwrap();
        let (id, payload) = Spi::get_two::<String, pgrx::JsonB>(
            "SELECT id, payload FROM ledger.record_task_event('t', 'task.progress', '{\"pct\": 50, \"Authorization\": \"x\"}')",
        )
        .unwrap();
        assert!(id.unwrap().starts_with("tevt_"));
        assert_eq!(
            payload.unwrap().0,
            serde_json::json!({"pct": 50, "Authorization": "[REDACTED]"})
        );
        assert_eq!(
            one::<String>("SELECT payload::text FROM ledger.record_task_event('t', 'note')"),
            "{}"
        );
        let before = digest();
        for kind in [
            "task.created",
            "task.status",
            "task.checkpoint",
            "task.snapshot",
        ] {
            let e = assert_error(
                &format!("SELECT ledger.record_task_event('t', '{kind}')"),
                "22023",
                "EVENT_TYPE_RESERVED",
            );
            assert_eq!(e.detail["event_type"], kind);
        }
        for (call, state, code) in [
            (
                "SELECT ledger.record_task_event('t', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.record_task_event('t', '')",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.record_task_event(NULL, 'note')",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.record_task_event('t', 'note', '[]')",
                "22023",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.record_task_event('nope', 'note')",
                "P0002",
                "TASK_NOT_FOUND",
            ),
        ] {
            assert_error(call, state, code);
        }
        assert_eq!(digest(), before);
        // The history is append-only and takes events in any status.
        Spi::run("SELECT ledger.transition_task('t', 'expired')").unwrap();
        Spi::run("SELECT ledger.record_task_event('t', 'late.note')").unwrap();
        assert_eq!(
            history("t"),
            "task.created,task.progress,note,task.status:expired,late.note"
        );
    }

    #[pg_test]
    fn snapshots_are_objects_of_live_tasks() {
        set_scope("t-task-snapshot", "w");
        Spi::run("SELECT ledger.create_task('agent.stream', task_id => 't')").unwrap();
        let snap = one::<String>(
            "SELECT snapshot::text FROM ledger.set_task_snapshot('t', '{\"payload\": {\"q\": 1}, \"secret\": \"s\"}')",
        );
        assert_eq!(
            snap,
            "{\"secret\": \"[REDACTED]\", \"payload\": {\"q\": 1}}"
        );
        Spi::run("SELECT ledger.set_task_snapshot('t', '{\"v\": 2}')").unwrap();
        assert_eq!(field("t", "snapshot"), "{\"v\": 2}");
        assert_eq!(
            one::<String>("SELECT string_agg(payload->>'keys', ',' ORDER BY created_at, id) FROM ledger.task_events WHERE event_type = 'task.snapshot'"),
            "[\"payload\", \"secret\"],[\"v\"]"
        );
        let before = digest();
        for (call, state, code) in [
            (
                "SELECT ledger.set_task_snapshot('t', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.set_task_snapshot('t', '\"x\"')",
                "22023",
                "ARGUMENT_NOT_OBJECT",
            ),
            (
                "SELECT ledger.set_task_snapshot(NULL, '{}')",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.set_task_snapshot('nope', '{}')",
                "P0002",
                "TASK_NOT_FOUND",
            ),
        ] {
            assert_error(call, state, code);
        }
        Spi::run("SELECT ledger.transition_task('t', 'failed')").unwrap();
        let before_terminal = digest();
        assert_ne!(before, before_terminal);
        assert_error(
            "SELECT ledger.set_task_snapshot('t', '{}')",
            "55000",
            "TASK_TERMINAL",
        );
        assert_eq!(digest(), before_terminal);
    }

    #[pg_test]
    fn retry_requeues_failed_canceled_and_expired_tasks_in_place() {
        set_scope("t-task-retry", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r')").unwrap();
        for status in ["failed", "canceled", "expired"] {
            Spi::run(&format!(
                "SELECT ledger.create_task('index', run_id => 'r', task_id => '{status}')"
            ))
            .unwrap();
            Spi::run(&format!("SELECT ledger.transition_task('{status}', 'running', progress => '{{\"pct\": 40}}')")).unwrap();
            Spi::run(&format!(
                "SELECT ledger.add_task_checkpoint('{status}', '{{}}')"
            ))
            .unwrap();
            Spi::run(&format!("SELECT ledger.transition_task('{status}', '{status}', output => '{{\"x\": 1}}', error_code => 'E', error_message => 'boom')")).unwrap();
            let row = one::<String>(&format!(
                "SELECT concat_ws('|', id, status, attempt_count) FROM ledger.retry_task('{status}')"
            ));
            assert_eq!(row, format!("{status}|queued|2"));
            assert_eq!(
                field(status, "concat_ws('|', progress, output IS NULL, error_code IS NULL, error_message IS NULL, \
                               started_at IS NULL, ended_at IS NULL, last_checkpoint_no)"),
                "{\"action\": \"requeued\"}|t|t|t|t|t|1"
            );
            assert_eq!(
                history(status),
                format!("task.created,task.status:running,task.checkpoint,task.status:{status},task.status:retrying,task.status:queued")
            );
            let outbox = one::<String>(&format!(
                "SELECT concat_ws('|', run_id, task_id, subject, status, payload->>'from', payload->>'attempt_count') \
                   FROM ledger.outbox WHERE event_type = 'task.retried' AND task_id = '{status}'"
            ));
            assert_eq!(
                outbox,
                format!("r|{status}|task:{status}|pending|{status}|2")
            );
        }
        // The new attempt runs like the first one did, and can be retried again.
        Spi::run("SELECT ledger.transition_task('failed', 'running')").unwrap();
        assert_eq!(field("failed", "started_at IS NOT NULL"), "true");
        Spi::run("SELECT ledger.transition_task('failed', 'failed')").unwrap();
        assert_eq!(
            one::<i32>("SELECT attempt_count FROM ledger.retry_task('failed')"),
            3
        );
        // A task without a run has an outbox row without one.
        Spi::run("SELECT ledger.create_task('index', task_id => 'solo')").unwrap();
        Spi::run("SELECT ledger.transition_task('solo', 'canceled')").unwrap();
        Spi::run("SELECT ledger.retry_task('solo')").unwrap();
        assert!(one::<bool>(
            "SELECT run_id IS NULL FROM ledger.outbox WHERE task_id = 'solo'"
        ));
    }

    #[pg_test]
    fn retry_refuses_every_other_status_and_writes_nothing() {
        set_scope("t-task-retry-refused", "w");
        let paths: [(&str, &[&str]); 8] = [
            ("queued", &[]),
            ("preparing", &["preparing"]),
            ("running", &["running"]),
            ("waiting_input", &["running", "waiting_input"]),
            ("waiting_approval", &["running", "waiting_approval"]),
            ("paused", &["running", "paused"]),
            ("retrying", &["failed", "retrying"]),
            ("succeeded", &["running", "succeeded"]),
        ];
        for (status, path) in paths {
            Spi::run(&format!(
                "SELECT ledger.create_task('index', task_id => '{status}')"
            ))
            .unwrap();
            for step in path {
                Spi::run(&format!(
                    "SELECT ledger.transition_task('{status}', '{step}')"
                ))
                .unwrap();
            }
            let before = digest();
            let e = assert_error(
                &format!("SELECT ledger.retry_task('{status}')"),
                "55000",
                "TRANSITION_INVALID",
            );
            assert_eq!(e.detail["from"], status);
            assert_eq!(e.detail["to"], "retrying");
            assert_eq!(digest(), before, "{status}");
        }
        assert_error(
            "SELECT ledger.retry_task(NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error(
            "SELECT ledger.retry_task('nope')",
            "P0002",
            "TASK_NOT_FOUND",
        );
        assert_error("SELECT ledger.retry_task('a b')", "22023", "ID_INVALID");
        assert_eq!(count("SELECT count(*) FROM ledger.outbox"), 0);
    }

    #[pg_test]
    fn replay_starts_a_new_task_without_the_old_attempts_ids() {
        set_scope("t-task-replay", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r')").unwrap();
        Spi::run("SELECT ledger.create_task('agent.stream', '{\"q\": \"hi\", \"n\": 1.0}', run_id => 'r', task_id => 'old')").unwrap();
        Spi::run(
            "SELECT ledger.set_task_snapshot('old', jsonb_build_object( \
                'task_id', 'old', 'run_id', 'r', 'assistant_message_id', 'm1', \
                'payload', jsonb_build_object('task_id', 'old', 'run_id', 'r', 'thread_id', 'th', 'nested', jsonb_build_object('run_id', 'kept')), \
                'request_context', jsonb_build_object('user', 'u1')))",
        )
        .unwrap();
        Spi::run("SELECT ledger.transition_task('old', 'running', progress => '{\"pct\": 70}')")
            .unwrap();
        let new = one::<String>("SELECT id FROM ledger.replay_task('old')");
        assert!(new.starts_with("task_") && new != "old", "{new}");
        assert_eq!(
            field(&new, "concat_ws('|', status, task_type, input, run_id IS NULL, replayed_from_task_id, attempt_count, progress, retried_as_task_id IS NULL)"),
            "queued|agent.stream|{\"n\": 1.0, \"q\": \"hi\"}|t|old|1|{}|t"
        );
        assert_eq!(
            field(&new, "snapshot"),
            "{\"payload\": {\"nested\": {\"run_id\": \"kept\"}, \"thread_id\": \"th\"}, \"request_context\": {\"user\": \"u1\"}, \"assistant_message_id\": \"m1\"}"
        );
        // The old task, non-terminal, is canceled directly and points at its replacement.
        assert_eq!(
            field("old", "concat_ws('|', status, retried_as_task_id, progress->>'retried_as_task_id', progress->>'pct', ended_at IS NOT NULL)"),
            format!("canceled|{new}|{new}|70|t")
        );
        assert!(
            field("old", "snapshot ? 'task_id'") == "true",
            "the old snapshot is kept"
        );
        assert_eq!(
            history("old"),
            "task.created,task.snapshot,task.status:running,task.status:canceled"
        );
        assert_eq!(history(&new), "task.created");
        assert_eq!(
            one::<String>(&format!("SELECT payload->>'replayed_from_task_id' FROM ledger.task_events WHERE task_id = '{new}'")),
            "old"
        );
        // Replaying it again returns the same replacement and changes nothing.
        let before = digest();
        assert_eq!(
            one::<String>("SELECT id FROM ledger.replay_task('old')"),
            new
        );
        assert_eq!(digest(), before);
        // Its work continues in the replacement: retrying the old task would run it twice.
        let e = assert_error("SELECT ledger.retry_task('old')", "55000", "TASK_REPLAYED");
        assert_eq!(e.detail["retried_as_task_id"], new.as_str());
        assert_eq!(digest(), before);
        // The replacement can be replayed in turn (its snapshot came along).
        let third = one::<String>(&format!("SELECT id FROM ledger.replay_task('{new}')"));
        assert_eq!(field(&third, "replayed_from_task_id"), new);
    }

    #[pg_test]
    fn replay_of_a_terminal_task_goes_through_retrying() {
        set_scope("t-task-replay-terminal", "w");
        for status in ["failed", "canceled", "expired"] {
            Spi::run(&format!(
                "SELECT ledger.create_task('index', task_id => '{status}')"
            ))
            .unwrap();
            Spi::run(&format!(
                "SELECT ledger.set_task_snapshot('{status}', '{{\"step\": 1}}')"
            ))
            .unwrap();
            Spi::run(&format!(
                "SELECT ledger.transition_task('{status}', '{status}', error_code => 'E')"
            ))
            .unwrap();
            let new = one::<String>(&format!("SELECT id FROM ledger.replay_task('{status}')"));
            assert_eq!(
                field(
                    status,
                    "concat_ws('|', status, retried_as_task_id, error_code, ended_at IS NOT NULL)"
                ),
                format!("canceled|{new}|E|t")
            );
            let expected = if status == "canceled" {
                "task.created,task.snapshot,task.status:canceled,task.status:retrying,task.status:canceled"
                    .to_owned()
            } else {
                format!("task.created,task.snapshot,task.status:{status},task.status:retrying,task.status:canceled")
            };
            assert_eq!(history(status), expected);
            assert_eq!(
                field(&new, "concat_ws('|', status, snapshot)"),
                "queued|{\"step\": 1}"
            );
        }
        // succeeded reaches nothing: it cannot be replayed.
        Spi::run("SELECT ledger.create_task('index', task_id => 'done')").unwrap();
        Spi::run("SELECT ledger.set_task_snapshot('done', '{}')").unwrap();
        Spi::run("SELECT ledger.transition_task('done', 'running')").unwrap();
        Spi::run("SELECT ledger.transition_task('done', 'succeeded')").unwrap();
        let before = digest();
        let e = assert_error(
            "SELECT ledger.replay_task('done')",
            "55000",
            "TRANSITION_INVALID",
        );
        assert_eq!(e.detail["from"], "succeeded");
        assert_eq!(digest(), before);
    }

    #[pg_test]
    fn replay_without_a_snapshot_changes_nothing() {
        set_scope("t-task-replay-missing", "w");
        Spi::run("SELECT ledger.create_task('agent.stream', task_id => 't')").unwrap();
        Spi::run("SELECT ledger.transition_task('t', 'failed', error_code => 'E')").unwrap();
        Spi::run("SELECT ledger.create_task('agent.stream', task_id => 'live')").unwrap();
        for task in ["t", "live"] {
            let before = digest();
            let e = assert_error(
                &format!("SELECT ledger.replay_task('{task}')"),
                "55000",
                "TASK_RETRY_SNAPSHOT_MISSING",
            );
            assert_eq!(e.detail["task_id"], task);
            assert_eq!(digest(), before, "{task}");
        }
        assert_eq!(count("SELECT count(*) FROM ledger.tasks"), 2);
        assert_error(
            "SELECT ledger.replay_task(NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error(
            "SELECT ledger.replay_task('nope')",
            "P0002",
            "TASK_NOT_FOUND",
        );
    }

    #[pg_test]
    fn task_functions_need_a_scope_and_see_only_their_own() {
        set_scope("t-task-scope", "w");
        Spi::run("SELECT ledger.create_task('index', task_id => 't')").unwrap();
        set_scope("t-task-scope", "other");
        for call in [
            "SELECT ledger.transition_task('t', 'running')",
            "SELECT ledger.add_task_checkpoint('t', '{}')",
            "SELECT ledger.record_task_event('t', 'note')",
            "SELECT ledger.set_task_snapshot('t', '{}')",
            "SELECT ledger.retry_task('t')",
            "SELECT ledger.replay_task('t')",
        ] {
            assert_error(call, "P0002", "TASK_NOT_FOUND");
        }
        Spi::run("SELECT set_config('ledger.tenant_id', '', true), set_config('ledger.workspace_id', '', true)").unwrap();
        for call in [
            "SELECT ledger.create_task('index')",
            "SELECT ledger.transition_task('t', 'running')",
            "SELECT ledger.add_task_checkpoint('t', '{}')",
            "SELECT ledger.record_task_event('t', 'note')",
            "SELECT ledger.set_task_snapshot('t', '{}')",
            "SELECT ledger.retry_task('t')",
            "SELECT ledger.replay_task('t')",
        ] {
            assert_error(call, "42501", "SCOPE_MISSING");
        }
        // A writer uses the functions but cannot write the tables.
        set_scope("t-task-scope", "w");
        Spi::run("SET LOCAL ROLE ledger_writer").unwrap();
        Spi::run("SELECT ledger.transition_task('t', 'running')").unwrap();
        for sql in [
            "UPDATE ledger.tasks SET status = 'succeeded'",
            "INSERT INTO ledger.task_events (tenant_id, workspace_id, id, task_id, event_type) VALUES ('t-task-scope', 'w', 'e', 't', 'task.status')",
            "DELETE FROM ledger.task_checkpoints",
        ] {
            assert_eq!(error_of(sql).sqlstate, "42501", "{sql}");
        }
        Spi::run("RESET ROLE").unwrap();
        assert_eq!(field("t", "status"), "running");
    }
}
