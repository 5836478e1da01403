//! Catch-up at scale: a client follows one run of 100,000 events through the
//! README's contract (LISTEN on the run's channel first, page with events_since from its cursor
//! until a short page, wait for a notification, repeat) while four writers append to that run
//! with audits, response events, costs and step transitions; half way its connection is
//! terminated and it reconnects with its cursor. It receives every event exactly once and in
//! order, and is woken for every commit after it listened again (the notifier worker, which
//! test.sh's preload makes the default, tells a run's channel once per flush with the last seq).
//! `#[ignore]`d like every session test; `pgrx-tests/test.sh` runs them with `-- --ignored`.

mod common;

use common::*;
use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;
use std::collections::{BTreeMap, HashSet};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// Events the writers append, in transactions of `BATCH`.
const EVENTS: i64 = 100_000;
const BATCH: i64 = 100;
/// Of which the mixed writer appends this many.
const MIXED: i64 = 3_000;
/// events_since's page.
const PAGE: i32 = 10_000;

/// A writer's transaction: the statement (`$1` the writer) and the event kinds each row of its
/// count appends.
#[derive(Clone, Copy)]
enum Batch {
    Audits,
    Responses,
    Costs,
    Steps,
}

impl Batch {
    fn sql(self) -> String {
        let each = match self {
            Batch::Audits => "ledger.record_audit('r', 'gateway', 'allow', actor => 'writer ' || $1::int)",
            Batch::Responses => "ledger.record_response_event('r', 'message', jsonb_build_object('writer', $1::int))",
            Batch::Costs => "ledger.record_cost('r', 'tokens', i, 0.001, 'USD', operation => 'writer ' || $1::int)",
            Batch::Steps => "ledger.transition_step((ledger.create_step('r', 'llm', node_id => 'writer ' || $1::int)).id, 'running')",
        };
        format!(
            "SELECT count({each}) FROM generate_series(1, {}) i",
            BATCH / self.kinds().len() as i64
        )
    }

    fn kinds(self) -> &'static [&'static str] {
        match self {
            Batch::Audits => &["audit.recorded"],
            Batch::Responses => &["response_event.recorded"],
            Batch::Costs => &["cost.recorded"],
            Batch::Steps => &["step.created", "step.status"],
        }
    }
}

/// What the follower saw: every (seq, event_id) in the order read, and the seqs it was notified of.
#[derive(Default)]
struct Followed {
    seqs: Vec<i64>,
    ids: HashSet<String>,
    notified: HashSet<i64>,
    wakeups: usize,
    pages: usize,
    /// Connections lost, and the run's last seq when the last connection had LISTENed.
    reconnects: usize,
    listened_at: i64,
}

/// The client of the README's contract, until it reads the run's `succeeded`. Each connection
/// LISTENs, then reads from the saved cursor; a lost connection (its backend terminated) is
/// replaced. `pids` gets each connection's backend pid.
fn follow(db: &str, pids: mpsc::Sender<i32>) -> Followed {
    let mut seen = Followed::default();
    let mut cursor: Option<String> = None;
    loop {
        let mut c = session(db);
        let channel: String = one(&mut c, "SELECT ledger.run_channel('r')");
        exec(&mut c, &format!("LISTEN {channel}"));
        seen.listened_at = one(&mut c, "SELECT last_seq FROM ledger.runs WHERE id = 'r'");
        let _ = pids.send(one(&mut c, "SELECT pg_backend_pid()"));
        match follow_on(&mut c, &channel, &mut cursor, &mut seen) {
            Ok(()) => return seen,
            Err(e) => {
                let state = sqlstate(&e);
                assert!(
                    state.is_none() || state.as_deref() == Some("57P01"),
                    "the follower lost its connection with {e}"
                );
                seen.reconnects += 1;
            }
        }
    }
}

/// Reads and waits on one connection. It re-reads only when notified: a lost notification would
/// leave it waiting, and fail the test.
fn follow_on(
    c: &mut Client,
    channel: &str,
    cursor: &mut Option<String>,
    seen: &mut Followed,
) -> Result<(), postgres::Error> {
    loop {
        let mut finished = false;
        loop {
            let page = c.query(
                "SELECT event_id, seq, event_type = 'run.status' AND payload->>'to' = 'succeeded' \
                   FROM ledger.events_since('r', $1, $2)",
                &[&*cursor, &PAGE],
            )?;
            seen.pages += 1;
            for row in &page {
                let (id, seq): (String, i64) = (row.get(0), row.get(1));
                let last = seen.seqs.last().copied().unwrap_or(0);
                assert_eq!(seq, last + 1, "the feed continues exactly after the cursor");
                assert!(seen.ids.insert(id.clone()), "event {id} read twice");
                seen.seqs.push(seq);
                finished |= row.get::<_, bool>(2);
                *cursor = Some(id);
            }
            if page.len() < PAGE as usize {
                break;
            }
        }
        if finished {
            // The last pages may have read events whose notifications are still on their way:
            // take them, so that the test can check none is missing.
            let last = seen.seqs.last().copied().unwrap_or(0);
            let mut notes = c.notifications();
            let mut waiting = notes.timeout_iter(Duration::from_secs(10));
            while seen.notified.iter().max().is_none_or(|m| *m < last) {
                match waiting.next()? {
                    Some(n) => take(channel, &n, seen),
                    None => break,
                }
            }
            return Ok(());
        }
        // Wait for a notification, then take every one already here.
        let mut notes = c.notifications();
        let first = notes
            .timeout_iter(Duration::from_secs(60))
            .next()?
            .expect("a notification within 60 s while events are due");
        take(channel, &first, seen);
        let mut more = notes.iter();
        while let Some(n) = more.next()? {
            take(channel, &n, seen);
        }
        seen.wakeups += 1;
    }
}

/// Records a notification's seq. The same seq twice fails the test, unless it was committed
/// before this connection listened: a new listener may be handed notifications already in the
/// queue (PostgreSQL's async.c: "we might get a few more"), which the first connection had.
fn take(channel: &str, n: &postgres::Notification, seen: &mut Followed) {
    assert_eq!(n.channel(), channel);
    let note: serde_json::Value = serde_json::from_str(n.payload()).unwrap();
    let seq = note["seq"].as_i64().unwrap();
    assert!(
        seen.notified.insert(seq) || seq <= seen.listened_at,
        "notified of seq {seq} twice"
    );
}

/// Waits until run r's feed reaches `seq`; fails if the writers stop before it does.
fn wait_for_seq<T>(c: &mut Client, seq: i64, writers: &[thread::JoinHandle<T>]) {
    let start = Instant::now();
    loop {
        let last: i64 = one(c, "SELECT last_seq FROM ledger.runs WHERE id = 'r'");
        if last >= seq {
            return;
        }
        assert!(
            !writers.iter().all(|w| w.is_finished()),
            "the writers stopped at seq {last}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the writers stalled at seq {last}"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

#[test]
#[ignore]
fn a_listening_client_gets_100000_events_exactly_once_in_order_under_4_writers() {
    let began = Instant::now();
    let db = database("ledger_catchup");
    let mut admin = session(&db);
    exec(
        &mut admin,
        "SELECT ledger.create_run('agent', run_id => 'r'); SELECT ledger.transition_run('r', 'running')",
    );

    let (tx, pids) = mpsc::channel();
    let db_f = db.clone();
    let follower = thread::spawn(move || follow(&db_f, tx));
    let pid = pids.recv().unwrap();

    // Three writers audit; the fourth mixes response events, costs and steps.
    let mixed: Vec<Batch> = [Batch::Responses, Batch::Costs, Batch::Steps]
        .into_iter()
        .cycle()
        .take((MIXED / BATCH) as usize)
        .collect();
    let audits = EVENTS / BATCH - mixed.len() as i64;
    let plans: Vec<Vec<Batch>> = (0..3)
        .map(|w| vec![Batch::Audits; ((audits + w) / 3) as usize])
        .chain([mixed])
        .collect();
    assert_eq!(
        plans.iter().map(Vec::len).sum::<usize>() as i64 * BATCH,
        EVENTS
    );
    let writing = Instant::now();
    let writers: Vec<_> = plans
        .into_iter()
        .enumerate()
        .map(|(w, plan)| {
            let db = db.clone();
            thread::spawn(move || {
                let mut c = session(&db);
                let mut produced: BTreeMap<&str, i64> = BTreeMap::new();
                for batch in plan {
                    let rows: i64 = c.query_one(&batch.sql(), &[&(w as i32)]).unwrap().get(0);
                    for kind in batch.kinds() {
                        *produced.entry(kind).or_default() += rows;
                    }
                }
                produced
            })
        })
        .collect();
    // Fresh tables have no statistics: analyze once the load is under way (docs/operations.md).
    wait_for_seq(&mut admin, 2000, &writers);
    exec(&mut admin, "ANALYZE");
    // Half way, the follower's connection is terminated; it reconnects and goes on from its cursor.
    wait_for_seq(&mut admin, EVENTS / 2, &writers);
    let killed: bool = one(
        &mut admin,
        &format!("SELECT pg_terminate_backend({pid}, 10000)"),
    );
    assert!(killed);

    let mut produced: BTreeMap<&str, i64> = BTreeMap::new();
    for w in writers {
        for (kind, n) in w.join().expect("a writer failed") {
            *produced.entry(kind).or_default() += n;
        }
    }
    let written = writing.elapsed();
    assert_eq!(produced.values().sum::<i64>(), EVENTS, "{produced:?}");
    exec(&mut admin, "SELECT ledger.transition_run('r', 'succeeded')");
    let done = Instant::now();
    let seen = follower.join().expect("the follower failed");
    let lag = done.elapsed();

    // Every event exactly once, in order: run.created, running, the writers' 100,000, succeeded.
    let total = EVENTS + 3;
    assert_eq!(seen.seqs.len() as i64, total);
    assert_eq!(seen.ids.len() as i64, total);
    assert_eq!(seen.seqs, (1..=total).collect::<Vec<i64>>());
    let in_ledger: BTreeMap<String, i64> = admin
        .query(
            "SELECT event_type, count(*) FROM ledger.run_events WHERE run_id = 'r' GROUP BY event_type",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(in_ledger.values().sum::<i64>(), total);
    for (kind, n) in &produced {
        assert_eq!(in_ledger.get(*kind), Some(n), "{kind}");
    }
    // Notified of every event committed after its second LISTEN, and of none twice (notifications
    // on their way when the first connection died are lost; the cursor made up for them).
    assert_eq!(seen.reconnects, 1);
    assert!(seen.listened_at >= EVENTS / 2);
    assert!(seen.notified.iter().all(|seq| (3..=total).contains(seq)));
    // Woken up to the very last event: a notification's seq covers every event up to it.
    assert_eq!(seen.notified.iter().max(), Some(&total));
    assert_eq!(broken_invariants(&mut admin), vec![]);
    eprintln!(
        "{total} events: written by 4 writers in {written:?} ({produced:?}); the follower read them in {} pages \
         after {} wake-ups ({} notifications) and {} reconnect (it listened again at seq {}) and was done {lag:?} \
         after the last one; {:?} in all",
        seen.pages,
        seen.wakeups,
        seen.notified.len(),
        seen.reconnects,
        seen.listened_at,
        began.elapsed()
    );
}
