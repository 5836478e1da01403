//! Durable waits: a worker parks its run until a time (`wait_run`), until an input arrives in its
//! mailbox (`wait_for_input`) or until its children have ended (`wait_for_children`). The run
//! waits in `waiting_input` with no owner and `not_before` set to the wake time (infinity when
//! only the mailbox wakes it), and `claim_run` hands it out again from then on, so no worker
//! holds it, or polls it, while it waits.

use crate::db;
use crate::error::{LedgerError, Result, SqlError};
use crate::feed;
use crate::jsonb::Jsonb;
use crate::mailbox;
use crate::rows::LockedRun;
use crate::run_leases;
use crate::runs::{self, RunEnd};
use crate::scope::{self, Scope};
use ledger_model::status::{check_transition, Resource, Status};
use pgrx::prelude::*;
use serde_json::{json, Value};

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

/// Whether `deadline` has passed.
fn passed(deadline: Option<TimestampWithTimeZone>) -> Result<bool> {
    let Some(at) = deadline else { return Ok(false) };
    Ok(at.into_inner() <= db::now()?.into_inner())
}

/// The owner's run waits for input `input_key`: `received` (with the input) when it is there,
/// `timed_out` when `deadline` passed without it, otherwise `waiting`: the run is parked in
/// `waiting_input` with no owner (the token is over), claimable again when the input arrives or
/// at the deadline (none: only the input wakes it).
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn wait_for_input(
    run_id: Option<&str>,
    run_token: Option<i64>,
    input_key: Option<&str>,
    deadline: default!(Option<TimestampWithTimeZone>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| {
        Ok(Jsonb::from(&for_input(
            run_id, run_token, input_key, deadline,
        )?))
    })
}

fn for_input(
    run_id: Option<&str>,
    run_token: Option<i64>,
    input_key: Option<&str>,
    deadline: Option<TimestampWithTimeZone>,
) -> Result<Value> {
    let scope = scope::current()?;
    let key = mailbox::input_key(input_key)?;
    let run = run_leases::owned(&scope, run_id, run_token)?;
    if let Some(mailbox::Slot {
        sha256: Some(_), ..
    }) = mailbox::slot(&scope, &run, key)?
    {
        let input = mailbox::row_json(&scope, &run.id, key)?;
        return Ok(json!({"status": "received", "input": input}));
    }
    if passed(deadline)? {
        return Ok(json!({"status": "timed_out", "input_key": key}));
    }
    run.ensure_live("waits")?;
    mailbox::mark_waiting(&scope, &run, key, deadline)?;
    park_owned(&scope, &run, deadline)?;
    Ok(json!({"status": "waiting", "input": mailbox::row_json(&scope, &run.id, key)?}))
}

/// The owner's run waits for its children (the runs created with it as `parent_run_id`):
/// `done` when every one has ended, `timed_out` when `deadline` passed first, otherwise
/// `waiting`: parked as `wait_for_input` parks it, claimable again when the last child ends or at
/// the deadline. Each answer lists the children with their status, summary and error.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn wait_for_children(
    run_id: Option<&str>,
    run_token: Option<i64>,
    deadline: default!(Option<TimestampWithTimeZone>, "NULL"),
) -> std::result::Result<Jsonb, SqlError> {
    feed::collected(|| Ok(Jsonb::from(&for_children(run_id, run_token, deadline)?)))
}

fn for_children(
    run_id: Option<&str>,
    run_token: Option<i64>,
    deadline: Option<TimestampWithTimeZone>,
) -> Result<Value> {
    let scope = scope::current()?;
    let run = run_leases::owned(&scope, run_id, run_token)?;
    // The run's lock orders this read after every child end that locked it first: a child that
    // ends later finds the wait below and wakes the run.
    let status = if mailbox::running_children(&scope, &run.id)? == 0 {
        "done"
    } else if passed(deadline)? {
        "timed_out"
    } else {
        run.ensure_live("waits")?;
        mailbox::mark_waiting(&scope, &run, mailbox::CHILDREN, deadline)?;
        park_owned(&scope, &run, deadline)?;
        "waiting"
    };
    Ok(json!({"status": status, "children": mailbox::children(&scope, &run.id)?}))
}

/// When a run of the scope (with `any_scope`, of any scope the session may state: members of
/// ledger_operator only) next becomes claimable by the clock alone: a wait's or a backoff's
/// `not_before`, a pending approval's deadline, or the end of a full rate window. NULL when
/// nothing is ahead. An idle worker sleeps until then or until `ledger_runs` is notified, so no
/// one polls a waiting run.
#[pg_extern(stable, parallel_safe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn next_wake(
    any_scope: default!(Option<bool>, false),
) -> std::result::Result<Option<TimestampWithTimeZone>, SqlError> {
    Ok(wake_time(any_scope.unwrap_or(false))?)
}

fn wake_time(any_scope: bool) -> Result<Option<TimestampWithTimeZone>> {
    let read = |r: &db::Row| db::opt::<TimestampWithTimeZone>(r, 1);
    if any_scope {
        ledger_model::run_leases::check_any_scope(scope::is_operator()?, None)?;
        return Ok(db::select_one("SELECT ledger_dispatch.next_wake()", &[], read)?.flatten());
    }
    let scope = scope::current()?;
    Ok(db::select_one(
        include_str!("../sql/queries/next_wake.sql"),
        &scope.args([db::clock()?.into()]),
        read,
    )?
    .flatten())
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

    /// A parent parked on its children is nobody's until the last one ends, whatever order they
    /// end in; then the next claim takes it and the wait answers how each ended. Each end is in
    /// the parent's mailbox too.
    #[pg_test]
    fn a_parent_waits_for_its_children_and_reads_how_they_ended() {
        set_scope("t-children", "w");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'p'); \
             SELECT ledger.claim_run('w', 'p'); \
             SELECT ledger.transition_run('p', 'running', run_token => 1); \
             SELECT ledger.create_run('agent', run_id => 'c1', parent_run_id => 'p'); \
             SELECT ledger.create_run('agent', run_id => 'c2', parent_run_id => 'p')",
        )
        .unwrap();
        let wait = one::<pgrx::JsonB>("SELECT ledger.wait_for_children('p', 1)").0;
        assert_eq!(wait["status"], "waiting");
        assert_eq!(wait["children"][1]["status"], "queued");
        let parent = "SELECT coalesce((SELECT run_id || ':' || run_token FROM ledger.claim_run('w', 'p')), 'none')";
        assert_eq!(one::<String>(parent), "none");
        Spi::run(
            "SELECT ledger.transition_run('c2', 'running'); \
             SELECT ledger.transition_run('c2', 'failed', error_code => 'CARRIER_DOWN')",
        )
        .unwrap();
        assert_eq!(one::<String>(parent), "none");
        Spi::run(
            "SELECT ledger.transition_run('c1', 'running'); \
             SELECT ledger.transition_run('c1', 'succeeded', output_summary => 'refunded')",
        )
        .unwrap();
        assert_eq!(one::<String>(parent), "p:2");
        let done = one::<pgrx::JsonB>("SELECT ledger.wait_for_children('p', 2)").0;
        assert_eq!(done["status"], "done");
        let ended: Vec<String> = done["children"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                format!(
                    "{}:{}:{}",
                    c["run_id"].as_str().unwrap(),
                    c["status"].as_str().unwrap(),
                    c["output_summary"]
                        .as_str()
                        .or(c["error_code"].as_str())
                        .unwrap()
                )
            })
            .collect();
        assert_eq!(ended, ["c1:succeeded:refunded", "c2:failed:CARRIER_DOWN"]);
        assert_eq!(
            one::<String>(
                "SELECT string_agg(input_key || '=' || (payload->>'status'), ' ' ORDER BY input_key) \
                   FROM ledger.run_mailbox WHERE run_id = 'p' AND received_at IS NOT NULL"
            ),
            "ledger:child:c1=succeeded ledger:child:c2=failed"
        );
        // The ledger's keys are its own.
        assert_error(
            "SELECT ledger.send_input('p', 'ledger:child:c1', '{}')",
            "22023",
            "INPUT_KEY_RESERVED",
        );
        assert_error(
            "SELECT ledger.wait_for_input('p', 2, 'ledger:children')",
            "22023",
            "INPUT_KEY_RESERVED",
        );
    }

    /// No children: done at once. A deadline that passed while a child runs: timed_out, and the
    /// owner keeps the run. A child that ends after its parent ended tells no one.
    #[pg_test]
    fn a_wait_for_children_without_children_or_past_its_deadline_returns_at_once() {
        set_scope("t-children-deadline", "w");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'p'); \
             SELECT ledger.claim_run('w', 'p'); \
             SELECT ledger.transition_run('p', 'running', run_token => 1)",
        )
        .unwrap();
        assert_eq!(
            one::<String>("SELECT ledger.wait_for_children('p', 1)::text"),
            r#"{"status": "done", "children": []}"#
        );
        Spi::run("SELECT ledger.create_run('agent', run_id => 'c', parent_run_id => 'p')").unwrap();
        assert_eq!(
            one::<String>(
                "SELECT ledger.wait_for_children('p', 1, clock_timestamp() - interval '1 second')->>'status'"
            ),
            "timed_out"
        );
        Spi::run(
            "SELECT ledger.heartbeat_run('p', 1); \
             SELECT ledger.transition_run('p', 'canceled', run_token => 1); \
             SELECT ledger.transition_run('c', 'canceled')",
        )
        .unwrap();
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.run_mailbox"), 0);
    }

    /// The nearest time ahead at which the clock alone makes a run claimable: a wait's end, an
    /// approval's deadline, a full rate window's end; the scope's own, or any scope's for an
    /// operator; NULL when nothing is ahead.
    #[pg_test]
    fn next_wake_is_the_nearest_wait_deadline_or_window_end_ahead() {
        set_scope("t-wake", "w");
        let ahead = |sql: &str| one::<String>(&format!("SELECT coalesce(({sql})::text, 'none')"));
        let in_seconds = |any: &str| {
            ahead(&format!(
                "SELECT round(extract(epoch FROM ledger.next_wake({any}) - clock_timestamp()))"
            ))
        };
        assert_eq!(ahead("SELECT ledger.next_wake()"), "none");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'r'); \
             SELECT ledger.claim_run('w', 'r'); \
             SELECT ledger.transition_run('r', 'running', run_token => 1); \
             SELECT ledger.wait_run('r', 1, clock_timestamp() + interval '1 hour'); \
             SELECT ledger.create_run('agent', run_id => 'later', \
                                      not_before => clock_timestamp() + interval '2 hours'); \
             SELECT ledger.create_run('agent', run_id => 'now', not_before => clock_timestamp())",
        )
        .unwrap();
        assert_eq!(in_seconds(""), "3600");
        // A pending approval's deadline comes first.
        Spi::run(
            "SELECT ledger.claim_run('w', 'now'); \
             SELECT ledger.transition_run('now', 'running', run_token => 1); \
             SELECT ledger.request_tool_approval('now', 'refund', '{}', run_token => 1, expires_in_seconds => 600)",
        )
        .unwrap();
        assert_eq!(in_seconds(""), "600");
        // Then a full rate window's end.
        Spi::run(
            "SELECT ledger.set_rate_limit('k', 1, 60); \
             SELECT ledger.create_run('agent', run_id => 'k1', concurrency_key => 'k'); \
             SELECT ledger.claim_run('w', 'k1')",
        )
        .unwrap();
        assert_eq!(in_seconds(""), "60");
        // Nothing of another scope counts in this one; an operator sees every scope's.
        set_scope("t-wake", "other");
        assert_eq!(ahead("SELECT ledger.next_wake()"), "none");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'soon', \
                                      not_before => clock_timestamp() + interval '30 seconds')",
        )
        .unwrap();
        assert_eq!(in_seconds(""), "30");
        assert_eq!(in_seconds("any_scope => true"), "30");
        // Runs that ended, and waits that only an input ends, are not ahead.
        Spi::run(
            "SELECT ledger.transition_run('soon', 'canceled'); \
             UPDATE ledger.runs SET not_before = 'infinity' WHERE id = 'r'",
        )
        .unwrap();
        assert_eq!(ahead("SELECT ledger.next_wake()"), "none");
        assert_eq!(in_seconds("any_scope => true"), "60");
        Spi::run("SET LOCAL ROLE ledger_writer").unwrap();
        assert_error(
            "SELECT ledger.next_wake(any_scope => true)",
            "42501",
            "OPERATOR_REQUIRED",
        );
    }
}
