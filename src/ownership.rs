//! Run ownership: a worker claims a run (a given one, or the oldest claimable one) with a lease
//! and a fencing token, keeps it with heartbeats and gives it back with a release. The token
//! fences the run's writes that carry it (`rows::LockedRun::fence`). Claiming does not change
//! the run's status: the worker moves it (queued -> running) with `transition_run`.

use crate::db;
use crate::error::{LedgerError, Result, SqlError};
use crate::feed;
use crate::model::args::{optional_id, required_id, required_label};
use crate::model::events::{Event, RunClaimed};
use crate::model::outbox as rules;
use crate::model::run_lease;
use crate::model::tool_call::extend_seconds;
use crate::rows;
use crate::runs;
use crate::scope::{self, Scope};
use pgrx::prelude::*;

type Claimed = pgrx::composite_type!('static, "ledger.claimed_run");

/// The runs a claim may take: not terminal, no live lease, and either waiting to start (queued,
/// retrying) or owned before (a run driven by a caller that never claims it stays its own).
const CLAIMABLE: &str = "SELECT id, lease_owner FROM ledger.runs \
     WHERE tenant_id = $1 AND workspace_id = $2 \
       AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired') \
       AND (lease_expires_at IS NULL OR lease_expires_at <= clock_timestamp()) \
       AND (status IN ('queued', 'retrying') OR run_token > 0)";

/// The filters of a claim: the labels each list may hold (NULL: any).
fn labels(argument: &str, list: Option<Vec<Option<String>>>) -> Result<Option<Vec<String>>> {
    list.map(|items| {
        items
            .into_iter()
            .map(|item| required_label(argument, item.as_deref()).map(str::to_owned))
            .collect()
    })
    .transpose()
}

/// Takes run `run_id`, or the oldest claimable run of the scope matching `modes` and `kinds`,
/// without waiting for a run another transaction holds; None when there is none.
fn claim(
    scope: &Scope,
    run_id: Option<&str>,
    modes: Option<Vec<String>>,
    kinds: Option<Vec<String>>,
    owner: &str,
    lease: i32,
) -> Result<Option<Claimed>> {
    let pick = |r: &db::Row| Ok((db::req::<String>(r, 1)?, db::opt::<String>(r, 2)?));
    let found = match run_id {
        Some(id) => db::write_one(
            &format!("{CLAIMABLE} AND id = $3 FOR NO KEY UPDATE SKIP LOCKED"),
            &scope.args([id.into()]),
            pick,
        )?,
        None => db::write_one(
            &format!(
                "{CLAIMABLE} AND ($3::text[] IS NULL OR mode = ANY ($3)) \
                   AND ($4::text[] IS NULL OR kind = ANY ($4)) \
                 ORDER BY queued_at, id LIMIT 1 FOR NO KEY UPDATE SKIP LOCKED"
            ),
            &scope.args([modes.into(), kinds.into()]),
            pick,
        )?,
    };
    let Some((id, previous_owner)) = found else {
        return Ok(None);
    };
    let run_token = db::write_one(
        "UPDATE ledger.runs SET lease_owner = $4, lease_seconds = $5, \
                lease_expires_at = clock_timestamp() + make_interval(secs => $5), \
                run_token = run_token + 1 \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 RETURNING run_token",
        &scope.args([id.as_str().into(), owner.into(), lease.into()]),
        |r| db::req::<i64>(r, 1),
    )?
    .ok_or_else(|| LedgerError::internal("a locked run was not updated"))?;
    let takeover = previous_owner.is_some();
    feed::append(
        scope,
        &id,
        None,
        &Event::RunClaimed(RunClaimed {
            run_id: &id,
            run_token,
            lease_owner: owner,
            previous_owner: previous_owner.as_deref(),
            takeover,
        }),
    )?;
    let inputs = runs::load_inputs(scope, &id)?;
    db::select_one(
        include_str!("../sql/queries/claimed_run.sql"),
        &scope.args([
            id.as_str().into(),
            takeover.into(),
            previous_owner.into(),
            inputs.into(),
        ]),
        |r| db::req::<Claimed>(r, 1),
    )
}

/// Claims a run for `lease_owner`: run `run_id`, or the oldest claimable run of the scope
/// (with `any_scope`, of every scope: members of ledger_operator only).
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn claim_run(
    lease_owner: Option<&str>,
    run_id: default!(Option<&str>, "NULL"),
    modes: default!(Option<Vec<Option<String>>>, "NULL"),
    kinds: default!(Option<Vec<Option<String>>>, "NULL"),
    lease_seconds: default!(Option<i32>, 60),
    any_scope: default!(Option<bool>, false),
) -> std::result::Result<
    SetOfIterator<'static, pgrx::composite_type!('static, "ledger.claimed_run")>,
    SqlError,
> {
    let owner = required_id("lease_owner", lease_owner)?;
    let run_id = optional_id("run_id", run_id)?;
    let modes = labels("modes", modes)?;
    let kinds = labels("kinds", kinds)?;
    let lease =
        rules::lease_seconds(lease_seconds.ok_or_else(|| LedgerError::required("lease_seconds"))?)?;
    let claimed = if any_scope.unwrap_or(false) {
        run_lease::check_any_scope(scope::is_operator()?, run_id)?;
        // The candidate is found and locked across scopes, then claimed in its own scope, which
        // this function's SET clause takes back at exit.
        let next = db::write_one(
            "SELECT tenant_id, workspace_id, id FROM ledger_dispatch.next_run($1, $2)",
            &[modes.into(), kinds.into()],
            |r| {
                Ok((
                    Scope {
                        tenant: db::req(r, 1)?,
                        workspace: db::req(r, 2)?,
                    },
                    db::req::<String>(r, 3)?,
                ))
            },
        )?;
        match next {
            Some((scope, id)) => {
                scope::enter(&scope)?;
                claim(&scope, Some(&id), None, None, owner, lease)?
            }
            None => None,
        }
    } else {
        let scope = scope::current()?;
        if let Some(id) = run_id {
            rows::run(&scope, "run_id", id)?;
        }
        claim(&scope, run_id, modes, kinds, owner, lease)?
    };
    Ok(SetOfIterator::new(claimed))
}

/// Locks the run and checks the owner's token (40001 `LEASE_STALE`).
fn owned(scope: &Scope, run_id: Option<&str>, run_token: Option<i64>) -> Result<rows::LockedRun> {
    let run_id = required_id("run_id", run_id)?;
    let token = run_token.ok_or_else(|| LedgerError::required("run_token"))?;
    let run = rows::lock_run(scope, "run_id", run_id)?;
    run.fence(Some(token))?;
    Ok(run)
}

/// Extends the owner's lease by `extend_seconds` (default: the claim's lease) from now.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn heartbeat_run(
    run_id: Option<&str>,
    run_token: Option<i64>,
    extend_seconds: default!(Option<i32>, "NULL"),
) -> std::result::Result<TimestampWithTimeZone, SqlError> {
    let scope = scope::current()?;
    let extend = extend_seconds.map(self::extend_seconds).transpose()?;
    let run = owned(&scope, run_id, run_token)?;
    run.ensure_live("heartbeats")?;
    Ok(db::write_one(
        "UPDATE ledger.runs \
            SET lease_expires_at = clock_timestamp() + make_interval(secs => coalesce($4, lease_seconds)) \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 RETURNING lease_expires_at",
        &scope.args([run.id.as_str().into(), extend.into()]),
        |r| db::req::<TimestampWithTimeZone>(r, 1),
    )?
    .ok_or_else(|| LedgerError::internal("a locked run was not updated"))?)
}

/// Gives the run up: it is claimable at once (unless terminal) and the token is over.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn release_run(run_id: Option<&str>, run_token: Option<i64>) -> std::result::Result<(), SqlError> {
    let scope = scope::current()?;
    let run = owned(&scope, run_id, run_token)?;
    db::execute(
        "UPDATE ledger.runs SET lease_owner = NULL, lease_expires_at = NULL \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3",
        &scope.args([run.id.as_str().into()]),
    )?;
    Ok(())
}
