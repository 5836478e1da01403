//! Multi-session tests of the outbox consumer API: concurrent consumers draining one outbox, a
//! consumer killed while it holds a batch, and an event that fails for good and is replayed.
//! `#[ignore]`d like every session test; `pgrx-tests/test.sh` runs them with `-- --ignored`.

mod common;

use common::*;
use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;
use std::collections::HashSet;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

/// `count` `run.created` events, written in one transaction.
fn events(c: &mut Client, count: i32) -> Vec<String> {
    exec(
        c,
        &format!("SELECT count(ledger.create_run('chat')) FROM generate_series(1, {count})"),
    );
    c.query(
        "SELECT id FROM ledger.outbox WHERE event_type = 'run.created'",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// (id, attempt_count) of a claimed batch.
fn claim(c: &mut Client, consumer: &str, max: i32, lease: i32) -> Vec<(String, i32)> {
    c.query(
        "SELECT id, attempt_count FROM ledger.claim_outbox_events($1, $2, $3)",
        &[&consumer, &max, &lease],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

fn ack(c: &mut Client, consumer: &str, ids: &[String]) -> i32 {
    c.query_one(
        "SELECT ledger.ack_outbox_events($1, $2::text[])",
        &[&consumer, &ids],
    )
    .unwrap()
    .get(0)
}

fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

#[test]
#[ignore]
fn four_consumers_drain_10000_events_each_delivered_exactly_once() {
    let db = database("ledger_outbox_drain");
    let mut setup = session(&db);
    let all = events(&mut setup, 10_000);
    assert_eq!(all.len(), 10_000);

    let start = Arc::new(Barrier::new(4));
    let began = Instant::now();
    let consumers: Vec<_> = (0..4)
        .map(|n| {
            let (db, start) = (db.clone(), start.clone());
            thread::spawn(move || {
                let name = format!("consumer-{n}");
                let mut c = session(&db);
                let mut acked = Vec::new();
                start.wait();
                loop {
                    let batch: Vec<String> = claim(&mut c, &name, 50, 60)
                        .into_iter()
                        .map(|(id, _)| id)
                        .collect();
                    if batch.is_empty() {
                        return acked;
                    }
                    assert_eq!(ack(&mut c, &name, &batch), batch.len() as i32);
                    acked.extend(batch);
                }
            })
        })
        .collect();
    let acked: Vec<Vec<String>> = consumers.into_iter().map(|t| t.join().unwrap()).collect();
    let elapsed = began.elapsed();
    let per_consumer: Vec<usize> = acked.iter().map(Vec::len).collect();
    eprintln!("drained 10,000 events with 4 consumers in {elapsed:?}: {per_consumer:?} each");

    let delivered: Vec<String> = acked.into_iter().flatten().collect();
    assert_eq!(delivered.len(), 10_000, "no event delivered twice");
    let unique: HashSet<&String> = delivered.iter().collect();
    assert_eq!(unique.len(), 10_000);
    assert_eq!(sorted(delivered), sorted(all));
    assert!(
        per_consumer.iter().all(|n| *n > 0),
        "every consumer took a share: {per_consumer:?}"
    );
    let left: i64 = one(
        &mut setup,
        "SELECT count(*) FROM ledger.outbox WHERE NOT (status = 'done' AND attempt_count = 1 \
            AND processed_at IS NOT NULL AND lease_owner IS NULL)",
    );
    assert_eq!(left, 0);
}

#[test]
#[ignore]
fn a_killed_consumers_batch_is_redelivered_after_its_lease() {
    let db = database("ledger_outbox_kill");
    let mut admin = session(&db);
    let all = events(&mut admin, 10);

    let mut victim = session(&db);
    let held: Vec<String> = claim(&mut victim, "victim", 4, 1)
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(held.len(), 4);
    // The claim committed; the consumer dies before it acks.
    crash(&mut admin, &mut victim);

    let mut other = session(&db);
    let rest = claim(&mut other, "other", 100, 60);
    assert_eq!(rest.len(), 6, "the victim's batch is still leased");
    assert!(rest.iter().all(|(id, n)| !held.contains(id) && *n == 1));

    thread::sleep(Duration::from_millis(1500));
    let again = claim(&mut other, "other", 100, 60);
    assert_eq!(
        sorted(again.iter().map(|(id, _)| id.clone()).collect()),
        sorted(held.clone())
    );
    assert!(
        again.iter().all(|(_, n)| *n == 2),
        "the lost delivery counts as an attempt: {again:?}"
    );
    let ids: Vec<String> = rest.into_iter().chain(again).map(|(id, _)| id).collect();
    assert_eq!(ack(&mut other, "other", &ids), 10);
    // The dead consumer's late ack would change nothing.
    assert_eq!(ack(&mut admin, "victim", &held), 0);
    let done: i64 = one(
        &mut admin,
        "SELECT count(*) FROM ledger.outbox WHERE status = 'done' AND lease_owner IS NULL",
    );
    assert_eq!(done, all.len() as i64);
}

#[test]
#[ignore]
fn an_event_nacked_64_times_fails_and_replay_brings_it_back() {
    let db = database("ledger_outbox_fail");
    let mut consumer = session(&db);
    let id = events(&mut consumer, 1).remove(0);
    // A superuser connection skips the backoff between rounds.
    let mut admin = connect_to(&db, "postgres");

    for attempt in 1..=64 {
        assert_eq!(
            claim(&mut consumer, "c1", 1, 60),
            vec![(id.clone(), attempt)],
            "round {attempt}"
        );
        let status: String = consumer
            .query_one(
                "SELECT status FROM ledger.nack_outbox_events('c1', $1, $2)",
                &[&id, &format!("attempt {attempt} failed")],
            )
            .unwrap()
            .get(0);
        assert_eq!(status, if attempt < 64 { "pending" } else { "failed" });
        exec(&mut admin, "UPDATE ledger.outbox SET available_at = now()");
    }
    let row = admin
        .query_one(
            "SELECT status, attempt_count, replay_count, error_message, processed_at IS NOT NULL FROM ledger.outbox",
            &[],
        )
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, i32>(1),
            row.get::<_, i32>(2),
            row.get::<_, String>(3),
            row.get::<_, bool>(4)
        ),
        ("failed".into(), 64, 0, "attempt 64 failed".into(), true)
    );
    assert!(claim(&mut consumer, "c1", 1, 60).is_empty());

    // Replay it while a consumer listens: it is told, and the next claim gets it.
    let mut listener = session(&db);
    exec(&mut listener, "LISTEN ledger_outbox");
    let row = session(&db)
        .query_one(
            "SELECT status, attempt_count, replay_count FROM ledger.replay_outbox_event($1)",
            &[&id],
        )
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, i32>(1),
            row.get::<_, i32>(2)
        ),
        ("pending".into(), 64, 1)
    );
    let note = listener
        .notifications()
        .timeout_iter(Duration::from_secs(10))
        .next()
        .unwrap()
        .expect("a notification");
    assert_eq!(note.payload(), id);
    assert_eq!(claim(&mut listener, "c2", 1, 60), vec![(id.clone(), 65)]);
    let err = consumer
        .query("SELECT ledger.replay_outbox_event($1)", &[&id])
        .unwrap_err();
    assert_eq!(failure(&err), ("55000".into(), "OUTBOX_NOT_FAILED".into()));
}
