//! Throughput of a model turn of four parallel tool calls, two ways side by side: four single
//! calls (each claimed, begun and completed in a transaction of its own: twelve commits) and
//! the batch (`claim_tool_calls(..., begin => true)` in one commit, then the four completions in
//! one transaction: two commits). Same calls, arguments and 2 KB results as the lifecycle table.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use postgres::{Client, Statement};
use serde_json::Value;

use crate::designs::{arguments, result_2kb};
use crate::{median, Settings, Target};

const CALLS: usize = 4;
const TOOL: &str = "crm.lookup_order";
/// The target: the batch turns at least twice as many turns per second.
const TARGET_RATIO: f64 = 2.0;

/// One client's run and prepared statements.
struct Turns {
    run_id: String,
    n: u64,
    claim: Statement,
    claim_batch: Statement,
    begin: Statement,
    complete: Statement,
}

impl Turns {
    fn new(c: &mut Client, run_id: String) -> Turns {
        c.batch_execute(&format!(
            "SELECT ledger.set_scope('bench', 'turns'); \
             SELECT ledger.create_run('agent', run_id => '{run_id}'); \
             SELECT ledger.transition_run('{run_id}', 'running')"
        ))
        .expect("a run");
        let mut p = |sql: &str| c.prepare(sql).expect("prepare");
        Turns {
            claim: p(&format!(
                "SELECT r->>'outcome', r->'tool_call'->>'id', (r->'tool_call'->>'attempt')::bigint \
                   FROM ledger.claim_tool_call($1, '{TOOL}', $2, tool_call_id => $3) AS r"
            )),
            claim_batch: p(
                "SELECT claim->>'outcome', claim->'tool_call'->>'id', (claim->'tool_call'->>'attempt')::bigint \
                   FROM ledger.claim_tool_calls($1, $2, begin => true) ORDER BY index",
            ),
            begin: p("SELECT ledger.begin_tool_call($1, $2)"),
            complete: p("SELECT ledger.complete_tool_call($1, $2, 'succeeded', $3)"),
            run_id,
            n: 0,
        }
    }

    /// The turn's call ids, new every turn.
    fn call_ids(&mut self) -> Vec<String> {
        self.n += 1;
        (0..CALLS).map(|i| format!("t{}-{i}", self.n)).collect()
    }

    /// Twelve commits: claim, begin and complete each call on its own.
    fn singles(&mut self, c: &mut Client, args: &Value, result: &Value) {
        let held: Vec<(String, i64)> = self
            .call_ids()
            .iter()
            .map(|call| {
                let row = c
                    .query_one(&self.claim, &[&self.run_id, args, call])
                    .expect("claim_tool_call");
                assert_eq!(row.get::<_, &str>(0), "claimed");
                (row.get(1), row.get(2))
            })
            .collect();
        for (id, attempt) in &held {
            c.execute(&self.begin, &[id, attempt])
                .expect("begin_tool_call");
        }
        for (id, attempt) in &held {
            c.execute(&self.complete, &[id, attempt, result])
                .expect("complete_tool_call");
        }
    }

    /// Two commits: the batch claimed and begun, then the four completions together.
    fn batch(&mut self, c: &mut Client, args: &Value, result: &Value) {
        let calls: Vec<Value> = self
            .call_ids()
            .into_iter()
            .map(|id| serde_json::json!({"tool_ref": TOOL, "arguments": args, "tool_call_id": id}))
            .collect();
        let rows = c
            .query(&self.claim_batch, &[&self.run_id, &Value::Array(calls)])
            .expect("claim_tool_calls");
        let mut tx = c.transaction().expect("BEGIN");
        for row in &rows {
            assert_eq!(row.get::<_, &str>(0), "claimed");
            let (id, attempt): (String, i64) = (row.get(1), row.get(2));
            tx.execute(&self.complete, &[&id, &attempt, result])
                .expect("complete_tool_call");
        }
        tx.commit().expect("COMMIT");
    }
}

/// Turns per second of the single calls and of the batch at `clients` clients, each the median
/// over `reps` runs, the two interleaved so that drift hits both.
fn cell(s: &Settings, clients: usize) -> [f64; 2] {
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 2]> = Arc::default();
    // Every round: the design (0 singles, 1 batch, 2 quit) handed to each client, then its end.
    let (start, done) = (
        Arc::new(Barrier::new(clients + 1)),
        Arc::new(Barrier::new(clients + 1)),
    );
    let design = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let (stop, counts, start, done, design) = (
                stop.clone(),
                counts.clone(),
                start.clone(),
                done.clone(),
                design.clone(),
            );
            let conn = s.lifecycle_conn.clone();
            thread::spawn(move || {
                let mut c = Client::connect(&conn, postgres::NoTls).expect("connect");
                let mut turns = Turns::new(&mut c, format!("turn-{clients}-{i}"));
                let (args, result) = (arguments(), result_2kb());
                loop {
                    start.wait();
                    let d = design.load(Relaxed) as usize;
                    if d == 2 {
                        break;
                    }
                    let mut n = 0;
                    while !stop.load(Relaxed) {
                        if d == 0 {
                            turns.singles(&mut c, &args, &result);
                        } else {
                            turns.batch(&mut c, &args, &result);
                        }
                        n += 1;
                    }
                    counts[d].fetch_add(n, Relaxed);
                    done.wait();
                }
            })
        })
        .collect();
    let mut rates: [Vec<f64>; 2] = Default::default();
    // One short unmeasured round first.
    for rep in 0..=s.reps {
        for d in 0..2 {
            counts[d].store(0, Relaxed);
            design.store(d as u64, Relaxed);
            stop.store(false, Relaxed);
            start.wait();
            let t0 = Instant::now();
            thread::sleep(Duration::from_secs_f64(if rep == 0 {
                s.secs.min(1.0)
            } else {
                s.secs
            }));
            stop.store(true, Relaxed);
            done.wait();
            if rep > 0 {
                rates[d].push(counts[d].load(Relaxed) as f64 / t0.elapsed().as_secs_f64());
            }
        }
        if rep == 0 {
            // Statistics for the warm-up's rows, as the lifecycle table takes them (a planner
            // that believes the tables empty picks plans no running ledger sees).
            s.connect().batch_execute("ANALYZE").expect("ANALYZE");
        }
    }
    design.store(2, Relaxed);
    start.wait();
    for h in handles {
        h.join().expect("client thread panicked");
    }
    rates.map(|mut r| median(&mut r))
}

pub fn run(s: &Settings, targets: &mut Vec<Target>) {
    println!("## A turn of {CALLS} parallel tool calls\n");
    println!(
        "Turns per second (each call claimed, begun and completed with a 2 KB result). Single: \
         each call's claim, begin and completion in its own transaction (12 commits a turn). \
         Batch: `claim_tool_calls(..., begin => true)` in one commit, then the {CALLS} \
         completions in one transaction (2 commits). Median of {} runs of {} s, interleaved.\n",
        s.reps, s.secs
    );
    println!("| clients | single calls | batch | batch / single |");
    println!("|---|---|---|---|");
    for &clients in &s.clients {
        let [single, batch] = cell(s, clients);
        let ratio = batch / single;
        println!("| {clients} | {single:.0} | {batch:.0} | {ratio:.2} x |");
        targets.push(Target {
            what: format!(
                "a turn of {CALLS} parallel calls, batch >= {TARGET_RATIO} x single at {clients} clients"
            ),
            measured: format!("{ratio:.2} x"),
            met: ratio >= TARGET_RATIO,
        });
    }
    println!();
}
