//! Concurrency and rate limits of a key (`ledger.runs.concurrency_key`): at most so many of its
//! runs hold a live lease at once (`set_concurrency_limit`), and at most so many claims of its
//! runs fall in one window of time (`set_rate_limit`). `claim_run` skips the runs of a full key
//! and never waits: under a limit it locks the limit's row with SKIP LOCKED (a claim that finds
//! it locked treats the key as full for now), counts again in a statement of its own and stamps
//! the row, so that two claims cannot both take the last place (in REPEATABLE READ the stamp
//! makes the later one fail 40001).

use crate::db;
use crate::error::{Code, LedgerError, Result, SqlError};
use crate::notifier;
use crate::scope::{self, Scope};
use ledger_model::args::required_label;
use pgrx::prelude::*;

/// The most runs a limit may allow in flight.
const MAX_IN_FLIGHT: i32 = 100_000;
/// The most claims a rate limit may allow per window, and the longest window (a day).
const MAX_PER_WINDOW: i32 = 1_000_000;
const MAX_WINDOW_SECONDS: i32 = 86_400;

/// The runs of the key that count against its limit: not terminal, lease live.
const IN_FLIGHT: &str = "SELECT count(*) FROM ledger.runs \
     WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3 \
       AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired') \
       AND lease_expires_at > clock_timestamp() AND id <> $4";

/// What a claim adds to its candidates (alias `r`, scope in $1 and $2): no key, or a key with
/// room as the claim's snapshot sees it (in flight, and in its rate window), and not one of $3
/// (keys the claim already passed over); `take_place` decides under the limit's lock. The
/// scope's full keys are found once per statement (an uncorrelated subquery), not once per
/// candidate, so a burst of one key's runs stays cheap to skip.
pub const HAS_ROOM: &str = "(r.concurrency_key IS NULL OR (r.concurrency_key <> ALL ($3::text[]) \
     AND r.concurrency_key NOT IN (SELECT l.concurrency_key FROM ledger.concurrency_limits l \
       WHERE l.tenant_id = $1 AND l.workspace_id = $2 \
         AND (l.max_in_flight <= (SELECT count(*) FROM ledger.runs f \
               WHERE f.tenant_id = $1 AND f.workspace_id = $2 \
                 AND f.concurrency_key = l.concurrency_key \
                 AND f.lease_expires_at > clock_timestamp() \
                 AND f.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')) \
           OR (l.max_per_window <= l.window_claims \
               AND l.window_start + make_interval(secs => l.window_seconds) > clock_timestamp())))))";

/// A key's limits as its locked row holds them.
struct Limits {
    max_in_flight: Option<i32>,
    max_per_window: Option<i32>,
    /// The current window has ended (or none began): this claim starts a new one.
    window_over: bool,
    window_claims: i32,
}

/// Whether run `run_id` (locked by the caller, not yet leased) may take a place of `key`'s
/// limits: true when the key has none, or room under its locked row, which is then stamped;
/// false when it is full or another claim holds its row.
pub fn take_place(scope: &Scope, key: &str, run_id: &str) -> Result<bool> {
    // One statement: the limits, locked unless another claim holds them, and whether there are.
    let (locked, limited) = db::write_one(
        "SELECT l.concurrency_key, l.max_in_flight, \
                l.max_per_window, \
                coalesce(l.window_start + make_interval(secs => l.window_seconds) <= clock_timestamp(), true), \
                l.window_claims, e.present \
           FROM (SELECT EXISTS (SELECT 1 FROM ledger.concurrency_limits \
                   WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3) AS present) e \
           LEFT JOIN LATERAL (SELECT * FROM ledger.concurrency_limits \
                   WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3 \
                   FOR NO KEY UPDATE SKIP LOCKED) l ON true",
        &scope.args([key.into()]),
        |r| {
            // The key column is NULL when no row was locked.
            let locked = db::opt::<String>(r, 1)?.is_some();
            let limits = Limits {
                max_in_flight: db::opt(r, 2)?,
                max_per_window: db::opt(r, 3)?,
                window_over: db::opt::<bool>(r, 4)?.unwrap_or(true),
                window_claims: db::opt(r, 5)?.unwrap_or(0),
            };
            Ok((locked.then_some(limits), db::req::<bool>(r, 6)?))
        },
    )?
    .ok_or_else(|| LedgerError::internal("a one-row query returned no row"))?;
    let Some(limits) = locked else {
        // No limit (room), or another claim holds its row (full for now).
        return Ok(!limited);
    };
    if let Some(max) = limits.max_per_window {
        if !limits.window_over && limits.window_claims >= max {
            return Ok(false);
        }
    }
    if let Some(max) = limits.max_in_flight {
        let in_flight = db::select_one(IN_FLIGHT, &scope.args([key.into(), run_id.into()]), |r| {
            db::req::<i64>(r, 1)
        })?
        .unwrap_or(0);
        if in_flight >= i64::from(max) {
            return Ok(false);
        }
    }
    db::execute(
        "UPDATE ledger.concurrency_limits SET claimed_at = $4, \
                window_start = CASE WHEN $5 THEN $4 ELSE window_start END, \
                window_claims = CASE WHEN $5 THEN 1 ELSE window_claims + 1 END \
          WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3",
        &scope.args([
            key.into(),
            db::clock()?.into(),
            (limits.max_per_window.is_some() && limits.window_over).into(),
        ]),
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
    let scope = scope::current()?;
    let key = required_label("concurrency_key", concurrency_key)?;
    let max = max_in_flight
        .map(|m| within("max_in_flight", m, 0, MAX_IN_FLIGHT))
        .transpose()?;
    Ok(set(
        &scope,
        key,
        Limit::InFlight,
        max.is_none(),
        [max, None, None],
    )
    .map(|()| max)?)
}

/// Lets at most `max_claims` claims of `concurrency_key`'s runs fall in each window of
/// `per_seconds` (NULL `max_claims`: removes the rate limit); returns the limit now in force.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn set_rate_limit(
    concurrency_key: Option<&str>,
    max_claims: Option<i32>,
    per_seconds: default!(Option<i32>, "60"),
) -> std::result::Result<Option<i32>, SqlError> {
    let scope = scope::current()?;
    let key = required_label("concurrency_key", concurrency_key)?;
    let max = max_claims
        .map(|m| within("max_claims", m, 0, MAX_PER_WINDOW))
        .transpose()?;
    let window = match max {
        Some(_) => Some(within(
            "per_seconds",
            per_seconds.ok_or_else(|| LedgerError::required("per_seconds"))?,
            1,
            MAX_WINDOW_SECONDS,
        )?),
        None => None,
    };
    Ok(set(&scope, key, Limit::Rate, max.is_none(), [None, max, window]).map(|()| max)?)
}

/// A limit's value in range (22023 `LIMIT_INVALID` naming the argument).
fn within(argument: &str, value: i32, min: i32, max: i32) -> Result<i32> {
    if !(min..=max).contains(&value) {
        return Err(LedgerError::new(
            Code::LimitInvalid,
            format!("{argument} must be between {min} and {max}"),
        )
        .with("argument", argument)
        .with("value", value));
    }
    Ok(value)
}

/// Which of a key's two limits a call sets or removes.
#[derive(Clone, Copy)]
enum Limit {
    InFlight,
    Rate,
}

/// Sets one of the key's limits (`values`: max_in_flight, or max_per_window and window_seconds),
/// or removes it (`removing`; the row goes with its last limit).
fn set(
    scope: &Scope,
    key: &str,
    limit: Limit,
    removing: bool,
    values: [Option<i32>; 3],
) -> Result<()> {
    let [in_flight, per_window, window] = values;
    let now = db::now()?;
    // A raised or removed limit lets runs of the key go on.
    notifier::runs_ready();
    if removing {
        let (drop, clear) = match limit {
            Limit::InFlight => (
                "DELETE FROM ledger.concurrency_limits \
                  WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3 \
                    AND max_per_window IS NULL",
                "UPDATE ledger.concurrency_limits SET max_in_flight = NULL, updated_at = $4 \
                  WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3",
            ),
            Limit::Rate => (
                "DELETE FROM ledger.concurrency_limits \
                  WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3 \
                    AND max_in_flight IS NULL",
                "UPDATE ledger.concurrency_limits SET max_per_window = NULL, window_seconds = NULL, \
                        window_start = NULL, window_claims = 0, updated_at = $4 \
                  WHERE tenant_id = $1 AND workspace_id = $2 AND concurrency_key = $3",
            ),
        };
        db::execute(drop, &scope.args([key.into()]))?;
        return db::execute(clear, &scope.args([key.into(), now.into()]));
    }
    let upsert = match limit {
        Limit::InFlight => {
            "INSERT INTO ledger.concurrency_limits \
                    (tenant_id, workspace_id, concurrency_key, max_in_flight, max_per_window, \
                     window_seconds, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (tenant_id, workspace_id, concurrency_key) \
             DO UPDATE SET max_in_flight = EXCLUDED.max_in_flight, updated_at = EXCLUDED.updated_at"
        }
        Limit::Rate => {
            "INSERT INTO ledger.concurrency_limits \
                    (tenant_id, workspace_id, concurrency_key, max_in_flight, max_per_window, \
                     window_seconds, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) \
             ON CONFLICT (tenant_id, workspace_id, concurrency_key) \
             DO UPDATE SET max_per_window = EXCLUDED.max_per_window, \
                           window_seconds = EXCLUDED.window_seconds, updated_at = EXCLUDED.updated_at"
        }
    };
    db::execute(
        upsert,
        &scope.args([
            key.into(),
            in_flight.into(),
            per_window.into(),
            window.into(),
            now.into(),
        ]),
    )
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

    /// A rate limit lets so many claims of a key's runs fall in a window: the next run of the key
    /// waits for the next window (the claim takes other runs, never waits), also by its id. The
    /// rate and the in-flight limit live side by side; removing one keeps the other.
    #[pg_test]
    fn a_rate_limited_key_is_skipped_until_its_window_ends() {
        set_scope("t-rate", "w");
        assert_eq!(
            one::<i32>("SELECT ledger.set_rate_limit('api-x', 2, 3600)"),
            2
        );
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'a', concurrency_key => 'api-x'); \
             SELECT ledger.create_run('agent', run_id => 'b', concurrency_key => 'api-x'); \
             SELECT ledger.create_run('agent', run_id => 'c', concurrency_key => 'api-x'); \
             SELECT ledger.create_run('agent', run_id => 'free')",
        )
        .unwrap();
        assert_eq!(claim("w1"), "a");
        Spi::run("SELECT ledger.transition_run('a', 'canceled')").unwrap();
        assert_eq!(claim("w2"), "b", "a rate counts claims, not runs in flight");
        Spi::run("SELECT ledger.transition_run('b', 'canceled')").unwrap();
        assert_eq!(claim("w3"), "free", "c waits for the next window");
        assert_eq!(claim("w4"), "none");
        assert_eq!(
            one::<String>(
                "SELECT coalesce((SELECT run_id FROM ledger.claim_run('w4', 'c')), 'none')"
            ),
            "none",
            "not even by its id"
        );
        assert_eq!(
            one::<String>(
                "SELECT window_claims || '/' || max_per_window FROM ledger.concurrency_limits"
            ),
            "2/2"
        );
        // The hour passes: a new window, its first claim.
        Spi::run(
            "UPDATE ledger.concurrency_limits SET window_start = window_start - interval '2 hours'",
        )
        .unwrap();
        assert_eq!(claim("w5"), "c");
        assert_eq!(
            one::<i32>("SELECT window_claims FROM ledger.concurrency_limits"),
            1
        );
        // Both limits on one key; each is removed on its own, and the row with the last.
        Spi::run("SELECT ledger.set_concurrency_limit('api-x', 1)").unwrap();
        assert_eq!(
            one::<String>(
                "SELECT concat_ws(':', max_in_flight, max_per_window, window_seconds) FROM ledger.concurrency_limits"
            ),
            "1:2:3600"
        );
        Spi::run("SELECT ledger.set_rate_limit('api-x', NULL)").unwrap();
        assert_eq!(
            one::<String>(
                "SELECT concat_ws(':', max_in_flight, coalesce(max_per_window, -1), window_claims) FROM ledger.concurrency_limits"
            ),
            "1:-1:0"
        );
        Spi::run("SELECT ledger.set_concurrency_limit('api-x', NULL)").unwrap();
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.concurrency_limits"),
            0
        );
        for (sql, code) in [
            ("SELECT ledger.set_rate_limit('k', -1)", "LIMIT_INVALID"),
            (
                "SELECT ledger.set_rate_limit('k', 1000001)",
                "LIMIT_INVALID",
            ),
            ("SELECT ledger.set_rate_limit('k', 5, 0)", "LIMIT_INVALID"),
            (
                "SELECT ledger.set_rate_limit('k', 5, 86401)",
                "LIMIT_INVALID",
            ),
            (
                "SELECT ledger.set_rate_limit('k', 5, NULL)",
                "ARGUMENT_REQUIRED",
            ),
            ("SELECT ledger.set_rate_limit(NULL, 5)", "ARGUMENT_REQUIRED"),
        ] {
            assert_error(sql, "22023", code);
        }
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.concurrency_limits"),
            0
        );
    }
}
