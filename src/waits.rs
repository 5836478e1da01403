//! Durable waits: a worker parks its run until a time (`wait_run`). The run waits in
//! `waiting_input` with no owner and `not_before` set to the wake time, and `claim_run` hands it
//! out again from then on, so no worker holds it, or polls it, while it waits.

use crate::db;
use crate::error::{LedgerError, Result, SqlError};
use crate::rows::LockedRun;
use crate::run_leases;
use crate::runs::{self, RunEnd};
use crate::scope::{self, Scope};
use ledger_model::status::{check_transition, Resource, Status};
use pgrx::prelude::*;

/// Parks the owner's run until `wake_at`: `waiting_input`, its lease given up (the token is
/// over), claimable from `wake_at` on. Returns the run.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn wait_run(
    run_id: Option<&str>,
    run_token: Option<i64>,
    wake_at: Option<TimestampWithTimeZone>,
) -> std::result::Result<pgrx::composite_type!('static, "ledger.runs"), SqlError> {
    Ok(park(run_id, run_token, wake_at)?)
}

fn park(
    run_id: Option<&str>,
    run_token: Option<i64>,
    wake_at: Option<TimestampWithTimeZone>,
) -> Result<pgrx::composite_type!('static, "ledger.runs")> {
    let scope = scope::current()?;
    let wake_at = wake_at.ok_or_else(|| LedgerError::required("wake_at"))?;
    let run = run_leases::owned(&scope, run_id, run_token)?;
    park_owned(&scope, &run, Some(wake_at))?;
    runs::row(&scope, &run.id)
}

/// Parks the owner's run (locked and fenced by the caller) in `waiting_input` without an owner,
/// claimable from `wake_at` on (None: not before something wakes it).
pub fn park_owned(
    scope: &Scope,
    run: &LockedRun,
    wake_at: Option<TimestampWithTimeZone>,
) -> Result<()> {
    // Already waiting (moved there by transition_run under the lease): only the wake time and
    // the lease change.
    if let Some(from) = check_transition(
        Resource::Run,
        &run.id,
        run.status,
        None,
        Status::WaitingInput,
    )? {
        runs::move_run(scope, run, from, Status::WaitingInput, RunEnd::default())?;
    }
    db::execute(
        "UPDATE ledger.runs SET not_before = coalesce($4, 'infinity'), lease_owner = NULL, \
                lease_expires_at = NULL \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([run.id.as_str().into(), wake_at.into()]),
    )
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn claimed() -> String {
        one::<String>(
            "SELECT coalesce((SELECT run_id || ':' || run_token || ':' || status \
               FROM ledger.claim_run('w')), 'none')",
        )
    }

    /// A run parked until a time is nobody's and is not handed out before it; from then on the
    /// next claim takes it (a new token), and the parking owner's token is over.
    #[pg_test]
    fn a_run_waits_until_its_wake_time_without_an_owner() {
        set_scope("t-wait", "w");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'r'); \
             SELECT ledger.claim_run('w'); \
             SELECT ledger.transition_run('r', 'running', run_token => 1)",
        )
        .unwrap();
        assert_eq!(
            one::<String>(
                "SELECT status || ':' || (lease_owner IS NULL) || ':' || (not_before > now()) \
                   FROM ledger.wait_run('r', 1, clock_timestamp() + interval '1 hour')"
            ),
            "waiting_input:true:true"
        );
        assert_eq!(claimed(), "none");
        assert_error(
            "SELECT ledger.heartbeat_run('r', 1)",
            "40001",
            "LEASE_STALE",
        );
        assert_error(
            "SELECT ledger.wait_run('r', 1, now())",
            "40001",
            "LEASE_STALE",
        );
        // The hour passes.
        Spi::run("UPDATE ledger.runs SET not_before = clock_timestamp() - interval '1 second'")
            .unwrap();
        assert_eq!(claimed(), "r:2:waiting_input");
        assert_eq!(
            one::<String>(
                "SELECT string_agg(payload->>'from' || '>' || (payload->>'to'), ' ' ORDER BY seq) \
                   FROM ledger.run_events WHERE event_type = 'run.status'"
            ),
            "queued>running running>waiting_input"
        );
        assert_eq!(
            one::<String>("SELECT (ledger.transition_run('r', 'running', run_token => 2)).status"),
            "running"
        );
    }

    /// Only a run its owner drives may wait: the status machine and the arguments are checked,
    /// and a refused call changes nothing.
    #[pg_test]
    fn a_wait_is_refused_outside_the_status_machine_or_without_a_time() {
        set_scope("t-wait-refused", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'q'); SELECT ledger.claim_run('w')")
            .unwrap();
        assert_error(
            "SELECT ledger.wait_run('q', 1, now())",
            "55000",
            "TRANSITION_INVALID",
        );
        assert_error(
            "SELECT ledger.wait_run('q', 1, NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error(
            "SELECT ledger.wait_run('q', NULL, now())",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        assert_error(
            "SELECT ledger.wait_run('missing', 1, now())",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_eq!(
            one::<String>(
                "SELECT status || ':' || lease_owner || ':' || (not_before IS NULL) FROM ledger.runs WHERE id = 'q'"
            ),
            "queued:w:true"
        );
    }
}
