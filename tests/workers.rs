//! Multi-session tests of run ownership: workers racing `claim_run` (also under a concurrency
//! limit), a takeover after a lease expired with the old owner fenced, an operator claiming runs
//! and outbox events across scopes, and login roles bound to their granted scopes. `#[ignore]`d
//! like every session test; `pgrx-tests/test.sh` runs them with `-- --ignored`.

mod common;

use common::*;
use postgres::Client;
use std::collections::HashSet;
use std::sync::{Arc, Barrier};
use std::thread;

/// A login role for one test, dropped (with its grants) at the end.
struct LoginRole {
    db: String,
    name: &'static str,
}

impl LoginRole {
    fn create(db: &str, name: &'static str, member_of: &str) -> LoginRole {
        exec(
            &mut connect_to(db, "postgres"),
            &format!(
                "DROP ROLE IF EXISTS \"{name}\"; CREATE ROLE \"{name}\" LOGIN IN ROLE {member_of}"
            ),
        );
        LoginRole {
            db: db.to_owned(),
            name,
        }
    }

    fn connect(&self) -> Client {
        connect_to(&self.db, self.name)
    }
}

impl Drop for LoginRole {
    fn drop(&mut self) {
        let name = self.name;
        let dropped = connect_to(&self.db, "postgres").batch_execute(&format!(
            "SELECT ledger.unbind_scope('{name}'); DROP OWNED BY \"{name}\"; DROP ROLE \"{name}\""
        ));
        if let Err(e) = dropped {
            if !thread::panicking() {
                panic!("dropping {name}: {e}");
            }
        }
    }
}

/// The run ids a worker claims, one claim per transaction, until nothing is left.
fn drain(c: &mut Client, owner: &str) -> Vec<String> {
    let mut claimed = Vec::new();
    loop {
        let rows = c
            .query("SELECT run_id FROM ledger.claim_run($1)", &[&owner])
            .unwrap();
        match rows.first() {
            Some(r) => claimed.push(r.get(0)),
            None => return claimed,
        }
    }
}

/// Two workers drain 60 queued runs at once: each run goes to exactly one of them, with token 1,
/// and neither ever waits (a wait would hit the 2 s statement timeout). A claim of a run another
/// transaction holds returns nothing at once, and a claimed run is not claimable while its lease
/// lives: a run goes to one worker also when both ask for it by id.
#[test]
#[ignore]
fn two_workers_racing_claim_run_each_run_goes_to_exactly_one() {
    let db = database("ledger_workers_race");
    let mut setup = session(&db);
    exec(
        &mut setup,
        "SELECT count(ledger.create_run('agent', run_id => 'r' || i)) FROM generate_series(1, 60) i",
    );
    let start = Arc::new(Barrier::new(2));
    let workers: Vec<_> = ["w1", "w2"]
        .into_iter()
        .map(|owner| {
            let (db, start) = (db.clone(), start.clone());
            thread::spawn(move || {
                let mut c = session(&db);
                exec(&mut c, "SET statement_timeout = '2s'");
                start.wait();
                drain(&mut c, owner)
            })
        })
        .collect();
    let claimed: Vec<Vec<String>> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let (a, b): (HashSet<_>, HashSet<_>) =
        (claimed[0].iter().collect(), claimed[1].iter().collect());
    assert!(a.is_disjoint(&b), "a run went to both workers");
    assert_eq!(a.len() + b.len(), 60);
    assert_eq!(
        claimed[0].len() + claimed[1].len(),
        60,
        "a run was claimed twice"
    );
    let tokens: String = one(
        &mut setup,
        "SELECT string_agg(DISTINCT run_token::text, ',') FROM ledger.runs",
    );
    assert_eq!(tokens, "1");
    let events: i64 = one(
        &mut setup,
        "SELECT count(*) FROM ledger.run_events WHERE event_type = 'run.claimed'",
    );
    assert_eq!(events, 60);

    // The same run, asked for by id by two workers: the first holds it (transaction open), the
    // second gets nothing at once, and nothing either once the first committed its lease.
    exec(
        &mut setup,
        "SELECT ledger.create_run('agent', run_id => 'one')",
    );
    let mut w1 = session(&db);
    let mut w2 = session(&db);
    exec(&mut w2, "SET statement_timeout = '2s'");
    exec(&mut w1, "BEGIN");
    let first = w1
        .query("SELECT run_token FROM ledger.claim_run('w1', 'one')", &[])
        .unwrap();
    assert_eq!(first.len(), 1);
    let busy = w2
        .query("SELECT run_token FROM ledger.claim_run('w2', 'one')", &[])
        .unwrap();
    assert!(busy.is_empty(), "the second worker took a held run");
    // Nor does "the oldest" wait for it.
    let oldest = w2
        .query("SELECT run_id FROM ledger.claim_run('w2')", &[])
        .unwrap();
    assert!(oldest.is_empty());
    exec(&mut w1, "COMMIT");
    let leased = w2
        .query("SELECT run_token FROM ledger.claim_run('w2', 'one')", &[])
        .unwrap();
    assert!(leased.is_empty(), "a live lease was taken");
    let owner: String = one(
        &mut setup,
        "SELECT lease_owner || ':' || run_token FROM ledger.runs WHERE id = 'one'",
    );
    assert_eq!(owner, "w1:1");
}

/// Worker 1 claims a run with a 1-second lease, starts it, adds a step and a tool call, and
/// stalls. Worker 2 takes the run over once the lease expired (token 2, takeover from w1). From
/// then on every write of worker 1 with its old token fails 40001 LEASE_STALE and writes
/// nothing; worker 2 goes on with its own.
#[test]
#[ignore]
fn a_takeover_after_lease_expiry_fences_the_old_owner() {
    let db = database("ledger_workers_takeover");
    let mut w1 = session(&db);
    let mut w2 = session(&db);
    exec(&mut w1, "SELECT ledger.create_run('agent', run_id => 'r')");
    let token: i64 = one(
        &mut w1,
        "SELECT run_token FROM ledger.claim_run('w1', lease_seconds => 1)",
    );
    assert_eq!(token, 1);
    exec(
        &mut w1,
        "SELECT ledger.transition_run('r', 'running', run_token => 1); \
         SELECT ledger.create_step('r', 'llm', step_id => 's1', run_token => 1); \
         SELECT ledger.claim_tool_call('r', 'search', tool_call_id => 'c1', run_token => 1)",
    );
    // Not before the lease ends.
    let early = w2
        .query("SELECT 1 FROM ledger.claim_run('w2')", &[])
        .unwrap();
    assert!(early.is_empty());
    thread::sleep(std::time::Duration::from_millis(1200));
    let row = w2
        .query_one(
            "SELECT run_id, run_token, takeover, previous_owner, status, \
                    jsonb_array_length(steps), tool_calls->0->>'tool_call_id' \
               FROM ledger.claim_run('w2')",
            &[],
        )
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, i64>(1),
            row.get::<_, bool>(2),
            row.get::<_, String>(3),
            row.get::<_, String>(4),
            row.get::<_, i32>(5),
            row.get::<_, String>(6),
        ),
        (
            "r".into(),
            2,
            true,
            "w1".into(),
            "running".into(),
            2,
            "c1".into()
        )
    );

    let mut admin = connect_to(&db, "postgres");
    let tables = [
        "runs",
        "run_steps",
        "run_events",
        "run_step_tool_calls",
        "approval_requests",
        "outbox",
    ];
    let before = table_digests(&mut admin, &tables);
    for sql in [
        "SELECT ledger.transition_run('r', 'succeeded', run_token => 1)",
        "SELECT ledger.create_step('r', 'llm', step_id => 's2', run_token => 1)",
        "SELECT ledger.transition_step('s1', 'succeeded', run_token => 1)",
        "SELECT ledger.claim_tool_call('r', 'search', tool_call_id => 'c2', run_token => 1)",
        "SELECT ledger.request_tool_approval('r', 'pay', '{}', tool_call_id => 'c3', run_token => 1)",
        "SELECT ledger.heartbeat_run('r', 1)",
        "SELECT ledger.release_run('r', 1)",
    ] {
        refused(&mut w1, sql, "40001", "LEASE_STALE");
    }
    assert_eq!(
        table_digests(&mut admin, &tables),
        before,
        "a stale write wrote"
    );

    exec(
        &mut w2,
        "SELECT ledger.create_step('r', 'llm', step_id => 's2', run_token => 2); \
         SELECT ledger.transition_run('r', 'succeeded', run_token => 2)",
    );
    let feed: String = one(
        &mut admin,
        "SELECT string_agg(payload->>'lease_owner' || ':' || (payload->>'run_token') || ':' || (payload->>'takeover'), ' ' ORDER BY seq) \
           FROM ledger.run_events WHERE event_type = 'run.claimed'",
    );
    assert_eq!(feed, "w1:1:false w2:2:true");
    let ended: bool = one(
        &mut admin,
        "SELECT lease_expires_at IS NULL AND status = 'succeeded' FROM ledger.runs WHERE id = 'r'",
    );
    assert!(ended, "a terminal transition ends the lease");
}

/// An operator login role (a member of ledger_operator) with no scope claims the runs and the
/// outbox events of two tenants, each with its scope, and sweeps expired tool-call leases of
/// both; its session has no scope afterwards. A plain writer cannot, with or without a scope.
#[test]
#[ignore]
fn an_operator_claims_runs_and_outbox_events_across_scopes() {
    let db = database("ledger_workers_operator");
    let operator = LoginRole::create(&db, "ledger_test_operator", "ledger_operator");
    let writer = LoginRole::create(&db, "ledger_test_plain_writer", "ledger_writer");
    let mut admin = connect_to(&db, "postgres");
    for tenant in ["acme", "globex"] {
        exec(
            &mut admin,
            &format!(
                "SELECT ledger.set_scope('{tenant}', 'support'); \
                 SELECT ledger.create_run('agent', run_id => 'run-{tenant}'); \
                 SELECT ledger.transition_run('run-{tenant}', 'running'); \
                 SELECT ledger.claim_tool_call('run-{tenant}', 'search', tool_call_id => 'c'); \
                 SELECT ledger.transition_run('run-{tenant}', 'paused'); \
                 SELECT ledger.transition_run('run-{tenant}', 'running')"
            ),
        );
    }
    // And a queued run per tenant for the pool.
    for tenant in ["acme", "globex"] {
        exec(
            &mut admin,
            &format!(
                "SELECT ledger.set_scope('{tenant}', 'support'); \
                 SELECT ledger.create_run('agent', run_id => 'queued-{tenant}')"
            ),
        );
    }

    let mut plain = writer.connect();
    refused(
        &mut plain,
        "SELECT * FROM ledger.claim_run('w')",
        "42501",
        "SCOPE_MISSING",
    );
    for sql in [
        "SELECT * FROM ledger.claim_run('w', any_scope => true)",
        "SELECT * FROM ledger.claim_outbox_events('w', any_scope => true)",
        "SELECT ledger.sweep_tool_calls(any_scope => true)",
    ] {
        refused(&mut plain, sql, "42501", "OPERATOR_REQUIRED");
    }
    exec(&mut plain, "SELECT ledger.set_scope('acme', 'support')");
    refused(
        &mut plain,
        "SELECT * FROM ledger.claim_run('w', any_scope => true)",
        "42501",
        "OPERATOR_REQUIRED",
    );

    let mut op = operator.connect();
    let mut claimed = Vec::new();
    for _ in 0..3 {
        for r in op
            .query(
                "SELECT tenant_id, workspace_id, run_id, run_token FROM ledger.claim_run('pool-1', any_scope => true)",
                &[],
            )
            .unwrap()
        {
            claimed.push(format!(
                "{}/{}/{}:{}",
                r.get::<_, String>(0),
                r.get::<_, String>(1),
                r.get::<_, String>(2),
                r.get::<_, i64>(3)
            ));
        }
    }
    claimed.sort();
    // The running runs nobody claimed stay with their caller.
    assert_eq!(
        claimed,
        [
            "acme/support/queued-acme:1",
            "globex/support/queued-globex:1"
        ]
    );
    let scope: Option<String> = one(&mut op, "SELECT ledger.scope_tenant()");
    assert_eq!(scope, None, "the claim's scope switch outlived it");
    // The worker then works in the row's scope with its token.
    exec(
        &mut op,
        "SELECT ledger.set_scope('globex', 'support'); \
         SELECT ledger.transition_run('queued-globex', 'running', run_token => 1)",
    );

    let events: Vec<String> = op
        .query(
            "SELECT tenant_id || '/' || event_type FROM ledger.claim_outbox_events('pool-1', 100, 60, any_scope => true) ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        events,
        [
            "acme/run.created",
            "acme/run.created",
            "globex/run.created",
            "globex/run.created"
        ]
    );

    // Expired tool-call leases of both tenants, swept by one call.
    exec(
        &mut admin,
        "UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 second'",
    );
    let swept: i32 = one(&mut op, "SELECT ledger.sweep_tool_calls(any_scope => true)");
    assert_eq!(swept, 2);
    let released: i64 = one(
        &mut admin,
        "SELECT count(*) FROM ledger.run_step_tool_calls WHERE lease_expires_at IS NULL",
    );
    assert_eq!(released, 2);
}

/// A login role whose name needs quoting (capitals) is bound like any other: the grant check
/// finds the session's role by its exact name (a lookup that folded it to lower case would find
/// no role, hence no binding, and let it state any scope).
#[test]
#[ignore]
fn a_mixed_case_login_role_is_bound_by_its_grants() {
    let db = database("ledger_workers_mixed_case");
    let bound = LoginRole::create(&db, "Ledger_Test_Mixed", "ledger_writer");
    exec(
        &mut connect_to(&db, "postgres"),
        "SELECT ledger.grant_scope('Ledger_Test_Mixed', 'acme', 'support')",
    );
    let mut app = bound.connect();
    exec(&mut app, "SELECT ledger.set_scope('acme', 'support')");
    refused(
        &mut app,
        "SELECT ledger.set_scope('globex', 'support')",
        "42501",
        "SCOPE_NOT_GRANTED",
    );
}

/// A login role bound by scope grants states only its granted scopes: set_scope refuses any
/// other, SET / set_config / PGOPTIONS / ALTER ROLE ... SET cannot state a scope at all, and
/// SET ROLE to another role does not lift the binding (it is the login role's). An unbound role
/// keeps stating any scope.
#[test]
#[ignore]
fn bound_login_roles_state_only_their_granted_scopes() {
    let db = database("ledger_workers_grants");
    // Without the preload, as a bound role needs none: the library loads at a session's first
    // ledger call, after any scope set by hand.
    let _plain = WithoutPreload::start();
    let bound = LoginRole::create(&db, "ledger_test_bound", "ledger_writer");
    let free = LoginRole::create(&db, "ledger_test_free", "ledger_writer");
    let mut admin = connect_to(&db, "postgres");
    exec(
        &mut admin,
        "SELECT ledger.set_scope('globex', 'support'); \
         SELECT ledger.create_run('agent', run_id => 'globex-secret'); \
         SELECT ledger.grant_scope('ledger_test_bound', 'acme', 'support'); \
         SELECT ledger.grant_scope('ledger_test_bound', 'initech')",
    );

    let mut app = bound.connect();
    exec(&mut app, "SELECT ledger.set_scope('acme', 'support')");
    exec(
        &mut app,
        "SELECT ledger.set_scope('initech', 'any-workspace')",
    );
    exec(&mut app, "SELECT ledger.set_scope('acme', 'support')");
    for sql in [
        "SELECT ledger.set_scope('globex', 'support')",
        "SELECT ledger.set_scope('acme', 'billing')",
        "SELECT ledger.set_scope('globex', 'support', true)",
    ] {
        refused(&mut app, sql, "42501", "SCOPE_NOT_GRANTED");
    }
    for sql in [
        "SET ledger.tenant_id = 'globex'",
        "SET LOCAL ledger.tenant_id = 'globex'",
        "SELECT set_config('ledger.tenant_id', 'globex', false)",
        "SELECT set_config('ledger.workspace_id', 'billing', true)",
    ] {
        refused(&mut app, sql, "42501", "SCOPE_SET_DIRECTLY");
    }
    // The refusals left the granted scope in place.
    let scope: String = one(
        &mut app,
        "SELECT ledger.scope_tenant() || '/' || ledger.scope_workspace()",
    );
    assert_eq!(scope, "acme/support");
    // SET ROLE to a role it is a member of changes nothing: the login role is bound.
    exec(&mut app, "SET ROLE ledger_writer");
    refused(
        &mut app,
        "SELECT ledger.set_scope('globex', 'support')",
        "42501",
        "SCOPE_NOT_GRANTED",
    );
    exec(&mut app, "RESET ROLE");
    // The role may neither read the grants nor change them.
    for sql in [
        "SELECT count(*) FROM ledger.scope_grants",
        "SELECT ledger.grant_scope('ledger_test_bound', 'globex')",
        "SELECT ledger.revoke_scope('ledger_test_bound', 'acme', 'support')",
    ] {
        let err = app.batch_execute(sql).unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("42501"), "{sql}: {err}");
    }

    // Before the library is loaded (nothing preloads it here) the GUCs have no check hook, so a
    // SET or the startup packet's options store the other tenant's scope. The first read of a
    // ledger table loads the library (the policies call its scope functions), which drops the
    // value before any policy reads it.
    let mut app = bound.connect();
    exec(
        &mut app,
        "SET ledger.tenant_id = 'globex'; SET ledger.workspace_id = 'support'",
    );
    let seen: i64 = one(&mut app, "SELECT count(*) FROM ledger.runs");
    assert_eq!(
        seen, 0,
        "a scope SET before the library loaded reached a policy"
    );
    let dropped: Option<String> = one(&mut app, "SELECT current_setting('ledger.tenant_id', true)");
    assert_eq!(dropped.as_deref().unwrap_or(""), "");
    let options = format!(
        "host={} port={} user=ledger_test_bound dbname={db} options='-c ledger.tenant_id=globex -c ledger.workspace_id=support'",
        env("LEDGER_TEST_HOST"),
        env("LEDGER_TEST_PORT")
    );
    let mut app = Client::connect(&options, postgres::NoTls).unwrap();
    let seen: i64 = one(&mut app, "SELECT count(*) FROM ledger.runs");
    assert_eq!(seen, 0);
    let at_login: Option<String> = one(&mut app, "SELECT ledger.scope_tenant()");
    assert_eq!(at_login, None);
    // ALTER ROLE ... SET is refused where the library is loaded.
    exec(&mut admin, "LOAD 'ledger'");
    refused(
        &mut admin,
        "ALTER ROLE ledger_test_bound SET ledger.tenant_id = 'globex'",
        "42501",
        "SCOPE_SET_DIRECTLY",
    );

    // An unbound role states any scope, as before.
    let mut other = free.connect();
    exec(&mut other, "SELECT ledger.set_scope('globex', 'support')");
    let seen: i64 = one(&mut other, "SELECT count(*) FROM ledger.runs");
    assert_eq!(seen, 1);
    // Revoking its last grant leaves the role bound, to no scope at all: never fail open.
    exec(
        &mut admin,
        "SELECT ledger.revoke_scope('ledger_test_bound', 'acme', 'support'); \
         SELECT ledger.revoke_scope('ledger_test_bound', 'initech')",
    );
    for mut app in [bound.connect(), app] {
        for sql in [
            "SELECT ledger.set_scope('globex', 'support')",
            "SELECT ledger.set_scope('acme', 'support')",
            "SELECT ledger.set_scope('initech', 'w', true)",
        ] {
            refused(&mut app, sql, "42501", "SCOPE_NOT_GRANTED");
        }
    }
    // Only the owner's explicit unbind_scope unbinds it.
    let unbound: bool = one(
        &mut admin,
        "SELECT ledger.unbind_scope('ledger_test_bound')",
    );
    assert!(unbound);
    let mut app = bound.connect();
    exec(&mut app, "SELECT ledger.set_scope('globex', 'support')");
}

/// Iteration `n`'s rows: the victim's runs (one of mode probe-m), outbox events and an expired
/// tool-call lease in scope victim/vw, and the operator's own run in gA/wA.
fn victim_and_own_rows(admin: &mut Client, n: usize) {
    exec(
        admin,
        &format!(
            "SELECT ledger.set_scope('victim', 'vw'); \
             SELECT ledger.create_run('probe-m', '{{\"plan\": \"v1\"}}', run_id => 'victim-run-1-{n}'); \
             SELECT ledger.create_run('other-m', '{{\"plan\": \"v2\"}}', run_id => 'victim-run-2-{n}'); \
             SELECT ledger.create_run('agent', run_id => 'victim-calls-{n}'); \
             SELECT ledger.transition_run('victim-calls-{n}', 'running'); \
             SELECT ledger.claim_tool_call('victim-calls-{n}', 'search', tool_call_id => 'c'); \
             UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 second' \
              WHERE run_id = 'victim-calls-{n}'; \
             SELECT ledger.set_scope('gA', 'wA'); \
             SELECT ledger.create_run('own-m', run_id => 'own-run-{n}')"
        ),
    );
}

/// The first column of every row a batch returns, run with the simple protocol (one implicit
/// transaction in autocommit).
fn values(c: &mut Client, batch: &str) -> Vec<Option<String>> {
    c.simple_query(batch)
        .unwrap_or_else(|e| panic!("{batch}: {e}"))
        .into_iter()
        .filter_map(|m| match m {
            postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).map(str::to_owned)),
            _ => None,
        })
        .collect()
}

/// The text of the last row of a batch (see `values`).
fn last_value(c: &mut Client, batch: &str) -> Option<String> {
    values(c, batch).pop().flatten()
}

/// After any cross-scope call returns, the session's scope is exactly what it was before it,
/// in autocommit and inside a transaction block, whether it was a session scope, a
/// transaction-local one or none: nothing later in the transaction reads or writes the claimed
/// row's scope (the tables, run_inputs, create_run), for claim_run, claim_outbox_events and
/// sweep_tool_calls alike.
#[test]
#[ignore]
fn an_operators_cross_scope_call_leaves_the_sessions_scope_as_it_was() {
    let db = database("ledger_workers_scope_back");
    let operator = LoginRole::create(&db, "ledger_test_scope_back", "ledger_operator");
    let mut admin = connect_to(&db, "postgres");
    let calls = [
        "SELECT count(*) FROM ledger.claim_run('op', modes => ARRAY['probe-m'], any_scope => true)",
        "SELECT count(*) FROM ledger.claim_outbox_events('op', 1, any_scope => true)",
        "SELECT ledger.sweep_tool_calls(any_scope => true)::bigint",
    ];
    let mut n = 0;
    for call in calls {
        for block in [true, false] {
            for before in ["session", "local", "none"] {
                n += 1;
                victim_and_own_rows(&mut admin, n);
                let case = format!("{call} (transaction block: {block}, scope before: {before})");
                let mut op = operator.connect();
                if before == "session" {
                    exec(&mut op, "SELECT ledger.set_scope('gA', 'wA')");
                }
                let local = if before == "local" {
                    "SELECT ledger.set_scope('gA', 'wA', true); "
                } else {
                    ""
                };
                // In autocommit the local scope is stated in the same batch as the call.
                let scoped = before != "none";
                let expected = scoped.then(|| "gA".to_owned());
                // What the rest of the transaction sees: the scope, the runs, another tenant's
                // inputs, and where a new run goes.
                let probes = [
                    "SELECT ledger.scope_tenant()".to_owned(),
                    "SELECT string_agg(id, ',') FROM ledger.runs WHERE id LIKE 'victim%'"
                        .to_owned(),
                    format!("SELECT count(*) FROM ledger.runs WHERE id = 'own-run-{n}'"),
                    "SELECT count(*) FROM ledger.outbox WHERE tenant_id = 'victim'".to_owned(),
                ];
                let want = [
                    expected.clone(),
                    None,
                    Some(if scoped { "1" } else { "0" }.to_owned()),
                    Some("0".to_owned()),
                ];
                if block {
                    exec(&mut op, &format!("BEGIN; {local}"));
                    let worked: i64 = one(&mut op, call);
                    assert!(worked >= 1, "{case}: the call found nothing to do");
                    for (probe, want) in probes.iter().zip(&want) {
                        assert_eq!(&last_value(&mut op, probe), want, "{case}: {probe}");
                    }
                } else {
                    // Autocommit: a local scope lasts one statement batch, so the call and the
                    // probes run in one, each after a call that found fresh rows to work on.
                    for (k, (probe, want)) in probes.iter().zip(&want).enumerate() {
                        if k > 0 {
                            victim_and_own_rows(&mut admin, 1000 * k + n);
                        }
                        let got = values(&mut op, &format!("{local}{call}; {probe}"));
                        let worked: i64 = got[got.len() - 2]
                            .as_deref()
                            .and_then(|w| w.parse().ok())
                            .unwrap_or(0);
                        assert!(worked >= 1, "{case}: the call found nothing to do");
                        assert_eq!(&got[got.len() - 1], want, "{case}: {probe}");
                    }
                }
                let (state, code) = if scoped {
                    ("P0002", "RUN_NOT_FOUND")
                } else {
                    ("42501", "SCOPE_MISSING")
                };
                refused(
                    &mut op,
                    &format!("{local}SELECT ledger.run_inputs('victim-run-2-{n}')"),
                    state,
                    code,
                );
                if block {
                    // The refusal aborted the block: again, then a write.
                    exec(&mut op, &format!("ROLLBACK; BEGIN; {local}"));
                    let _: i64 = one(&mut op, call);
                }
                let create =
                    format!("{local}SELECT ledger.create_run('own-m', run_id => 'injected-{n}')");
                if scoped {
                    exec(&mut op, &create);
                } else {
                    refused(&mut op, &create, "42501", "SCOPE_MISSING");
                }
                if block {
                    exec(&mut op, "COMMIT");
                }
                let tenant: Option<String> = one(&mut op, "SELECT ledger.scope_tenant()");
                let after = (before == "session").then(|| "gA".to_owned());
                assert_eq!(tenant, after, "{case}: after the transaction");
                let injected: String = one(
                    &mut admin,
                    &format!(
                        "SELECT coalesce(string_agg(tenant_id, ','), '') FROM ledger.runs WHERE id = 'injected-{n}'"
                    ),
                );
                assert_eq!(
                    injected,
                    if scoped { "gA" } else { "" },
                    "{case}: the new run's scope"
                );
            }
        }
    }
}

/// A bound operator's any_scope means "any of my granted scopes": it claims, leases and sweeps
/// only the runs, outbox events and tool calls of the scopes granted to its login role, leaves
/// every other tenant's alone, and with no grant left reaches none (until unbound).
#[test]
#[ignore]
fn a_bound_operator_works_across_its_granted_scopes_only() {
    let db = database("ledger_workers_bound_operator");
    let operator = LoginRole::create(&db, "ledger_test_bound_operator", "ledger_operator");
    let mut admin = connect_to(&db, "postgres");
    let scopes = [
        ("mine", "w1"),
        ("mine", "w2"),
        ("also", "w"),
        ("victim", "vw"),
    ];
    for (tenant, workspace) in scopes {
        exec(
            &mut admin,
            &format!(
                "SELECT ledger.set_scope('{tenant}', '{workspace}'); \
                 SELECT ledger.create_run('agent', run_id => 'queued'); \
                 SELECT ledger.create_run('agent', run_id => 'calls'); \
                 SELECT ledger.transition_run('calls', 'running'); \
                 SELECT ledger.claim_tool_call('calls', 'search', tool_call_id => 'c')"
            ),
        );
    }
    exec(
        &mut admin,
        "UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 second'; \
         SELECT ledger.grant_scope('ledger_test_bound_operator', 'mine'); \
         SELECT ledger.grant_scope('ledger_test_bound_operator', 'also', 'w')",
    );
    let mut op = operator.connect();
    let victim_untouched = |admin: &mut Client, what: &str| {
        let touched: i64 = one(
            admin,
            "SELECT (SELECT count(*) FROM ledger.runs WHERE tenant_id = 'victim' AND run_token > 0) \
                  + (SELECT count(*) FROM ledger.outbox WHERE tenant_id = 'victim' AND attempt_count > 0) \
                  + (SELECT count(*) FROM ledger.run_step_tool_calls \
                      WHERE tenant_id = 'victim' AND (status <> 'claimed' OR lease_expires_at IS NULL))",
        );
        assert_eq!(touched, 0, "{what} reached the victim's rows");
    };
    let mut claimed: Vec<String> = Vec::new();
    loop {
        let rows = op
            .query(
                "SELECT tenant_id || '/' || workspace_id || '/' || run_id FROM ledger.claim_run('pool', any_scope => true)",
                &[],
            )
            .unwrap();
        match rows.first() {
            Some(r) => claimed.push(r.get(0)),
            None => break,
        }
    }
    claimed.sort();
    assert_eq!(
        claimed,
        ["also/w/queued", "mine/w1/queued", "mine/w2/queued"]
    );
    victim_untouched(&mut admin, "claim_run");
    let events: Vec<String> = op
        .query(
            "SELECT DISTINCT tenant_id FROM ledger.claim_outbox_events('pool', 1000, any_scope => true) ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(events, ["also", "mine"]);
    victim_untouched(&mut admin, "claim_outbox_events");
    let swept: i32 = one(&mut op, "SELECT ledger.sweep_tool_calls(any_scope => true)");
    assert_eq!(swept, 3);
    victim_untouched(&mut admin, "sweep_tool_calls");
    // What waits for people, and when a wait ends next: of its granted scopes only (the
    // victim's wait ends sooner, and a run of it is stopped by a budget too).
    for (tenant, workspace) in scopes {
        exec(
            &mut admin,
            &format!(
                "SELECT ledger.set_scope('{tenant}', '{workspace}'); \
                 SELECT ledger.set_budget('tool_calls', 0, 'run', run_id => 'queued')"
            ),
        );
    }
    exec(
        &mut admin,
        "UPDATE ledger.runs SET status = 'paused', error_code = 'BUDGET_EXHAUSTED' WHERE id = 'queued'; \
         UPDATE ledger.runs SET not_before = now() + interval '1 hour' WHERE id = 'calls'; \
         UPDATE ledger.runs SET not_before = now() + interval '1 minute' \
          WHERE id = 'calls' AND tenant_id = 'victim'",
    );
    let inbox: String = one(
        &mut op,
        "SELECT string_agg(tenant_id || '/' || workspace_id || ':' || budget_stops, ' ' \
                           ORDER BY tenant_id, workspace_id) \
           FROM ledger.inbox(any_scope => true)",
    );
    assert_eq!(inbox, "also/w:1 mine/w1:1 mine/w2:1");
    let wakes_in_an_hour: bool = one(
        &mut op,
        "SELECT ledger.next_wake(any_scope => true) > now() + interval '59 minutes'",
    );
    assert!(wakes_in_an_hour, "next_wake answered the victim's wait");
    // In a transaction block too, the session has no scope after its cross-scope calls.
    exec(&mut op, "BEGIN");
    for call in [
        "SELECT count(*) FROM ledger.claim_run('pool', any_scope => true)",
        "SELECT count(*) FROM ledger.claim_outbox_events('pool', 1000, any_scope => true)",
        "SELECT count(*) FROM (SELECT ledger.sweep_tool_calls(any_scope => true)) s",
    ] {
        let _: i64 = one(&mut op, call);
        let scope: Option<String> = one(&mut op, "SELECT ledger.scope_tenant()");
        assert_eq!(scope, None, "{call}");
    }
    exec(&mut op, "ROLLBACK");

    // With no grant left the role stays bound and reaches no scope.
    exec(
        &mut admin,
        "SELECT ledger.revoke_scope('ledger_test_bound_operator', 'mine'); \
         SELECT ledger.revoke_scope('ledger_test_bound_operator', 'also', 'w'); \
         UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 second' WHERE status = 'claimed'; \
         UPDATE ledger.outbox SET available_at = now(), lease_expires_at = now() - interval '1 second'",
    );
    let runs: i64 = one(
        &mut op,
        "SELECT count(*) FROM ledger.claim_run('pool', any_scope => true)",
    );
    let events: i64 = one(
        &mut op,
        "SELECT count(*) FROM ledger.claim_outbox_events('pool', 1000, any_scope => true)",
    );
    let swept: i32 = one(&mut op, "SELECT ledger.sweep_tool_calls(any_scope => true)");
    assert_eq!((runs, events, swept), (0, 0, 0));
    let (inbox, wake): (i64, Option<std::time::SystemTime>) = (
        one(
            &mut op,
            "SELECT count(*) FROM ledger.inbox(any_scope => true)",
        ),
        one(&mut op, "SELECT ledger.next_wake(any_scope => true)"),
    );
    assert_eq!((inbox, wake), (0, None));
    victim_untouched(&mut admin, "a role with no grant left");
    // An unbound operator reaches every scope, the victim's too.
    exec(
        &mut admin,
        "SELECT ledger.unbind_scope('ledger_test_bound_operator')",
    );
    let swept: i32 = one(&mut op, "SELECT ledger.sweep_tool_calls(any_scope => true)");
    assert_eq!(swept, 4);
    let victims: i64 = one(
        &mut admin,
        "SELECT count(*) FROM ledger.run_step_tool_calls WHERE tenant_id = 'victim' AND lease_expires_at IS NULL",
    );
    assert_eq!(victims, 1);
}

/// What one role gets from one cross-scope path: "refused <SQLSTATE> <code>" or what it reached.
fn outcome(c: &mut Client, sql: &str) -> String {
    match c.query(sql, &[]) {
        Ok(rows) => {
            let mut seen: Vec<String> = rows.iter().map(|r| r.get::<_, String>(0)).collect();
            seen.sort();
            seen.dedup();
            seen.join(",")
        }
        Err(e) => {
            let (state, code) = failure(&e);
            format!("refused {state} {code}").trim_end().to_owned()
        }
    }
}

/// docs/security.md's table, row by row: every role (writer, reader, operator, bound operator,
/// bound writer, a login role with no ledger grant) against every cross-scope path (the three
/// any_scope calls, the monitoring views without a scope and with another tenant's, the run
/// channel, the notifier's counters). Each role gets exactly its cell, and nothing it reached
/// is another tenant's unless the cell says so.
#[test]
#[ignore]
fn every_role_against_every_cross_scope_path() {
    let db = database("ledger_workers_matrix");
    let roles = [
        LoginRole::create(&db, "ledger_m_writer", "ledger_writer"),
        LoginRole::create(&db, "ledger_m_reader", "ledger_reader"),
        LoginRole::create(&db, "ledger_m_operator", "ledger_operator"),
        LoginRole::create(&db, "ledger_m_bound_operator", "ledger_operator"),
        LoginRole::create(&db, "ledger_m_bound_writer", "ledger_writer"),
        LoginRole::create(&db, "ledger_m_no_grant", "pg_monitor"),
    ];
    let mut admin = connect_to(&db, "postgres");
    exec(
        &mut admin,
        "SELECT ledger.grant_scope('ledger_m_bound_operator', 'mine'); \
         SELECT ledger.grant_scope('ledger_m_bound_writer', 'mine')",
    );
    let reset = |admin: &mut Client| {
        // The feed and the audit records have no foreign keys to the runs: truncated by name.
        exec(
            admin,
            "TRUNCATE ledger.runs, ledger.outbox, ledger.run_events, ledger.audit_events CASCADE",
        );
        for tenant in ["mine", "victim"] {
            exec(
                admin,
                &format!(
                    "SELECT ledger.set_scope('{tenant}', 'w'); \
                     SELECT ledger.create_run('agent', run_id => 'queued'); \
                     SELECT ledger.create_run('agent', run_id => 'calls'); \
                     SELECT ledger.transition_run('calls', 'running'); \
                     SELECT ledger.claim_tool_call('calls', 'search', tool_call_id => 'c')"
                ),
            );
        }
        exec(
            admin,
            "UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 second'",
        );
    };
    let paths = [
        // One claim per row (the lease owner makes each call its own), until nothing is left.
        "SELECT c.tenant_id FROM generate_series(1, 4) g, \
                LATERAL ledger.claim_run('w' || g, any_scope => true) c",
        "SELECT tenant_id FROM ledger.claim_outbox_events('w', 1000, any_scope => true)",
        "SELECT ledger.sweep_tool_calls(any_scope => true)::text",
        "SELECT count(*)::text FROM ledger.run_overview",
        "SELECT ledger.set_scope('victim', 'w')::text",
        "SELECT ledger.run_channel('queued')",
        "SELECT 'counters' FROM ledger.notifier_status()",
    ];
    let operator = [
        "mine,victim",
        "mine,victim",
        "2",
        "refused 42501 SCOPE_MISSING",
        "",
        "refused 42501 SCOPE_MISSING",
        "counters",
    ];
    let bound_operator = [
        "mine",
        "mine",
        "1",
        "refused 42501 SCOPE_MISSING",
        "refused 42501 SCOPE_NOT_GRANTED",
        "refused 42501 SCOPE_MISSING",
        "counters",
    ];
    let writer = [
        "refused 42501 OPERATOR_REQUIRED",
        "refused 42501 OPERATOR_REQUIRED",
        "refused 42501 OPERATOR_REQUIRED",
        "refused 42501 SCOPE_MISSING",
        "",
        "refused 42501 SCOPE_MISSING",
        "refused 42501 OPERATOR_REQUIRED",
    ];
    let mut bound_writer = writer;
    bound_writer[4] = "refused 42501 SCOPE_NOT_GRANTED";
    // No EXECUTE on the writers; views, read functions and notifier_status as a writer.
    let reader = [
        "refused 42501",
        "refused 42501",
        "refused 42501",
        "refused 42501 SCOPE_MISSING",
        "",
        "refused 42501 SCOPE_MISSING",
        "refused 42501 OPERATOR_REQUIRED",
    ];
    // No privilege on anything of the ledger's.
    let no_grant = ["refused 42501"; 7];
    let expected = [
        writer,
        reader,
        operator,
        bound_operator,
        bound_writer,
        no_grant,
    ];
    for (role, cells) in roles.iter().zip(expected) {
        for (path, cell) in paths.iter().zip(cells) {
            reset(&mut admin);
            let mut c = role.connect();
            assert_eq!(outcome(&mut c, path), cell, "{} / {path}", role.name);
            // Only the unbound operator reached the victim's rows.
            let touched: i64 = one(
                &mut admin,
                "SELECT (SELECT count(*) FROM ledger.runs WHERE tenant_id = 'victim' AND run_token > 0) \
                      + (SELECT count(*) FROM ledger.outbox WHERE tenant_id = 'victim' AND attempt_count > 0) \
                      + (SELECT count(*) FROM ledger.run_step_tool_calls \
                          WHERE tenant_id = 'victim' AND (lease_expires_at IS NULL OR status <> 'claimed'))",
            );
            // (The unbound operator's sweep of both tenants answers "2".)
            let reaches =
                role.name == "ledger_m_operator" && (cell.contains("victim") || cell == "2");
            assert_eq!(
                touched > 0,
                reaches,
                "{} / {path}: the victim's rows",
                role.name
            );
        }
    }
}

/// A concurrency limit holds under racing claims. Eight workers drain 40 runs of one key under a
/// limit of 3, each claim in a transaction held open until every worker has claimed once: no
/// claim waits (2 s statement timeout), and at no point do more than 3 of the key's runs hold a
/// live lease. In REPEATABLE READ, a claim whose snapshot predates another claim's taking the
/// last place fails 40001 instead of taking a fourth; the limit's row stamp is what makes it
/// fail.
#[test]
#[ignore]
fn racing_claims_never_take_more_places_than_the_concurrency_limit() {
    let db = database("ledger_workers_limit");
    let mut setup = session(&db);
    exec(
        &mut setup,
        "SELECT ledger.set_concurrency_limit('k', 3); \
         SELECT count(ledger.create_run('agent', run_id => 'r' || i, concurrency_key => 'k')) \
           FROM generate_series(1, 40) i",
    );
    let in_flight = "SELECT count(*) FROM ledger.runs WHERE concurrency_key = 'k' \
                       AND lease_expires_at > clock_timestamp() \
                       AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired')";
    let claimed_once = Arc::new(Barrier::new(8));
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let (db, claimed_once) = (db.clone(), claimed_once.clone());
            thread::spawn(move || {
                let mut c = session(&db);
                exec(&mut c, "SET statement_timeout = '2s'");
                exec(&mut c, "BEGIN");
                let got = c
                    .query(
                        "SELECT run_id FROM ledger.claim_run($1)",
                        &[&format!("w{i}")],
                    )
                    .unwrap()
                    .len();
                claimed_once.wait();
                exec(&mut c, "COMMIT");
                got
            })
        })
        .collect();
    let got: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    let leased: i64 = one(&mut setup, in_flight);
    assert!((1..=3).contains(&got), "{got} claims took a place");
    assert_eq!(leased, got as i64);
    // A full key: every further claim, however many race, gets nothing.
    let more: usize = (0..8)
        .map(|i| {
            let db = db.clone();
            thread::spawn(move || {
                let mut c = session(&db);
                exec(&mut c, "SET statement_timeout = '2s'");
                drain(&mut c, &format!("x{i}")).len()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|w| w.join().unwrap())
        .sum();
    let leased: i64 = one(&mut setup, in_flight);
    assert_eq!((got + more, leased), (3, 3));

    // REPEATABLE READ: a's snapshot is taken before b takes the last place of a limit of 1.
    exec(
        &mut setup,
        "SELECT ledger.set_concurrency_limit('one', 1); \
         SELECT ledger.create_run('agent', run_id => 'one-a', concurrency_key => 'one'); \
         SELECT ledger.create_run('agent', run_id => 'one-b', concurrency_key => 'one')",
    );
    let mut a = session(&db);
    exec(
        &mut a,
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM ledger.runs",
    );
    let mut b = session(&db);
    let taken: String = one(&mut b, "SELECT run_id FROM ledger.claim_run('b', 'one-a')");
    assert_eq!(taken, "one-a");
    let refused = a
        .query("SELECT run_id FROM ledger.claim_run('a', 'one-b')", &[])
        .unwrap_err();
    assert_eq!(
        refused.code().map(|c| c.code()),
        Some("40001"),
        "{refused:?}"
    );
    exec(&mut a, "ROLLBACK");
    let leased: i64 = one(
        &mut setup,
        "SELECT count(*) FROM ledger.runs WHERE concurrency_key = 'one' AND lease_expires_at > clock_timestamp()",
    );
    assert_eq!(leased, 1);
}

/// A tenant's budget of tool calls is exact under racing claims: 16 sessions of two workspaces,
/// each claiming a call of its own run in an open transaction, take exactly the budget's 5
/// executions; the rest are answered budget_exhausted and their runs parked. In REPEATABLE
/// READ, a claim whose snapshot predates the last unit's taking fails 40001 instead of passing.
#[test]
#[ignore]
fn racing_claims_never_spend_past_a_budget() {
    let db = database("ledger_workers_budget");
    let mut setup = session(&db);
    let runs = |first: i32, last: i32| {
        format!(
            "SELECT count(ledger.create_run('agent', run_id => 'r' || i)) FROM generate_series({first}, {last}) i; \
             SELECT count(ledger.transition_run('r' || i, 'running')) FROM generate_series({first}, {last}) i;"
        )
    };
    exec(
        &mut setup,
        &format!(
            "SELECT ledger.set_budget('tool_calls', 5, 'tenant'); {} \
             SELECT ledger.set_scope('acme', 'billing'); {} \
             SELECT ledger.set_scope('acme', 'support');",
            runs(0, 7),
            runs(8, 15)
        ),
    );
    // The sixteen claims start together; each holds its transaction open a moment after its
    // decision, so the next ones queue behind the budget's lock instead of running one by one.
    let start = Arc::new(Barrier::new(16));
    let workers: Vec<_> = (0..16)
        .map(|i| {
            let (db, start) = (db.clone(), start.clone());
            thread::spawn(move || {
                let mut c = session(&db);
                if i >= 8 {
                    exec(&mut c, "SELECT ledger.set_scope('acme', 'billing')");
                }
                exec(&mut c, "SET statement_timeout = '20s'");
                start.wait();
                exec(&mut c, "BEGIN");
                let outcome: String = one(
                    &mut c,
                    &format!(
                        "SELECT ledger.claim_tool_call('r{i}', 'mail.send', '{{}}', tool_call_id => 'c')->>'outcome'"
                    ),
                );
                exec(&mut c, "SELECT pg_sleep(0.05); COMMIT");
                outcome
            })
        })
        .collect();
    let outcomes: Vec<String> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let count = |o: &str| outcomes.iter().filter(|x| x.as_str() == o).count();
    assert_eq!(
        (count("claimed"), count("budget_exhausted")),
        (5, 11),
        "{outcomes:?}"
    );
    // What the two workspaces hold (the test's session reads every scope): the calls handed out,
    // and the runs parked by the budget.
    let held = setup
        .query_one(
            "SELECT (SELECT count(*) FROM ledger.run_step_tool_calls WHERE tenant_id = 'acme'), \
                    (SELECT count(*) FROM ledger.runs WHERE tenant_id = 'acme' AND status = 'paused' \
                        AND error_code = 'BUDGET_EXHAUSTED')",
            &[],
        )
        .unwrap();
    assert_eq!((held.get::<_, i64>(0), held.get::<_, i64>(1)), (5, 11));
    let spent: String = one(
        &mut setup,
        "SELECT spent::text FROM ledger.budget_usage WHERE level = 'tenant'",
    );
    assert_eq!(spent, "5");

    // REPEATABLE READ: a's snapshot is taken before b takes the last unit of a workspace's
    // budget with a call of another run (so only the budget's row is shared).
    exec(
        &mut setup,
        "SELECT ledger.set_scope('other', 'rr'); \
         SELECT ledger.set_budget('tool_calls', 1); \
         SELECT ledger.create_run('agent', run_id => 'a'), ledger.create_run('agent', run_id => 'b'); \
         SELECT ledger.transition_run('a', 'running'), ledger.transition_run('b', 'running')",
    );
    let mut a = session(&db);
    exec(&mut a, "SELECT ledger.set_scope('other', 'rr')");
    exec(
        &mut a,
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM ledger.runs",
    );
    let mut b = session(&db);
    exec(&mut b, "SELECT ledger.set_scope('other', 'rr')");
    let taken: String = one(
        &mut b,
        "SELECT ledger.claim_tool_call('b', 'mail.send', '{}', tool_call_id => 'c')->>'outcome'",
    );
    assert_eq!(taken, "claimed");
    let late = a
        .query(
            "SELECT ledger.claim_tool_call('a', 'mail.send', '{}', tool_call_id => 'c')",
            &[],
        )
        .unwrap_err();
    assert_eq!(sqlstate(&late).as_deref(), Some("40001"), "{late:?}");
    exec(&mut a, "ROLLBACK");
    let now: (String, i64) = {
        let row = setup
            .query_one(
                "SELECT (SELECT spent::text FROM ledger.budget_usage WHERE tenant_id = 'other'), \
                        (SELECT count(*) FROM ledger.run_step_tool_calls WHERE tenant_id = 'other')",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(now, ("1".to_owned(), 1));
}

/// Scopes take turns under the operator's claim across scopes: a burst of 10,000 queued runs in
/// one scope, queued first, holds up the runs of two other scopes by at most one claim each
/// (each scope served longest ago goes first), and within a scope the highest priority goes
/// first. Prints the delay and the claim's time at that depth.
#[test]
#[ignore]
fn a_burst_in_one_scope_does_not_hold_up_another_scopes_runs() {
    let db = database("ledger_workers_fair");
    let operator = LoginRole::create(&db, "ledger_test_fair_operator", "ledger_operator");
    let mut admin = connect_to(&db, "postgres");
    exec(
        &mut admin,
        "SELECT ledger.set_scope('burst', 'support'); \
         SELECT count(ledger.create_run('agent', run_id => 'b' || i)) FROM generate_series(1, 10000) i; \
         SELECT ledger.set_scope('quiet', 'support'); \
         SELECT ledger.create_run('agent', run_id => 'q1'); \
         SELECT ledger.create_run('agent', run_id => 'q2', priority => 5); \
         SELECT ledger.set_scope('calm', 'ops'); \
         SELECT ledger.create_run('agent', run_id => 'c1')",
    );
    let mut op = operator.connect();
    let started = std::time::Instant::now();
    let order: Vec<String> = (0..9)
        .map(|_| {
            one::<String>(
                &mut op,
                "SELECT tenant_id || '/' || run_id FROM ledger.claim_run('pool', any_scope => true)",
            )
        })
        .collect();
    let per_claim = started.elapsed() / 9;
    // Never-served scopes first (by name), then the one served longest ago; a scope with nothing
    // left drops out of the turns. (The burst's runs share a queued_at: they go by id.)
    assert_eq!(
        order,
        [
            "burst/b1",
            "calm/c1",
            "quiet/q2",
            "burst/b10",
            "quiet/q1",
            "burst/b100",
            "burst/b1000",
            "burst/b10000",
            "burst/b1001"
        ]
    );
    // A claim holding its scope's turn (its transaction open) holds up no other claim: the next
    // one stamps nothing it cannot lock and takes the scope's next run.
    exec(&mut op, "BEGIN");
    let held: String = one(
        &mut op,
        "SELECT run_id FROM ledger.claim_run('pool', any_scope => true)",
    );
    let mut other = operator.connect();
    exec(&mut other, "SET statement_timeout = '5s'");
    let next: String = one(
        &mut other,
        "SELECT run_id FROM ledger.claim_run('pool-2', any_scope => true)",
    );
    assert_eq!((held.as_str(), next.as_str()), ("b1002", "b1003"));
    exec(&mut op, "COMMIT");
    let waited = |run: &str| order.iter().position(|r| r.ends_with(run)).unwrap_or(9);
    println!(
        "fairness: 10,000 queued runs in one scope; the other scopes' first runs were claims {} and {} \
         (the burst's runs claimed before them: {}); {per_claim:?} per claim at that depth",
        waited("/c1") + 1,
        waited("/q2") + 1,
        order[..waited("/q2")].iter().filter(|r| r.starts_with("burst/")).count()
    );
}

/// A parent parking on its children and its last child ending, in two sessions, in both orders:
/// whichever commits second sees the other, so the parent is never left asleep with every child
/// ended (the run's lock orders them). Each order is forced by holding one transaction open
/// until the other blocks on the parent's lock.
#[test]
#[ignore]
fn a_parent_and_its_last_child_never_miss_each_other() {
    let db = database("ledger_children_race");
    for (i, parent_first) in [true, false].into_iter().enumerate() {
        let (p, c) = (format!("p{i}"), format!("c{i}"));
        let mut setup = session(&db);
        exec(
            &mut setup,
            &format!(
                "SELECT ledger.create_run('agent', run_id => '{p}'); \
                 SELECT ledger.claim_run('w', '{p}'); \
                 SELECT ledger.transition_run('{p}', 'running', run_token => 1); \
                 SELECT ledger.create_run('agent', run_id => '{c}', parent_run_id => '{p}'); \
                 SELECT ledger.transition_run('{c}', 'running')"
            ),
        );
        let (mut first, mut second) = (session(&db), session(&db));
        let park = format!("SELECT ledger.wait_for_children('{p}', 1)->>'status'");
        let end = format!("SELECT ledger.transition_run('{c}', 'succeeded')");
        let (hold, then) = if parent_first {
            (&park, &end)
        } else {
            (&end, &park)
        };
        exec(&mut first, "BEGIN");
        first.query(hold.as_str(), &[]).unwrap();
        let pid: i32 = one(&mut second, "SELECT pg_backend_pid()");
        let then = then.clone();
        let waiter = thread::spawn(move || {
            second
                .query_one(then.as_str(), &[])
                .ok()
                .and_then(|r| r.try_get::<_, String>(0).ok())
        });
        wait_until_blocked(&mut setup, pid);
        exec(&mut first, "COMMIT");
        let answered = waiter.join().unwrap();
        if parent_first {
            let claimed: Option<String> = setup
                .query_opt(
                    &format!("SELECT run_id FROM ledger.claim_run('w', '{p}')"),
                    &[],
                )
                .unwrap()
                .map(|r| r.get(0));
            assert_eq!(
                claimed.as_deref(),
                Some(p.as_str()),
                "the last child woke its parent"
            );
            assert_eq!(
                one::<String>(
                    &mut setup,
                    &format!("SELECT ledger.wait_for_children('{p}', 2)->>'status'")
                ),
                "done"
            );
        } else {
            // The parent asked after the child's end committed: every child has ended.
            assert_eq!(answered.as_deref(), Some("done"));
        }
    }
}

/// Two sweepers firing one schedule: the one that holds it creates every due firing's run, the
/// other skips it without waiting (a statement_timeout proves it), and nothing fires twice.
#[test]
#[ignore]
fn two_sweepers_fire_each_firing_once_and_never_wait() {
    let db = database("ledger_schedule_race");
    let mut setup = session(&db);
    exec(
        &mut setup,
        "SELECT ledger.set_schedule('every-10', '*/10 * * * *', 'agent', catch_up => 'all'); \
         UPDATE ledger.schedules SET next_fire_at = next_fire_at - interval '30 minutes'",
    );
    let (mut first, mut second) = (session(&db), session(&db));
    exec(&mut first, "BEGIN");
    let fired: i32 = one(&mut first, "SELECT ledger.fire_schedules()");
    assert_eq!(fired, 3);
    exec(&mut second, "SET statement_timeout = '5s'");
    let skipped: i32 = one(&mut second, "SELECT ledger.fire_schedules()");
    assert_eq!(skipped, 0, "the held schedule is skipped");
    exec(&mut first, "COMMIT");
    let again: i32 = one(&mut second, "SELECT ledger.fire_schedules()");
    assert_eq!(again, 0, "nothing is due any more");
    let runs: i64 = one(
        &mut setup,
        "SELECT count(DISTINCT request_id) FILTER (WHERE request_id LIKE 'schedule:every-10:%') FROM ledger.runs",
    );
    let all: i64 = one(&mut setup, "SELECT count(*) FROM ledger.runs");
    assert_eq!((runs, all), (3, 3));
}

/// A rate limit holds under racing claims: eight workers, each claim in a transaction held open
/// until all have claimed, drain 20 runs of a key allowed 3 claims an hour. Exactly 3 runs are
/// claimed, no claim waits (2 s statement timeout), and the window counts 3.
#[test]
#[ignore]
fn racing_claims_never_pass_the_rate_limit() {
    let db = database("ledger_workers_rate");
    let mut setup = session(&db);
    exec(
        &mut setup,
        "SELECT ledger.set_rate_limit('api', 3, 3600); \
         SELECT count(ledger.create_run('agent', run_id => 'r' || i, concurrency_key => 'api')) \
           FROM generate_series(1, 20) i",
    );
    let claimed_once = Arc::new(Barrier::new(8));
    let workers: Vec<_> = (0..8)
        .map(|i| {
            let (db, claimed_once) = (db.clone(), claimed_once.clone());
            thread::spawn(move || {
                let mut c = session(&db);
                exec(&mut c, "SET statement_timeout = '2s'");
                exec(&mut c, "BEGIN");
                let first = c
                    .query(
                        "SELECT run_id FROM ledger.claim_run($1)",
                        &[&format!("w{i}")],
                    )
                    .unwrap()
                    .len();
                claimed_once.wait();
                exec(&mut c, "COMMIT");
                first + drain(&mut c, &format!("w{i}")).len()
            })
        })
        .collect();
    let got: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    let claimed: i64 = one(
        &mut setup,
        "SELECT count(*) FROM ledger.runs WHERE run_token > 0",
    );
    let window: i32 = one(
        &mut setup,
        "SELECT window_claims FROM ledger.concurrency_limits",
    );
    assert_eq!((got, claimed, window), (3, 3, 3));
}
