//! Helpers shared by the multi-session test files: connections to the cluster that
//! `pgrx-tests/test.sh` starts (LEDGER_TEST_HOST, LEDGER_TEST_PORT, LEDGER_TEST_PGDATA,
//! LEDGER_TEST_BINDIR), one fresh database per test, and the server's own programs.
#![allow(dead_code)] // each test file uses a different subset

use postgres::{Client, NoTls};
use std::process::{Command, Stdio};

pub fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set; run pgrx-tests/test.sh"))
}

pub fn connect_to(db: &str, user: &str) -> Client {
    let conn = format!(
        "host={} port={} user={user} dbname={db}",
        env("LEDGER_TEST_HOST"),
        env("LEDGER_TEST_PORT")
    );
    Client::connect(&conn, NoTls).unwrap_or_else(|e| panic!("connect {conn}: {e}"))
}

/// A fresh database with the extension, one per test.
pub fn database(name: &str) -> String {
    let mut admin = connect_to("postgres", "postgres");
    exec(&mut admin, &format!("DROP DATABASE IF EXISTS {name}"));
    exec(&mut admin, &format!("CREATE DATABASE {name}"));
    let mut c = connect_to(name, "postgres");
    exec(&mut c, "CREATE EXTENSION ledger");
    name.to_owned()
}

pub fn session(db: &str) -> Client {
    let mut c = connect_to(db, "postgres");
    exec(&mut c, "SELECT ledger.set_scope('acme', 'support')");
    c
}

pub fn exec(c: &mut Client, sql: &str) {
    c.batch_execute(sql)
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The one value of a one-row query.
pub fn one<T: postgres::types::FromSqlOwned>(c: &mut Client, sql: &str) -> T {
    c.query_one(sql, &[])
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

/// `sql` must fail with SQLSTATE `state` and DETAIL code `code` ("" for PostgreSQL's own errors).
pub fn refused(c: &mut Client, sql: &str, state: &str, code: &str) {
    let err = c
        .batch_execute(sql)
        .err()
        .unwrap_or_else(|| panic!("not refused: {sql}"));
    assert_eq!(failure(&err), (state.into(), code.into()), "{sql}: {err}");
}

/// (SQLSTATE, DETAIL code) of a failed statement.
pub fn failure(e: &postgres::Error) -> (String, String) {
    let db = e
        .as_db_error()
        .unwrap_or_else(|| panic!("not a server error: {e}"));
    let detail: serde_json::Value = db
        .detail()
        .and_then(|d| serde_json::from_str(d).ok())
        .unwrap_or_default();
    (
        db.code().code().to_owned(),
        detail["code"].as_str().unwrap_or_default().to_owned(),
    )
}

pub fn seqs(c: &mut Client, run_id: &str, after: Option<&str>) -> Vec<(String, i64)> {
    c.query(
        "SELECT event_id, seq FROM ledger.events_since($1, $2)",
        &[&run_id, &after],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// A server program of the cluster under test, run as `postgres` when we are root.
pub fn pg_tool(name: &str) -> Command {
    let path = format!("{}/{name}", env("LEDGER_TEST_BINDIR"));
    if running_as_root() {
        let mut c = Command::new("sudo");
        c.args(["-u", "postgres", "--", &path]);
        c
    } else {
        Command::new(path)
    }
}

/// `name` (psql, pg_dump, pg_restore, pg_basebackup) connecting to the test cluster as postgres.
pub fn pg_client(name: &str) -> Command {
    let mut c = pg_tool(name);
    c.args([
        "-h",
        &env("LEDGER_TEST_HOST"),
        "-p",
        &env("LEDGER_TEST_PORT"),
        "-U",
        "postgres",
    ]);
    c
}

pub fn restart_server() {
    restart_server_with("fast");
}

/// `pg_ctl restart -m <mode>`: `fast` (a clean shutdown), or `immediate`, which is a crash: every
/// backend dies without a checkpoint and the server recovers from the WAL when it starts again.
pub fn restart_server_with(mode: &str) {
    let status = pg_tool("pg_ctl")
        .args([
            "-D",
            &env("LEDGER_TEST_PGDATA"),
            "-m",
            mode,
            "-w",
            "restart",
        ])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "pg_ctl restart -m {mode} failed");
}

/// Restarts the server with these options instead of its own (`LEDGER_TEST_SERVER_OPTIONS`, what
/// test.sh starts it with: the library preloaded); `restart_server_as_configured` goes back.
pub fn restart_server_with_options(options: &str) {
    let command_line = format!(
        "-p {} -k {} -c listen_addresses='' {options}",
        env("LEDGER_TEST_PORT"),
        env("LEDGER_TEST_HOST")
    );
    let status = pg_tool("pg_ctl")
        .args(["-D", &env("LEDGER_TEST_PGDATA"), "-m", "fast", "-w", "-o"])
        .arg(command_line)
        .arg("restart")
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "pg_ctl restart -o {options} failed");
}

pub fn restart_server_as_configured() {
    restart_server_with_options(&std::env::var("LEDGER_TEST_SERVER_OPTIONS").unwrap_or_default());
}

/// The server restarted without the library preloaded, for as long as this lives.
pub struct WithoutPreload;

impl WithoutPreload {
    pub fn start() -> WithoutPreload {
        restart_server_with_options("-c shared_preload_libraries=''");
        WithoutPreload
    }
}

impl Drop for WithoutPreload {
    fn drop(&mut self) {
        restart_server_as_configured();
    }
}

pub fn running_as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0\n"))
        .unwrap_or(false)
}

/// Kills an executor's backend, as a crash would.
pub fn crash(admin: &mut Client, executor: &mut Client) {
    let pid: i32 = one(executor, "SELECT pg_backend_pid()");
    let killed: bool = one(admin, &format!("SELECT pg_terminate_backend({pid}, 5000)"));
    assert!(killed);
    assert!(
        executor.batch_execute("SELECT 1").is_err(),
        "the executor's session is gone"
    );
}

/// (table, row count, digest of the rows) for each of `tables`, read as the superuser (so across
/// all scopes): equal digests mean equal rows.
pub fn table_digests(c: &mut Client, tables: &[&str]) -> Vec<(String, i64, String)> {
    tables
        .iter()
        .map(|t| {
            let row = c
                .query_one(
                    &format!("SELECT count(*), coalesce(md5(string_agg(x::text, '|' ORDER BY x::text)), '') FROM ledger.{t} x"),
                    &[],
                )
                .unwrap();
            (t.to_string(), row.get(0), row.get(1))
        })
        .collect()
}

/// `table_digests` of the rows outside one scope: what a caller in that scope must never change,
/// while its own rows may.
pub fn digests_outside_scope(
    c: &mut Client,
    tables: &[&str],
    tenant: &str,
    workspace: &str,
) -> Vec<(String, i64, String)> {
    tables
        .iter()
        .map(|t| {
            let row = c
                .query_one(
                    &format!("SELECT count(*), coalesce(md5(string_agg(x::text, '|' ORDER BY x::text)), '') FROM ledger.{t} x WHERE NOT (x.tenant_id = $1 AND x.workspace_id = $2)"),
                    &[&tenant, &workspace],
                )
                .unwrap();
            (t.to_string(), row.get(0), row.get(1))
        })
        .collect()
}

/// The SQLSTATE of a failed statement, or `None` when no server answered (the connection broke).
pub fn sqlstate(e: &postgres::Error) -> Option<String> {
    e.as_db_error().map(|db| db.code().code().to_owned())
}

/// Waits until backend `pid` is blocked by a lock another backend holds.
pub fn wait_until_blocked(c: &mut Client, pid: i32) {
    let start = std::time::Instant::now();
    while !c
        .query_one("SELECT cardinality(pg_blocking_pids($1)) > 0", &[&pid])
        .unwrap()
        .get::<_, bool>(0)
    {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "backend {pid} never blocked"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// What every committed state of the ledger keeps, whatever crashed or was canceled: a name and
/// a query counting the rows that break it, across all scopes (run it as the superuser). The
/// joins are grouped so that they stay linear in a run of 100,000 events.
pub const INVARIANTS: [(&str, &str); 14] = [
    (
        "every event belongs to a run",
        "SELECT count(*) FROM ledger.run_events e WHERE NOT EXISTS (SELECT FROM ledger.runs r \
           WHERE (r.tenant_id, r.workspace_id, r.id) = (e.tenant_id, e.workspace_id, e.run_id))",
    ),
    (
        "an event's step is a step of the event's run",
        "SELECT count(*) FROM ledger.run_events e WHERE e.step_id IS NOT NULL AND NOT EXISTS (SELECT FROM ledger.run_steps s \
           WHERE (s.tenant_id, s.workspace_id, s.id, s.run_id) = (e.tenant_id, e.workspace_id, e.step_id, e.run_id))",
    ),
    (
        "every audit record's run exists and its step is a step of that run",
        "SELECT count(*) FROM ledger.audit_events a WHERE (a.run_id IS NOT NULL AND NOT EXISTS (SELECT FROM ledger.runs r \
           WHERE (r.tenant_id, r.workspace_id, r.id) = (a.tenant_id, a.workspace_id, a.run_id))) \
           OR (a.step_id IS NOT NULL AND NOT EXISTS (SELECT FROM ledger.run_steps s \
           WHERE (s.tenant_id, s.workspace_id, s.id, s.run_id) = (a.tenant_id, a.workspace_id, a.step_id, a.run_id)))",
    ),
    (
        "every run's events are seq 1..last_seq without a hole",
        "SELECT count(*) FROM ledger.runs r LEFT JOIN (SELECT tenant_id, workspace_id, run_id, count(*) AS n, \
                min(seq) AS lo, max(seq) AS hi FROM ledger.run_events GROUP BY 1, 2, 3) e \
             ON (e.tenant_id, e.workspace_id, e.run_id) = (r.tenant_id, r.workspace_id, r.id) \
          WHERE coalesce(e.n, 0) <> r.last_seq OR coalesce(e.hi, 0) <> r.last_seq OR coalesce(e.lo, 1) <> 1",
    ),
    (
        "every run has one run.created, at seq 1",
        "SELECT count(*) FROM ledger.runs r LEFT JOIN ledger.run_events e \
             ON (e.tenant_id, e.workspace_id, e.run_id, e.seq) = (r.tenant_id, r.workspace_id, r.id, 1) \
           LEFT JOIN (SELECT tenant_id, workspace_id, run_id, count(*) AS n FROM ledger.run_events \
                       WHERE event_type = 'run.created' GROUP BY 1, 2, 3) c \
             ON (c.tenant_id, c.workspace_id, c.run_id) = (r.tenant_id, r.workspace_id, r.id) \
          WHERE e.event_type IS DISTINCT FROM 'run.created' OR c.n IS DISTINCT FROM 1",
    ),
    (
        "every run's steps are step_no 1..n without a hole, each with its step.created event",
        "SELECT count(*) FROM ledger.run_steps s \
           JOIN (SELECT tenant_id, workspace_id, run_id, count(*) AS n, max(step_no) AS hi, min(step_no) AS lo \
                   FROM ledger.run_steps GROUP BY 1, 2, 3) c \
             ON (c.tenant_id, c.workspace_id, c.run_id) = (s.tenant_id, s.workspace_id, s.run_id) \
          WHERE c.n <> c.hi OR c.lo <> 1 OR NOT EXISTS (SELECT 1 FROM ledger.run_events e \
                 WHERE (e.tenant_id, e.workspace_id, e.run_id, e.step_id) = (s.tenant_id, s.workspace_id, s.run_id, s.id) \
                   AND e.event_type = 'step.created')",
    ),
    (
        "every task's checkpoints are 1..last_checkpoint_no without a hole",
        "SELECT count(*) FROM ledger.tasks t LEFT JOIN (SELECT tenant_id, workspace_id, task_id, count(*) AS n, \
                min(checkpoint_no) AS lo, max(checkpoint_no) AS hi FROM ledger.task_checkpoints GROUP BY 1, 2, 3) c \
             ON (c.tenant_id, c.workspace_id, c.task_id) = (t.tenant_id, t.workspace_id, t.id) \
          WHERE coalesce(c.n, 0) <> t.last_checkpoint_no OR coalesce(c.hi, 0) <> t.last_checkpoint_no \
             OR coalesce(c.lo, 1) <> 1",
    ),
    (
        "every tool call's step is a tool step of its run",
        "SELECT count(*) FROM ledger.run_step_tool_calls t WHERE NOT EXISTS (SELECT FROM ledger.run_steps s \
           WHERE (s.tenant_id, s.workspace_id, s.id, s.run_id) = (t.tenant_id, t.workspace_id, t.step_id, t.run_id) \
             AND s.step_type = 'tool')",
    ),
    (
        "every tool call's attempt, lease and times fit its status",
        "SELECT count(*) FROM ledger.run_step_tool_calls t WHERE (CASE t.status \
           WHEN 'waiting_approval' THEN t.attempt = 0 AND t.approval_id IS NOT NULL AND t.lease_expires_at IS NULL \
           WHEN 'claimed' THEN t.attempt >= 1 AND t.outbound_started_at IS NULL AND t.completed_at IS NULL \
                AND (t.lease_owner IS NULL) = (t.lease_expires_at IS NULL) \
           WHEN 'running' THEN t.attempt >= 1 AND t.outbound_started_at IS NOT NULL AND t.completed_at IS NULL \
                AND t.lease_owner IS NOT NULL AND t.lease_expires_at IS NOT NULL \
           WHEN 'in_doubt' THEN t.attempt >= 1 AND t.completed_at IS NULL \
                AND t.lease_expires_at IS NULL AND t.error_code = 'OUTCOME_UNKNOWN' \
           WHEN 'rejected' THEN t.lease_expires_at IS NULL \
           ELSE t.attempt >= 1 AND t.completed_at IS NOT NULL AND t.lease_owner IS NULL \
                AND t.lease_expires_at IS NULL AND (t.result IS NULL OR t.result_artifact_id IS NULL) END) IS NOT TRUE",
    ),
    (
        "every outbox row's lock fits its status",
        "SELECT count(*) FROM ledger.outbox o WHERE (CASE o.status \
           WHEN 'pending' THEN o.lease_owner IS NULL AND o.lease_expires_at IS NULL AND o.processed_at IS NULL \
           WHEN 'processing' THEN o.lease_owner IS NOT NULL AND o.lease_expires_at IS NOT NULL \
                AND o.processed_at IS NULL AND o.attempt_count >= 1 \
           ELSE o.lease_owner IS NULL AND o.lease_expires_at IS NULL AND o.processed_at IS NOT NULL END) IS NOT TRUE",
    ),
    (
        "every run has its one run.created outbox row",
        "SELECT count(*) FROM ledger.runs r WHERE (SELECT count(*) FROM ledger.outbox o \
           WHERE (o.tenant_id, o.workspace_id, o.run_id) = (r.tenant_id, r.workspace_id, r.id) \
             AND o.event_type = 'run.created') <> 1",
    ),
    (
        "every terminal run.status event has its run.status.updated outbox row",
        "SELECT count(*) FROM ledger.runs r WHERE \
           (SELECT count(*) FROM ledger.run_events e WHERE (e.tenant_id, e.workspace_id, e.run_id) = \
              (r.tenant_id, r.workspace_id, r.id) AND e.event_type = 'run.status' \
              AND e.payload->>'to' IN ('succeeded', 'failed', 'canceled', 'expired')) <> \
           (SELECT count(*) FROM ledger.outbox o WHERE (o.tenant_id, o.workspace_id, o.run_id) = \
              (r.tenant_id, r.workspace_id, r.id) AND o.event_type = 'run.status.updated')",
    ),
    (
        "every cost entry has one cost.recorded event and one outbox row, every such event its entry",
        "WITH ev AS (SELECT tenant_id, workspace_id, payload->>'cost_id' AS id, count(*) AS n FROM ledger.run_events \
                      WHERE event_type = 'cost.recorded' GROUP BY 1, 2, 3), \
              ob AS (SELECT tenant_id, workspace_id, substr(subject, 6) AS id, count(*) AS n FROM ledger.outbox \
                      WHERE event_type = 'cost.recorded' GROUP BY 1, 2, 3) \
         SELECT count(*) FROM ledger.run_cost_entries c FULL JOIN ev USING (tenant_id, workspace_id, id) \
           LEFT JOIN ob USING (tenant_id, workspace_id, id) \
          WHERE c.id IS NULL OR ev.n IS DISTINCT FROM 1 OR ob.n IS DISTINCT FROM 1",
    ),
    (
        "every in-doubt marking is in the feed and the outbox alike",
        "WITH ev AS (SELECT tenant_id, workspace_id, payload->>'tool_call_record_id' AS id, count(*) AS n \
                       FROM ledger.run_events WHERE event_type = 'tool_call.in_doubt' GROUP BY 1, 2, 3), \
              ob AS (SELECT tenant_id, workspace_id, substr(subject, 11) AS id, count(*) AS n FROM ledger.outbox \
                      WHERE event_type = 'tool_call.in_doubt' GROUP BY 1, 2, 3) \
         SELECT count(*) FROM ev FULL JOIN ob USING (tenant_id, workspace_id, id) \
           FULL JOIN (SELECT tenant_id, workspace_id, id FROM ledger.run_step_tool_calls WHERE status = 'in_doubt') t \
           USING (tenant_id, workspace_id, id) \
          WHERE ev.n IS DISTINCT FROM ob.n OR ev.n IS NULL",
    ),
];

/// The `INVARIANTS` that `c` (a superuser connection) finds broken, with how many rows break each.
pub fn broken_invariants(c: &mut Client) -> Vec<(&'static str, i64)> {
    INVARIANTS
        .iter()
        .map(|(name, sql)| (*name, one::<i64>(c, sql)))
        .filter(|(_, n)| *n != 0)
        .collect()
}

/// The names of the ledger's tables.
pub fn ledger_tables(c: &mut Client) -> Vec<String> {
    ledger_relations(c, "r")
}

/// The names of schema `ledger`'s relations of one `relkind` ('r' tables, 'v' views), sorted.
pub fn ledger_relations(c: &mut Client, kind: &str) -> Vec<String> {
    c.query(
        "SELECT relname::text FROM pg_class WHERE relnamespace = 'ledger'::regnamespace \
           AND relkind::text = $1 ORDER BY 1",
        &[&kind],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}
