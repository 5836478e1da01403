//! The notifier worker (`ledger.notify = worker`, the library preloaded as test.sh starts the
//! server): followers are woken by the worker, not by the writers; while it is gone or its table
//! is full, writers notify by themselves; prepared transactions wake followers when committed;
//! each database has its own worker, which leaves when idle so that its database can be dropped;
//! without the preload, writers notify inline as before. Real sessions, a real server.
//!
//! Run by pgrx-tests/test.sh (`cargo test --test notifier -- --ignored --test-threads=1`).

mod common;

use common::*;
use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;
use std::collections::HashMap;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// A notification as a follower sees it.
#[derive(Debug, Clone)]
struct Heard {
    channel: String,
    payload: String,
    pid: i32,
    at: Instant,
}

impl Heard {
    fn seq(&self) -> i64 {
        let note: serde_json::Value = serde_json::from_str(&self.payload).expect("JSON payload");
        note["seq"].as_i64().expect("seq")
    }
}

fn hear(c: &mut Client, within: Duration) -> Vec<Heard> {
    c.notifications()
        .timeout_iter(within)
        .map(|n| {
            Ok(Heard {
                channel: n.channel().to_owned(),
                payload: n.payload().to_owned(),
                pid: n.process_id(),
                at: Instant::now(),
            })
        })
        .collect()
        .expect("notifications work")
}

/// Notifications until one on `channel` arrives (at most `within`).
fn hear_on(c: &mut Client, channel: &str, within: Duration) -> Vec<Heard> {
    let deadline = Instant::now() + within;
    let mut heard = Vec::new();
    while Instant::now() < deadline {
        let mut notes = c.notifications();
        let mut it = notes.timeout_iter(deadline - Instant::now());
        match it.next().expect("notifications work") {
            Some(n) => {
                heard.push(Heard {
                    channel: n.channel().to_owned(),
                    payload: n.payload().to_owned(),
                    pid: n.process_id(),
                    at: Instant::now(),
                });
                if n.channel() == channel {
                    break;
                }
            }
            None => break,
        }
    }
    heard
}

fn channel_of(c: &mut Client, run_id: &str) -> String {
    one(c, &format!("SELECT ledger.run_channel('{run_id}')"))
}

fn listen_to(c: &mut Client, run_id: &str) -> String {
    let channel = channel_of(c, run_id);
    exec(c, &format!("LISTEN {channel}"));
    channel
}

fn backend_pid(c: &mut Client) -> i32 {
    one(c, "SELECT pg_backend_pid()")
}

/// The pids of the notifier workers connected to `db`.
fn workers(admin: &mut Client, db: &str) -> Vec<i32> {
    admin
        .query(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'ledger notifier' AND datname = $1",
            &[&db],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Writes to run `r` until a notification comes from someone else than the writer: the worker
/// is attached. Returns its pid.
fn worker_serving(writer: &mut Client, listener: &mut Client, channel: &str) -> i32 {
    let me = backend_pid(writer);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        exec(writer, "SELECT ledger.create_step('r', 'llm')");
        let heard = hear_on(listener, channel, Duration::from_secs(2));
        if let Some(n) = heard.iter().find(|n| n.channel == channel && n.pid != me) {
            return n.pid;
        }
    }
    panic!("no notification from a worker within 10 s");
}

/// A writer with run `r` and a follower listening to it in `db`: (writer, follower, channel).
fn run_followed(db: &str) -> (Client, Client, String) {
    let mut writer = session(db);
    let mut listener = session(db);
    exec(
        &mut writer,
        "SELECT ledger.create_run('chat', run_id => 'r')",
    );
    let channel = listen_to(&mut listener, "r");
    (writer, listener, channel)
}

/// (notify, preloaded, worker_pid) of `ledger.notifier_status()`.
fn notifier_status(c: &mut Client) -> (String, bool, Option<i32>) {
    let r = c
        .query_one(
            "SELECT notify, preloaded, worker_pid FROM ledger.notifier_status()",
            &[],
        )
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

fn last_seq(c: &mut Client, run_id: &str) -> i64 {
    one(
        c,
        &format!("SELECT last_seq FROM ledger.runs WHERE id = '{run_id}'"),
    )
}

#[test]
#[ignore]
fn followers_are_woken_by_the_worker_once_per_commit_with_the_last_seq() {
    let db = database("ledger_notifier_wake");
    let (mut writer, mut listener, channel) = run_followed(&db);
    let mut admin = connect_to(&db, "postgres");
    exec(&mut listener, "LISTEN ledger_outbox");
    let worker = worker_serving(&mut writer, &mut listener, &channel);
    assert_eq!(workers(&mut admin, &db), vec![worker]);
    let status = notifier_status(&mut writer);
    assert_eq!(status, ("worker".into(), true, Some(worker)));

    // Five steps in one transaction: one notification, with the last seq; the rows are the
    // authority and the follower reads all five.
    let cursor: String = one(
        &mut listener,
        "SELECT event_id FROM ledger.events_since('r') ORDER BY seq DESC LIMIT 1",
    );
    exec(
        &mut writer,
        "BEGIN; SELECT ledger.create_step('r', 'llm') FROM generate_series(1, 5); COMMIT",
    );
    let heard = hear(&mut listener, Duration::from_millis(1500));
    let on_run: Vec<&Heard> = heard.iter().filter(|n| n.channel == channel).collect();
    assert_eq!(on_run.len(), 1, "{heard:?}");
    assert_eq!(on_run[0].pid, worker);
    let seq = last_seq(&mut writer, "r");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&on_run[0].payload).unwrap(),
        serde_json::json!({"run_id": "r", "seq": seq})
    );
    assert_eq!(seqs(&mut listener, "r", Some(&cursor)).len(), 5);

    // The outbox's listeners are woken by the worker too, with an event id (a worker just
    // active: an idle one leaves after 2 s).
    let worker = worker_serving(&mut writer, &mut listener, &channel);
    exec(&mut writer, "SELECT ledger.transition_run('r', 'running')");
    exec(
        &mut writer,
        "SELECT ledger.transition_run('r', 'succeeded')",
    );
    let heard = hear_on(&mut listener, "ledger_outbox", Duration::from_secs(3));
    let outbox = heard
        .iter()
        .find(|n| n.channel == "ledger_outbox")
        .expect("an outbox wake-up");
    assert!(outbox.payload.starts_with("obx_"), "{outbox:?}");
    assert_eq!(outbox.pid, worker);
}

/// Idle workers listen on `ledger_runs`: every commit that may make a run claimable tells them
/// (the notifier worker by default, the writer itself inline), with an empty payload that names
/// no scope; a commit that makes none claimable is silent.
#[test]
#[ignore]
fn idle_workers_hear_ledger_runs_when_a_run_may_be_claimed() {
    let db = database("ledger_notifier_runs");
    let (mut writer, mut listener, channel) = run_followed(&db);
    exec(&mut listener, "LISTEN ledger_runs");
    let me = backend_pid(&mut writer);
    for mode in ["worker", "inline"] {
        exec(&mut writer, &format!("SET ledger.notify = {mode}"));
        let run = format!("r-{mode}");
        let told = |writer: &mut Client, listener: &mut Client, what: &str, sql: &str| {
            if mode == "worker" {
                // A worker just active (an idle one leaves after 2 s, and then writers notify).
                worker_serving(writer, listener, &channel);
                hear(listener, Duration::from_millis(300));
            }
            exec(writer, sql);
            let heard = hear_on(listener, "ledger_runs", Duration::from_secs(5));
            let note = heard
                .iter()
                .find(|n| n.channel == "ledger_runs")
                .unwrap_or_else(|| panic!("{mode}: {what} told no idle worker: {heard:?}"));
            assert_eq!(note.payload, "", "{mode}: {what}");
            assert_eq!(
                note.pid == me,
                mode == "inline",
                "{mode}: {what}: sent by {}",
                note.pid
            );
            // Whatever else the worker had gathered with it.
            hear(listener, Duration::from_millis(300));
        };
        let silent = |writer: &mut Client, listener: &mut Client, what: &str, sql: &str| {
            exec(writer, sql);
            let heard = hear(listener, Duration::from_millis(1500));
            assert!(
                heard.iter().all(|n| n.channel != "ledger_runs"),
                "{mode}: {what} made no run claimable: {heard:?}"
            );
        };
        told(
            &mut writer,
            &mut listener,
            "a new run",
            &format!("SELECT ledger.create_run('agent', run_id => '{run}')"),
        );
        silent(
            &mut writer,
            &mut listener,
            "a claim and a wait",
            &format!(
                "SELECT ledger.claim_run('w', '{run}'); \
                 SELECT ledger.transition_run('{run}', 'running', run_token => 1); \
                 SELECT ledger.wait_for_input('{run}', 1, 'answer', now() + interval '1 day')"
            ),
        );
        told(
            &mut writer,
            &mut listener,
            "an input",
            &format!("SELECT ledger.send_input('{run}', 'answer', '{{\"ok\": true}}')"),
        );
        silent(
            &mut writer,
            &mut listener,
            "a claim and a heartbeat",
            &format!(
                "SELECT ledger.claim_run('w', '{run}'); SELECT ledger.heartbeat_run('{run}', 2)"
            ),
        );
        told(
            &mut writer,
            &mut listener,
            "a release",
            &format!("SELECT ledger.release_run('{run}', 2)"),
        );
        told(
            &mut writer,
            &mut listener,
            "a run's end",
            &format!(
                "SELECT ledger.claim_run('w', '{run}'); \
                 SELECT ledger.transition_run('{run}', 'running', run_token => 3); \
                 SELECT ledger.transition_run('{run}', 'succeeded', run_token => 3)"
            ),
        );
        told(
            &mut writer,
            &mut listener,
            "a raised limit",
            "SELECT ledger.set_concurrency_limit('k', 2)",
        );
    }
}

#[test]
#[ignore]
fn while_the_worker_is_gone_writers_notify_and_no_follower_waits_past_its_backstop() {
    let db = database("ledger_notifier_kill");
    let mut admin = connect_to(&db, "postgres");
    let mut setup = session(&db);
    let runs: Vec<String> = (0..4).map(|i| format!("k{i}")).collect();
    for r in &runs {
        exec(
            &mut setup,
            &format!("SELECT ledger.create_run('chat', run_id => '{r}')"),
        );
    }
    let mut listener = session(&db);
    let channels: HashMap<String, String> = runs
        .iter()
        .map(|r| (listen_to(&mut listener, r), r.clone()))
        .collect();
    exec(
        &mut setup,
        "SELECT ledger.create_run('chat', run_id => 'r')",
    );
    let probe = listen_to(&mut listener, "r");
    let first = worker_serving(&mut setup, &mut listener, &probe);

    // Four writers commit a step every few milliseconds for 4 s; the worker is terminated
    // three times meanwhile.
    let (tx, rx) = mpsc::channel::<(String, i64, Instant, i32)>();
    let writers: Vec<_> = runs
        .iter()
        .map(|r| {
            let (db, r, tx) = (db.clone(), r.clone(), tx.clone());
            thread::spawn(move || {
                let mut c = session(&db);
                let me = backend_pid(&mut c);
                let end = Instant::now() + Duration::from_secs(4);
                while Instant::now() < end {
                    exec(&mut c, &format!("SELECT ledger.create_step('{r}', 'llm')"));
                    // committed; this thread is the run's only writer
                    let seq = last_seq(&mut c, &r);
                    tx.send((r.clone(), seq, Instant::now(), me)).unwrap();
                    thread::sleep(Duration::from_millis(5));
                }
            })
        })
        .collect();
    drop(tx);
    let killer = {
        let db = db.clone();
        thread::spawn(move || {
            let mut admin = connect_to(&db, "postgres");
            let mut killed = Vec::new();
            for _ in 0..3 {
                thread::sleep(Duration::from_millis(900));
                if let Some(pid) = workers(&mut admin, &db).first().copied() {
                    let done: bool =
                        one(&mut admin, &format!("SELECT pg_terminate_backend({pid})"));
                    assert!(done);
                    killed.push(pid);
                }
            }
            killed
        })
    };
    let mut heard = Vec::new();
    let listen_until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < listen_until {
        heard.extend(hear(&mut listener, Duration::from_millis(200)));
    }
    for w in writers {
        w.join().unwrap();
    }
    let killed = killer.join().unwrap();
    let commits: Vec<(String, i64, Instant, i32)> = rx.iter().collect();
    assert!(killed.len() >= 2, "the worker was terminated: {killed:?}");
    assert!(killed.contains(&first));

    // Every commit was told to its follower (a notification with its seq or a later one can only
    // be sent after it committed), and within 3 s (the worker's restart takes 1 s).
    let writer_pids: Vec<i32> = commits.iter().map(|c| c.3).collect();
    let mut longest = Duration::ZERO;
    for (run, seq, at, _) in &commits {
        let told = heard
            .iter()
            .filter(|n| channels.get(&n.channel) == Some(run) && n.seq() >= *seq)
            .map(|n| n.at)
            .min();
        let waited = told
            .map(|t| t.saturating_duration_since(*at))
            .unwrap_or_else(|| {
                panic!(
                    "commit of seq {seq} on {run} was never told ({} commits)",
                    commits.len()
                )
            });
        longest = longest.max(waited);
    }
    assert!(
        longest < Duration::from_secs(3),
        "a follower waited {longest:?}"
    );
    // Both paths were taken: the workers' and the writers' own.
    let by_writers = heard
        .iter()
        .filter(|n| writer_pids.contains(&n.pid))
        .count();
    let by_workers = heard
        .iter()
        .filter(|n| channels.contains_key(&n.channel) && !writer_pids.contains(&n.pid))
        .count();
    assert!(
        by_writers > 0 && by_workers > 0,
        "{by_writers} by writers, {by_workers} by workers"
    );
    println!(
        "{} commits, {by_writers} notifications by writers, {by_workers} by workers, \
         {} workers terminated, longest wait {longest:?}",
        commits.len(),
        killed.len()
    );
    // A worker serves the database again.
    let back = worker_serving(&mut setup, &mut listener, &probe);
    assert!(!killed.contains(&back));
    assert_eq!(workers(&mut admin, &db), vec![back]);
}

/// Stops (SIGSTOP) and continues a process for as long as it lives.
struct Stopped(i32);

impl Stopped {
    fn new(pid: i32) -> Stopped {
        signal("-STOP", pid);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(sig: &str, pid: i32) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill {sig} {pid}");
}

/// Sets a server parameter with ALTER SYSTEM and reloads; reset on drop.
struct Setting<'a> {
    admin: &'a mut Client,
    name: &'static str,
}

impl<'a> Setting<'a> {
    fn new(admin: &'a mut Client, name: &'static str, value: &str) -> Setting<'a> {
        exec(admin, &format!("ALTER SYSTEM SET {name} = '{value}'"));
        exec(admin, "SELECT pg_reload_conf()");
        Setting { admin, name }
    }
}

impl Drop for Setting<'_> {
    fn drop(&mut self) {
        // Two statements: ALTER SYSTEM refuses to run in the implicit transaction of a batch.
        let _ = self
            .admin
            .batch_execute(&format!("ALTER SYSTEM RESET {}", self.name));
        let _ = self.admin.batch_execute("SELECT pg_reload_conf()");
    }
}

#[test]
#[ignore]
fn a_full_table_sends_writers_to_notify_by_themselves_and_nothing_is_lost() {
    let db = database("ledger_notifier_full");
    let mut admin = connect_to("postgres", "postgres");
    let _capacity = Setting::new(&mut admin, "ledger.notifier_capacity", "2");
    let mut writer = session(&db);
    let mut listener = session(&db);
    let runs: Vec<String> = (0..6).map(|i| format!("f{i}")).collect();
    let mut channels = Vec::new();
    for r in &runs {
        exec(
            &mut writer,
            &format!("SELECT ledger.create_run('chat', run_id => '{r}')"),
        );
        channels.push(listen_to(&mut listener, r));
    }
    exec(
        &mut writer,
        "SELECT ledger.create_run('chat', run_id => 'r')",
    );
    let probe = listen_to(&mut listener, "r");
    let worker = worker_serving(&mut writer, &mut listener, &probe);
    let capacity: i32 = one(&mut writer, "SELECT capacity FROM ledger.notifier_status()");
    assert_eq!(capacity, 2);
    let me = backend_pid(&mut writer);

    let heard = {
        // The worker cannot drain its table: two commits fill it, the other four notify by
        // themselves (all within its heartbeat's 2 s, so it still counts as alive).
        let _stopped = Stopped::new(worker);
        thread::sleep(Duration::from_millis(50));
        for r in &runs {
            exec(
                &mut writer,
                &format!("SELECT ledger.create_step('{r}', 'llm')"),
            );
        }
        let heard = hear(&mut listener, Duration::from_millis(300));
        let by_writer = heard.iter().filter(|n| n.pid == me).count();
        assert!(by_writer >= 4, "{heard:?}");
        heard
    };
    // Continued, the worker tells the rest.
    let mut all = heard;
    all.extend(hear(&mut listener, Duration::from_secs(2)));
    for (r, channel) in runs.iter().zip(&channels) {
        let seq = last_seq(&mut writer, r);
        assert!(
            all.iter().any(|n| &n.channel == channel && n.seq() == seq),
            "{r} was not told: {all:?}"
        );
    }
    // Only the six runs count: the probe's run `r` may still hear from the worker while it was
    // being found.
    let by_worker = all
        .iter()
        .filter(|n| n.pid == worker && channels.contains(&n.channel))
        .count();
    assert!(by_worker <= 2, "{all:?}");
}

#[test]
#[ignore]
fn a_prepared_transaction_wakes_followers_when_it_is_committed() {
    let db = database("ledger_notifier_2pc");
    let (mut writer, mut listener, channel) = run_followed(&db);
    // Whether a worker is attached or not (it left after 2 s idle), the news waits for the
    // prepared transaction.
    for pause in [0, 3000] {
        hear(&mut listener, Duration::from_millis(pause));
        exec(
            &mut writer,
            "BEGIN; SELECT ledger.create_step('r', 'llm'); PREPARE TRANSACTION 'ledger_2pc'",
        );
        assert!(
            hear(&mut listener, Duration::from_millis(500)).is_empty(),
            "nothing is told before COMMIT PREPARED"
        );
        exec(&mut writer, "COMMIT PREPARED 'ledger_2pc'");
        let heard = hear_on(&mut listener, &channel, Duration::from_secs(2));
        let seq = last_seq(&mut writer, "r");
        assert!(
            heard.iter().any(|n| n.channel == channel && n.seq() == seq),
            "after {pause} ms idle: {heard:?}"
        );
    }
    // Inline, PostgreSQL refuses to prepare a transaction that notified.
    exec(&mut writer, "SET ledger.notify = inline");
    let err = writer
        .batch_execute(
            "BEGIN; SELECT ledger.create_step('r', 'llm'); PREPARE TRANSACTION 'ledger_2pc_inline'",
        )
        .unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("0A000"), "{err}");
    exec(&mut writer, "ROLLBACK");
}

#[test]
#[ignore]
fn each_database_has_its_own_worker_which_leaves_when_idle() {
    let dbs = [
        database("ledger_notifier_db1"),
        database("ledger_notifier_db2"),
    ];
    let mut admin = connect_to("postgres", "postgres");
    let mut pids = Vec::new();
    for db in &dbs {
        let (mut writer, mut listener, channel) = run_followed(db);
        pids.push(worker_serving(&mut writer, &mut listener, &channel));
    }
    assert_ne!(pids[0], pids[1]);
    // Idle for longer than 2 s, both leave; their databases can be dropped (DROP DATABASE
    // refuses while a session, a worker's too, is connected).
    let deadline = Instant::now() + Duration::from_secs(10);
    while dbs.iter().any(|db| !workers(&mut admin, db).is_empty()) {
        assert!(
            Instant::now() < deadline,
            "workers still connected after 10 s"
        );
        thread::sleep(Duration::from_millis(200));
    }
    for db in &dbs {
        exec(&mut admin, &format!("DROP DATABASE {db}"));
    }
}

#[test]
#[ignore]
fn without_the_preload_writers_notify_inline_as_before() {
    let db = database("ledger_notifier_inline");
    let _plain = WithoutPreload::start();
    let mut writer = session(&db);
    let mut listener = session(&db);
    let status = notifier_status(&mut writer);
    assert_eq!(status, ("inline".into(), false, None));
    exec(
        &mut writer,
        "SELECT ledger.create_run('chat', run_id => 'r')",
    );
    let channel = listen_to(&mut listener, "r");
    let me = backend_pid(&mut writer);
    exec(
        &mut writer,
        "BEGIN; SELECT ledger.create_step('r', 'llm'); SELECT ledger.create_step('r', 'llm'); COMMIT",
    );
    // One notification per event, from the writer, with the event's id and type.
    let heard = hear(&mut listener, Duration::from_millis(1000));
    let on_run: Vec<&Heard> = heard.iter().filter(|n| n.channel == channel).collect();
    assert_eq!(on_run.len(), 2, "{heard:?}");
    for n in on_run {
        assert_eq!(n.pid, me);
        let note: serde_json::Value = serde_json::from_str(&n.payload).unwrap();
        assert_eq!(note["event_type"], "step.created");
        assert!(note["event_id"].as_str().unwrap().starts_with("evt_"));
    }
    let mut admin = connect_to("postgres", "postgres");
    assert!(workers(&mut admin, &db).is_empty());
}

#[test]
#[ignore]
fn after_a_server_crash_a_new_worker_serves_the_database() {
    let db = database("ledger_notifier_crash");
    let (mut writer, mut listener, channel) = run_followed(&db);
    let before = worker_serving(&mut writer, &mut listener, &channel);
    restart_server_with("immediate");
    let mut writer = session(&db);
    let mut listener = session(&db);
    let channel = listen_to(&mut listener, "r");
    let after = worker_serving(&mut writer, &mut listener, &channel);
    assert_ne!(before, after);
}

/// A rolled-back prepared transaction wrote nothing anyone can read: nobody is woken for it,
/// whether its news waited in the worker's table (a worker attached) or a worker was asked for
/// (none attached: it left after 2 s idle).
#[test]
#[ignore]
fn a_rolled_back_prepared_transaction_wakes_nobody() {
    let db = database("ledger_notifier_2pc_rollback");
    let (mut writer, mut listener, channel) = run_followed(&db);
    let mut admin = connect_to(&db, "postgres");
    for pause in [0, 3000] {
        if pause == 0 {
            worker_serving(&mut writer, &mut listener, &channel);
        }
        hear(&mut listener, Duration::from_millis(pause));
        exec(
            &mut writer,
            "BEGIN; SELECT ledger.create_step('r', 'llm'); PREPARE TRANSACTION 'ledger_2pc_rollback'",
        );
        exec(&mut writer, "ROLLBACK PREPARED 'ledger_2pc_rollback'");
        let heard = hear(&mut listener, Duration::from_millis(1500));
        assert!(
            heard.iter().all(|n| n.channel != channel),
            "after {pause} ms idle: {heard:?}"
        );
        let waiting: i32 = one(&mut admin, "SELECT waiting FROM ledger.notifier_status()");
        assert_eq!(waiting, 0);
    }
}

/// Rolls back a prepared transaction that a failing test left behind: it would keep its database
/// from being dropped by the next run and hold back every vacuum of the cluster.
struct PreparedGuard<'a> {
    db: &'a str,
    gid: &'static str,
}

impl Drop for PreparedGuard<'_> {
    fn drop(&mut self) {
        if thread::panicking() {
            let _ = connect_to(self.db, "postgres")
                .batch_execute(&format!("ROLLBACK PREPARED '{}'", self.gid));
        }
    }
}

/// One transaction reserves at most 64 channels of the worker's table. A prepared one parks 64
/// (the others' followers read on their backstop timer), so other writers still find room; an
/// ordinary one with more notifies every channel by itself. Nothing committed goes untold.
#[test]
#[ignore]
fn one_transaction_reserves_at_most_64_channels() {
    let db = database("ledger_notifier_bound");
    let mut admin = connect_to("postgres", "postgres");
    let _capacity = Setting::new(&mut admin, "ledger.notifier_capacity", "80");
    let mut writer = session(&db);
    let mut listener = session(&db);
    let runs: Vec<String> = (0..80).map(|i| format!("b{i}")).collect();
    exec(
        &mut writer,
        "SELECT ledger.create_run('chat', run_id => 'b' || i) FROM generate_series(0, 79) i; \
         SELECT ledger.create_run('chat', run_id => 'r')",
    );
    let channels: Vec<String> = runs.iter().map(|r| listen_to(&mut listener, r)).collect();
    let probe = listen_to(&mut listener, "r");
    let worker = worker_serving(&mut writer, &mut listener, &probe);
    let mut status = connect_to(&db, "postgres");
    let capacity: i32 = one(&mut status, "SELECT capacity FROM ledger.notifier_status()");
    assert_eq!(capacity, 80);

    let mut preparer = session(&db);
    let _guard = PreparedGuard {
        db: &db,
        gid: "ledger_2pc_bound",
    };
    exec(
        &mut preparer,
        "BEGIN; SELECT ledger.create_step('b' || i, 'llm') FROM generate_series(0, 79) i; \
         PREPARE TRANSACTION 'ledger_2pc_bound'",
    );
    let waiting: i32 = one(&mut status, "SELECT waiting FROM ledger.notifier_status()");
    assert_eq!(waiting, 64, "the prepared transaction parks 64 channels");
    // Another writer's commit still goes through the worker: the table has room.
    let heard = {
        exec(&mut writer, "SELECT ledger.create_step('r', 'llm')");
        hear_on(&mut listener, &probe, Duration::from_secs(2))
    };
    let told = heard
        .iter()
        .find(|n| n.channel == probe)
        .expect("probe told");
    assert_eq!(told.pid, worker, "{heard:?}");

    exec(&mut preparer, "COMMIT PREPARED 'ledger_2pc_bound'");
    let heard = hear(&mut listener, Duration::from_millis(1500));
    let woken: Vec<&Heard> = heard
        .iter()
        .filter(|n| channels.contains(&n.channel))
        .collect();
    assert_eq!(woken.len(), 64, "{heard:?}");
    assert!(woken.iter().all(|n| n.pid == worker));

    // An ordinary commit of 80 channels notifies all of them by itself.
    let me = backend_pid(&mut writer);
    exec(
        &mut writer,
        "BEGIN; SELECT ledger.create_step('b' || i, 'llm') FROM generate_series(0, 79) i; COMMIT",
    );
    let heard = hear(&mut listener, Duration::from_millis(1000));
    for (r, channel) in runs.iter().zip(&channels) {
        let seq = last_seq(&mut writer, r);
        assert!(
            heard
                .iter()
                .any(|n| &n.channel == channel && n.seq() == seq && n.pid == me),
            "{r} was not told by its writer: {heard:?}"
        );
    }
}

/// Login roles of each kind, and one without any ledger grant, for `db` (roles are cluster-wide:
/// dropped by `drop_roles`).
const ROLES: [(&str, &str); 4] = [
    ("ledger_test_no_grant", ""),
    ("ledger_test_reader", "ledger_reader"),
    ("ledger_test_writer", "ledger_writer"),
    ("ledger_test_operator", "ledger_operator"),
];

fn create_roles(su: &mut Client) {
    for (role, member_of) in ROLES {
        let membership = if member_of.is_empty() {
            String::new()
        } else {
            format!(" IN ROLE {member_of}")
        };
        exec(
            su,
            &format!("DROP ROLE IF EXISTS {role}; CREATE ROLE {role} LOGIN{membership}"),
        );
    }
}

fn drop_roles(su: &mut Client) {
    for (role, _) in ROLES {
        exec(su, &format!("DROP OWNED BY {role}; DROP ROLE {role}"));
    }
}

/// 0.4.0's channel of a run, which anyone could compute from public names: the first 16 bytes of
/// SHA-256 over tenant, workspace and run id (built-in functions only, no ledger grant needed).
const UNKEYED_CHANNEL: &str = "SELECT 'ledger_run_' || left(encode(sha256(convert_to($1, 'UTF8') \
    || '\\x00'::bytea || convert_to($2, 'UTF8') || '\\x00'::bytea || convert_to($3, 'UTF8')), 'hex'), 32)";

/// A run's channel name is keyed with a secret only the ledger's owner reads: a role without any
/// ledger grant that computes it from the run's public names, as it could up to 0.4.0, LISTENs
/// on a channel nobody notifies, while the real one (`run_channel`, here for a reader) is woken.
/// No application role (reader, writer, operator, no grant) can read the key.
#[test]
#[ignore]
fn a_role_without_a_ledger_grant_cannot_compute_a_run_channel() {
    let db = database("ledger_notifier_keyed");
    let mut su = connect_to(&db, "postgres");
    create_roles(&mut su);
    let mut writer = session(&db);
    exec(
        &mut writer,
        "SELECT ledger.create_run('chat', run_id => 'order-4f05')",
    );
    let mut outsider = connect_to(&db, "ledger_test_no_grant");
    let guessed: String = outsider
        .query_one(UNKEYED_CHANNEL, &[&"acme", &"support", &"order-4f05"])
        .unwrap()
        .get(0);
    exec(&mut outsider, &format!("LISTEN {guessed}"));
    refused(
        &mut outsider,
        "SELECT ledger.run_channel('order-4f05')",
        "42501",
        "",
    );
    let mut reader = connect_to(&db, "ledger_test_reader");
    exec(&mut reader, "SELECT ledger.set_scope('acme', 'support')");
    let channel = listen_to(&mut reader, "order-4f05");
    assert_ne!(channel, guessed);
    assert_eq!(channel, channel_of(&mut writer, "order-4f05"));

    exec(
        &mut writer,
        "SELECT ledger.create_step('order-4f05', 'llm')",
    );
    let heard = hear_on(&mut reader, &channel, Duration::from_secs(3));
    assert!(heard.iter().any(|n| n.channel == channel), "{heard:?}");
    let overheard = hear(&mut outsider, Duration::from_millis(500));
    assert!(overheard.is_empty(), "{overheard:?}");

    for (role, _) in ROLES {
        let mut c = connect_to(&db, role);
        for sql in [
            "SELECT key FROM ledger.channel_key",
            "SELECT count(*) FROM ledger.channel_key",
        ] {
            refused(&mut c, sql, "42501", "");
        }
    }
    drop(outsider);
    drop(reader);
    drop_roles(&mut su);
}

/// `notifier_status` counts every tenant's commits: operators read it, a writer or a reader gets
/// 42501 OPERATOR_REQUIRED, a role without any ledger grant cannot call it.
#[test]
#[ignore]
fn the_notifier_status_is_for_operators_only() {
    let db = database("ledger_notifier_status_roles");
    let mut su = connect_to(&db, "postgres");
    create_roles(&mut su);
    for (role, member_of) in ROLES {
        let mut c = connect_to(&db, role);
        let status = "SELECT notifications_sent FROM ledger.notifier_status()";
        match member_of {
            "ledger_operator" => {
                let _: i64 = one(&mut c, status);
            }
            "" => refused(&mut c, status, "42501", ""),
            _ => refused(&mut c, status, "42501", "OPERATOR_REQUIRED"),
        }
    }
    drop_roles(&mut su);
}

/// The key is read once per backend and kept, but never across DROP and CREATE EXTENSION: the
/// backend that re-created the extension computes the new key's channels, and its writes wake
/// a follower of the new channel.
#[test]
#[ignore]
fn a_backend_never_keeps_a_dropped_extensions_channel_key() {
    let db = database("ledger_notifier_recreated");
    let mut writer = session(&db);
    exec(
        &mut writer,
        "SELECT ledger.create_run('chat', run_id => 'r')",
    );
    let before = channel_of(&mut writer, "r");
    exec(
        &mut writer,
        "DROP EXTENSION ledger CASCADE; CREATE EXTENSION ledger; \
         SELECT ledger.set_scope('acme', 'support'); \
         SELECT ledger.create_run('chat', run_id => 'r')",
    );
    let after = channel_of(&mut writer, "r");
    assert_ne!(after, before);
    let mut listener = session(&db);
    assert_eq!(listen_to(&mut listener, "r"), after);
    exec(&mut writer, "SELECT ledger.create_step('r', 'llm')");
    let heard = hear_on(&mut listener, &after, Duration::from_secs(3));
    assert!(heard.iter().any(|n| n.channel == after), "{heard:?}");
}
