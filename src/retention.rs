//! Retention: purging finished runs with everything that hangs off them, while the
//! idempotency keys of their tool calls stay behind as tombstones, so a late duplicate can
//! never execute again.

use crate::artifacts::blobs;
use crate::db;
use crate::error::{raise, Code, LedgerError, Result, SqlError};
use crate::graph_checkpoints;
use crate::scope::{self, Scope};
use ledger_model::retention::check_older_than;
use pgrx::datum::Interval;
use pgrx::prelude::*;

pub const MAX_BATCH: i32 = 100_000;

/// Up to `limit` purgeable runs, locked: terminal and ended before the cutoff, with no tool call
/// still open (claimed, running, in_doubt, waiting_approval), and referenced by no other run or
/// task. Runs referenced by a newer attempt go once that attempt has gone (leaf first).
fn candidates(scope: &Scope, older_than: &Interval, limit: i32) -> Result<Vec<String>> {
    db::write_one(
        include_str!("../sql/queries/purgeable_runs.sql"),
        &scope.args([(*older_than).into(), limit.into()]),
        |r| db::req::<Vec<String>>(r, 1),
    )
    .map(Option::unwrap_or_default)
}

/// The tables whose rows of a run go with it, in the order they are deleted (before the runs).
const RUN_ROWS: [&str; 11] = [
    "run_step_tool_calls",
    "run_mailbox",
    "approval_requests",
    "run_cost_entries",
    "audit_events",
    "response_events",
    "citations",
    "run_feedback",
    "run_events",
    "run_artifacts",
    "run_steps",
];

/// Deletes the runs `ids` and every row that hangs off them, keeping tool-call tombstones.
fn purge(scope: &Scope, ids: Vec<String>) -> Result<()> {
    let run = |sql: &str| db::execute(sql, &scope.args([ids.clone().into()]));
    run(include_str!("../sql/queries/keep_tool_call_tombstones.sql"))?;
    graph_checkpoints::delete_for_purged_runs(scope, &ids)?;
    for table in RUN_ROWS {
        run(&format!(
            "DELETE FROM ledger.{table} \
              WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = ANY($3)"
        ))?;
    }
    // Delivered facts go; undelivered ones stay for their consumers, detached from the run.
    run("DELETE FROM ledger.outbox \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = ANY($3) AND status = 'done'")?;
    run("UPDATE ledger.outbox SET run_id = NULL \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = ANY($3)")?;
    run("DELETE FROM ledger.runs WHERE tenant_id = $1 AND workspace_id = $2 AND id = ANY($3)")
}

/// Blobs no run input and no artifact refers to any more, swept under the scope's blob lock; while
/// a blob writer holds it, they stay for the next purge.
fn sweep_blobs(scope: &Scope) -> Result<()> {
    if !blobs::try_lock_for_sweep(scope)? {
        return Ok(());
    }
    db::execute(
        include_str!("../sql/queries/sweep_unreferenced_blobs.sql"),
        &scope.args([]),
    )
}

/// Deletes up to `batch` finished runs of the scope that ended more than `older_than` ago, with
/// all their rows and the blobs nothing else refers to; returns how many runs went.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn purge_runs(
    older_than: Option<Interval>,
    batch: default!(Option<i32>, 1000),
) -> std::result::Result<i32, SqlError> {
    let scope = scope::current()?;
    let older_than = older_than.ok_or_else(|| LedgerError::required("older_than"))?;
    let batch = batch.ok_or_else(|| LedgerError::required("batch"))?;
    if !(1..=MAX_BATCH).contains(&batch) {
        raise(
            LedgerError::new(Code::LimitInvalid, "batch must be between 1 and 100000")
                .with("batch", batch),
        );
    }
    check_older_than(older_than.months(), older_than.days(), older_than.micros())?;
    let mut purged = 0;
    while purged < batch {
        let ids = candidates(&scope, &older_than, batch - purged)?;
        if ids.is_empty() {
            break;
        }
        purged += ids.len() as i32;
        purge(&scope, ids)?;
    }
    if purged > 0 {
        sweep_blobs(&scope)?;
    }
    Ok(purged)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn run_sql(sql: &str) {
        Spi::run(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// A finished run with a step, a tool call (its result offloaded), costs, events, outbox rows.
    fn finished_run(id: &str, key: &str) {
        run_sql(&format!("SELECT ledger.create_run('agent', ('{{\"run\": \"{id}\", \"big\": \"' || repeat('i', 9000) || '\"}}')::jsonb, run_id => '{id}')"));
        run_sql(&format!("SELECT ledger.transition_run('{id}', 'running')"));
        let tc = one::<String>(&format!(
            "SELECT ledger.claim_tool_call('{id}', 'send', '{{\"to\": \"x\"}}', idempotency_key => '{key}')->'tool_call'->>'id'"
        ));
        run_sql(&format!("SELECT ledger.begin_tool_call('{tc}', 1)"));
        run_sql(&format!("SELECT ledger.complete_tool_call('{tc}', 1, 'succeeded', jsonb_build_object('run', '{id}', 'r', repeat('r', 9000)))"));
        run_sql(&format!(
            "SELECT ledger.record_cost('{id}', 'tokens', 1, 0.1, 'USD')"
        ));
        run_sql(&format!("SELECT ledger.record_feedback('{id}', 1)"));
        run_sql(&format!(
            "SELECT ledger.transition_run('{id}', 'succeeded')"
        ));
    }

    fn count(table: &str) -> i64 {
        one::<i64>(&format!(
            "SELECT count(*) FROM ledger.{table} WHERE tenant_id = 't-purge'"
        ))
    }

    #[pg_test]
    fn purge_removes_old_runs_and_keeps_tombstones() {
        set_scope("t-purge", "w");
        finished_run("old", "k-old");
        finished_run("new", "k-new");
        run_sql("SELECT ledger.create_run('agent', run_id => 'live')");
        // Make "old" look old; "new" ended just now.
        run_sql("UPDATE ledger.runs SET ended_at = now() - interval '40 days' WHERE tenant_id = 't-purge' AND id = 'old'");
        assert_eq!(count("blobs"), 4);
        assert_eq!(
            one::<i32>("SELECT ledger.purge_runs(interval '30 days')"),
            1
        );
        assert_eq!(
            one::<String>("SELECT string_agg(id, ',' ORDER BY id) FROM ledger.runs"),
            "live,new"
        );
        for table in [
            "run_steps",
            "run_step_tool_calls",
            "run_events",
            "run_artifacts",
            "run_cost_entries",
            "run_feedback",
        ] {
            assert_eq!(
                one::<i64>(&format!(
                    "SELECT count(*) FROM ledger.{table} WHERE run_id = 'old'"
                )),
                0,
                "{table}"
            );
        }
        assert_eq!(
            count("blobs"),
            2,
            "the old run's inputs and result blobs went"
        );
        assert_eq!(
            one::<i32>("SELECT ledger.purge_runs(interval '30 days')"),
            0
        );
        // A late duplicate of the old run's call does not execute.
        let out = one::<pgrx::JsonB>("SELECT ledger.claim_tool_call('live', 'send', '{\"to\": \"x\"}', idempotency_key => 'k-old')").0;
        assert_eq!(out["outcome"], "purged");
        assert_eq!(out["tool_call"]["status"], "succeeded");
        assert_eq!(out["tool_call"]["run_id"], "old");
        assert_error(
            "SELECT ledger.claim_tool_call('live', 'send', '{\"to\": \"y\"}', idempotency_key => 'k-old')",
            "23505",
            "IDEMPOTENCY_MISMATCH",
        );
        assert_error(
            "SELECT ledger.request_tool_approval('live', 'send', '{\"to\": \"x\"}', idempotency_key => 'k-old')",
            "55000",
            "TOOL_CALL_PURGED",
        );
        assert_eq!(count("run_step_tool_calls"), 1);
    }

    #[pg_test]
    fn purge_goes_leaf_first_and_spares_open_calls_and_other_scopes() {
        set_scope("t-purge-other", "w");
        finished_run("theirs", "k-theirs");
        run_sql("UPDATE ledger.runs SET ended_at = now() - interval '40 days' WHERE tenant_id = 't-purge-other'");
        set_scope("t-purge-chain", "w");
        finished_run("a1", "k-a1");
        run_sql("SELECT ledger.replay_run('a1')");
        run_sql("SELECT ledger.transition_run(id, 'canceled') FROM ledger.runs WHERE source_run_id = 'a1'");
        // A run whose tool call is still in doubt is kept.
        run_sql("SELECT ledger.create_run('agent', run_id => 'doubt'), ledger.transition_run('doubt', 'running')");
        let tc =
            one::<String>("SELECT ledger.claim_tool_call('doubt', 'x', '{}')->'tool_call'->>'id'");
        run_sql(&format!(
            "SELECT ledger.complete_tool_call('{tc}', 1, 'unknown')"
        ));
        run_sql("SELECT ledger.transition_run('doubt', 'failed')");
        run_sql("UPDATE ledger.runs SET ended_at = now() - interval '40 days' WHERE tenant_id = 't-purge-chain'");
        // One at a time: the retry goes first, then its source.
        assert_eq!(
            one::<i32>("SELECT ledger.purge_runs(interval '1 day', 1)"),
            1
        );
        assert!(one::<bool>(
            "SELECT EXISTS (SELECT 1 FROM ledger.runs WHERE tenant_id = 't-purge-chain' AND id = 'a1')"
        ));
        assert_eq!(one::<i32>("SELECT ledger.purge_runs(interval '1 day')"), 1);
        // (Tests run as a superuser, which bypasses row-level security: filter by tenant.)
        let left = |t: &str, table: &str| {
            one::<String>(&format!("SELECT coalesce(string_agg(x::text, ','), '') FROM (SELECT count(*) x FROM ledger.{table} WHERE tenant_id = '{t}') c"))
        };
        assert_eq!(
            one::<String>(
                "SELECT string_agg(id, ',') FROM ledger.runs WHERE tenant_id = 't-purge-chain'"
            ),
            "doubt"
        );
        assert_eq!(
            left("t-purge-other", "runs"),
            "1",
            "another scope's runs are untouched"
        );
        assert_eq!(left("t-purge-other", "blobs"), "2");
        assert_error(
            "SELECT ledger.purge_runs(interval '-1 day')",
            "22023",
            "INTERVAL_INVALID",
        );
        // Out of range: now() - older_than would not be a timestamp, however its parts add up.
        for far in [
            "interval '10000 years'",
            "interval '1000 years 1 day'",
            "interval '2147483647 days'",
            "interval '9223372036854775807 microseconds'",
            "interval '178000000 years' - interval '2000000000 days'",
        ] {
            let e = assert_error(
                &format!("SELECT ledger.purge_runs({far})"),
                "22023",
                "INTERVAL_INVALID",
            );
            assert_eq!(
                e.message,
                "ledger: older_than is out of range (at most 1000 years)"
            );
        }
        assert_eq!(
            one::<i32>("SELECT ledger.purge_runs(interval '1000 years')"),
            0
        );
        assert_eq!(
            one::<i32>("SELECT ledger.purge_runs(interval '1 day -1 hour')"),
            0
        );
        assert_error(
            "SELECT ledger.purge_runs(interval '1 day', 0)",
            "22023",
            "LIMIT_INVALID",
        );
        assert_error(
            "SELECT ledger.purge_runs(NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
    }
}
