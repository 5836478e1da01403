//! Run leases: a worker claims a run (a given one, or the oldest claimable one) with a lease
//! and a fencing token, keeps it with heartbeats and gives it back with a release. The token
//! fences the run's writes that carry it (`rows::LockedRun::fence`). Claiming does not change
//! the run's status: the worker moves it (queued -> running) with `transition_run`.

use crate::budgets;
use crate::concurrency;
use crate::db;
use crate::error::{LedgerError, Result, SqlError};
use crate::feed;
use crate::notifier;
use crate::rows::{self, HeldRun};
use crate::runs;
use crate::scope::{self, Scope};
use ledger_model::args::{optional_id, required_id, required_label};
use ledger_model::events::{Event, RunClaimed};
use ledger_model::outbox as rules;
use ledger_model::run_leases;
use ledger_model::tool_calls::extend_seconds;
use pgrx::prelude::*;

type Claimed = pgrx::composite_type!('static, "ledger.claimed_run");

/// The runs a claim may take: not terminal, no live lease, due (`not_before` passed), and either
/// waiting to start (queued, retrying) or owned before (a run driven by a caller that never
/// claims it stays its own). Each claim adds `concurrency::HAS_ROOM` ($3: keys it passed over) and
/// `budgets::WITHIN_BUDGET` (a run no budget stops).
const CLAIMABLE: &str = "SELECT id, lease_owner, concurrency_key FROM ledger.runs r \
     WHERE tenant_id = $1 AND workspace_id = $2 \
       AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired') \
       AND (lease_expires_at IS NULL OR lease_expires_at <= clock_timestamp()) \
       AND (not_before IS NULL OR not_before <= clock_timestamp()) \
       AND (status IN ('queued', 'retrying') OR run_token > 0)";

/// Of the claimable runs, those the oldest-first claim hands out: none of its calls waits for a
/// person (in doubt, or for an approval). A worker parks such a run (releases it) and the
/// decision makes it claimable again, so no worker spins on it; `run_id` still takes it. A
/// paused re-run may be parked on a call in doubt in its lineage (it takes its ancestors'
/// records): it waits for that call's decision too.
const WAITS_FOR_NOBODY: &str = "NOT EXISTS (SELECT 1 FROM ledger.run_step_tool_calls t \
     WHERE t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id AND t.run_id = r.id \
       AND t.status = 'in_doubt') \
     AND NOT (r.status = 'paused' AND r.source_run_id IS NOT NULL AND EXISTS ( \
       WITH RECURSIVE up (id, source_run_id) AS ( \
           SELECT s.id, s.source_run_id FROM ledger.runs s \
            WHERE s.tenant_id = r.tenant_id AND s.workspace_id = r.workspace_id \
              AND s.id = r.source_run_id \
           UNION ALL \
           SELECT s.id, s.source_run_id FROM up \
             JOIN ledger.runs s ON s.tenant_id = r.tenant_id \
              AND s.workspace_id = r.workspace_id AND s.id = up.source_run_id) \
       SELECT 1 FROM up JOIN ledger.run_step_tool_calls t \
           ON t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id \
          AND t.run_id = up.id AND t.status = 'in_doubt')) \
     AND NOT EXISTS (SELECT 1 FROM ledger.approval_requests a \
     WHERE a.tenant_id = r.tenant_id AND a.workspace_id = r.workspace_id AND a.run_id = r.id \
       AND a.status = 'pending' AND (a.expires_at IS NULL OR a.expires_at > clock_timestamp()))";

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

/// Takes run `run_id`, or the claimable run of the scope matching `modes` and `kinds` with the
/// highest priority, oldest first within it, without waiting for a run another transaction
/// holds; None when there is none.
fn claim(
    scope: &Scope,
    run_id: Option<&str>,
    modes: Option<Vec<String>>,
    kinds: Option<Vec<String>>,
    owner: &str,
    lease: i32,
) -> Result<Option<Claimed>> {
    let pick = |r: &db::Row| {
        Ok((
            db::req::<String>(r, 1)?,
            db::opt::<String>(r, 2)?,
            db::opt::<String>(r, 3)?,
        ))
    };
    // Keys found full (or held by another claim) are left out of the next look; a run passed
    // over stays locked until the transaction ends, which other claims skip.
    let mut full: Vec<String> = Vec::new();
    let (id, previous_owner) = loop {
        let found = match run_id {
            Some(id) => db::write_one(
                &format!(
                    "{CLAIMABLE} AND {} AND {} AND id = $4 FOR NO KEY UPDATE SKIP LOCKED",
                    concurrency::HAS_ROOM,
                    budgets::WITHIN_BUDGET
                ),
                &scope.args([full.clone().into(), id.into()]),
                pick,
            )?,
            None => db::write_one(
                &format!(
                    "{CLAIMABLE} AND {} AND ($4::text[] IS NULL OR mode = ANY ($4)) \
                       AND ($5::text[] IS NULL OR kind = ANY ($5)) AND {WAITS_FOR_NOBODY} AND {} \
                     ORDER BY priority DESC, queued_at, id LIMIT 1 FOR NO KEY UPDATE SKIP LOCKED",
                    concurrency::HAS_ROOM,
                    budgets::WITHIN_BUDGET
                ),
                &scope.args([
                    full.clone().into(),
                    modes.clone().into(),
                    kinds.clone().into(),
                ]),
                pick,
            )?,
        };
        let Some((id, previous_owner, key)) = found else {
            return Ok(None);
        };
        match key {
            Some(key) if !concurrency::take_place(scope, &key, &id)? => {
                if run_id.is_some() {
                    return Ok(None);
                }
                full.push(key);
            }
            _ => break (id, previous_owner),
        }
    };
    let (run_token, last_seq) = db::write_one(
        "UPDATE ledger.runs SET lease_owner = $4, lease_seconds = $5, \
                lease_expires_at = $6, run_token = run_token + 1 \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 RETURNING run_token, last_seq",
        &scope.args([
            id.as_str().into(),
            owner.into(),
            lease.into(),
            db::clock_plus(lease.into())?.into(),
        ]),
        |r| Ok((db::req::<i64>(r, 1)?, db::req::<i64>(r, 2)?)),
    )?
    .ok_or_else(|| LedgerError::internal("a locked run was not updated"))?;
    let takeover = previous_owner.is_some();
    feed::append(
        scope,
        HeldRun { id: &id, last_seq },
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

/// Claims a run for `lease_owner`: run `run_id`, or the scope's claimable run of the highest
/// priority, oldest first (with `any_scope`, of every scope: members of ledger_operator only).
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
        run_leases::check_any_scope(scope::is_operator()?, run_id)?;
        // The candidate is found and locked across the caller's scopes (its granted ones, when
        // its login role is bound), then claimed in its own scope, which is taken back after.
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
            Some((scope, id)) => scope::within(&scope, || {
                take_turn(&scope)?;
                claim(&scope, Some(&id), None, None, owner, lease)
            })?,
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

/// Stamps the scope as served now: the claim across scopes looks at the others first next time.
/// A candidate that is not taken after all (its key filled up meanwhile) counts as a turn too,
/// so a scope that cannot be served does not stay first. Never waits on a turn another claim
/// holds (that claim stamps it); only two claims taking a never-served scope's first turn at the
/// same moment wait for each other's insert.
fn take_turn(scope: &Scope) -> Result<()> {
    let (held, exists) = db::write_one(
        "SELECT (SELECT true FROM ledger.dispatch_turns WHERE tenant_id = $1 AND workspace_id = $2 \
                    FOR NO KEY UPDATE SKIP LOCKED), \
                EXISTS (SELECT 1 FROM ledger.dispatch_turns WHERE tenant_id = $1 AND workspace_id = $2)",
        &scope.args([]),
        |r| Ok((db::opt::<bool>(r, 1)?.is_some(), db::req::<bool>(r, 2)?)),
    )?
    .unwrap_or((false, false));
    let stamp = match (held, exists) {
        (true, _) => {
            "UPDATE ledger.dispatch_turns SET served_at = $3 WHERE tenant_id = $1 AND workspace_id = $2"
        }
        // The insert's conflict check would wait for a claim that holds the row: leave it be.
        (false, true) => return Ok(()),
        (false, false) => {
            "INSERT INTO ledger.dispatch_turns (tenant_id, workspace_id, served_at) VALUES ($1, $2, $3) \
             ON CONFLICT (tenant_id, workspace_id) DO NOTHING"
        }
    };
    db::execute(stamp, &scope.args([db::clock()?.into()]))
}

/// Locks the run and checks the owner's token (40001 `LEASE_STALE`).
pub fn owned(
    scope: &Scope,
    run_id: Option<&str>,
    run_token: Option<i64>,
) -> Result<rows::LockedRun> {
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
    let until = extend
        .or(run.lease_seconds)
        .map(|s| db::clock_plus(s.into()))
        .transpose()?;
    Ok(db::write_one(
        "UPDATE ledger.runs SET lease_expires_at = $4 \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 RETURNING lease_expires_at",
        &scope.args([run.id.as_str().into(), until.into()]),
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
    notifier::runs_ready();
    Ok(())
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    /// run_id, run_token and takeover of one claim, or "none".
    fn claim(args: &str) -> String {
        one::<String>(&format!(
            "SELECT coalesce((SELECT concat_ws(':', run_id, run_token, takeover, previous_owner) \
               FROM ledger.claim_run({args})), 'none')"
        ))
    }

    /// Lets the lease of run `id` run out.
    fn expire(id: &str) {
        Spi::run(&format!(
            "UPDATE ledger.runs SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE id = '{id}'"
        ))
        .unwrap();
    }

    #[pg_test]
    fn claims_take_the_oldest_claimable_run_of_the_scope() {
        set_scope("t-claim", "w");
        Spi::run(
            "SELECT ledger.create_run('chat', run_id => 'a'); \
             SELECT ledger.create_run('agent', kind => 'triage', run_id => 'b'); \
             SELECT ledger.create_run('chat', run_id => 'legacy'); \
             SELECT ledger.transition_run('legacy', 'running')",
        )
        .unwrap();
        assert_eq!(claim("'w1', modes => ARRAY['agent']"), "b:1:f");
        // A run driven by a caller that never claims it is not taken from them.
        assert_eq!(claim("'w1'"), "a:1:f");
        assert_eq!(claim("'w2'"), "none");
        assert_eq!(claim("'w2', 'legacy'"), "none");
        assert_eq!(claim("'w2', kinds => ARRAY['triage']"), "none");
        // Claiming leaves the status alone and writes run.claimed with the token.
        assert_eq!(
            one::<String>(
                "SELECT string_agg(r.status || ':' || e.payload::text, ' ' ORDER BY r.id) FROM ledger.runs r \
                   JOIN ledger.run_events e ON e.run_id = r.id AND e.event_type = 'run.claimed'"
            ),
            r#"queued:{"run_id": "a", "takeover": false, "run_token": 1, "lease_owner": "w1", "previous_owner": null} queued:{"run_id": "b", "takeover": false, "run_token": 1, "lease_owner": "w1", "previous_owner": null}"#
        );
        // An expired lease is taken over, with a new token, from its owner.
        expire("a");
        assert_eq!(claim("'w2'"), "a:2:t:w1");
        // The claim returns what a resuming worker needs.
        Spi::run("SELECT ledger.create_step('b', 'llm', step_key => 'plan', run_token => 1)")
            .unwrap();
        expire("b");
        Spi::run("CREATE TEMP TABLE claimed AS SELECT * FROM ledger.claim_run('w3', 'b', lease_seconds => 30)")
            .unwrap();
        // The cursor is the feed's newest event: this claim's run.claimed.
        assert_eq!(
            one::<String>(
                "SELECT concat_ws('|', tenant_id, workspace_id, run_id, run_token, lease_owner, status, mode, kind, \
                        steps->0->>'step_key', jsonb_array_length(tool_calls), jsonb_array_length(approvals), \
                        last_event_id = (SELECT id FROM ledger.run_events WHERE run_id = 'b' AND event_type = 'run.claimed' \
                                          ORDER BY seq DESC LIMIT 1), \
                        lease_expires_at > now() + interval '29 seconds' AND lease_expires_at < now() + interval '31 seconds') \
                   FROM claimed"
            ),
            "t-claim|w|b|2|w3|queued|agent|triage|plan|0|0|t|t"
        );
        assert_error(
            "SELECT * FROM ledger.claim_run('w', 'nope')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        // A terminal run is not claimable, and its owner's lease ended.
        Spi::run("SELECT ledger.transition_run('b', 'canceled', run_token => 2)").unwrap();
        assert!(one::<bool>(
            "SELECT lease_expires_at IS NULL FROM ledger.runs WHERE id = 'b'"
        ));
        expire("b");
        assert_eq!(claim("'w4', 'b'"), "none");
    }

    /// The claim takes the highest priority first, oldest (then by id) within one, and no run
    /// before its not_before, not even by its id; a retry keeps its source's priority and waits
    /// for its backoff.
    #[pg_test]
    fn claims_take_the_highest_priority_first_and_no_run_before_its_time() {
        set_scope("t-claim-order", "w");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'old'); \
             SELECT ledger.create_run('agent', run_id => 'later', priority => 100, \
                                      not_before => clock_timestamp() + interval '1 hour'); \
             SELECT ledger.create_run('agent', run_id => 'urgent', priority => 5); \
             SELECT ledger.create_run('agent', run_id => 'low', priority => -5); \
             SELECT ledger.create_run('agent', run_id => 'due', \
                                      not_before => clock_timestamp() - interval '1 second')",
        )
        .unwrap();
        let order: Vec<String> = (1..=5).map(|i| claim(&format!("'w{i}'"))).collect();
        assert_eq!(
            order,
            ["urgent:1:f", "due:1:f", "old:1:f", "low:1:f", "none"]
        );
        assert_eq!(claim("'w6', 'later'"), "none");
        Spi::run("UPDATE ledger.runs SET not_before = clock_timestamp() WHERE id = 'later'")
            .unwrap();
        assert_eq!(claim("'w6'"), "later:1:f");
        // A repeated request returns its run whatever time and priority it computes anew.
        Spi::run("SELECT ledger.create_run('agent', request_id => 'req', run_id => 'once', priority => 3)")
            .unwrap();
        assert_eq!(
            one::<String>(
                "SELECT id || ':' || priority FROM ledger.create_run('agent', request_id => 'req', \
                         run_id => 'once', priority => 4, not_before => clock_timestamp())"
            ),
            "once:3"
        );
        // A retry keeps the priority and is not claimable before its not_before.
        Spi::run(
            "SELECT ledger.transition_run('once', 'failed'); \
             CREATE TEMP TABLE retried AS SELECT * FROM ledger.retry_run('once', \
                 not_before => clock_timestamp() + interval '30 seconds')",
        )
        .unwrap();
        assert_eq!(
            one::<String>(
                "SELECT concat_ws(':', priority, not_before > now() + interval '29 seconds', attempt_no) FROM retried"
            ),
            "3:t:2"
        );
        assert_eq!(claim("'w7'"), "none");
        // The bounds: -1000 to 1000, and a refused run writes nothing.
        for p in ["1001", "-1001"] {
            assert_error(
                &format!("SELECT ledger.create_run('agent', run_id => 'bad', priority => {p})"),
                "22023",
                "PRIORITY_INVALID",
            );
        }
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.runs WHERE id = 'bad'"),
            0
        );
    }

    /// A run parked for a person (a call in doubt or waiting for approval) is not handed out by
    /// the oldest-first claim, so released workers do not spin on it; the decision makes it
    /// claimable again. Its id still takes it.
    #[pg_test]
    fn a_run_waiting_for_a_person_is_handed_out_after_the_decision() {
        set_scope("t-claim-park", "w");
        Spi::run(
            "SELECT ledger.create_run('agent', run_id => 'p'); \
             SELECT ledger.create_run('agent', run_id => 'q')",
        )
        .unwrap();
        assert_eq!(claim("'w1'"), "p:1:f");
        let approval = one::<String>(
            "SELECT ledger.request_tool_approval('p', 'payments.refund', '{\"order\": 7}', tool_call_id => 'refund', run_token => 1)->'approval'->>'id'",
        );
        Spi::run("SELECT ledger.release_run('p', 1)").unwrap();
        assert_eq!(claim("'w2'"), "q:1:f");
        assert_eq!(claim("'w2'"), "none");
        Spi::run(&format!(
            "SELECT ledger.resolve_approval('{approval}', 'approved', actor => 'lead')"
        ))
        .unwrap();
        assert_eq!(claim("'w2'"), "p:2:f");
        // In doubt: parked the same way until a person resolves the call.
        let call = refund_in_doubt(2);
        Spi::run("SELECT ledger.release_run('p', 2)").unwrap();
        assert_eq!(claim("'w3'"), "none");
        assert_eq!(claim("'w3', 'p'"), "p:3:f");
        Spi::run(&format!(
            "SELECT ledger.release_run('p', 3); \
             SELECT ledger.resolve_tool_call('{call}', 'failed', actor => 'ops')"
        ))
        .unwrap();
        assert_eq!(claim("'w3'"), "p:4:f");
    }

    /// Run `p`'s refund call, begun and completed `unknown` under `run_token`: its record id.
    fn refund_in_doubt(run_token: i64) -> String {
        let call = one::<String>(&format!(
            "SELECT ledger.claim_tool_call('p', 'payments.refund', '{{\"order\": 7}}', tool_call_id => 'refund', run_token => {run_token})->'tool_call'->>'id'"
        ));
        Spi::run(&format!(
            "SELECT ledger.begin_tool_call('{call}', 1); \
             SELECT ledger.complete_tool_call('{call}', 1, 'unknown')"
        ))
        .unwrap();
        call
    }

    #[pg_test]
    fn a_rerun_parked_on_a_call_in_doubt_in_its_lineage_waits_for_its_decision() {
        set_scope("t-claim-lineage", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'p')").unwrap();
        assert_eq!(claim("'w1'"), "p:1:f");
        let call = refund_in_doubt(1);
        Spi::run("SELECT ledger.transition_run('p', 'failed', run_token => 1)").unwrap();
        let rerun = one::<String>("SELECT id FROM ledger.retry_run('p')");
        assert_eq!(
            claim("'w1'"),
            format!("{rerun}:1:f"),
            "a fresh re-run starts"
        );
        let out = one::<String>(&format!(
            "SELECT ledger.claim_tool_call('{rerun}', 'payments.refund', '{{\"order\": 7}}', tool_call_id => 'refund', run_token => 1)->>'outcome'"
        ));
        assert_eq!(out, "in_doubt");
        Spi::run(&format!(
            "SELECT ledger.transition_run('{rerun}', 'running', run_token => 1); \
             SELECT ledger.transition_run('{rerun}', 'paused', run_token => 1); \
             SELECT ledger.release_run('{rerun}', 1)"
        ))
        .unwrap();
        for any_scope in ["false", "true"] {
            assert_eq!(
                claim(&format!("'w2', any_scope => {any_scope}")),
                "none",
                "parked, any_scope {any_scope}"
            );
        }
        Spi::run(&format!(
            "SELECT ledger.resolve_tool_call('{call}', 'failed', actor => 'ops')"
        ))
        .unwrap();
        assert_eq!(claim("'w2'"), format!("{rerun}:2:f"));
    }

    #[pg_test]
    fn a_stale_token_writes_nothing_and_no_token_works_as_before() {
        set_scope("t-fence", "w");
        Spi::run("SELECT ledger.create_run('agent', run_id => 'r')").unwrap();
        assert_eq!(claim("'w1'"), "r:1:f");
        Spi::run(
            "SELECT ledger.transition_run('r', 'running', run_token => 1); \
             SELECT ledger.create_step('r', 'llm', step_id => 's', run_token => 1)",
        )
        .unwrap();
        expire("r");
        // Fenced by the token, not the clock: the expired owner still writes ...
        Spi::run("SELECT ledger.transition_step('s', 'running', run_token => 1)").unwrap();
        // ... until someone takes the run over.
        assert_eq!(claim("'w2'"), "r:2:t:w1");
        let events = || one::<i64>("SELECT count(*) FROM ledger.run_events");
        let before = events();
        for call in [
            "SELECT ledger.transition_run('r', 'succeeded', run_token => 1)",
            "SELECT ledger.create_step('r', 'llm', run_token => 1)",
            "SELECT ledger.transition_step('s', 'succeeded', run_token => 1)",
            "SELECT ledger.claim_tool_call('r', 'search', run_token => 1)",
            "SELECT ledger.request_tool_approval('r', 'pay', '{}', run_token => 1)",
            "SELECT ledger.heartbeat_run('r', 1)",
            "SELECT ledger.release_run('r', 1)",
        ] {
            let e = assert_error(call, "40001", "LEASE_STALE");
            assert_eq!(
                (
                    e.detail["run_token"].as_i64(),
                    e.detail["current_run_token"].as_i64()
                ),
                (Some(1), Some(2)),
                "{call}"
            );
        }
        assert_eq!(events(), before);
        assert_eq!(
            one::<String>("SELECT status FROM ledger.run_steps WHERE id = 's'"),
            "running"
        );
        // Callers without a token are not fenced.
        Spi::run("SELECT ledger.create_step('r', 'llm')").unwrap();
        // A heartbeat extends the lease; a release ends the token and frees the run at once.
        assert!(one::<bool>(
            "SELECT ledger.heartbeat_run('r', 2, 600) > now() + interval '599 seconds'"
        ));
        Spi::run("SELECT ledger.release_run('r', 2)").unwrap();
        let e = assert_error(
            "SELECT ledger.create_step('r', 'llm', run_token => 2)",
            "40001",
            "LEASE_STALE",
        );
        assert_eq!(e.detail["lease_released"], true);
        assert_eq!(claim("'w3'"), "r:3:f");
    }

    #[pg_test]
    fn claim_arguments_are_checked() {
        set_scope("t-claim-args", "w");
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        for (call, sqlstate, code) in [
            (
                "SELECT * FROM ledger.claim_run(NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT * FROM ledger.claim_run('w', lease_seconds => 0)",
                "22023",
                "TIMEOUT_INVALID",
            ),
            (
                "SELECT * FROM ledger.claim_run('w', lease_seconds => 86401)",
                "22023",
                "TIMEOUT_INVALID",
            ),
            (
                "SELECT * FROM ledger.claim_run('w', lease_seconds => NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT * FROM ledger.claim_run('w', modes => ARRAY[NULL])",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT * FROM ledger.claim_run('w', 'r', any_scope => true)",
                "22023",
                "ARGUMENT_CONFLICT",
            ),
            (
                "SELECT ledger.heartbeat_run('r', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.heartbeat_run(NULL, 1)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            (
                "SELECT ledger.heartbeat_run('r', 1, 0)",
                "22023",
                "TIMEOUT_INVALID",
            ),
            (
                "SELECT ledger.heartbeat_run('nope', 1)",
                "P0002",
                "RUN_NOT_FOUND",
            ),
            (
                "SELECT ledger.release_run('r', NULL)",
                "22023",
                "ARGUMENT_REQUIRED",
            ),
            // A run nobody claimed has no valid token.
            ("SELECT ledger.release_run('r', 0)", "40001", "LEASE_STALE"),
        ] {
            assert_error(call, sqlstate, code);
        }
        assert_eq!(claim("'w'"), "r:1:f");
        Spi::run("SELECT ledger.transition_run('r', 'canceled')").unwrap();
        assert_error(
            "SELECT ledger.heartbeat_run('r', 1)",
            "55000",
            "RUN_TERMINAL",
        );
        // Across scopes: for members of ledger_operator only.
        Spi::run("SET LOCAL ROLE ledger_writer").unwrap();
        for call in [
            "SELECT * FROM ledger.claim_run('w', any_scope => true)",
            "SELECT * FROM ledger.claim_outbox_events('w', any_scope => true)",
            "SELECT ledger.sweep_tool_calls(any_scope => true)",
        ] {
            assert_error(call, "42501", "OPERATOR_REQUIRED");
        }
    }

    #[pg_test]
    fn scope_grants_bind_a_login_role() {
        assert!(one::<bool>(
            "SELECT ledger.grant_scope(session_user, 't-bound')"
        ));
        assert!(!one::<bool>(
            "SELECT ledger.grant_scope(session_user, 't-bound')"
        ));
        assert!(one::<bool>(
            "SELECT ledger.grant_scope(session_user, 't-other', 'w1')"
        ));
        set_scope("t-bound", "any");
        set_scope("t-other", "w1");
        for (tenant, workspace) in [("t-other", "w2"), ("t-third", "w")] {
            let e = assert_error(
                &format!("SELECT ledger.set_scope('{tenant}', '{workspace}')"),
                "42501",
                "SCOPE_NOT_GRANTED",
            );
            assert_eq!(e.detail["tenant_id"], tenant);
        }
        // The refused call left the scope as it was.
        assert_eq!(one::<String>("SELECT ledger.scope_tenant()"), "t-other");
        // Revoking is exact: the every-workspace grant is the NULL one.
        assert!(!one::<bool>(
            "SELECT ledger.revoke_scope(session_user, 't-bound', 'any')"
        ));
        assert!(one::<bool>(
            "SELECT ledger.revoke_scope(session_user, 't-bound')"
        ));
        assert!(one::<bool>(
            "SELECT ledger.revoke_scope(session_user, 't-other', 'w1')"
        ));
        // No grant left: still bound, to no scope at all (revoking never opens every scope).
        for (tenant, workspace) in [("t-third", "w"), ("t-bound", "any")] {
            assert_error(
                &format!("SELECT ledger.set_scope('{tenant}', '{workspace}')"),
                "42501",
                "SCOPE_NOT_GRANTED",
            );
        }
        // Only an explicit unbind_scope unbinds it.
        assert!(one::<bool>("SELECT ledger.unbind_scope(session_user)"));
        assert!(!one::<bool>("SELECT ledger.unbind_scope(session_user)"));
        set_scope("t-third", "w");
        assert_error(
            "SELECT ledger.unbind_scope('no_such_role')",
            "P0002",
            "ROLE_NOT_FOUND",
        );
        assert_error(
            "SELECT ledger.grant_scope('no_such_role', 't')",
            "P0002",
            "ROLE_NOT_FOUND",
        );
        // Application roles may neither call the grant functions nor read the grants.
        Spi::run("SET LOCAL ROLE ledger_writer").unwrap();
        for call in [
            "SELECT ledger.grant_scope('ledger_writer', 't')",
            "SELECT ledger.revoke_scope('ledger_writer', 't')",
            "SELECT ledger.unbind_scope('ledger_writer')",
            "SELECT count(*) FROM ledger.scope_grants",
            "SELECT count(*) FROM ledger.scope_bindings",
        ] {
            assert_eq!(crate::testing::error_of(call).sqlstate, "42501", "{call}");
        }
    }
}
