//! Multi-session tests: real client connections to a real server, for what one transaction
//! cannot show: races, commit order, LISTEN/NOTIFY across reconnects and a server restart,
//! and row-level security for a login role.
//!
//! They need a running cluster with the extension installed; `pgrx-tests/test.sh` starts one
//! and passes it in LEDGER_TEST_HOST / LEDGER_TEST_PORT (and LEDGER_TEST_PGDATA /
//! LEDGER_TEST_BINDIR for the restart). They are `#[ignore]`d so that `cargo pgrx test`
//! does not run them without a server: `cargo test --test sessions -- --ignored`.

use postgres::fallible_iterator::FallibleIterator;
use postgres::{Client, NoTls};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set; run pgrx-tests/test.sh"))
}

fn connect_to(db: &str, user: &str) -> Client {
    let conn = format!("host={} port={} user={user} dbname={db}", env("LEDGER_TEST_HOST"), env("LEDGER_TEST_PORT"));
    Client::connect(&conn, NoTls).unwrap_or_else(|e| panic!("connect {conn}: {e}"))
}

/// A fresh database with the extension, one per test.
fn database(name: &str) -> String {
    let mut admin = connect_to("postgres", "postgres");
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name}")).unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {name}")).unwrap();
    let mut c = connect_to(name, "postgres");
    c.batch_execute("CREATE EXTENSION ledger").unwrap();
    name.to_owned()
}

fn session(db: &str) -> Client {
    let mut c = connect_to(db, "postgres");
    c.batch_execute("SELECT ledger.set_scope('acme', 'support')").unwrap();
    c
}

/// (SQLSTATE, DETAIL code) of a failed statement.
fn failure(e: &postgres::Error) -> (String, String) {
    let db = e.as_db_error().unwrap_or_else(|| panic!("not a server error: {e}"));
    let detail: serde_json::Value = db.detail().and_then(|d| serde_json::from_str(d).ok()).unwrap_or_default();
    (db.code().code().to_owned(), detail["code"].as_str().unwrap_or_default().to_owned())
}

fn seqs(c: &mut Client, run_id: &str, after: Option<&str>) -> Vec<(String, i64)> {
    c.query("SELECT event_id, seq FROM ledger.events_since($1, $2)", &[&run_id, &after])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[test]
#[ignore]
fn racing_the_same_transition_exactly_one_wins() {
    let db = database("ledger_race");
    let mut setup = session(&db);
    setup.batch_execute("SELECT ledger.create_run('chat', run_id => 'r'); SELECT ledger.transition_run('r', 'running')").unwrap();

    let mut a = session(&db);
    a.batch_execute("BEGIN").unwrap();
    a.query("SELECT ledger.transition_run('r', 'succeeded', expected_status => 'running')", &[]).unwrap();

    // B starts while A holds the row; it waits on the lock and must lose.
    let (tx, rx) = mpsc::channel();
    let db_b = db.clone();
    let b = thread::spawn(move || {
        let mut b = session(&db_b);
        tx.send(()).unwrap();
        b.query("SELECT ledger.transition_run('r', 'failed', expected_status => 'running')", &[])
            .map(|_| ())
    });
    rx.recv().unwrap();
    thread::sleep(Duration::from_millis(300));
    a.batch_execute("COMMIT").unwrap();
    let err = b.join().unwrap().expect_err("the second writer must not win");
    assert_eq!(failure(&err), ("40001".into(), "TRANSITION_CONFLICT".into()));

    let status: String = setup.query_one("SELECT status FROM ledger.runs WHERE id = 'r'", &[]).unwrap().get(0);
    assert_eq!(status, "succeeded");
    let kinds: i64 = setup.query_one("SELECT count(*) FROM ledger.run_events WHERE kind = 'run.status'", &[]).unwrap().get(0);
    assert_eq!(kinds, 2, "the loser wrote no event");
}

#[test]
#[ignore]
fn events_since_never_skips_a_late_commit() {
    let db = database("ledger_order");
    let mut setup = session(&db);
    setup.batch_execute("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
    let mut reader = session(&db);
    let first = seqs(&mut reader, "r", None);
    assert_eq!(first.iter().map(|e| e.1).collect::<Vec<_>>(), vec![1]);
    let cursor = first[0].0.clone();

    // Writer A takes seq 2 and holds its transaction open.
    let mut a = session(&db);
    a.batch_execute("BEGIN; SELECT ledger.transition_run('r', 'running')").unwrap();
    // Writer B starts later; it cannot take seq 3 until A commits.
    let db_b = db.clone();
    let b = thread::spawn(move || {
        let mut b = session(&db_b);
        b.batch_execute("BEGIN; SELECT ledger.create_step('r', 'llm', step_id => 's'); COMMIT").unwrap();
    });
    thread::sleep(Duration::from_millis(300));
    // Nothing after the cursor is visible yet: no seq 3 can exist before seq 2 commits.
    assert!(seqs(&mut reader, "r", Some(&cursor)).is_empty());
    a.batch_execute("COMMIT").unwrap();
    b.join().unwrap();
    let after = seqs(&mut reader, "r", Some(&cursor));
    assert_eq!(after.iter().map(|e| e.1).collect::<Vec<_>>(), vec![2, 3]);
}

#[test]
#[ignore]
fn concurrent_writers_produce_a_gapless_feed() {
    let db = database("ledger_gapless");
    session(&db).batch_execute("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let db = db.clone();
            thread::spawn(move || {
                let mut c = session(&db);
                for i in 0..25 {
                    c.execute("SELECT ledger.create_step('r', 'llm', step_key => $1)", &[&format!("w{w}-{i}")]).unwrap();
                }
            })
        })
        .collect();
    // A reader tails the feed while they write: every batch continues exactly where the last ended.
    let mut reader = session(&db);
    let mut cursor: Option<String> = None;
    let mut seen = Vec::new();
    loop {
        let done = writers.iter().all(|w| w.is_finished());
        let batch = seqs(&mut reader, "r", cursor.as_deref());
        if let Some(last) = batch.last() {
            cursor = Some(last.0.clone());
        }
        seen.extend(batch.into_iter().map(|e| e.1));
        if done && seen.len() == 101 {
            break;
        }
        assert!(seen.len() <= 101);
        thread::sleep(Duration::from_millis(5));
    }
    for w in writers {
        w.join().unwrap();
    }
    assert_eq!(seen, (1..=101).collect::<Vec<i64>>());
}

/// The client contract: LISTEN, then events_since(cursor), then again on each notification.
fn catch_up(c: &mut Client, cursor: &mut Option<String>, seen: &mut Vec<i64>) {
    for (id, seq) in seqs(c, "r", cursor.as_deref()) {
        seen.push(seq);
        *cursor = Some(id);
    }
}

fn listen(c: &mut Client) {
    let channel: String = c.query_one("SELECT ledger.run_channel('r')", &[]).unwrap().get(0);
    c.batch_execute(&format!("LISTEN {channel}")).unwrap();
}

fn wait_notified(c: &mut Client) -> serde_json::Value {
    let n = c
        .notifications()
        .timeout_iter(Duration::from_secs(10))
        .next()
        .expect("notifications work")
        .expect("a notification within 10s");
    serde_json::from_str(n.payload()).expect("JSON payload")
}

#[test]
#[ignore]
fn listen_and_catch_up_lose_nothing_across_reconnect_and_restart() {
    let db = database("ledger_listen");
    let mut writer = session(&db);
    writer.batch_execute("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();

    let mut listener = session(&db);
    listen(&mut listener);
    let (mut cursor, mut seen) = (None, Vec::new());
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, vec![1]);

    writer.batch_execute("SELECT ledger.transition_run('r', 'running')").unwrap();
    let note = wait_notified(&mut listener);
    assert_eq!(note["seq"], 2);
    assert_eq!(note["kind"], "run.status");
    assert_eq!(note["run_id"], "r");
    assert!(note["event_id"].as_str().unwrap().starts_with("evt_"));
    assert_eq!(note.as_object().unwrap().len(), 4, "ids only: {note}");
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, vec![1, 2]);

    // The client drops; events keep coming; it reconnects, LISTENs, then catches up.
    drop(listener);
    writer.batch_execute("SELECT ledger.create_step('r', 'llm', step_id => 's1'); SELECT ledger.transition_step('s1', 'running')").unwrap();
    let mut listener = session(&db);
    listen(&mut listener);
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, vec![1, 2, 3, 4]);

    // Events committed, then the server restarts before the client reads them.
    writer.batch_execute("SELECT ledger.transition_step('s1', 'succeeded')").unwrap();
    drop(writer);
    drop(listener);
    restart_server();
    let mut writer = session(&db);
    writer.batch_execute("SELECT ledger.transition_run('r', 'failed')").unwrap();
    let mut listener = session(&db);
    listen(&mut listener);
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, vec![1, 2, 3, 4, 5, 6]);
    // And live notifications flow again after the restart.
    writer.batch_execute("SELECT ledger.transition_run('r', 'retrying')").unwrap();
    assert_eq!(wait_notified(&mut listener)["seq"], 7);
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, (1..=7).collect::<Vec<i64>>());
}

fn restart_server() {
    let pg_ctl = format!("{}/pg_ctl", env("LEDGER_TEST_BINDIR"));
    let data = env("LEDGER_TEST_PGDATA");
    let mut cmd = if running_as_root() {
        let mut c = std::process::Command::new("sudo");
        c.args(["-u", "postgres", "--", &pg_ctl]);
        c
    } else {
        std::process::Command::new(&pg_ctl)
    };
    let status = cmd.args(["-D", &data, "-m", "fast", "-w", "restart"]).stdout(std::process::Stdio::null()).status().unwrap();
    assert!(status.success(), "pg_ctl restart failed");
}

fn running_as_root() -> bool {
    std::process::Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false)
}

#[test]
#[ignore]
fn a_login_role_without_scope_sees_zero_rows() {
    let db = database("ledger_rls");
    let mut admin = session(&db);
    admin
        .batch_execute(
            "SELECT ledger.create_run('chat', run_id => 'r'); \
             DROP ROLE IF EXISTS ledger_test_app; \
             CREATE ROLE ledger_test_app LOGIN IN ROLE ledger_writer",
        )
        .unwrap();
    let mut app = connect_to(&db, "ledger_test_app");
    for table in ["runs", "run_events", "outbox", "run_steps", "blobs"] {
        let n: i64 = app.query_one(&format!("SELECT count(*) FROM ledger.{table}"), &[]).unwrap().get(0);
        assert_eq!(n, 0, "{table} without scope");
    }
    let err = app.query("SELECT ledger.create_run('chat')", &[]).unwrap_err();
    assert_eq!(failure(&err), ("42501".into(), "SCOPE_MISSING".into()));
    app.batch_execute("SELECT ledger.set_scope('acme', 'other')").unwrap();
    let n: i64 = app.query_one("SELECT count(*) FROM ledger.runs", &[]).unwrap().get(0);
    assert_eq!(n, 0);
    app.batch_execute("SELECT ledger.set_scope('acme', 'support')").unwrap();
    let n: i64 = app.query_one("SELECT count(*) FROM ledger.runs", &[]).unwrap().get(0);
    assert_eq!(n, 1);
    // A plain write is refused even in the right scope.
    let err = app.batch_execute("UPDATE ledger.runs SET status = 'succeeded'").unwrap_err();
    assert_eq!(err.as_db_error().unwrap().code().code(), "42501");
    // is_local scope ends with the transaction.
    app.batch_execute("RESET ledger.tenant_id; RESET ledger.workspace_id").unwrap();
    app.batch_execute("BEGIN; SELECT ledger.set_scope('acme', 'support', is_local => true)").unwrap();
    let n: i64 = app.query_one("SELECT count(*) FROM ledger.runs", &[]).unwrap().get(0);
    assert_eq!(n, 1);
    app.batch_execute("COMMIT").unwrap();
    let n: i64 = app.query_one("SELECT count(*) FROM ledger.runs", &[]).unwrap().get(0);
    assert_eq!(n, 0);
    drop(app);
    admin.batch_execute("DROP ROLE ledger_test_app").unwrap();
}
