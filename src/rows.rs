//! Finding and locking the ledger's rows: runs, steps, tasks, tool calls and approvals, each
//! found by id in the caller's scope and returned as a small typed head.
//!
//! Locks are taken in one order: the run first, then the record (an approval, a step), then the
//! record's step. A record's lock takes the `LockedRun` of its run as proof that the run is held,
//! so a function cannot lock a record of a run it has not locked. Tool calls, and the steps the
//! tool-call functions move, are read under their run's lock without a row lock of their own:
//! every writer holds the run first, so the row lock added only WAL (a record per row). A function
//! waits for one run only: a claim whose key belongs to another run takes that run only if no one
//! holds it (else it reads the record unlocked), because its caller may already hold a second
//! run in the same transaction and the other run's holder may be waiting for ours. Tasks stand
//! apart: a task's writes lock only the task.

use crate::db;
use crate::error::{Code, LedgerError, Result};
use crate::scope::Scope;
use ledger_model::ids;
use ledger_model::run_leases;
use ledger_model::status::{Resource, Status};
use ledger_model::tool_calls::{ApprovalStatus, CallStatus};
use pgrx::datum::DatumWithOid;
use pgrx::{FromDatum, IntoDatum};

/// How a row is read: plainly (read-only, so also on a hot standby), or locked until the
/// transaction ends, which needs a writable transaction.
#[derive(Clone, Copy)]
enum Lock {
    No,
    /// `FOR NO KEY UPDATE`: what the row's own UPDATEs take; it serialises writers without
    /// blocking the foreign-key checks of rows inserted for it.
    NoKeyUpdate,
    /// `FOR NO KEY UPDATE SKIP LOCKED`: the row only if no one else holds it.
    NoKeyUpdateSkipLocked,
    /// `FOR KEY SHARE`: the row kept from a purge until the transaction ends, waiting for a purge
    /// that is deleting it (and then not found); writers' `FOR NO KEY UPDATE` does not block it.
    KeyShare,
    /// `FOR KEY SHARE SKIP LOCKED`: the row only if no one is deleting it (a purge).
    KeyShareSkipLocked,
    /// `FOR UPDATE`.
    Update,
}

/// The first row of `query` read under `lock` (its clause appended to the query).
fn first<R>(
    query: &str,
    lock: Lock,
    args: &[DatumWithOid],
    map: impl FnOnce(&db::Row) -> Result<R>,
) -> Result<Option<R>> {
    let locked = match lock {
        Lock::No => return db::select_one(query, args, map),
        Lock::NoKeyUpdate => format!("{query} FOR NO KEY UPDATE"),
        Lock::NoKeyUpdateSkipLocked => format!("{query} FOR NO KEY UPDATE SKIP LOCKED"),
        Lock::KeyShare => format!("{query} FOR KEY SHARE"),
        Lock::KeyShareSkipLocked => format!("{query} FOR KEY SHARE SKIP LOCKED"),
        Lock::Update => format!("{query} FOR UPDATE"),
    };
    db::write_one(&locked, args, map)
}

/// Refuses to add `what` to a finished run or task (55000 `code`).
fn ensure_live(code: Code, name: &str, id: &str, status: Status, what: &str) -> Result<()> {
    if !status.is_terminal() {
        return Ok(());
    }
    Err(LedgerError::new(
        code,
        format!("{name} {id} is {}; it takes no new {what}", status.as_str()),
    )
    .with(&format!("{name}_id"), id)
    .with("status", status.as_str()))
}

/// The whole row `id` of `table` in the scope, as the table's composite type (what the SQL
/// functions return), or P0002 `code`. `table` is always a literal of the caller's.
pub fn scoped_row<T: FromDatum + IntoDatum>(
    scope: &Scope,
    table: &str,
    id: &str,
    code: Code,
    what: &str,
) -> Result<T> {
    db::select_one(
        &format!("SELECT x FROM {table} x WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3"),
        &scope.args([id.into()]),
        |r| db::req(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found(code, what, id))
}

// Runs.

/// The columns of a run the functions decide on.
#[derive(Clone)]
pub struct RunHead {
    pub id: String,
    pub mode: String,
    pub subject_kind: String,
    pub subject_id: Option<String>,
    pub status: Status,
    pub attempt_no: i32,
    pub root_run_id: String,
    pub parent_run_id: Option<String>,
}

impl RunHead {
    /// Refuses to add `what` (steps, tool calls, ...) to a finished run (55000 `RUN_TERMINAL`).
    pub fn ensure_live(&self, what: &str) -> Result<()> {
        ensure_live(Code::RunTerminal, "run", &self.id, self.status, what)
    }
}

/// A run whose row this transaction holds locked, with its `last_seq` and its owner's fencing
/// token as read under the lock.
#[derive(Clone)]
pub struct LockedRun {
    pub head: RunHead,
    pub last_seq: i64,
    pub run_token: i64,
    /// An owner holds the run: claimed, and neither released nor taken over since.
    pub lease_held: bool,
    /// The lease of the last claim, which a heartbeat renews by default; None: never claimed.
    pub lease_seconds: Option<i32>,
}

impl LockedRun {
    /// The run as the feed's appends take it.
    pub fn held(&self) -> HeldRun<'_> {
        HeldRun {
            id: &self.id,
            last_seq: self.last_seq,
        }
    }

    /// The fence of every write about a run that may carry the owner's `run_token`: none given
    /// passes, else it must be the current token of a held run (40001 `LEASE_STALE`). Read
    /// under the run's lock, so no claim can take the run over before the write commits.
    pub fn fence(&self, run_token: Option<i64>) -> Result<()> {
        run_leases::check_token(&self.id, run_token, self.run_token, self.lease_held)
    }
}

/// A run this transaction holds (locked, or inserted by it) with its `last_seq` as read then:
/// what appending to its feed takes (`feed::append`), so that a call collecting its events
/// allocates their seqs after it without a statement.
#[derive(Clone, Copy)]
pub struct HeldRun<'a> {
    pub id: &'a str,
    pub last_seq: i64,
}

impl std::ops::Deref for LockedRun {
    type Target = RunHead;

    fn deref(&self) -> &RunHead {
        &self.head
    }
}

const RUN: &str = "SELECT id, mode, subject_kind, subject_id, status, attempt_no, root_run_id, \
                          last_seq, run_token, lease_owner IS NOT NULL, lease_seconds, parent_run_id \
                     FROM ledger.runs WHERE tenant_id = $1 AND workspace_id = $2";

/// The run whose `column` (`id` or `request_id`) is `key`, read under `lock`.
fn run_by(scope: &Scope, column: &str, key: &str, lock: Lock) -> Result<Option<LockedRun>> {
    first(
        &format!("{RUN} AND {column} = $3"),
        lock,
        &scope.args([key.into()]),
        |r| {
            Ok(LockedRun {
                head: RunHead {
                    id: db::req(r, 1)?,
                    mode: db::req(r, 2)?,
                    subject_kind: db::req(r, 3)?,
                    subject_id: db::opt(r, 4)?,
                    status: Status::parse(Resource::Run, &db::req::<String>(r, 5)?)?,
                    attempt_no: db::req(r, 6)?,
                    root_run_id: db::req(r, 7)?,
                    parent_run_id: db::opt(r, 12)?,
                },
                last_seq: db::req(r, 8)?,
                run_token: db::req(r, 9)?,
                lease_held: db::req(r, 10)?,
                lease_seconds: db::opt(r, 11)?,
            })
        },
    )
}

/// The run `run_id` in scope, locked, if it exists (a run a child names as its parent).
pub fn lock_run_if_any(scope: &Scope, run_id: &str) -> Result<Option<LockedRun>> {
    run_by(scope, "id", run_id, Lock::NoKeyUpdate)
}

/// The run `run_id` in scope, if any (not locked).
pub fn find_run(scope: &Scope, run_id: &str) -> Result<Option<RunHead>> {
    Ok(run_by(scope, "id", run_id, Lock::No)?.map(|r| r.head))
}

fn run_not_found(argument: &str, run_id: &str) -> LedgerError {
    LedgerError::not_found(Code::RunNotFound, "run", run_id).with("argument", argument)
}

/// A run that must exist in scope, not locked (P0002 `RUN_NOT_FOUND`, naming the argument).
pub fn run(scope: &Scope, argument: &str, run_id: &str) -> Result<RunHead> {
    ids::validate(argument, run_id)?;
    find_run(scope, run_id)?.ok_or_else(|| run_not_found(argument, run_id))
}

/// A run that a new row will reference, like `run`, kept from a purge until the transaction
/// ends: a purge racing the writer ends in "not found" rather than in a foreign-key violation.
/// The foreign key's own check takes the same lock at the INSERT, so this adds no wait and no
/// WAL of its own.
pub fn referenced_run(scope: &Scope, argument: &str, run_id: &str) -> Result<RunHead> {
    ids::validate(argument, run_id)?;
    Ok(run_by(scope, "id", run_id, Lock::KeyShare)?
        .ok_or_else(|| run_not_found(argument, run_id))?
        .head)
}

/// Checks that the run exists in scope (P0002 `RUN_NOT_FOUND`): the read paths' check.
pub fn run_exists(scope: &Scope, run_id: &str) -> Result<()> {
    ids::validate("run_id", run_id)?;
    match find_run(scope, run_id)? {
        Some(_) => Ok(()),
        None => Err(LedgerError::not_found(Code::RunNotFound, "run", run_id)),
    }
}

/// Locks a run that must exist in scope (P0002 `RUN_NOT_FOUND`, naming the argument): the first
/// lock of every write about a run.
pub fn lock_run(scope: &Scope, argument: &str, run_id: &str) -> Result<LockedRun> {
    ids::validate(argument, run_id)?;
    run_by(scope, "id", run_id, Lock::NoKeyUpdate)?.ok_or_else(|| run_not_found(argument, run_id))
}

/// Locks the run if no one else holds it; None when it is busy or gone.
pub fn try_lock_run(scope: &Scope, run_id: &str) -> Result<Option<LockedRun>> {
    run_by(scope, "id", run_id, Lock::NoKeyUpdateSkipLocked)
}

/// Keeps the run from being purged until this transaction ends, without waiting and without
/// blocking its writers (they take `FOR NO KEY UPDATE`); false when a purge holds it or it is gone.
pub fn try_key_share_run(scope: &Scope, run_id: &str) -> Result<bool> {
    Ok(run_by(scope, "id", run_id, Lock::KeyShareSkipLocked)?.is_some())
}

/// Locks the run a record is written for, and checks that the step it names, if any, is one of
/// the run's.
pub fn lock_owner(scope: &Scope, run_id: &str, step_id: Option<&str>) -> Result<LockedRun> {
    let run = lock_run(scope, "run_id", run_id)?;
    if let Some(step) = step_id {
        ids::validate("step_id", step)?;
        step_of_run(scope, step, run_id)?;
    }
    Ok(run)
}

// Steps.

/// The columns of a step the functions decide on.
pub struct StepHead {
    pub run_id: String,
    pub step_type: String,
    pub status: Status,
}

const STEP: &str = "SELECT run_id, step_type, status FROM ledger.run_steps \
                     WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3";

fn step_by(
    scope: &Scope,
    step_id: &str,
    run_id: Option<&str>,
    lock: Lock,
) -> Result<Option<StepHead>> {
    let (query, args) = match run_id {
        None => (STEP.to_owned(), scope.args([step_id.into()])),
        Some(run) => (
            format!("{STEP} AND run_id = $4"),
            scope.args([step_id.into(), run.into()]),
        ),
    };
    first(&query, lock, &args, |r| {
        Ok(StepHead {
            run_id: db::req(r, 1)?,
            step_type: db::req(r, 2)?,
            status: Status::parse(Resource::Step, &db::req::<String>(r, 3)?)?,
        })
    })
}

/// The step `step_id` in scope, if any (not locked).
pub fn find_step(scope: &Scope, step_id: &str) -> Result<Option<StepHead>> {
    step_by(scope, step_id, None, Lock::No)
}

/// A step that must be one of the run's (P0002 `STEP_NOT_FOUND`, naming the run), not locked.
pub fn step_of_run(scope: &Scope, step_id: &str, run_id: &str) -> Result<StepHead> {
    step_by(scope, step_id, Some(run_id), Lock::No)?.ok_or_else(|| {
        LedgerError::not_found(Code::StepNotFound, "step", step_id).with("run_id", run_id)
    })
}

/// Locks a step of the locked run (P0002 `STEP_NOT_FOUND`).
pub fn lock_step(scope: &Scope, run: &LockedRun, step_id: &str) -> Result<StepHead> {
    step_by(scope, step_id, Some(&run.id), Lock::Update)?
        .ok_or_else(|| LedgerError::not_found(Code::StepNotFound, "step", step_id))
}

/// Locks the step's run, then the step; None when the step is not in scope.
pub fn lock_step_by_id(scope: &Scope, step_id: &str) -> Result<Option<(LockedRun, StepHead)>> {
    let Some(found) = find_step(scope, step_id)? else {
        return Ok(None);
    };
    let run = lock_run(scope, "run_id", &found.run_id)?;
    let step = lock_step(scope, &run, step_id)?;
    Ok(Some((run, step)))
}

// Tasks.

/// The columns of a task the functions decide on.
pub struct TaskHead {
    pub id: String,
    pub task_type: String,
    pub run_id: Option<String>,
    pub status: Status,
    pub attempt_count: i32,
    pub retried_as_task_id: Option<String>,
}

impl TaskHead {
    /// Refuses to change a finished task's row outside a transition (55000 `TASK_TERMINAL`).
    pub fn ensure_live(&self, what: &str) -> Result<()> {
        ensure_live(Code::TaskTerminal, "task", &self.id, self.status, what)
    }
}

fn task_by(scope: &Scope, task_id: &str, lock: Lock) -> Result<TaskHead> {
    ids::validate("task_id", task_id)?;
    first(
        "SELECT id, task_type, run_id, status, attempt_count, retried_as_task_id FROM ledger.tasks \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        lock,
        &scope.args([task_id.into()]),
        |r| {
            Ok(TaskHead {
                id: db::req(r, 1)?,
                task_type: db::req(r, 2)?,
                run_id: db::opt(r, 3)?,
                status: Status::parse(Resource::Task, &db::req::<String>(r, 4)?)?,
                attempt_count: db::req(r, 5)?,
                retried_as_task_id: db::opt(r, 6)?,
            })
        },
    )?
    .ok_or_else(|| LedgerError::not_found(Code::TaskNotFound, "task", task_id))
}

/// A task that must exist in scope (P0002 `TASK_NOT_FOUND`), not locked.
pub fn task(scope: &Scope, task_id: &str) -> Result<TaskHead> {
    task_by(scope, task_id, Lock::No)
}

/// Locks a task that must exist in scope (P0002 `TASK_NOT_FOUND`).
pub fn lock_task(scope: &Scope, task_id: &str) -> Result<TaskHead> {
    task_by(scope, task_id, Lock::NoKeyUpdate)
}

// Tool calls.

/// A tool-call record as the functions decide on it.
pub struct ToolCall {
    pub id: String,
    pub run_id: String,
    pub step_id: String,
    pub tool_call_id: String,
    pub tool_ref: String,
    pub idempotency_key: String,
    pub request_hash: String,
    pub status: CallStatus,
    pub attempt: i64,
    pub lease_seconds: i32,
    /// The attempt holds a lease (it may have expired): false once a sweep, an in-doubt marking
    /// or a `retry` resolution released it.
    pub lease_held: bool,
    pub lease_live: bool,
    pub outbound_started: bool,
    pub result_artifact_id: Option<String>,
    pub result_sha256: Option<String>,
    /// The approval's status; a pending one past its deadline reads `expired`.
    pub approval: Option<ApprovalStatus>,
    pub lease_owner: Option<String>,
    pub approval_id: Option<String>,
}

/// How a tool call is found.
#[derive(Clone, Copy)]
pub enum By<'a> {
    Id(&'a str),
    Key(&'a str),
    RunCall(&'a str, &'a str),
}

fn tool_call_by(scope: &Scope, by: By, lock: Lock) -> Result<Option<ToolCall>> {
    const SELECT: &str = "SELECT t.id, t.run_id, t.step_id, t.tool_call_id, t.tool_ref, \
            t.idempotency_key, t.request_hash, t.status, t.attempt, t.lease_seconds, \
            t.lease_expires_at IS NOT NULL, coalesce(t.lease_expires_at > clock_timestamp(), false), \
            t.outbound_started_at IS NOT NULL, t.result_artifact_id, t.result_sha256, \
            CASE WHEN a.status = 'pending' AND a.expires_at <= clock_timestamp() THEN 'expired' \
                 ELSE a.status END, \
            t.lease_owner, t.approval_id \
       FROM ledger.run_step_tool_calls t \
       LEFT JOIN ledger.approval_requests a \
         ON a.tenant_id = t.tenant_id AND a.workspace_id = t.workspace_id AND a.id = t.approval_id \
      WHERE t.tenant_id = $1 AND t.workspace_id = $2";
    let (filter, key, second) = match by {
        By::Id(id) => ("t.id = $3", id, None),
        By::Key(k) => ("t.idempotency_key = $3", k, None),
        By::RunCall(run, call) => ("t.run_id = $3 AND t.tool_call_id = $4", run, Some(call)),
    };
    let mut args = scope.args([key.into()]);
    if let Some(call) = second {
        args.push(call.into());
    }
    first(&format!("{SELECT} AND {filter}"), lock, &args, |r| {
        Ok(ToolCall {
            id: db::req(r, 1)?,
            run_id: db::req(r, 2)?,
            step_id: db::req(r, 3)?,
            tool_call_id: db::req(r, 4)?,
            tool_ref: db::req(r, 5)?,
            idempotency_key: db::req(r, 6)?,
            request_hash: db::req(r, 7)?,
            status: CallStatus::parse(&db::req::<String>(r, 8)?)?,
            attempt: db::req(r, 9)?,
            lease_seconds: db::req(r, 10)?,
            lease_held: db::req(r, 11)?,
            lease_live: db::req(r, 12)?,
            outbound_started: db::req(r, 13)?,
            result_artifact_id: db::opt(r, 14)?,
            result_sha256: db::opt(r, 15)?,
            approval: db::opt::<String>(r, 16)?
                .as_deref()
                .and_then(ApprovalStatus::from_name),
            lease_owner: db::opt(r, 17)?,
            approval_id: db::opt(r, 18)?,
        })
    })
}

/// The tool call `by` names in scope, if any (not locked).
pub fn find_tool_call(scope: &Scope, by: By) -> Result<Option<ToolCall>> {
    tool_call_by(scope, by, Lock::No)
}

/// Fails unless `run` is the record's run: locking a record of a run not held breaks the order.
fn check_held(run: &LockedRun, record_run_id: &str) -> Result<()> {
    if run.id == record_run_id {
        Ok(())
    } else {
        Err(LedgerError::internal(
            "a record was locked without its run's lock",
        ))
    }
}

/// The tool call `id` of the locked run, read under the run's lock; None when it is not in scope
/// (a purge may have removed it meanwhile). Every writer of a call holds its run's lock first, so
/// that lock alone serialises them: a row lock of the call's own would only add a WAL record.
pub fn held_tool_call(scope: &Scope, run: &LockedRun, id: &str) -> Result<Option<ToolCall>> {
    let found = tool_call_by(scope, By::Id(id), Lock::No)?;
    if let Some(rec) = &found {
        check_held(run, &rec.run_id)?;
    }
    Ok(found)
}

/// Locks the tool call `id`'s run, then reads the call under it (P0002 `TOOL_CALL_NOT_FOUND`).
pub fn lock_tool_call_by_id(scope: &Scope, id: &str) -> Result<(LockedRun, ToolCall)> {
    let not_found = || LedgerError::not_found(Code::ToolCallNotFound, "tool call", id);
    let found = find_tool_call(scope, By::Id(id))?.ok_or_else(not_found)?;
    let run = lock_run(scope, "run_id", &found.run_id)?;
    let rec = held_tool_call(scope, &run, id)?.ok_or_else(not_found)?;
    Ok((run, rec))
}

/// Locks the tool call `id` of the locked run if its lease has expired and no one else holds it.
pub fn try_lock_expired_tool_call(
    scope: &Scope,
    run: &LockedRun,
    id: &str,
) -> Result<Option<ToolCall>> {
    let locked = db::write_one(
        "SELECT 1 FROM ledger.run_step_tool_calls WHERE tenant_id = $1 AND workspace_id = $2 \
            AND id = $3 AND lease_expires_at <= clock_timestamp() FOR UPDATE SKIP LOCKED",
        &scope.args([id.into()]),
        |_| Ok(()),
    )?;
    if locked.is_none() {
        return Ok(None);
    }
    let found = find_tool_call(scope, By::Id(id))?;
    if let Some(rec) = &found {
        check_held(run, &rec.run_id)?;
    }
    Ok(found)
}

// Approvals.

/// The columns of an approval request the functions decide on.
pub struct ApprovalHead {
    pub run_id: String,
    pub status: String,
    pub tool_call_record_id: Option<String>,
    /// Pending past its deadline: no one may decide it, it is to be expired.
    pub due: bool,
}

fn approval_by(scope: &Scope, approval_id: &str, lock: Lock) -> Result<Option<ApprovalHead>> {
    first(
        "SELECT run_id, status, tool_call_record_id, \
                status = 'pending' AND coalesce(expires_at <= clock_timestamp(), false) \
           FROM ledger.approval_requests \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        lock,
        &scope.args([approval_id.into()]),
        |r| {
            Ok(ApprovalHead {
                run_id: db::req(r, 1)?,
                status: db::req(r, 2)?,
                tool_call_record_id: db::opt(r, 3)?,
                due: db::req(r, 4)?,
            })
        },
    )
}

/// Locks the approval of `run` (held by this transaction) if it is pending past its deadline.
pub fn lock_due_approval(
    scope: &Scope,
    run: &LockedRun,
    approval_id: &str,
) -> Result<Option<ApprovalHead>> {
    let Some(approval) = approval_by(scope, approval_id, Lock::Update)? else {
        return Ok(None);
    };
    check_held(run, &approval.run_id)?;
    Ok(approval.due.then_some(approval))
}

/// Locks the approval's run, then the approval (P0002 `APPROVAL_NOT_FOUND`).
pub fn lock_approval(scope: &Scope, approval_id: &str) -> Result<(LockedRun, ApprovalHead)> {
    let not_found = || LedgerError::not_found(Code::ApprovalNotFound, "approval", approval_id);
    let found = approval_by(scope, approval_id, Lock::No)?.ok_or_else(not_found)?;
    let run = lock_run(scope, "run_id", &found.run_id)?;
    let approval = approval_by(scope, approval_id, Lock::Update)?.ok_or_else(not_found)?;
    check_held(&run, &approval.run_id)?;
    Ok((run, approval))
}
