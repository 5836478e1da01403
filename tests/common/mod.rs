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

pub fn restart_server() {
    let status = pg_tool("pg_ctl")
        .args([
            "-D",
            &env("LEDGER_TEST_PGDATA"),
            "-m",
            "fast",
            "-w",
            "restart",
        ])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "pg_ctl restart failed");
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
