//! The run event feed (SPEC §6, replay #2) and the transactional outbox (SPEC §11, write side).
//!
//! Every write that concerns a run appends to `run_events` in the caller's transaction. The seq
//! comes from `runs.last_seq`, bumped under the run's row lock, so seq N+1 cannot commit before
//! seq N: a reader that has seen N never misses anything below it.

use crate::db;
use crate::error::{LedgerError, Result};
use crate::jsonb::Jsonb;
use crate::model::{hash, ids};
use crate::scope::{self, Scope};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use serde_json::{json, Value};

/// Locks the run's row and allocates its next event seq.
pub fn next_seq(scope: &Scope, run_id: &str) -> Result<i64> {
    db::write_one(
        "UPDATE ledger.runs SET last_seq = last_seq + 1 \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 RETURNING last_seq",
        &[
            scope.tenant.as_str().into(),
            scope.workspace.as_str().into(),
            run_id.into(),
        ],
        |r| db::req::<i64>(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found("RUN_NOT_FOUND", "run", run_id))
}

/// Writes the event with an already allocated seq and notifies the run's channel (delivered at
/// commit). The notification carries ids only: any role may LISTEN on any channel.
pub fn insert(
    scope: &Scope,
    run_id: &str,
    seq: i64,
    kind: &str,
    step_id: Option<&str>,
    payload: &Value,
) -> Result<String> {
    let id = ids::new_id("evt");
    let note = json!({"run_id": run_id, "seq": seq, "event_id": id, "kind": kind}).to_string();
    db::execute(
        "WITH e AS (INSERT INTO ledger.run_events \
                        (tenant_id, workspace_id, id, run_id, seq, kind, step_id, payload) \
                    VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING 1) \
         SELECT pg_catalog.pg_notify($9, $10) FROM e",
        &[
            scope.tenant.as_str().into(),
            scope.workspace.as_str().into(),
            id.as_str().into(),
            run_id.into(),
            seq.into(),
            kind.into(),
            step_id.into(),
            Jsonb::from(payload).into(),
            hash::run_channel(&scope.tenant, &scope.workspace, run_id).into(),
            note.into(),
        ],
    )?;
    Ok(id)
}

/// Appends one event to the run's feed; returns its seq.
pub fn append(
    scope: &Scope,
    run_id: &str,
    kind: &str,
    step_id: Option<&str>,
    payload: &Value,
) -> Result<i64> {
    let seq = next_seq(scope, run_id)?;
    insert(scope, run_id, seq, kind, step_id, payload)?;
    Ok(seq)
}

/// Writes an outbox row in the caller's transaction and notifies `ledger_outbox` with its id.
pub fn enqueue(
    scope: &Scope,
    event_type: &str,
    run_id: Option<&str>,
    task_id: Option<&str>,
    subject: Option<&str>,
    payload: &Value,
) -> Result<String> {
    let id = ids::new_id("obx");
    db::execute(
        "WITH o AS (INSERT INTO ledger.outbox \
                        (tenant_id, workspace_id, id, event_type, run_id, task_id, subject, payload) \
                    VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id) \
         SELECT pg_catalog.pg_notify('ledger_outbox', o.id) FROM o",
        &[
            scope.tenant.as_str().into(),
            scope.workspace.as_str().into(),
            id.as_str().into(),
            event_type.into(),
            run_id.into(),
            task_id.into(),
            subject.into(),
            Jsonb::from(payload).into(),
        ],
    )?;
    Ok(id)
}

pub fn run_exists(scope: &Scope, run_id: &str) -> Result<bool> {
    Ok(db::select_one(
        "SELECT 1 FROM ledger.runs WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &[
            scope.tenant.as_str().into(),
            scope.workspace.as_str().into(),
            run_id.into(),
        ],
        |_| Ok(()),
    )?
    .is_some())
}

pub const MAX_EVENTS_PER_CALL: i32 = 10_000;

/// The run's events after `after_event_id` (from the start when NULL), in seq order.
#[allow(clippy::type_complexity)]
#[pg_extern(stable, parallel_safe, security_definer)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn events_since(
    run_id: Option<&str>,
    after_event_id: default!(Option<&str>, "NULL"),
    max_events: default!(Option<i32>, 1000),
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(event_id, String),
            name!(seq, i64),
            name!(kind, String),
            name!(step_id, Option<String>),
            name!(payload, Jsonb),
            name!(created_at, TimestampWithTimeZone),
        ),
    >,
    ErrorReport,
> {
    let scope = scope::current()?;
    let run_id = run_id.ok_or_else(|| LedgerError::required("run_id"))?;
    ids::validate("run_id", run_id)?;
    let limit = max_events.ok_or_else(|| LedgerError::required("max_events"))?;
    if !(1..=MAX_EVENTS_PER_CALL).contains(&limit) {
        return Err(LedgerError::invalid(
            "LIMIT_INVALID",
            "max_events must be between 1 and 10000",
        )
        .with("argument", "max_events")
        .with("value", limit)
        .into());
    }
    if !run_exists(&scope, run_id)? {
        return Err(LedgerError::not_found("RUN_NOT_FOUND", "run", run_id).into());
    }
    let after = match after_event_id {
        None => 0,
        Some(event_id) => db::select_one(
            "SELECT seq FROM ledger.run_events \
              WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 AND run_id = $4",
            &[
                scope.tenant.as_str().into(),
                scope.workspace.as_str().into(),
                event_id.into(),
                run_id.into(),
            ],
            |r| db::req::<i64>(r, 1),
        )?
        .ok_or_else(|| {
            LedgerError::not_found("EVENT_NOT_FOUND", "event", event_id).with("run_id", run_id)
        })?,
    };
    let rows = db::select(
        "SELECT id, seq, kind, step_id, payload, created_at FROM ledger.run_events \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 AND seq > $4 \
          ORDER BY seq LIMIT $5",
        &[
            scope.tenant.as_str().into(),
            scope.workspace.as_str().into(),
            run_id.into(),
            after.into(),
            i64::from(limit).into(),
        ],
        |r| {
            Ok((
                db::req::<String>(r, 1)?,
                db::req::<i64>(r, 2)?,
                db::req::<String>(r, 3)?,
                db::opt::<String>(r, 4)?,
                db::req::<Jsonb>(r, 5)?,
                db::req::<TimestampWithTimeZone>(r, 6)?,
            ))
        },
    )?;
    Ok(TableIterator::new(rows))
}

/// The NOTIFY channel of a run in the current scope.
#[pg_extern(stable, parallel_safe, security_definer)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn run_channel(run_id: Option<&str>) -> std::result::Result<String, ErrorReport> {
    let scope = scope::current()?;
    let run_id = run_id.ok_or_else(|| LedgerError::required("run_id"))?;
    ids::validate("run_id", run_id)?;
    Ok(hash::run_channel(&scope.tenant, &scope.workspace, run_id))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn setup_run_with_events() {
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        Spi::run("SELECT ledger.transition_run('r', 'running')").unwrap();
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 's')").unwrap();
        Spi::run("SELECT ledger.transition_step('s', 'running')").unwrap();
        Spi::run("SELECT ledger.transition_step('s', 'succeeded')").unwrap();
        Spi::run("SELECT ledger.transition_run('r', 'succeeded')").unwrap();
    }

    #[pg_test]
    fn events_since_reads_from_a_cursor_in_seq_order() {
        set_scope("t-feed", "w");
        setup_run_with_events();
        assert_eq!(
            one::<String>("SELECT string_agg(seq || ':' || kind, ',' ORDER BY seq) FROM ledger.events_since('r')"),
            "1:run.created,2:run.status,3:step.created,4:step.status,5:step.status,6:run.status"
        );
        let cursor = one::<String>("SELECT event_id FROM ledger.events_since('r') WHERE seq = 3");
        assert_eq!(
            one::<String>(&format!("SELECT string_agg(seq::text, ',' ORDER BY seq) FROM ledger.events_since('r', '{cursor}')")),
            "4,5,6"
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT string_agg(seq::text, ',') FROM ledger.events_since('r', '{cursor}', 2)"
            )),
            "4,5"
        );
        let last = one::<String>("SELECT event_id FROM ledger.events_since('r') WHERE seq = 6");
        assert_eq!(
            one::<i64>(&format!(
                "SELECT count(*) FROM ledger.events_since('r', '{last}')"
            )),
            0
        );
        assert!(one::<bool>(
            "SELECT bool_and(event_id LIKE 'evt\\_%') FROM ledger.events_since('r')"
        ));
        assert!(one::<bool>(
            "SELECT step_id = 's' FROM ledger.events_since('r') WHERE seq = 4"
        ));
    }

    #[pg_test]
    fn a_cursor_that_is_not_an_event_of_the_run_is_refused() {
        set_scope("t-feed-cursor", "w");
        setup_run_with_events();
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r2')").unwrap();
        let other = one::<String>("SELECT event_id FROM ledger.events_since('r2')");
        let e = assert_error(
            &format!("SELECT * FROM ledger.events_since('r', '{other}')"),
            "P0002",
            "EVENT_NOT_FOUND",
        );
        assert_eq!(e.detail["run_id"], "r");
        assert_error(
            "SELECT * FROM ledger.events_since('r', 'evt_nope')",
            "P0002",
            "EVENT_NOT_FOUND",
        );
        assert_error(
            "SELECT * FROM ledger.events_since('nope')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_error(
            "SELECT * FROM ledger.events_since('r', NULL, 0)",
            "22023",
            "LIMIT_INVALID",
        );
        assert_error(
            "SELECT * FROM ledger.events_since('r', NULL, 10001)",
            "22023",
            "LIMIT_INVALID",
        );
        assert_error(
            "SELECT * FROM ledger.events_since(NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
    }

    #[pg_test]
    fn run_channels_are_per_scope_and_fit_a_channel_name() {
        set_scope("t-chan", "w");
        let a = one::<String>("SELECT ledger.run_channel('r')");
        assert!(a.starts_with("ledger_run_") && a.len() <= 63);
        let long = "r".repeat(128);
        assert!(one::<String>(&format!("SELECT ledger.run_channel('{long}')")).len() <= 63);
        set_scope("t-chan-2", "w");
        assert_ne!(one::<String>("SELECT ledger.run_channel('r')"), a);
    }

    #[pg_test]
    fn outbox_rows_are_written_with_the_fact() {
        set_scope("t-outbox", "w");
        setup_run_with_events();
        assert_eq!(
            one::<String>("SELECT string_agg(event_type || ':' || status, ',' ORDER BY occurred_at, event_type) FROM ledger.outbox"),
            "run.created:pending,run.status.updated:pending"
        );
        assert!(one::<bool>(
            "SELECT bool_and(id LIKE 'obx\\_%' AND run_id = 'r') FROM ledger.outbox"
        ));
        assert_eq!(
            one::<String>("SELECT payload->>'new_status' FROM ledger.outbox WHERE event_type = 'run.status.updated'"),
            "succeeded"
        );
    }
}
