//! Concurrency limits: at most so many runs of a key (`ledger.runs.concurrency_key`) hold a live
//! lease at once. `claim_run` skips the runs of a full key and never waits: under a limit it
//! locks the limit's row with SKIP LOCKED (a claim that finds it locked treats the key as full
//! for now), counts again in a statement of its own and stamps the row, so that two claims
//! cannot both take the last place (in REPEATABLE READ the stamp makes the later one fail 40001).

use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::scope::{self, Scope};
use ledger_model::args::required_label;
use pgrx::prelude::*;

/// The most runs a limit may allow in flight.
const MAX_IN_FLIGHT: i32 = 100_000;

/// The runs of the key that count against its limit: not terminal, lease live.
const IN_FLIGHT: &str = "SELECT count(*) FROM ledger.runs \
     WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3 \
       AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired') \
       AND lease_expires_at > clock_timestamp() AND id <> $4";

/// What a claim adds to its candidates (alias `r`, scope in $1 and $2): no key, or a key with
/// room as the claim's snapshot sees it, and not one of $3 (keys the claim already passed over);
/// `take_place` decides under the limit's lock. The scope's full keys are found once per
/// statement (an uncorrelated subquery), not once per candidate, so a burst of one key's runs
/// stays cheap to skip.
pub const HAS_ROOM: &str = "(r.concurrency_key IS NULL OR (r.concurrency_key <> ALL ($3::text[]) \
     AND r.concurrency_key NOT IN (SELECT l.concurrency_key FROM ledger.concurrency_limits l \
       WHERE l.tenant_id = $1 AND l.workspace_id = $2 \
         AND l.max_in_flight <= (SELECT count(*) FROM ledger.runs f \
               WHERE f.tenant_id = $1 AND f.workspace_id = $2 \
                 AND f.concurrency_key = l.concurrency_key \
                 AND f.lease_expires_at > clock_timestamp() \
                 AND f.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')))))";

/// Whether run `run_id` (locked by the caller, not yet leased) may take a place of `key`'s
/// limit: true when the key has no limit or room under its locked row, which is then stamped;
/// false when it is full or another claim holds its row.
pub fn take_place(scope: &Scope, key: &str, run_id: &str) -> Result<bool> {
    // One statement: the limit, locked unless another claim holds it, and whether there is one.
    let (locked, limited) = db::write_one(
        "SELECT (SELECT max_in_flight FROM ledger.concurrency_limits \
                  WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3 \
                    FOR NO KEY UPDATE SKIP LOCKED), \
                EXISTS (SELECT 1 FROM ledger.concurrency_limits \
                  WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3)",
        &scope.args([key.into()]),
        |r| Ok((db::opt::<i32>(r, 1)?, db::req::<bool>(r, 2)?)),
    )?
    .ok_or_else(|| LedgerError::internal("a one-row query returned no row"))?;
    let Some(max) = locked else {
        // No limit (room), or another claim holds its row (full for now).
        return Ok(!limited);
    };
    let in_flight = db::select_one(IN_FLIGHT, &scope.args([key.into(), run_id.into()]), |r| {
        db::req::<i64>(r, 1)
    })?
    .unwrap_or(0);
    if in_flight >= i64::from(max) {
        return Ok(false);
    }
    db::execute(
        "UPDATE ledger.concurrency_limits SET claimed_at = $4 \
          WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3",
        &scope.args([key.into(), db::clock()?.into()]),
    )?;
    Ok(true)
}

/// Sets the limit of `concurrency_key` (NULL `max_in_flight`: removes it); returns the limit now
/// in force.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn set_concurrency_limit(
    concurrency_key: Option<&str>,
    max_in_flight: Option<i32>,
) -> std::result::Result<Option<i32>, SqlError> {
    Ok(set_limit(concurrency_key, max_in_flight)?)
}

fn set_limit(concurrency_key: Option<&str>, max_in_flight: Option<i32>) -> Result<Option<i32>> {
    let scope = scope::current()?;
    let key = required_label("concurrency_key", concurrency_key)?;
    let Some(max) = max_in_flight else {
        db::execute(
            "DELETE FROM ledger.concurrency_limits \
              WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3",
            &scope.args([key.into()]),
        )?;
        return Ok(None);
    };
    if !(0..=MAX_IN_FLIGHT).contains(&max) {
        return Err(LedgerError::new(
            Code::LimitInvalid,
            "max_in_flight must be between 0 and 100000",
        )
        .with("argument", "max_in_flight")
        .with("value", max));
    }
    db::execute(
        "INSERT INTO ledger.concurrency_limits \
                (tenant_id, workspace_id, concurrency_key, max_in_flight, updated_at) \
         VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (tenant_id, workspace_id, concurrency_key) \
         DO UPDATE SET max_in_flight = EXCLUDED.max_in_flight, updated_at = EXCLUDED.updated_at",
        &scope.args([key.into(), max.into(), db::now()?.into()]),
    )?;
    Ok(Some(max))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn claim(owner: &str) -> String {
        one::<String>(&format!(
            "SELECT coalesce((SELECT run_id FROM ledger.claim_run('{owner}')), 'none')"
        ))
    }

    /// A full key's runs wait (the claim takes the next run without a key, never waits), a
    /// released or finished run frees its place, 0 pauses the key and NULL lifts the limit.
    #[pg_test]
    fn a_full_key_is_skipped_until_one_of_its_runs_lets_go() {
        set_scope("t-limits", "w");
        assert_eq!(
            one::<i32>("SELECT ledger.set_concurrency_limit('customer-7', 1)"),
            1
        );
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'a', concurrency_key => 'customer-7'); \
             SELECT ledger.create_run('agent', run_id => 'b', concurrency_key => 'customer-7'); \
             SELECT ledger.create_run('agent', run_id => 'c', concurrency_key => 'customer-7'); \
             SELECT ledger.create_run('agent', run_id => 'free')",
        )
        .unwrap();
        assert_eq!(claim("w1"), "a");
        assert_eq!(claim("w2"), "free", "b waits: the key is full");
        assert_eq!(claim("w3"), "none");
        assert_eq!(
            one::<String>(
                "SELECT coalesce((SELECT run_id FROM ledger.claim_run('w3', 'b')), 'none')"
            ),
            "none",
            "not even by its id"
        );
        assert!(one::<bool>(
            "SELECT claimed_at IS NOT NULL FROM ledger.concurrency_limits WHERE concurrency_key = 'customer-7'"
        ));
        Spi::run("SELECT ledger.release_run('a', 1)").unwrap();
        assert_eq!(
            claim("w4"),
            "a",
            "a released run frees its place, and is itself the oldest"
        );
        Spi::run("SELECT ledger.transition_run('a', 'canceled')").unwrap();
        assert_eq!(claim("w5"), "b", "a finished run frees its place");
        // Two places; 0 pauses the key; NULL lifts the limit.
        Spi::run("SELECT ledger.transition_run('b', 'canceled')").unwrap();
        assert_eq!(
            one::<i32>("SELECT ledger.set_concurrency_limit('customer-7', 0)"),
            0
        );
        assert_eq!(claim("w6"), "none");
        assert!(one::<bool>(
            "SELECT ledger.set_concurrency_limit('customer-7', NULL) IS NULL"
        ));
        assert_eq!(claim("w6"), "c");
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.concurrency_limits"),
            0
        );
        // A retry keeps the key.
        Spi::run("SELECT ledger.transition_run('c', 'failed')").unwrap();
        assert_eq!(
            one::<String>("SELECT concurrency_key FROM ledger.retry_run('c')"),
            "customer-7"
        );
    }

    #[pg_test]
    fn a_bad_limit_is_refused_and_writes_nothing() {
        set_scope("t-limits-bad", "w");
        for (sql, code) in [
            (
                "SELECT ledger.set_concurrency_limit('k', -1)",
                "LIMIT_INVALID",
            ),
            (
                "SELECT ledger.set_concurrency_limit('k', 100001)",
                "LIMIT_INVALID",
            ),
            (
                "SELECT ledger.set_concurrency_limit(NULL, 1)",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.set_concurrency_limit(E'k\\n', 1)",
                "LABEL_INVALID",
            ),
            (
                "SELECT ledger.create_run('agent', concurrency_key => E'k\\n')",
                "LABEL_INVALID",
            ),
        ] {
            assert_error(sql, "22023", code);
        }
        assert_eq!(
            one::<i64>("SELECT (SELECT count(*) FROM ledger.concurrency_limits) + (SELECT count(*) FROM ledger.runs)"),
            0
        );
    }
}
