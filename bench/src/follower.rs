//! Follower wake-up under load. While `clients` sessions write lifecycles through a ledger design,
//! a probe writer appends an event to a run of its own every few milliseconds (autocommit, so a
//! durable commit each), and a follower reads them the way README's "Catching up" says: LISTEN on
//! `ledger.run_channel` first, read `events_since` from its cursor to the end, and again on every
//! notification. Each event's figure is (the follower has read it) − (the probe's COMMIT
//! returned), both on this process's clock: negative when the follower was faster than the
//! writer's own answer.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;

use crate::designs::{arguments, notify_setting, result_2kb, writer, Kind, Ledger, DESIGNS};
use crate::{median, percentile, Settings, Target};

/// How often the probe appends, at most (it waits for its commit first).
const PROBE_EVERY: Duration = Duration::from_millis(10);
/// The follower's timer (README: with no notification, read again on a timer): a lost
/// notification shows up as a read this late.
const BACKSTOP: Duration = Duration::from_secs(1);
const PAGE: i32 = 1000;

pub fn run(s: &Settings, clients: usize, targets: &mut Vec<Target>) {
    let secs = if s.smoke { 1.0 } else { 6.0 };
    println!("## Follower wake-up under load\n");
    println!(
        "{clients} clients write lifecycles through the design for {secs:.0} s while a probe \
         writer appends an event (`record_response_event`, autocommit) to a run of its own every \
         {} ms or as soon as its last commit returned, and a follower on its own connection \
         follows that run as README's \"Catching up\" says (LISTEN on `run_channel` first, then \
         `events_since` from its cursor, again on every notification; a {} s timer as the \
         backstop). Per event: the time the follower has read it minus the time the probe's \
         COMMIT returned, both on the benchmark's clock. Designs whose sessions do not notify \
         are left out (their followers poll).\n",
        PROBE_EVERY.as_millis(),
        BACKSTOP.as_secs()
    );
    println!("| design | writers | events | median | p99 | max |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (d, design) in DESIGNS.iter().enumerate() {
        if design.kind != Kind::Ledger || design.notify == Some("off") || design.budgets {
            continue;
        }
        let mut lat = measure(s, clients, d, secs);
        let n = lat.len();
        let (m, p99) = (median(&mut lat), percentile(&mut lat, 0.99));
        let max = lat.iter().copied().fold(f64::MIN, f64::max);
        println!(
            "| {} | {clients} | {n} | {m:.3} ms | {p99:.3} ms | {max:.3} ms |",
            design.name
        );
        if design.notify.is_none() {
            targets.push(Target {
                what: format!("follower wake-up under {clients} writers: p99 < 10 ms"),
                measured: format!("{p99:.3} ms"),
                met: p99 < 10.0,
            });
        }
    }
    println!();
}

/// The wake-up figures (ms) of design `d` under `clients` writers for `secs` seconds.
fn measure(s: &Settings, clients: usize, d: usize, secs: f64) -> Vec<f64> {
    let design = &DESIGNS[d];
    let probe = format!("probe-{d}");
    let scope = "SELECT ledger.set_scope('bench', 'follow')";
    let mut w = writer(&s.conn);
    w.batch_execute(&format!(
        "{scope}; SELECT ledger.create_run('agent', run_id => '{probe}'); {}",
        notify_setting(design)
    ))
    .expect("probe run");

    // 1. LISTEN first, 2. read to the end: the cursor.
    let mut f = s.connect();
    f.batch_execute(scope).expect("set_scope");
    let channel: String = f
        .query_one("SELECT ledger.run_channel($1)", &[&probe])
        .expect("run_channel")
        .get(0);
    f.batch_execute(&format!("LISTEN {channel}"))
        .expect("LISTEN");
    let page = f
        .prepare("SELECT event_id FROM ledger.events_since($1, $2, $3)")
        .expect("prepare events_since");
    let mut cursor: Option<String> = None;
    let read_all = |f: &mut Client, cursor: &mut Option<String>, at: &mut Vec<Instant>| loop {
        let rows = f
            .query(&page, &[&probe, cursor, &PAGE])
            .expect("events_since");
        let now = Instant::now();
        at.extend(rows.iter().map(|_| now));
        if let Some(last) = rows.last() {
            *cursor = Some(last.get(0));
        }
        if rows.len() < PAGE as usize {
            break;
        }
    };
    read_all(&mut f, &mut cursor, &mut Vec::new());

    // The writers.
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(Barrier::new(clients + 1));
    let writers: Vec<_> = (0..clients)
        .map(|i| {
            let (stop, ready, conn) = (stop.clone(), ready.clone(), s.lifecycle_conn.clone());
            let setting = notify_setting(design);
            thread::spawn(move || {
                let mut c = writer(&conn);
                c.batch_execute(&setting).expect("ledger.notify");
                let mut ledger = Ledger::new(&mut c, format!("follow-{d}-{i}"), false);
                let (args, result) = (arguments(), result_2kb());
                ready.wait();
                while !stop.load(Relaxed) {
                    ledger.lifecycle(&mut c, &args, &result);
                }
            })
        })
        .collect();
    ready.wait();

    // The probe writer: its COMMITs' return times, in seq order.
    let commits = Arc::new(Mutex::new(Vec::new()));
    let appended = Arc::new(AtomicUsize::new(0));
    let probe_done = Arc::new(AtomicBool::new(false));
    let prober = {
        let (commits, appended, done) = (commits.clone(), appended.clone(), probe_done.clone());
        let probe = probe.clone();
        thread::spawn(move || {
            let append = w
                .prepare("SELECT ledger.record_response_event($1, 'delta', '{\"text\": \"hi\"}')")
                .expect("prepare the probe");
            let until = Instant::now() + Duration::from_secs_f64(secs);
            while Instant::now() < until {
                let t = Instant::now();
                w.execute(&append, &[&probe]).expect("probe event");
                commits.lock().expect("commits").push(Instant::now());
                appended.fetch_add(1, Relaxed);
                thread::sleep(PROBE_EVERY.saturating_sub(t.elapsed()));
            }
            done.store(true, Relaxed);
        })
    };

    // 3. On every notification (or the timer), read to the end again.
    let mut reads = Vec::new();
    while !(probe_done.load(Relaxed) && reads.len() >= appended.load(Relaxed)) {
        f.notifications()
            .timeout_iter(BACKSTOP)
            .next()
            .expect("notification stream");
        read_all(&mut f, &mut cursor, &mut reads);
    }
    prober.join().expect("probe thread");
    stop.store(true, Relaxed);
    for h in writers {
        h.join().expect("writer thread");
    }
    let commits = commits.lock().expect("commits");
    assert_eq!(
        reads.len(),
        commits.len(),
        "the follower read every probe event"
    );
    reads
        .iter()
        .zip(commits.iter())
        .map(|(r, c)| {
            if r >= c {
                (*r - *c).as_secs_f64() * 1e3
            } else {
                -((*c - *r).as_secs_f64() * 1e3)
            }
        })
        .collect()
}
