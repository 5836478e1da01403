//! Latencies of the read side (events_since on a large feed, the catch-up wake-up, the replay
//! bundle and the evidence) and the in-process redaction + hash throughput.

use std::sync::mpsc;
use std::thread;
use std::time::Instant;

use postgres::fallible_iterator::FallibleIterator;
use serde_json::{json, Value};

use crate::{median, percentile, Settings, Target};
use ledger_model::{json as cjson, redaction};

/// A small deterministic generator (xorshift64*): reproducible cursors without a dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

pub fn run(s: &Settings, targets: &mut Vec<Target>) {
    let mut c = s.connect();
    // The lifecycle phase just wrote a few hundred thousand rows: give the planner statistics
    // before the bulk loads (see README, Operations: ANALYZE after a bulk load).
    c.batch_execute("ANALYZE").expect("ANALYZE");
    println!("## Reads, wake-up and redaction\n");
    println!("| measurement | median | p95 | notes |");
    println!("|---|---:|---:|---|");
    events_since(s, &mut c, targets);
    wakeup(s, targets);
    bundles(s, &mut c, targets);
    redaction(s, targets);
    println!();
}

fn events_since(s: &Settings, c: &mut postgres::Client, targets: &mut Vec<Target>) {
    let (runs, per) = (s.event_runs, s.events_per_run);
    c.batch_execute("SELECT ledger.set_scope('bench', 'events')")
        .expect("set_scope");
    let t = Instant::now();
    for r in 0..runs {
        c.execute(
            "SELECT ledger.create_run('agent', run_id => $1)",
            &[&format!("ev-{r}")],
        )
        .expect("create_run");
    }
    // Appending a million events through the functions would take minutes; the feed's rows are
    // loaded directly (as the superuser, like a restore), in seq order, with ids that sort like
    // the ledger's ULIDs, then each run's last_seq is moved past them.
    let n = (runs * per) as i64;
    c.execute(
        "INSERT INTO ledger.run_events (tenant_id, workspace_id, id, run_id, seq, event_type, payload)
         SELECT 'bench', 'events', format('evt_%s_%s', r, lpad(e::text, 8, '0')),
                'ev-' || r, e + 1, 'bench.tick', jsonb_build_object('n', e, 'text', repeat('x', 100))
           FROM generate_series(1, $2::bigint) e, generate_series(0, ($1::bigint / $2::bigint) - 1) r",
        &[&n, &(per as i64)],
    )
    .expect("loading events");
    c.execute(
        "UPDATE ledger.runs SET last_seq = last_seq + $1 WHERE tenant_id = 'bench' AND workspace_id = 'events'",
        &[&(per as i64)],
    )
    .expect("moving last_seq");
    c.batch_execute("ANALYZE ledger.run_events; ANALYZE ledger.runs")
        .expect("ANALYZE");
    let total: i64 = c
        .query_one("SELECT count(*) FROM ledger.run_events", &[])
        .expect("count")
        .get(0);
    let load_s = t.elapsed().as_secs_f64();

    let page = c
        .prepare("SELECT event_id, seq FROM ledger.events_since($1, $2, 100)")
        .expect("prepare events_since");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut lat = Vec::with_capacity(s.page_queries);
    for _ in 0..s.page_queries {
        let r = rng.below(runs);
        let e = 1 + rng.below(per - 100);
        let (run, cursor) = (format!("ev-{r}"), format!("evt_{r}_{e:08}"));
        let t = Instant::now();
        let rows = c.query(&page, &[&run, &cursor]).expect("events_since");
        lat.push(ms(t));
        assert_eq!(rows.len(), 100, "a full page");
        assert_eq!(
            rows[0].get::<_, i64>(1),
            e as i64 + 2,
            "the page starts after the cursor"
        );
    }
    let (m, p95) = (median(&mut lat), percentile(&mut lat, 0.95));
    println!(
        "| `events_since` page of 100, random cursor | {m:.3} ms | {p95:.3} ms | {total} events in ledger.run_events ({runs} runs × {per}), loaded and analyzed in {load_s:.0} s; client round trip included |"
    );
    targets.push(Target {
        what: format!("events_since page (100 of {total} events) median < 1 ms"),
        measured: format!("{m:.3} ms"),
        met: m < 1.0,
    });
}

/// From the writer sending an event to a LISTENing reader holding it from events_since.
fn wakeup(s: &Settings, targets: &mut Vec<Target>) {
    let mut w = s.connect();
    w.batch_execute(
        "SELECT ledger.set_scope('bench', 'wake');
         SELECT ledger.create_run('agent', run_id => 'wake-1')",
    )
    .expect("wake-up run");
    let mut r = s.connect();
    r.batch_execute("SELECT ledger.set_scope('bench', 'wake')")
        .expect("set_scope");
    let channel: String = r
        .query_one("SELECT ledger.run_channel('wake-1')", &[])
        .expect("run_channel")
        .get(0);
    r.batch_execute(&format!("LISTEN {channel}"))
        .expect("LISTEN");
    let first: String = r
        .query_one(
            "SELECT event_id FROM ledger.events_since('wake-1') ORDER BY seq DESC LIMIT 1",
            &[],
        )
        .expect("cursor")
        .get(0);
    let (tx, rx) = mpsc::channel::<Instant>();
    let n = s.wakeups;
    let reader = thread::spawn(move || {
        let page = r
            .prepare("SELECT event_id FROM ledger.events_since('wake-1', $1)")
            .expect("prepare");
        let mut cursor = first;
        for _ in 0..n {
            r.notifications()
                .blocking_iter()
                .next()
                .expect("notification")
                .expect("notification stream ended");
            let rows = r.query(&page, &[&cursor]).expect("events_since");
            assert_eq!(rows.len(), 1, "one new event per notification");
            cursor = rows[0].get(0);
            tx.send(Instant::now()).expect("report");
        }
    });
    let append = w
        .prepare("SELECT ledger.record_response_event('wake-1', 'delta', '{\"text\": \"hi\"}')")
        .expect("prepare");
    let mut lat = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        w.execute(&append, &[]).expect("record_response_event");
        let t1 = rx.recv().expect("reader");
        lat.push((t1 - t0).as_secs_f64() * 1e3);
    }
    reader.join().expect("reader thread");
    let (m, p95) = (median(&mut lat), percentile(&mut lat, 0.95));
    println!(
        "| NOTIFY → `events_since` wake-up | {m:.3} ms | {p95:.3} ms | from the writer sending its (autocommit, durable) event to a LISTENing reader holding the row; {n} events |"
    );
    targets.push(Target {
        what: "wake-up median < 5 ms".into(),
        measured: format!("{m:.3} ms"),
        met: m < 5.0,
    });
}

fn bundles(s: &Settings, c: &mut postgres::Client, targets: &mut Vec<Target>) {
    c.batch_execute("SELECT ledger.set_scope('bench', 'bundle')")
        .expect("set_scope");
    let mut medians = Vec::new();
    for steps in s.bundle_steps {
        let run = format!("bundle-{steps}");
        let t = Instant::now();
        let mut tx = c.transaction().expect("BEGIN");
        tx.execute(
            "SELECT ledger.create_run('agent', inputs => '{\"q\": \"bench\"}', run_id => $1)",
            &[&run],
        )
        .expect("create_run");
        tx.execute(
            "SELECT count(ledger.create_step($1, 'llm', input_summary => 'step ' || g))
               FROM generate_series(1, $2) g",
            &[&run, &(steps as i32)],
        )
        .expect("create_step");
        tx.execute(
            "SELECT count(ledger.record_cost($1, 'tokens', 1200, 0.0125, 'USD',
                    usage => '{\"prompt_tokens\": 1000, \"completion_tokens\": 200}', model_ref => 'small'))
               FROM generate_series(1, $2) g",
            &[&run, &((steps / 10) as i32)],
        )
        .expect("record_cost");
        tx.commit().expect("COMMIT");
        let load_s = t.elapsed().as_secs_f64();
        c.batch_execute("ANALYZE ledger.run_steps; ANALYZE ledger.run_cost_entries")
            .expect("ANALYZE");

        let bundle = c
            .prepare("SELECT ledger.replay_bundle($1)::text")
            .expect("prepare");
        let mut lat = Vec::new();
        let mut bytes = 0;
        for _ in 0..s.bundle_calls {
            let t = Instant::now();
            let text: String = c.query_one(&bundle, &[&run]).expect("replay_bundle").get(0);
            lat.push(ms(t));
            bytes = text.len();
        }
        let (m, p95) = (median(&mut lat), percentile(&mut lat, 0.95));
        println!(
            "| `replay_bundle`, {steps} steps + {} costs | {m:.1} ms | {p95:.1} ms | {:.1} MB of JSON; the run was written through the functions in {load_s:.1} s |",
            steps / 10,
            bytes as f64 / 1e6
        );
        medians.push(m);

        let evidence = c
            .prepare("SELECT ledger.run_evidence($1)::text")
            .expect("prepare");
        let mut lat = Vec::new();
        for _ in 0..s.bundle_calls {
            let t = Instant::now();
            c.query_one(&evidence, &[&run]).expect("run_evidence");
            lat.push(ms(t));
        }
        let (m, p95) = (median(&mut lat), percentile(&mut lat, 0.95));
        println!("| `run_evidence`, {steps} steps | {m:.1} ms | {p95:.1} ms | |");
    }
    let [small, large] = s.bundle_steps;
    let ratio = medians[1] / medians[0];
    targets.push(Target {
        what: format!("replay_bundle of {large} steps < 10 × {small} steps"),
        measured: format!(
            "{ratio:.1} × ({:.1} ms vs {:.1} ms)",
            medians[1], medians[0]
        ),
        met: ratio < (large / small) as f64,
    });
}

/// About 1 MB of tool arguments: many records, each with keys and values to redact.
fn big_arguments() -> String {
    let records: Vec<Value> = (0..4_000)
        .map(|i| {
            json!({
                "id": i,
                "name": format!("customer {i}"),
                "email": format!("user{i}@example.com"),
                "apiKey": "k-0123456789abcdef",
                "notes": "Called about the delayed order; promised a refund within five days.",
                "auth": {"header": "Bearer abcdefghijklmnopqrstuvwxyz0123", "token_count": 3},
                "tags": ["vip", "eu", "delayed"],
                "amount": 12.5,
            })
        })
        .collect();
    cjson::canonical(&json!({"query": "bulk update", "records": records}))
}

fn redaction(s: &Settings, targets: &mut Vec<Target>) {
    let text = big_arguments();
    let mb = text.len() as f64 / 1e6;
    let rules = redaction::Rules::default();
    let mut full = Vec::new();
    let mut no_parse = Vec::new();
    for _ in 0..s.redact_iters {
        // What claim_tool_call does with its arguments: parse, hash, redact (+ size summary).
        let t = Instant::now();
        let v = cjson::parse(&text).expect("parse");
        let hash = cjson::request_hash(&v);
        let stored = redaction::summarize_arguments(&rules, v, &hash);
        full.push(mb / t.elapsed().as_secs_f64());
        assert!(stored.get("truncated").is_some() && hash.len() == 64);
        let v = cjson::parse(&text).expect("parse");
        let t = Instant::now();
        let hash = cjson::request_hash(&v);
        let stored = redaction::summarize_arguments(&rules, v, &hash);
        no_parse.push(mb / t.elapsed().as_secs_f64());
        assert!(stored.get("truncated").is_some() && hash.len() == 64);
    }
    let (m, m2) = (median(&mut full), median(&mut no_parse));
    println!(
        "| redaction + hash of {mb:.2} MB arguments (in process) | {m:.0} MB/s | | parse + redact + size summary + sha256 of canonical JSON; {m2:.0} MB/s without the parse |"
    );
    targets.push(Target {
        what: "redaction + hash ≥ 100 MB/s".into(),
        measured: format!("{m:.0} MB/s"),
        met: m >= 100.0,
    });
}
