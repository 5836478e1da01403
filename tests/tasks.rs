//! Multi-session tests of tasks: racing transitions (a concurrent cancel and complete must not
//! both "win"), the atomicity of replay_task across a killed session, and
//! gapless checkpoints from concurrent writers. Run like tests/sessions.rs (`-- --ignored`).

mod common;

const TASK_TABLES: [&str; 4] = ["tasks", "task_events", "task_checkpoints", "outbox"];

use common::*;
use std::sync::{mpsc, Arc, Barrier};
use std::thread;

#[test]
#[ignore]
fn racing_task_transitions_exactly_one_wins() {
    let db = database("ledger_task_race");
    let mut setup = session(&db);
    exec(
        &mut setup,
        "SELECT ledger.create_task('index', task_id => 't'); SELECT ledger.transition_task('t', 'running')",
    );

    // A holds the row; B waits on it and must lose once A commits.
    let mut a = session(&db);
    exec(&mut a, "BEGIN");
    exec(
        &mut a,
        "SELECT ledger.transition_task('t', 'succeeded', expected_status => 'running')",
    );
    let (tx, rx) = mpsc::channel();
    let db_b = db.clone();
    let b = thread::spawn(move || {
        let mut b = session(&db_b);
        tx.send(one::<i32>(&mut b, "SELECT pg_backend_pid()"))
            .unwrap();
        b.query(
            "SELECT ledger.transition_task('t', 'canceled', expected_status => 'running')",
            &[],
        )
        .map(|_| ())
    });
    let pid = rx.recv().unwrap();
    wait_until_blocked(&mut setup, pid);
    exec(&mut a, "COMMIT");
    let err = b
        .join()
        .unwrap()
        .expect_err("the second writer must not win");
    assert_eq!(
        failure(&err),
        ("40001".into(), "TRANSITION_CONFLICT".into())
    );
    let status: String = one(&mut setup, "SELECT status FROM ledger.tasks WHERE id = 't'");
    assert_eq!(status, "succeeded");
    let events: i64 = one(
        &mut setup,
        "SELECT count(*) FROM ledger.task_events WHERE event_type = 'task.status'",
    );
    assert_eq!(events, 2, "the loser wrote no event");

    // Unsynchronised races, many times: whatever the interleaving, one wins, one conflicts.
    for round in 0..20 {
        let id = format!("t{round}");
        exec(
            &mut setup,
            &format!("SELECT ledger.create_task('index', task_id => '{id}'); SELECT ledger.transition_task('{id}', 'running')"),
        );
        let barrier = Arc::new(Barrier::new(2));
        let racers: Vec<_> = ["succeeded", "canceled"]
            .into_iter()
            .map(|to| {
                let (db, id, barrier) = (db.clone(), id.clone(), barrier.clone());
                thread::spawn(move || {
                    let mut c = session(&db);
                    barrier.wait();
                    c.query(
                        "SELECT ledger.transition_task($1, $2, expected_status => 'running')",
                        &[&id, &to],
                    )
                    .map(|_| to)
                })
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
        let winners: Vec<&str> = results
            .iter()
            .filter_map(|r| r.as_ref().ok().copied())
            .collect();
        assert_eq!(winners.len(), 1, "round {round}");
        for e in results.iter().filter_map(|r| r.as_ref().err()) {
            assert_eq!(failure(e), ("40001".into(), "TRANSITION_CONFLICT".into()));
        }
        let status: String = one(
            &mut setup,
            &format!("SELECT status FROM ledger.tasks WHERE id = '{id}'"),
        );
        assert_eq!(status, winners[0], "round {round}");
    }
}

#[test]
#[ignore]
fn a_replay_killed_before_commit_changes_nothing_and_a_committed_one_changes_both() {
    let db = database("ledger_task_replay");
    let mut admin = session(&db);
    exec(
        &mut admin,
        "SELECT ledger.create_task('agent.stream', '{\"q\": 1}', task_id => 't'); \
         SELECT ledger.set_task_snapshot('t', '{\"task_id\": \"t\", \"run_id\": \"r\", \"payload\": {\"run_id\": \"r\", \"q\": 1}}'); \
         SELECT ledger.transition_task('t', 'running'); \
         SELECT ledger.transition_task('t', 'failed', error_code => 'E')",
    );
    let before = table_digests(&mut admin, &TASK_TABLES);

    let mut executor = session(&db);
    exec(&mut executor, "BEGIN");
    let lost: String = one(&mut executor, "SELECT id FROM ledger.replay_task('t')");
    let inside: String = one(
        &mut executor,
        "SELECT status FROM ledger.tasks WHERE id = 't'",
    );
    assert_eq!(
        inside, "canceled",
        "inside its transaction the replay is whole"
    );
    crash(&mut admin, &mut executor);

    assert_eq!(
        table_digests(&mut admin, &TASK_TABLES),
        before,
        "neither half survived"
    );
    let n: i64 = one(
        &mut admin,
        &format!("SELECT count(*) FROM ledger.tasks WHERE id = '{lost}'"),
    );
    assert_eq!(n, 0);

    let mut c = session(&db);
    let new: String = one(&mut c, "SELECT id FROM ledger.replay_task('t')");
    assert_ne!(new, lost);
    let old: String = one(
        &mut admin,
        "SELECT concat_ws('|', status, retried_as_task_id, progress->>'retried_as_task_id') FROM ledger.tasks WHERE id = 't'",
    );
    assert_eq!(old, format!("canceled|{new}|{new}"));
    let replacement: String = one(
        &mut admin,
        &format!("SELECT concat_ws('|', status, replayed_from_task_id, input::text, snapshot::text) FROM ledger.tasks WHERE id = '{new}'"),
    );
    assert_eq!(replacement, "queued|t|{\"q\": 1}|{\"payload\": {\"q\": 1}}");
}

#[test]
#[ignore]
fn concurrent_checkpoint_writers_get_gapless_numbers() {
    let db = database("ledger_task_checkpoints");
    exec(
        &mut session(&db),
        "SELECT ledger.create_task('index', task_id => 't')",
    );
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let db = db.clone();
            thread::spawn(move || {
                let mut c = session(&db);
                for i in 0..25 {
                    c.execute(
                        "SELECT ledger.add_task_checkpoint('t', jsonb_build_object('w', $1::int, 'i', $2::int))",
                        &[&w, &i],
                    )
                    .unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let mut c = session(&db);
    let numbers: Vec<i64> = c
        .query(
            "SELECT checkpoint_no FROM ledger.task_checkpoints WHERE task_id = 't' ORDER BY checkpoint_no",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(numbers, (1..=100).collect::<Vec<i64>>());
    let last: i64 = one(
        &mut c,
        "SELECT last_checkpoint_no FROM ledger.tasks WHERE id = 't'",
    );
    assert_eq!(last, 100);
}
