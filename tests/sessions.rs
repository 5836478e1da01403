//! Multi-session tests: real client connections to a real server, for what one transaction
//! cannot show: races, commit order, LISTEN/NOTIFY across reconnects and a server restart,
//! and row-level security for a login role.
//!
//! They need a running cluster with the extension installed (see `common`). They are
//! `#[ignore]`d so that `cargo pgrx test` does not run them without a server;
//! `pgrx-tests/test.sh` runs every test file with `-- --ignored`.

mod common;

use common::*;
use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;
use std::io::Write;
use std::process::Stdio;
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

#[test]
#[ignore]
fn racing_the_same_transition_exactly_one_wins() {
    let db = database("ledger_race");
    let mut setup = session(&db);
    exec(&mut setup, "SELECT ledger.create_run('chat', run_id => 'r'); SELECT ledger.transition_run('r', 'running')");

    let mut a = session(&db);
    exec(&mut a, "BEGIN");
    exec(
        &mut a,
        "SELECT ledger.transition_run('r', 'succeeded', expected_status => 'running')",
    );

    // B starts while A holds the row; it waits on the lock and must lose.
    let (tx, rx) = mpsc::channel();
    let db_b = db.clone();
    let b = thread::spawn(move || {
        let mut b = session(&db_b);
        tx.send(()).unwrap();
        b.query(
            "SELECT ledger.transition_run('r', 'failed', expected_status => 'running')",
            &[],
        )
        .map(|_| ())
    });
    rx.recv().unwrap();
    thread::sleep(Duration::from_millis(300));
    exec(&mut a, "COMMIT");
    let err = b
        .join()
        .unwrap()
        .expect_err("the second writer must not win");
    assert_eq!(
        failure(&err),
        ("40001".into(), "TRANSITION_CONFLICT".into())
    );

    let status: String = one(&mut setup, "SELECT status FROM ledger.runs WHERE id = 'r'");
    assert_eq!(status, "succeeded");
    let kinds: i64 = one(
        &mut setup,
        "SELECT count(*) FROM ledger.run_events WHERE event_type = 'run.status'",
    );
    assert_eq!(kinds, 2, "the loser wrote no event");
}

#[test]
#[ignore]
fn events_since_never_skips_a_late_commit() {
    let db = database("ledger_order");
    let mut setup = session(&db);
    exec(
        &mut setup,
        "SELECT ledger.create_run('chat', run_id => 'r')",
    );
    let mut reader = session(&db);
    let first = seqs(&mut reader, "r", None);
    assert_eq!(first.iter().map(|e| e.1).collect::<Vec<_>>(), vec![1]);
    let cursor = first[0].0.clone();

    // Writer A takes seq 2 and holds its transaction open.
    let mut a = session(&db);
    exec(
        &mut a,
        "BEGIN; SELECT ledger.transition_run('r', 'running')",
    );
    // Writer B starts later; it cannot take seq 3 until A commits.
    let db_b = db.clone();
    let b = thread::spawn(move || {
        let mut b = session(&db_b);
        exec(
            &mut b,
            "BEGIN; SELECT ledger.create_step('r', 'llm', step_id => 's'); COMMIT",
        );
    });
    thread::sleep(Duration::from_millis(300));
    // Nothing after the cursor is visible yet: no seq 3 can exist before seq 2 commits.
    assert!(seqs(&mut reader, "r", Some(&cursor)).is_empty());
    exec(&mut a, "COMMIT");
    b.join().unwrap();
    let after = seqs(&mut reader, "r", Some(&cursor));
    assert_eq!(after.iter().map(|e| e.1).collect::<Vec<_>>(), vec![2, 3]);
}

/// Two workers resuming the same run create its step by the same key at once: the second waits
/// for the first's run lock and gets the same step, so the run has it once.
#[test]
#[ignore]
fn two_workers_creating_a_step_by_the_same_key_get_one_step() {
    let db = database("ledger_step_key_race");
    let mut a = session(&db);
    exec(&mut a, "SELECT ledger.create_run('agent', run_id => 'r')");
    exec(
        &mut a,
        "BEGIN; SELECT ledger.create_step('r', 'llm', step_key => 'plan')",
    );
    let (tx, rx) = mpsc::channel();
    let db_b = db.clone();
    let b = thread::spawn(move || {
        let mut b = session(&db_b);
        tx.send(one::<i32>(&mut b, "SELECT pg_backend_pid()"))
            .unwrap();
        one::<String>(
            &mut b,
            "SELECT id || ':' || step_no FROM ledger.create_step('r', 'llm', step_key => 'plan')",
        )
    });
    let pid = rx.recv().unwrap();
    let mut watch = session(&db);
    wait_until_blocked(&mut watch, pid);
    exec(&mut a, "COMMIT");
    let b_step = b.join().unwrap();
    let a_step: String = one(
        &mut watch,
        "SELECT id || ':' || step_no FROM ledger.run_steps WHERE step_key = 'plan'",
    );
    assert_eq!(b_step, a_step);
    assert!(a_step.ends_with(":1"));
    let created: i64 = one(
        &mut watch,
        "SELECT count(*) FROM ledger.run_events WHERE event_type = 'step.created'",
    );
    assert_eq!(created, 1);
}

#[test]
#[ignore]
fn concurrent_writers_produce_a_gapless_feed() {
    let db = database("ledger_gapless");
    exec(
        &mut session(&db),
        "SELECT ledger.create_run('chat', run_id => 'r')",
    );
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let db = db.clone();
            thread::spawn(move || {
                let mut c = session(&db);
                for i in 0..25 {
                    c.execute(
                        "SELECT ledger.create_step('r', 'llm', step_key => $1)",
                        &[&format!("w{w}-{i}")],
                    )
                    .unwrap();
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
    // The steps count 1..100 in the order they were created, whichever writer made them.
    let numbered: bool = one(
        &mut reader,
        "SELECT array_agg(s.step_no ORDER BY e.seq) = array(SELECT generate_series(1, 100)::bigint) \
           FROM ledger.run_steps s JOIN ledger.run_events e \
             ON e.run_id = s.run_id AND e.step_id = s.id AND e.event_type = 'step.created'",
    );
    assert!(numbered);
}

/// The client contract: LISTEN, then events_since(cursor), then again on each notification.
fn catch_up(c: &mut Client, cursor: &mut Option<String>, seen: &mut Vec<i64>) {
    for (id, seq) in seqs(c, "r", cursor.as_deref()) {
        seen.push(seq);
        *cursor = Some(id);
    }
}

fn listen(c: &mut Client) {
    let channel: String = one(c, "SELECT ledger.run_channel('r')");
    exec(c, &format!("LISTEN {channel}"));
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
    exec(
        &mut writer,
        "SELECT ledger.create_run('chat', run_id => 'r')",
    );

    let mut listener = session(&db);
    listen(&mut listener);
    let (mut cursor, mut seen) = (None, Vec::new());
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, vec![1]);

    exec(&mut writer, "SELECT ledger.transition_run('r', 'running')");
    // Sent by the notifier worker (test.sh preloads the library): the run and its last seq.
    let note = wait_notified(&mut listener);
    assert_eq!(note, serde_json::json!({"run_id": "r", "seq": 2}));
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, vec![1, 2]);

    // The client drops; events keep coming; it reconnects, LISTENs, then catches up.
    drop(listener);
    exec(&mut writer, "SELECT ledger.create_step('r', 'llm', step_id => 's1'); SELECT ledger.transition_step('s1', 'running')");
    let mut listener = session(&db);
    listen(&mut listener);
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, vec![1, 2, 3, 4]);

    // Events committed, then the server restarts before the client reads them.
    exec(
        &mut writer,
        "SELECT ledger.transition_step('s1', 'succeeded')",
    );
    drop(writer);
    drop(listener);
    restart_server();
    let mut writer = session(&db);
    exec(&mut writer, "SELECT ledger.transition_run('r', 'failed')");
    let mut listener = session(&db);
    listen(&mut listener);
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, vec![1, 2, 3, 4, 5, 6]);
    // And live notifications flow again after the restart.
    exec(&mut writer, "SELECT ledger.transition_run('r', 'retrying')");
    assert_eq!(wait_notified(&mut listener)["seq"], 7);
    catch_up(&mut listener, &mut cursor, &mut seen);
    assert_eq!(seen, (1..=7).collect::<Vec<i64>>());
}

#[test]
#[ignore]
fn a_login_role_without_scope_sees_zero_rows() {
    let db = database("ledger_rls");
    let mut admin = session(&db);
    exec(
        &mut admin,
        "SELECT ledger.create_run('chat', run_id => 'r'); \
         DROP ROLE IF EXISTS ledger_test_app; \
         CREATE ROLE ledger_test_app LOGIN IN ROLE ledger_writer",
    );
    let mut app = connect_to(&db, "ledger_test_app");
    for table in ["runs", "run_events", "outbox", "run_steps", "blobs"] {
        let n: i64 = one(&mut app, &format!("SELECT count(*) FROM ledger.{table}"));
        assert_eq!(n, 0, "{table} without scope");
    }
    let err = app
        .query("SELECT ledger.create_run('chat')", &[])
        .unwrap_err();
    assert_eq!(failure(&err), ("42501".into(), "SCOPE_MISSING".into()));
    exec(&mut app, "SELECT ledger.set_scope('acme', 'other')");
    let n: i64 = one(&mut app, "SELECT count(*) FROM ledger.runs");
    assert_eq!(n, 0);
    exec(&mut app, "SELECT ledger.set_scope('acme', 'support')");
    let n: i64 = one(&mut app, "SELECT count(*) FROM ledger.runs");
    assert_eq!(n, 1);
    // A plain write is refused even in the right scope.
    let err = app
        .batch_execute("UPDATE ledger.runs SET status = 'succeeded'")
        .unwrap_err();
    assert_eq!(err.as_db_error().unwrap().code().code(), "42501");
    // is_local scope ends with the transaction.
    exec(
        &mut app,
        "RESET ledger.tenant_id; RESET ledger.workspace_id",
    );
    exec(
        &mut app,
        "BEGIN; SELECT ledger.set_scope('acme', 'support', is_local => true)",
    );
    let n: i64 = one(&mut app, "SELECT count(*) FROM ledger.runs");
    assert_eq!(n, 1);
    exec(&mut app, "COMMIT");
    let n: i64 = one(&mut app, "SELECT count(*) FROM ledger.runs");
    assert_eq!(n, 0);
    drop(app);
    exec(&mut admin, "DROP ROLE ledger_test_app");
}

#[test]
#[ignore]
fn pg_dump_and_restore_keep_every_row_and_the_feed_goes_on() {
    let src = database("ledger_dump_src");
    let mut c = session(&src);
    exec(
        &mut c,
        "SELECT ledger.create_run('chat', '{\"q\": 1}', run_id => 'r1'); \
         SELECT ledger.transition_run('r1', 'running'); \
         SELECT ledger.create_step('r1', 'llm', step_id => 's1'); \
         SELECT ledger.transition_step('s1', 'failed'); \
         SELECT ledger.transition_run('r1', 'failed', error_step_id => 's1'); \
         SELECT ledger.create_run('chat', jsonb_build_object('big', repeat('x', 20000)), run_id => 'r2', source_run_id => 'r1', parent_run_id => 'r1'); \
         SELECT ledger.transition_run('r2', 'running'); \
         SELECT ledger.record_cost('r2', 'tokens', 10, 0.01, 'USD'); \
         SELECT ledger.create_task('agent.stream', run_id => 'r2', task_id => 't1'); \
         SELECT ledger.set_concurrency_limit('customer-7', 4); \
         SELECT ledger.set_rate_limit('customer-7', 30, 60); \
         SELECT ledger.set_budget('USD', 100, period => 'day'); \
         SELECT ledger.set_budget('tokens', 1000000, 'tenant'); \
         SELECT ledger.send_input('r2', 'answer', '{\"text\": \"yes\"}', sender => 'ana'); \
         SELECT ledger.set_schedule('nightly', '30 2 * * *', 'chat', time_zone => 'Europe/Berlin'); \
         SELECT ledger.set_scope('other', 'w'); \
         SELECT ledger.create_run('chat', run_id => 'r1'); \
         SELECT ledger.claim_run('operator', any_scope => true); \
         SELECT ledger.grant_scope('ledger_reader', 'acme')",
    );
    exec(&mut c, "SELECT ledger.set_scope('acme', 'support')");
    // A finished tool call whose 30 KB result lives in an artifact.
    let tc: String = one(
        &mut c,
        "SELECT ledger.claim_tool_call('r2', 'fetch', '{\"page\": 1}', idempotency_key => 'fetch-1')->'tool_call'->>'id'",
    );
    exec(&mut c, &format!("SELECT ledger.begin_tool_call('{tc}', 1)"));
    exec(
        &mut c,
        &format!("SELECT ledger.complete_tool_call('{tc}', 1, 'succeeded', jsonb_build_object('html', repeat('h', 30000)))"),
    );
    // A graph checkpoint of the run, with a channel value and a pending write (opaque bytes).
    exec(
        &mut c,
        "SELECT ledger.put_graph_checkpoint('r2', 'th', '', 'c1', '{\"channel_versions\": {\"a\": \"1\"}}', \
             channels => '{a}', versions => '{1}', blob_types => '{bytes}', blobs => ARRAY['\\x00ff'::bytea]); \
         SELECT ledger.put_graph_checkpoint_writes('th', '', 'c1', 'task', '{0}', '{a}', '{bytes}', ARRAY['\\x01'::bytea])",
    );
    let cursor: String = one(
        &mut c,
        "SELECT event_id FROM ledger.events_since('r2') WHERE seq = 2",
    );
    // The run channels' key: the restore adds the dumped row beside the one its CREATE
    // EXTENSION made, and the dumped one stays in force (checked below through run_channel).
    let tables = ledger_tables(&mut connect_to(&src, "postgres"));
    let tables: Vec<&str> = tables
        .iter()
        .map(String::as_str)
        .filter(|t| *t != "channel_key")
        .collect();
    let channel: String = one(&mut c, "SELECT ledger.run_channel('r2')");
    let before = table_digests(&mut connect_to(&src, "postgres"), &tables);
    let empty: Vec<&str> = before
        .iter()
        .filter(|(_, n, _)| *n == 0)
        .map(|(t, _, _)| t.as_str())
        .collect();
    assert!(
        empty.iter().all(|t| [
            "approval_requests",
            "audit_events",
            "citations",
            "response_events",
            "run_feedback",
            "task_checkpoints",
            "tool_call_tombstones"
        ]
        .contains(t)),
        "tables left empty: {empty:?}"
    );

    let dump = pg_client("pg_dump").args(["-Fc", &src]).output().unwrap();
    assert!(
        dump.status.success(),
        "pg_dump: {}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let mut admin = connect_to("postgres", "postgres");
    exec(&mut admin, "DROP DATABASE IF EXISTS ledger_dump_dst");
    exec(&mut admin, "CREATE DATABASE ledger_dump_dst");
    let mut restore = pg_client("pg_restore")
        .args(["--exit-on-error", "-d", "ledger_dump_dst"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    restore
        .stdin
        .take()
        .unwrap()
        .write_all(&dump.stdout)
        .unwrap();
    let out = restore.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "pg_restore: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    assert_eq!(
        table_digests(&mut connect_to("ledger_dump_dst", "postgres"), &tables),
        before
    );
    let mut d = session("ledger_dump_dst");
    let big: i32 = one(&mut d, "SELECT length(ledger.run_inputs('r2')->>'big')");
    assert_eq!(big, 20000);
    // Followers keep their channels.
    let restored: String = one(&mut d, "SELECT ledger.run_channel('r2')");
    assert_eq!(restored, channel);
    // The feed continues where it stopped: the next event is seq 6 of r1.
    exec(&mut d, "SELECT ledger.transition_run('r1', 'retrying')");
    let seq: Vec<i64> = seqs(&mut d, "r1", None).into_iter().map(|e| e.1).collect();
    assert_eq!(seq, (1..=6).collect::<Vec<i64>>());
    // A catch-up cursor taken before the dump still works after the restore.
    let rest: Vec<i64> = seqs(&mut d, "r2", Some(&cursor))
        .into_iter()
        .map(|e| e.1)
        .collect();
    let all: i64 = one(&mut d, "SELECT count(*) FROM ledger.events_since('r2')");
    assert_eq!(rest, (3..=all).collect::<Vec<i64>>());
    // Idempotent replay works on the restored ledger, the offloaded result verified.
    let replayed: bool = one(
        &mut d,
        "WITH c AS (SELECT ledger.claim_tool_call('r2', 'fetch', '{\"page\": 1}', idempotency_key => 'fetch-1') AS o) \
         SELECT o->>'outcome' = 'replayed' AND length(o->'response'->'result'->>'html') = 30000 FROM c",
    );
    assert!(replayed);
}

#[test]
#[ignore]
fn concurrent_creates_with_one_request_id_make_one_run() {
    let db = database("ledger_request");
    let mut a = session(&db);
    exec(&mut a, "BEGIN");
    let first: String = one(
        &mut a,
        "SELECT id FROM ledger.create_run('chat', request_id => 'req-1')",
    );
    let db_b = db.clone();
    let b = thread::spawn(move || {
        let mut b = session(&db_b);
        // Waits on A's uncommitted row, then returns it.
        b.query_one(
            "SELECT id FROM ledger.create_run('chat', request_id => 'req-1')",
            &[],
        )
        .map(|r| r.get::<_, String>(0))
    });
    thread::sleep(Duration::from_millis(300));
    exec(&mut a, "COMMIT");
    assert_eq!(
        b.join()
            .unwrap()
            .expect("the second create returns the first run"),
        first
    );
    let n: i64 = one(&mut a, "SELECT count(*) FROM ledger.runs");
    assert_eq!(n, 1);
}

#[test]
#[ignore]
fn outbox_rows_notify_their_id_at_commit() {
    let db = database("ledger_outbox_notify");
    let mut listener = session(&db);
    exec(&mut listener, "LISTEN ledger_outbox");
    let mut writer = session(&db);
    exec(
        &mut writer,
        "BEGIN; SELECT ledger.create_run('chat', run_id => 'r')",
    );
    // Nothing is delivered before commit.
    assert!(listener
        .notifications()
        .timeout_iter(Duration::from_millis(300))
        .next()
        .unwrap()
        .is_none());
    exec(&mut writer, "COMMIT");
    let n = listener
        .notifications()
        .timeout_iter(Duration::from_secs(10))
        .next()
        .unwrap()
        .expect("a notification");
    let id: String = one(
        &mut listener,
        "SELECT id FROM ledger.outbox WHERE event_type = 'run.created'",
    );
    assert_eq!(n.payload(), id);
    assert!(id.starts_with("obx_"));
}

/// No notification arrives on `c` within `ms` milliseconds.
fn silent_for(c: &mut Client, ms: u64) -> bool {
    c.notifications()
        .timeout_iter(Duration::from_millis(ms))
        .next()
        .expect("notifications work")
        .is_none()
}

#[test]
#[ignore]
fn with_notify_off_writes_are_silent_and_polling_finds_them() {
    let db = database("ledger_notify_off");
    let mut listener = session(&db);
    listen(&mut listener);
    exec(&mut listener, "LISTEN ledger_outbox");
    let mut writer = session(&db);
    exec(&mut writer, "SET ledger.notify = off");
    // run.created: a feed event and an outbox row, and no NOTIFY for either.
    exec(
        &mut writer,
        "SELECT ledger.create_run('chat', run_id => 'r')",
    );
    assert!(silent_for(&mut listener, 500));
    assert_eq!(seqs(&mut listener, "r", None).len(), 1);
    let outbox: i64 = one(&mut listener, "SELECT count(*) FROM ledger.outbox");
    assert_eq!(outbox, 1);
    // Set for one transaction only, the next write notifies again, and with the right seq.
    exec(
        &mut writer,
        "RESET ledger.notify; BEGIN; SET LOCAL ledger.notify = off; \
         SELECT ledger.transition_run('r', 'running'); COMMIT",
    );
    assert!(silent_for(&mut listener, 300));
    exec(
        &mut writer,
        "SELECT ledger.transition_run('r', 'succeeded')",
    );
    let heard: Vec<(String, String)> = listener
        .notifications()
        .timeout_iter(Duration::from_secs(2))
        .map(|n| Ok((n.channel().to_owned(), n.payload().to_owned())))
        .collect()
        .expect("notifications work");
    let seqs_heard: Vec<i64> = heard
        .iter()
        .filter(|(channel, _)| channel != "ledger_outbox")
        .map(|(_, note)| {
            let note: serde_json::Value = serde_json::from_str(note).expect("JSON");
            note["seq"].as_i64().expect("seq")
        })
        .collect();
    assert_eq!(
        heard.len(),
        2,
        "the event and the terminal status's outbox row: {heard:?}"
    );
    assert_eq!(seqs_heard, [3]);
    // Only an operator may switch it off: a writer role may not silence others' followers.
    exec(
        &mut writer,
        "DROP ROLE IF EXISTS ledger_test_quiet; \
         CREATE ROLE ledger_test_quiet LOGIN IN ROLE ledger_writer",
    );
    let mut app = connect_to(&db, "ledger_test_quiet");
    exec(&mut app, "SELECT ledger.set_scope('acme', 'support')");
    let err = app.batch_execute("SET ledger.notify = off").unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("42501"));
    drop(app);
    exec(&mut writer, "DROP ROLE ledger_test_quiet");
}

#[test]
#[ignore]
fn run_and_step_writers_in_one_transaction_do_not_deadlock() {
    let db = database("ledger_lock_order");
    let mut y = session(&db);
    exec(&mut y, "SELECT ledger.create_run('chat', run_id => 'r'); SELECT ledger.create_step('r', 'llm', step_id => 's')");
    // Y holds the run ...
    exec(
        &mut y,
        "BEGIN; SELECT ledger.transition_run('r', 'running')",
    );
    // ... while X moves the step (it must queue behind Y on the run, not grab the step first) ...
    let db_x = db.clone();
    let x = thread::spawn(move || {
        session(&db_x).batch_execute("SELECT ledger.transition_step('s', 'running')")
    });
    thread::sleep(Duration::from_millis(300));
    // ... and Y then moves the same step in its transaction.
    exec(
        &mut y,
        "SELECT ledger.transition_step('s', 'running'); COMMIT",
    );
    x.join()
        .unwrap()
        .expect("no deadlock: X sees the step already running");
    let kinds: i64 = one(
        &mut y,
        "SELECT count(*) FROM ledger.run_events WHERE event_type = 'step.status'",
    );
    assert_eq!(kinds, 1);
}

// ---- Tool calls --------------------------------------------------------------------------

/// A database with a running run `r`.
fn tool_db(name: &str) -> String {
    let db = database(name);
    exec(
        &mut session(&db),
        "SELECT ledger.create_run('agent', run_id => 'r'); SELECT ledger.transition_run('r', 'running')",
    );
    db
}

fn claim_json(c: &mut Client, call: &str) -> serde_json::Value {
    let text: String = one(
        c,
        &format!("SELECT ledger.claim_tool_call('r', 'send_email', '{{\"to\": \"a@example.com\"}}', tool_call_id => '{call}')::text"),
    );
    serde_json::from_str(&text).unwrap()
}

fn record_id(c: &mut Client, call: &str) -> String {
    one(
        c,
        &format!("SELECT id FROM ledger.run_step_tool_calls WHERE tool_call_id = '{call}'"),
    )
}

fn expire_lease(c: &mut Client, call: &str) {
    exec(
        c,
        &format!("UPDATE ledger.run_step_tool_calls SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE tool_call_id = '{call}'"),
    );
}

#[test]
#[ignore]
fn two_executors_claiming_one_key_one_wins_one_is_busy() {
    let db = tool_db("ledger_tc_race");
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
    let claims: Vec<_> = (0..2)
        .map(|_| {
            let (db, barrier) = (db.clone(), barrier.clone());
            thread::spawn(move || {
                let mut c = session(&db);
                barrier.wait();
                claim_json(&mut c, "c1")["outcome"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
        })
        .collect();
    let mut outcomes: Vec<String> = claims.into_iter().map(|t| t.join().unwrap()).collect();
    outcomes.sort();
    assert_eq!(outcomes, ["busy", "claimed"]);
    let n: i64 = one(
        &mut session(&db),
        "SELECT count(*) FROM ledger.run_step_tool_calls",
    );
    assert_eq!(n, 1);
}

/// A call of run `run` under `key`, with `args`: claimed, then (by `end`) begun and completed
/// with `{"key": key}`, or left claimed or running with its lease expired.
fn call_on(c: &mut Client, run: &str, key: &str, end: &str) {
    let id: String = one(
        c,
        &format!("SELECT ledger.claim_tool_call('{run}', 'send', '{{\"k\": \"{key}\"}}', idempotency_key => '{key}')->'tool_call'->>'id'"),
    );
    if end != "claimed" {
        exec(c, &format!("SELECT ledger.begin_tool_call('{id}', 1)"));
    }
    match end {
        "succeeded" => exec(
            c,
            &format!("SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{\"key\": \"{key}\"}}')"),
        ),
        _ => exec(
            c,
            &format!("UPDATE ledger.run_step_tool_calls SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE id = '{id}'"),
        ),
    }
}

fn claim_key(c: &mut Client, run: &str, key: &str) -> Result<serde_json::Value, postgres::Error> {
    let text: String = c
        .query_one(
            &format!("SELECT ledger.claim_tool_call('{run}', 'send', '{{\"k\": \"{key}\"}}', idempotency_key => '{key}')::text"),
            &[],
        )?
        .get(0);
    Ok(serde_json::from_str(&text).unwrap())
}

/// The issue's case: key `ka` recorded on run A, `kb` on run B. S2 holds B (an audit in an open
/// transaction); S1 claims on A with `kb`; S2 claims on B with `ka`. A claim never waits for a
/// second run while it holds its own, so neither gets 40P01 and both replay. A call of the held
/// run that needs writing (taken over, or marked in doubt) is answered without waiting: `busy`
/// or `in_doubt`, and written by a claim once that run is free.
#[test]
#[ignore]
fn claims_naming_each_others_keys_never_deadlock() {
    let db = database("ledger_tc_cross");
    let mut setup = session(&db);
    for run in ["A", "B"] {
        exec(
            &mut setup,
            &format!("SELECT ledger.create_run('agent', run_id => '{run}'); SELECT ledger.transition_run('{run}', 'running')"),
        );
    }
    call_on(&mut setup, "A", "ka", "succeeded");
    call_on(&mut setup, "B", "kb", "succeeded");
    call_on(&mut setup, "B", "kc", "claimed");
    call_on(&mut setup, "B", "kd", "running");

    let mut s2 = session(&db);
    exec(
        &mut s2,
        "BEGIN; SELECT ledger.record_audit('B', 'gw', 'allow')",
    );
    let (claimed_tx, claimed_rx) = mpsc::channel();
    let (commit_tx, commit_rx) = mpsc::channel::<()>();
    let db1 = db.clone();
    let s1 = thread::spawn(move || -> Result<serde_json::Value, postgres::Error> {
        let mut s1 = session(&db1);
        let pid: i32 = one(&mut s1, "SELECT pg_backend_pid()");
        claimed_tx.send(Some(pid)).unwrap();
        s1.batch_execute("BEGIN")?;
        let out = claim_key(&mut s1, "A", "kb");
        let _ = claimed_tx.send(None);
        let out = out?;
        commit_rx.recv().unwrap();
        s1.batch_execute("COMMIT")?;
        Ok(out)
    });
    let s1_pid = claimed_rx.recv().unwrap().unwrap();
    // S1's claim has answered (or, as before 0.4.0, waits for B).
    let mut watch = session(&db);
    let start = std::time::Instant::now();
    while claimed_rx.try_recv().is_err() {
        let blocked: bool = watch
            .query_one("SELECT cardinality(pg_blocking_pids($1)) > 0", &[&s1_pid])
            .unwrap()
            .get(0);
        if blocked {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "S1 neither answered nor blocked"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let s2_claim = claim_key(&mut s2, "B", "ka");
    let s2_commit = s2.batch_execute("COMMIT");
    // S1 has ended already if its claim failed.
    let _ = commit_tx.send(());
    let s1_claim = s1.join().unwrap();
    let s1_out = s1_claim.unwrap_or_else(|e| panic!("S1: {:?} {e}", sqlstate(&e)));
    let s2_out = s2_claim.unwrap_or_else(|e| panic!("S2: {:?} {e}", sqlstate(&e)));
    s2_commit.unwrap();
    for (out, key) in [(&s1_out, "kb"), (&s2_out, "ka")] {
        assert_eq!(out["outcome"], "replayed", "{key}: {out}");
        assert_eq!(out["response"]["result"]["key"], key);
    }
    // Each replay is evidence in the calling run's feed.
    let replays: Vec<String> = watch
        .query(
            "SELECT run_id || ':' || (payload->>'idempotency_key') FROM ledger.run_events \
              WHERE event_type = 'tool_call.replayed' ORDER BY run_id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(replays, ["A:kb", "B:ka"]);

    // B held again: a call of B to take over, or to mark in doubt, is answered at once.
    exec(
        &mut s2,
        "BEGIN; SELECT ledger.record_audit('B', 'gw', 'allow')",
    );
    let mut s1 = session(&db);
    exec(&mut s1, "SET lock_timeout = '5s'");
    let out = claim_key(&mut s1, "A", "kc").unwrap();
    assert_eq!(
        (
            out["outcome"].as_str(),
            out["tool_call"]["attempt"].as_i64()
        ),
        (Some("busy"), Some(1))
    );
    let out = claim_key(&mut s1, "A", "kd").unwrap();
    assert_eq!(
        (out["outcome"].as_str(), out["tool_call"]["status"].as_str()),
        (Some("in_doubt"), Some("running"))
    );
    exec(&mut s2, "COMMIT");
    let out = claim_key(&mut s1, "A", "kc").unwrap();
    assert_eq!(
        (
            out["outcome"].as_str(),
            out["tool_call"]["attempt"].as_i64()
        ),
        (Some("claimed"), Some(2))
    );
    let out = claim_key(&mut s1, "A", "kd").unwrap();
    assert_eq!(
        (out["outcome"].as_str(), out["tool_call"]["status"].as_str()),
        (Some("in_doubt"), Some("in_doubt"))
    );
    assert!(broken_invariants(&mut watch).is_empty());
}

#[test]
#[ignore]
fn a_crash_after_begin_leaves_the_call_in_doubt_never_claimed() {
    let db = tool_db("ledger_tc_crash_after");
    let mut admin = session(&db);
    let mut executor = session(&db);
    assert_eq!(claim_json(&mut executor, "c1")["outcome"], "claimed");
    let id = record_id(&mut executor, "c1");
    exec(
        &mut executor,
        &format!("SELECT ledger.begin_tool_call('{id}', 1)"),
    );
    // The request leaves; the executor dies before it can record the answer.
    crash(&mut admin, &mut executor);
    let mut other = session(&db);
    assert_eq!(
        claim_json(&mut other, "c1")["outcome"],
        "busy",
        "the lease is still live"
    );
    expire_lease(&mut admin, "c1");
    for _ in 0..3 {
        let out = claim_json(&mut other, "c1");
        assert_eq!(out["outcome"], "in_doubt");
        assert_eq!(out["tool_call"]["attempt"], 1);
    }
    let n: i64 = one(
        &mut admin,
        "SELECT count(*) FROM ledger.outbox WHERE event_type = 'tool_call.in_doubt'",
    );
    assert_eq!(n, 1);
}

#[test]
#[ignore]
fn a_crash_before_begin_is_taken_over_and_the_zombie_is_fenced() {
    let db = tool_db("ledger_tc_crash_before");
    let mut admin = session(&db);
    let mut executor = session(&db);
    assert_eq!(claim_json(&mut executor, "c1")["outcome"], "claimed");
    let id = record_id(&mut executor, "c1");
    crash(&mut admin, &mut executor);
    expire_lease(&mut admin, "c1");
    let mut next = session(&db);
    let out = claim_json(&mut next, "c1");
    assert_eq!(
        (
            out["outcome"].as_str(),
            out["tool_call"]["attempt"].as_i64()
        ),
        (Some("claimed"), Some(2))
    );
    // The first executor comes back (a paused process, a slow network): its writes are refused.
    let mut zombie = session(&db);
    for late in [
        format!("SELECT ledger.begin_tool_call('{id}', 1)"),
        format!("SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{}}')"),
    ] {
        let err = zombie.batch_execute(&late).unwrap_err();
        assert_eq!(failure(&err), ("40001".into(), "LEASE_STALE".into()));
    }
    exec(
        &mut next,
        &format!("SELECT ledger.begin_tool_call('{id}', 2)"),
    );
    exec(
        &mut next,
        &format!("SELECT ledger.complete_tool_call('{id}', 2, 'succeeded', '{{\"id\": 42}}')"),
    );
    assert_eq!(claim_json(&mut zombie, "c1")["outcome"], "replayed");
}

#[test]
#[ignore]
fn a_late_completion_of_the_current_attempt_is_accepted_after_expiry() {
    let db = tool_db("ledger_tc_late");
    let mut admin = session(&db);
    let mut executor = session(&db);
    claim_json(&mut executor, "c1");
    let id = record_id(&mut executor, "c1");
    exec(
        &mut executor,
        &format!("SELECT ledger.begin_tool_call('{id}', 1)"),
    );
    expire_lease(&mut admin, "c1");
    // A sweep marks it in doubt meanwhile; the executor's answer still resolves it.
    let swept: i32 = one(&mut admin, "SELECT ledger.sweep_tool_calls()");
    assert_eq!(swept, 1);
    exec(
        &mut executor,
        &format!("SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', '{{\"ok\": true}}')"),
    );
    let out = claim_json(&mut admin, "c1");
    assert_eq!(out["outcome"], "replayed");
    assert_eq!(out["response"]["result"]["ok"], true);
}

#[test]
#[ignore]
fn sweep_under_concurrent_claims_never_double_executes() {
    let db = tool_db("ledger_tc_sweep");
    let mut admin = session(&db);
    // 40 calls: even ones had their request leave, odd ones never began.
    for i in 0..40 {
        let call = format!("c{i}");
        claim_json(&mut admin, &call);
        if i % 2 == 0 {
            let id = record_id(&mut admin, &call);
            exec(
                &mut admin,
                &format!("SELECT ledger.begin_tool_call('{id}', 1)"),
            );
        }
    }
    exec(&mut admin, "UPDATE ledger.run_step_tool_calls SET lease_expires_at = clock_timestamp() - interval '1 second'");
    let sweepers: Vec<_> = (0..2)
        .map(|_| {
            let db = db.clone();
            thread::spawn(move || {
                let mut c = session(&db);
                (0..5)
                    .map(|_| one::<i32>(&mut c, "SELECT ledger.sweep_tool_calls()"))
                    .sum::<i32>()
            })
        })
        .collect();
    let claimers: Vec<_> = (0..2)
        .map(|w| {
            let db = db.clone();
            thread::spawn(move || {
                let mut c = session(&db);
                (0..40)
                    .map(|i| {
                        let out = claim_json(&mut c, &format!("c{}", (i + w * 20) % 40));
                        (i, out["outcome"].as_str().unwrap().to_owned())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let swept: i32 = sweepers.into_iter().map(|t| t.join().unwrap()).sum();
    for t in claimers {
        for (_, outcome) in t.join().unwrap() {
            assert!(
                ["claimed", "busy", "in_doubt"].contains(&outcome.as_str()),
                "{outcome}"
            );
        }
    }
    assert!(swept <= 40);
    // Every call whose request left is in doubt at attempt 1; every other one was claimed at most once more.
    let wrong: i64 = one(
        &mut admin,
        "SELECT count(*) FROM ledger.run_step_tool_calls WHERE \
           (substr(tool_call_id, 2)::int % 2 = 0 AND NOT (status = 'in_doubt' AND attempt = 1)) OR \
           (substr(tool_call_id, 2)::int % 2 = 1 AND NOT (status = 'claimed' AND attempt <= 2))",
    );
    assert_eq!(wrong, 0);
    let doubts: i64 = one(
        &mut admin,
        "SELECT count(*) FROM ledger.outbox WHERE event_type = 'tool_call.in_doubt'",
    );
    assert_eq!(doubts, 20, "each in-doubt call is announced once");
}

#[test]
#[ignore]
fn a_re_run_gets_every_tool_result_back_without_executing() {
    let db = tool_db("ledger_tc_rerun");
    let mut a = session(&db);
    // Run r calls three tools; one returns 1 MB.
    let calls = [
        (
            "lookup",
            "'{\"order\": 1042}'",
            "'{\"status\": \"shipped\"}'",
        ),
        (
            "history",
            "'{\"order\": 1042}'",
            "jsonb_build_object('pages', repeat('x', 1024 * 1024))",
        ),
        (
            "notify",
            "'{\"to\": \"a@example.com\"}'",
            "'{\"sent\": true}'",
        ),
    ];
    for (tool, args, result) in calls {
        let id: String = one(
            &mut a,
            &format!("SELECT ledger.claim_tool_call('r', '{tool}', {args}, idempotency_key => 'order-1042:{tool}')->'tool_call'->>'id'"),
        );
        exec(&mut a, &format!("SELECT ledger.begin_tool_call('{id}', 1)"));
        exec(
            &mut a,
            &format!("SELECT ledger.complete_tool_call('{id}', 1, 'succeeded', {result})"),
        );
    }
    exec(&mut a, "SELECT ledger.transition_run('r', 'succeeded')");
    let artifacts: i64 = one(&mut a, "SELECT count(*) FROM ledger.run_artifacts");
    assert_eq!(artifacts, 1);

    // Run r2 replays r: the same keys come back from the ledger.
    let mut b = session(&db);
    exec(&mut b, "SELECT ledger.create_run('agent', run_id => 'r2', source_run_id => 'r'); SELECT ledger.transition_run('r2', 'running')");
    for (tool, args, result) in calls {
        let matches: bool = one(
            &mut b,
            &format!(
                "WITH c AS (SELECT ledger.claim_tool_call('r2', '{tool}', {args}, idempotency_key => 'order-1042:{tool}') AS o) \
                 SELECT o->>'outcome' = 'replayed' AND (o->'response'->'result') = {result} \
                        AND (o->'tool_call'->>'attempt')::int = 1 AND (o->'response'->'metadata'->>'idempotent_replay')::bool FROM c"
            ),
        );
        assert!(matches, "{tool}");
    }
    let replayed: i64 = one(
        &mut b,
        "SELECT count(*) FROM ledger.events_since('r2') WHERE event_type = 'tool_call.replayed'",
    );
    assert_eq!(replayed, 3);
    let records: i64 = one(&mut b, "SELECT count(*) FROM ledger.run_step_tool_calls");
    assert_eq!(records, 3, "no new record, no new attempt");
}

// ---- The blob store's lock ---------------------------------------------------------------

/// The bytes every test artifact holds: stored once per scope, whoever references them.
const BLOB: &str = "convert_to(repeat('blob-bytes ', 1000), 'UTF8')";

/// A purge never sweeps a blob that a transaction still open is about to reference, and never
/// waits for that transaction either: the blob stays for the next purge. The writer's artifact
/// reads back whole after it commits.
#[test]
#[ignore]
fn a_purge_leaves_alone_a_blob_an_open_transaction_references() {
    let db = database("ledger_blob_gc");
    let mut admin = session(&db);
    exec(
        &mut admin,
        &format!(
            "SELECT ledger.create_run('agent', run_id => 'old'); SELECT ledger.transition_run('old', 'running'); \
             SELECT ledger.put_artifact('old', {BLOB}); SELECT ledger.transition_run('old', 'succeeded'); \
             UPDATE ledger.runs SET ended_at = now() - interval '40 days' WHERE id = 'old'; \
             SELECT ledger.create_run('agent', run_id => 'live'); SELECT ledger.transition_run('live', 'running')"
        ),
    );
    // The writer stores the same bytes for its own run, and has not committed.
    let mut writer = session(&db);
    exec(&mut writer, "BEGIN");
    let artifact: String = one(
        &mut writer,
        &format!("SELECT id FROM ledger.put_artifact('live', {BLOB})"),
    );
    let mut purger = session(&db);
    exec(&mut purger, "SET statement_timeout = '10s'");
    let purged: i32 = one(&mut purger, "SELECT ledger.purge_runs('1 day')");
    assert_eq!(
        purged, 1,
        "the old run went, without waiting for the writer"
    );
    exec(&mut writer, "COMMIT");
    let blobs: i64 = one(&mut admin, "SELECT count(*) FROM ledger.blobs");
    assert_eq!(blobs, 1, "the blob the writer referenced stayed");
    let same: bool = one(
        &mut admin,
        &format!("SELECT ledger.get_artifact('{artifact}') = {BLOB}"),
    );
    assert!(same);
    // Unreferenced and unlocked, the next purge sweeps a blob.
    exec(
        &mut admin,
        "SELECT ledger.transition_run('live', 'succeeded'); \
         UPDATE ledger.runs SET ended_at = now() - interval '40 days' WHERE id = 'live'",
    );
    let purged: i32 = one(&mut purger, "SELECT ledger.purge_runs('1 day')");
    assert_eq!(purged, 1);
    let blobs: i64 = one(&mut admin, "SELECT count(*) FROM ledger.blobs");
    assert_eq!(blobs, 0);
}

/// The blob lock is a row only the functions can lock: a role without any ledger grant (or with
/// one) cannot read, lock or watch `ledger.blob_locks`, and the advisory lock key of 0.3.0, which
/// anyone could compute and take, no longer blocks anything.
#[test]
#[ignore]
fn no_other_role_can_block_a_scopes_blob_writers() {
    let db = database("ledger_blob_lock_roles");
    let mut su = connect_to(&db, "postgres");
    exec(
        &mut su,
        "DROP ROLE IF EXISTS ledger_test_outsider; CREATE ROLE ledger_test_outsider LOGIN; \
         DROP ROLE IF EXISTS ledger_test_app; CREATE ROLE ledger_test_app LOGIN IN ROLE ledger_writer",
    );
    let mut writer = session(&db);
    exec(
        &mut writer,
        "SELECT ledger.create_run('agent', run_id => 'r'); SELECT ledger.transition_run('r', 'running')",
    );
    for role in ["ledger_test_outsider", "ledger_test_app"] {
        let mut other = connect_to(&db, role);
        if role == "ledger_test_app" {
            exec(&mut other, "SELECT ledger.set_scope('acme', 'support')");
        }
        for sql in [
            "SELECT 1 FROM ledger.blob_locks FOR KEY SHARE",
            "SELECT 1 FROM ledger.blob_locks FOR UPDATE",
            "SELECT count(*) FROM ledger.blob_locks",
            "BEGIN; LOCK TABLE ledger.blob_locks IN ACCESS SHARE MODE",
            "BEGIN; LOCK TABLE ledger.blob_locks IN ACCESS EXCLUSIVE MODE",
        ] {
            let err = other.batch_execute(sql).unwrap_err();
            assert_eq!(sqlstate(&err).as_deref(), Some("42501"), "{role}: {sql}");
            exec(&mut other, "ROLLBACK");
        }
        // 0.3.0's key for this scope, held by the other role ...
        exec(
            &mut other,
            "SELECT pg_advisory_lock(('x' || substr(encode(sha256('ledger.blobs'::bytea || '\\x00'::bytea || \
                 convert_to('acme', 'UTF8') || '\\x00'::bytea || convert_to('support', 'UTF8')), 'hex'), 1, 15))::bit(60)::bigint)",
        );
        // ... blocks no writer of the scope.
        exec(&mut writer, "SET statement_timeout = '10s'");
        exec(
            &mut writer,
            &format!("SELECT ledger.put_artifact('r', {BLOB} || convert_to('{role}', 'UTF8'))"),
        );
    }
    let locks: i64 = one(&mut su, "SELECT count(*) FROM ledger.blob_locks");
    assert_eq!(locks, 1, "one row for the scope");
    exec(
        &mut su,
        "DROP OWNED BY ledger_test_outsider, ledger_test_app; DROP ROLE ledger_test_outsider; DROP ROLE ledger_test_app",
    );
}

/// A writer racing a purge of the run it names gets P0002 `RUN_NOT_FOUND`, like every other
/// missing run, never PostgreSQL's raw foreign-key violation: the purge deletes the run and
/// holds it uncommitted, the writer waits for it, and the purge commits.
#[test]
#[ignore]
fn writers_racing_a_purge_of_their_run_get_run_not_found() {
    let db = database("ledger_purge_race");
    let mut admin = session(&db);
    let writes = [
        ("failed", "SELECT ledger.retry_run('old')"),
        ("succeeded", "SELECT ledger.replay_run('old')"),
        (
            "succeeded",
            "SELECT ledger.create_run('agent', parent_run_id => 'old')",
        ),
        (
            "succeeded",
            "SELECT ledger.create_run('agent', source_run_id => 'old')",
        ),
        (
            "succeeded",
            "SELECT ledger.create_task('email', run_id => 'old')",
        ),
    ];
    for (status, write) in writes {
        exec(
            &mut admin,
            &format!(
                "SELECT ledger.create_run('agent', run_id => 'old'); \
                 SELECT ledger.transition_run('old', 'running'); \
                 SELECT ledger.transition_run('old', '{status}'); \
                 UPDATE ledger.runs SET ended_at = now() - interval '40 days' WHERE id = 'old'"
            ),
        );
        let mut purger = session(&db);
        exec(&mut purger, "BEGIN");
        let purged: i32 = one(&mut purger, "SELECT ledger.purge_runs('1 day')");
        assert_eq!(purged, 1, "{write}");
        let mut writer = session(&db);
        let pid: i32 = one(&mut writer, "SELECT pg_backend_pid()");
        let racing =
            std::thread::spawn(move || writer.batch_execute(write).map_err(|e| failure(&e)));
        wait_until_blocked(&mut admin, pid);
        exec(&mut purger, "COMMIT");
        let outcome = racing.join().unwrap();
        assert_eq!(
            outcome,
            Err(("P0002".to_owned(), "RUN_NOT_FOUND".to_owned())),
            "{write}"
        );
        let left: i64 = one(&mut admin, "SELECT count(*) FROM ledger.runs");
        assert_eq!(left, 0, "{write}: the refused write left a run behind");
    }
}

/// A re-run resolves its call through its lineage while the ancestor's own executor is
/// completing that call in an open transaction: the re-runs answer `busy` at once (they never
/// wait for the ancestor, nor execute), and after the commit each replays the ancestor's result.
#[test]
#[ignore]
fn reruns_racing_their_ancestors_call_never_wait_for_it_nor_make_it() {
    let db = database("ledger_lineage_race");
    let mut setup = session(&db);
    let claim = |run: &str| {
        format!("SELECT ledger.claim_tool_call('{run}', 'email', '{{\"to\": \"a\"}}', tool_call_id => 'c1')->>'outcome'")
    };
    exec(&mut setup, "SELECT ledger.create_run('agent', run_id => 'r'); SELECT ledger.transition_run('r', 'running')");
    let outcome: String = one(&mut setup, &claim("r"));
    assert_eq!(outcome, "claimed");
    exec(&mut setup, "SELECT ledger.begin_tool_call(id, 1) FROM ledger.run_step_tool_calls; SELECT ledger.transition_run('r', 'failed')");
    let g1: String = one(&mut setup, "SELECT id FROM ledger.retry_run('r')");
    exec(&mut setup, &format!("SELECT ledger.transition_run('{g1}', 'running'); SELECT ledger.transition_run('{g1}', 'failed')"));
    let g2: String = one(
        &mut setup,
        &format!("SELECT id FROM ledger.retry_run('{g1}')"),
    );

    let mut executor = session(&db);
    exec(&mut executor, "BEGIN; SELECT ledger.complete_tool_call(id, 1, 'succeeded', '{\"sent\": true}') FROM ledger.run_step_tool_calls");
    let reruns: Vec<_> = [g1.clone(), g2.clone()]
        .into_iter()
        .map(|run| {
            let (db, sql) = (db.clone(), claim(&run));
            thread::spawn(move || {
                let mut c = session(&db);
                exec(&mut c, "SET statement_timeout = '5s'");
                let outcome: String = one(&mut c, &sql);
                outcome
            })
        })
        .collect();
    for rerun in reruns {
        assert_eq!(rerun.join().unwrap(), "busy");
    }
    exec(&mut executor, "COMMIT");
    for run in [&g1, &g2] {
        let outcome: String = one(&mut setup, &claim(run));
        assert_eq!(outcome, "replayed", "{run}");
    }
    let records: String = one(
        &mut setup,
        "SELECT string_agg(run_id || ':' || status || ':' || attempt, ',') FROM ledger.run_step_tool_calls",
    );
    assert_eq!(records, "r:succeeded:1", "one record, executed once");
}
