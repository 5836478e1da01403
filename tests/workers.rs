//! Multi-session tests of run ownership: workers racing `claim_run`, a takeover after a lease
//! expired with the old owner fenced, an operator claiming runs and outbox events across scopes,
//! and login roles bound to their granted scopes. `#[ignore]`d like every session test;
//! `pgrx-tests/test.sh` runs them with `-- --ignored`.

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
            &format!("DROP ROLE IF EXISTS {name}; CREATE ROLE {name} LOGIN IN ROLE {member_of}"),
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
            "DELETE FROM ledger.scope_grants WHERE grantee::text = '{name}'; \
             DROP OWNED BY {name}; DROP ROLE {name}"
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
    // Without grants the bound role is unbound again.
    exec(
        &mut admin,
        "SELECT ledger.revoke_scope('ledger_test_bound', 'acme', 'support'); \
         SELECT ledger.revoke_scope('ledger_test_bound', 'initech')",
    );
    let mut app = bound.connect();
    exec(&mut app, "SELECT ledger.set_scope('globex', 'support')");
}
