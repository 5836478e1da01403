//! What waits for people, per scope: calls in doubt, pending approvals, runs stopped by a budget
//! and failed outbox events, each counted with the oldest one's time, so that a person on call
//! learns from one query whether all is well and where to go first.

use crate::db;
use crate::error::{Result, SqlError};
use crate::scope;
use pgrx::prelude::*;

type Row = (
    String,
    String,
    i64,
    Option<TimestampWithTimeZone>,
    i64,
    Option<TimestampWithTimeZone>,
    i64,
    Option<TimestampWithTimeZone>,
    i64,
    Option<TimestampWithTimeZone>,
);

/// The scope's row (all zeros when nothing waits), or with `any_scope` (members of
/// ledger_operator only) one row per scope the session may state that has something waiting,
/// by tenant and workspace.
#[allow(clippy::type_complexity)]
#[pg_extern(stable, parallel_safe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn inbox(
    any_scope: default!(Option<bool>, false),
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(tenant_id, String),
            name!(workspace_id, String),
            name!(calls_in_doubt, i64),
            name!(oldest_in_doubt_at, Option<TimestampWithTimeZone>),
            name!(pending_approvals, i64),
            name!(oldest_approval_at, Option<TimestampWithTimeZone>),
            name!(budget_stops, i64),
            name!(oldest_budget_stop_at, Option<TimestampWithTimeZone>),
            name!(failed_outbox_events, i64),
            name!(oldest_failed_outbox_event_at, Option<TimestampWithTimeZone>),
        ),
    >,
    SqlError,
> {
    Ok(TableIterator::new(rows(any_scope.unwrap_or(false))?))
}

fn rows(any_scope: bool) -> Result<Vec<Row>> {
    const QUERY: &str = "SELECT * FROM ledger_dispatch.inbox($1, $2)";
    if any_scope {
        ledger_model::run_leases::check_any_scope(scope::is_operator()?, None)?;
        return db::select(QUERY, &[None::<&str>.into(), None::<&str>.into()], row);
    }
    let scope = scope::current()?;
    let mut rows = db::select(QUERY, &scope.args([]), row)?;
    if rows.is_empty() {
        let (t, w) = (scope.tenant.clone(), scope.workspace.clone());
        rows.push((t, w, 0, None, 0, None, 0, None, 0, None));
    }
    Ok(rows)
}

fn row(r: &db::Row) -> Result<Row> {
    Ok((
        db::req(r, 1)?,
        db::req(r, 2)?,
        db::req(r, 3)?,
        db::opt(r, 4)?,
        db::req(r, 5)?,
        db::opt(r, 6)?,
        db::req(r, 7)?,
        db::opt(r, 8)?,
        db::req(r, 9)?,
        db::opt(r, 10)?,
    ))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn inbox(args: &str) -> String {
        one::<String>(&format!(
            "SELECT string_agg(concat_ws(':', tenant_id, workspace_id, calls_in_doubt, \
                    round(extract(epoch FROM now() - oldest_in_doubt_at) / 60), pending_approvals, \
                    oldest_approval_at IS NOT NULL, budget_stops, \
                    round(extract(epoch FROM now() - oldest_budget_stop_at) / 60), \
                    failed_outbox_events, \
                    round(extract(epoch FROM now() - oldest_failed_outbox_event_at) / 60)), ' ' \
                    ORDER BY tenant_id, workspace_id) \
               FROM ledger.inbox({args})"
        ))
    }

    /// One row per scope: what waits for a person there, counted, with how long the oldest has
    /// waited; a scope sees its own, an operator every scope with something waiting.
    #[pg_test]
    fn the_inbox_counts_what_waits_for_people_per_scope() {
        set_scope("t-inbox", "a");
        assert_eq!(inbox(""), "t-inbox:a:0:0:f:0:0");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'r1'); \
             SELECT ledger.claim_tool_call('r1', 'crm.lookup', '{}', tool_call_id => 'c1'); \
             SELECT ledger.claim_tool_call('r1', 'crm.lookup', '{\"n\": 2}', tool_call_id => 'c2'); \
             UPDATE ledger.run_step_tool_calls SET status = 'in_doubt', \
                    updated_at = now() - interval '2 hours' WHERE tool_call_id = 'c1'; \
             UPDATE ledger.run_step_tool_calls SET status = 'in_doubt', \
                    updated_at = now() - interval '5 minutes' WHERE tool_call_id = 'c2'; \
             SELECT ledger.request_tool_approval('r1', 'payments.wire', '{\"amount\": 100}', \
                                                tool_call_id => 'pay'); \
             SELECT ledger.create_run('agent', run_id => 'r2'); \
             SELECT ledger.set_budget('tool_calls', 0, 'run', run_id => 'r2'); \
             UPDATE ledger.runs SET status = 'paused', error_code = 'BUDGET_EXHAUSTED', \
                    updated_at = now() - interval '30 minutes' WHERE id = 'r2'; \
             UPDATE ledger.outbox SET status = 'failed', processed_at = now() - interval '1 hour' \
              WHERE id = (SELECT min(id) FROM ledger.outbox)",
        )
        .unwrap();
        assert_eq!(inbox(""), "t-inbox:a:2:120:1:t:1:30:1:60");
        // A raised budget leaves the run to a worker: no person is waited for any more.
        Spi::run("SELECT ledger.set_budget('tool_calls', 5, 'run', run_id => 'r2')").unwrap();
        assert_eq!(inbox(""), "t-inbox:a:2:120:1:t:0:1:60");
        Spi::run("SELECT ledger.set_budget('tool_calls', 0, 'run', run_id => 'r2')").unwrap();
        // An approval past its deadline no longer waits for anyone.
        set_scope("t-inbox", "b");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'r3'); \
             SELECT ledger.request_tool_approval('r3', 'payments.wire', '{}', tool_call_id => 'p3'); \
             SELECT ledger.request_tool_approval('r3', 'payments.wire', '{}', tool_call_id => 'p4', \
                                                expires_in_seconds => 60); \
             UPDATE ledger.approval_requests SET expires_at = now() - interval '1 second' \
              WHERE expires_at IS NOT NULL",
        )
        .unwrap();
        assert_eq!(inbox(""), "t-inbox:b:0:1:t:0:0");
        assert_eq!(
            inbox("any_scope => true"),
            "t-inbox:a:2:120:1:t:1:30:1:60 t-inbox:b:0:1:t:0:0"
        );
        Spi::run("SET LOCAL ROLE ledger_writer").unwrap();
        assert_error(
            "SELECT * FROM ledger.inbox(any_scope => true)",
            "42501",
            "OPERATOR_REQUIRED",
        );
    }
}
