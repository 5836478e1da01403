//! What fairness costs a claim (issue 29): throughput of a run's dispatch lifecycle (create_run;
//! claim_run; transition_run to running, then to succeeded, both with the claim's run_token) at
//! several client counts, three ways side by side:
//!
//! - scoped: every client in one scope, each claim takes the scope's best run directly;
//! - across scopes: the runs spread over 8 scopes, each claim with `any_scope => true`, which
//!   serves the scopes in turn (`ledger_dispatch.next_run`);
//! - across scopes, one scope's backlog: the same beside a ninth scope holding a backlog of
//!   queued runs of one concurrency key whose limit is taken. Its runs are live (in
//!   `runs_live_idx`) but none is claimable, so the scope is never served: every claim across
//!   scopes looks at it first (the one served longest ago) and passes over its whole backlog.
//!
//! Each design has a database of its own, so that a claim across scopes sees only its own
//! design's scopes: not the other designs' runs, nor the other parts' runs that stay live.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use postgres::{Client, Config, NoTls, Statement};

use crate::lifecycle::cpu_ms;
use crate::{median, Settings, Target};

const TENANT: &str = "claims";
/// The scopes of the designs across scopes (workspaces w0..w7).
const SCOPES: usize = 8;
/// Lifecycles each client runs, unmeasured, after connecting for a design's round.
const WARM: usize = 5;

struct Design {
    name: &'static str,
    database: &'static str,
    any_scope: bool,
    backlog: bool,
}

const DESIGNS: [Design; 3] = [
    Design {
        name: "scoped",
        database: "ledger_claims_scoped",
        any_scope: false,
        backlog: false,
    },
    Design {
        name: "across scopes",
        database: "ledger_claims_across",
        any_scope: true,
        backlog: false,
    },
    Design {
        name: "across scopes, one scope's backlog",
        database: "ledger_claims_backlog",
        any_scope: true,
        backlog: true,
    },
];
const N: usize = DESIGNS.len();
/// `DESIGNS.len()` as the clients' signal to end.
const QUIT: usize = N;

/// `conn` (a libpq-style string) with another database.
fn connect(conn: &str, database: &str) -> Client {
    let mut config: Config = conn.parse().expect("connection string");
    config
        .dbname(database)
        .connect(NoTls)
        .unwrap_or_else(|e| panic!("cannot connect to {database}: {e}"))
}

/// One client's session in a design's database, with its prepared statements.
struct Worker {
    owner: String,
    /// The session's scope: where its next run is created.
    scope: (String, String),
    create: Statement,
    claim: Statement,
    set_scope: Statement,
    running: Statement,
    succeeded: Statement,
}

impl Worker {
    fn new(c: &mut Client, d: &Design, i: usize) -> Worker {
        let workspace = if d.any_scope {
            format!("w{}", i % SCOPES)
        } else {
            "scoped".into()
        };
        let set_scope = c
            .prepare("SELECT ledger.set_scope($1, $2)")
            .expect("prepare set_scope");
        c.execute(&set_scope, &[&TENANT, &workspace])
            .expect("set_scope");
        let claim = if d.any_scope {
            "SELECT tenant_id, workspace_id, run_id, run_token \
               FROM ledger.claim_run($1, any_scope => true)"
        } else {
            "SELECT tenant_id, workspace_id, run_id, run_token FROM ledger.claim_run($1)"
        };
        let mut p = |sql: &str| c.prepare(sql).expect("prepare");
        Worker {
            owner: format!("claims-{i}"),
            scope: (TENANT.into(), workspace),
            create: p("SELECT ledger.create_run('agent')"),
            claim: p(claim),
            running: p("SELECT status FROM ledger.transition_run($1, 'running', run_token => $2)"),
            succeeded: p(
                "SELECT status FROM ledger.transition_run($1, 'succeeded', run_token => $2)",
            ),
            set_scope,
        }
    }

    /// One run created, claimed (perhaps another client's) and ended.
    fn lifecycle(&mut self, c: &mut Client) {
        c.execute(&self.create, &[]).expect("create_run");
        // Each client in its claim has created one run more than it claimed, so there is a run
        // for every claim under way; a claim still finds none when the one left for it is
        // newer than its snapshot while the others' claims hold theirs (SKIP LOCKED): again.
        let row = loop {
            if let Some(row) = c.query_opt(&self.claim, &[&self.owner]).expect("claim_run") {
                break row;
            }
        };
        let scope: (String, String) = (row.get(0), row.get(1));
        let (run_id, token): (String, i64) = (row.get(2), row.get(3));
        // A claim across scopes may hand out another scope's run, whose writes need its scope
        // (as a worker across scopes does). The client's next run is then created there too:
        // each scope gets a run for the one claimed from it, so the queued runs stay spread over
        // the scopes as the clients started them.
        if scope != self.scope {
            c.execute(&self.set_scope, &[&scope.0, &scope.1])
                .expect("set_scope");
            self.scope = scope;
        }
        for (to, statement) in [("running", &self.running), ("succeeded", &self.succeeded)] {
            let row = c
                .query_one(statement, &[&run_id, &token])
                .expect("transition_run");
            assert_eq!(row.get::<_, &str>(0), to);
        }
    }
}

/// Makes each design's database (the cluster is new every run); the backlog design's gets its
/// backlog.
fn databases(s: &Settings) {
    let mut admin = s.connect();
    for d in &DESIGNS {
        admin
            .batch_execute(&format!("CREATE DATABASE {}", d.database))
            .expect("CREATE DATABASE");
        let mut c = connect(&s.conn, d.database);
        c.batch_execute("CREATE EXTENSION ledger")
            .expect("CREATE EXTENSION");
        if d.backlog {
            // A burst under one key whose limit is taken (one run held for a day): live, not
            // claimable, as when a tenant's key is full.
            c.batch_execute(&format!(
                "SELECT ledger.set_scope('{TENANT}', 'backlog');
                 SELECT ledger.set_concurrency_limit('burst', 1);
                 SELECT count(ledger.create_run('agent', concurrency_key => 'burst'))
                   FROM generate_series(1, {});
                 SELECT count(*) FROM ledger.claim_run('held', lease_seconds => 86400);
                 ANALYZE",
                s.claims_backlog
            ))
            .expect("the backlog");
        }
    }
}

/// Runs per second of each design at `clients` clients and machine CPU ms per run, medians over
/// `reps` runs with the designs interleaved; and how many lifecycles each design ran in all.
fn cell(s: &Settings, clients: usize) -> ([f64; N], [f64; N], [u64; N]) {
    let design = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; N]> = Arc::default();
    let totals: Arc<[AtomicU64; N]> = Arc::default();
    // Each round: the design is set (ready), the clients connect and warm up (start), run, end (done).
    let [ready, start, done] = [(); 3].map(|_| Arc::new(Barrier::new(clients + 1)));
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let (design, stop, counts, totals) =
                (design.clone(), stop.clone(), counts.clone(), totals.clone());
            let (ready, start, done) = (ready.clone(), start.clone(), done.clone());
            let conn = s.lifecycle_conn.clone();
            thread::spawn(move || loop {
                ready.wait();
                let d = design.load(Relaxed);
                if d == QUIT {
                    break;
                }
                // One connection at a time (a connection per client and design would pass
                // max_connections at 128 clients), warmed up before the clock starts.
                let mut c = connect(&conn, DESIGNS[d].database);
                let mut w = Worker::new(&mut c, &DESIGNS[d], i);
                for _ in 0..WARM {
                    w.lifecycle(&mut c);
                }
                start.wait();
                let mut n = 0;
                while !stop.load(Relaxed) {
                    w.lifecycle(&mut c);
                    n += 1;
                }
                counts[d].fetch_add(n, Relaxed);
                totals[d].fetch_add(n + WARM as u64, Relaxed);
                done.wait();
            })
        })
        .collect();
    let mut rates: [Vec<f64>; N] = Default::default();
    let mut cpu: [Vec<f64>; N] = Default::default();
    // One short unmeasured round first, then the designs interleaved so drift hits them all.
    for rep in 0..=s.reps {
        for (d, each) in DESIGNS.iter().enumerate() {
            counts[d].store(0, Relaxed);
            design.store(d, Relaxed);
            stop.store(false, Relaxed);
            ready.wait();
            start.wait();
            let (t0, cpu0) = (Instant::now(), cpu_ms());
            thread::sleep(Duration::from_secs_f64(if rep == 0 {
                s.secs.min(1.0)
            } else {
                s.secs
            }));
            stop.store(true, Relaxed);
            done.wait();
            if rep > 0 {
                let n = counts[d].load(Relaxed) as f64;
                rates[d].push(n / t0.elapsed().as_secs_f64());
                cpu[d].push((cpu_ms() - cpu0) / n);
            } else {
                // Statistics for the warm-up's rows, as the other tables take them.
                connect(&s.conn, each.database)
                    .batch_execute("ANALYZE")
                    .expect("ANALYZE");
            }
        }
    }
    design.store(QUIT, Relaxed);
    ready.wait();
    for h in handles {
        h.join().expect("client thread panicked");
    }
    let m = |xs: [Vec<f64>; N]| xs.map(|mut r| median(&mut r));
    (m(rates), m(cpu), totals.each_ref().map(|t| t.load(Relaxed)))
}

/// Every lifecycle counted ended its run, and no run is left live but the backlog.
fn check(s: &Settings, totals: [u64; N]) {
    for (d, total) in DESIGNS.iter().zip(totals) {
        let row = connect(&s.conn, d.database)
            .query_one(
                "SELECT count(*) FILTER (WHERE status = 'succeeded'),
                        count(*) FILTER (WHERE status <> 'succeeded')
                   FROM ledger.runs",
                &[],
            )
            .expect("count check");
        let (ended, live): (i64, i64) = (row.get(0), row.get(1));
        let backlog = if d.backlog { s.claims_backlog } else { 0 };
        assert!(
            ended as u64 == total && live as usize == backlog,
            "{}: {ended} runs ended and {live} left for {total} lifecycles",
            d.name
        );
    }
}

pub fn run(s: &Settings, targets: &mut Vec<Target>) {
    println!("## What fairness costs a claim\n");
    println!(
        "Runs per second: `create_run`; `claim_run`; `transition_run` to running, then to \
         succeeded, with the claim's `run_token` (4 commits a run; the run claimed may be another \
         client's). Scoped: every client in one scope, `claim_run` takes the scope's best run. \
         Across: {SCOPES} scopes, `claim_run(any_scope => true)` serves them in turn (a run from \
         another scope costs a `set_scope` more). With backlog: the same beside a scope holding \
         {} queued runs of a key whose limit (1) is taken: never served, so every claim looks \
         at it first. Each design in a database of its own; median of {} runs of {} s, \
         interleaved, each after {WARM} unmeasured runs per client.\n",
        s.claims_backlog, s.reps, s.secs
    );
    databases(s);
    println!(
        "| clients | scoped runs/s | across ÷ scoped | across with backlog ÷ scoped | CPU per run, ms: {} |",
        DESIGNS.map(|d| d.name).join(" / ")
    );
    println!("|---:|---:|---:|---:|---:|");
    let mut totals = [0; N];
    for &n in &s.clients {
        let (rate, cpu, done) = cell(s, n);
        for d in 0..N {
            totals[d] += done[d];
        }
        let [scoped, across, backlog] = rate;
        println!(
            "| {n} | {scoped:.0} | {:.2} | {:.2} | {} |",
            across / scoped,
            backlog / scoped,
            cpu.map(|c| format!("{c:.2}")).join(" / ")
        );
        for (what, rate) in [
            ("across-scope claims", across),
            ("across-scope claims beside one scope's backlog", backlog),
        ] {
            targets.push(Target {
                what: format!("{what} ≥ 0.9 × scoped at {n} clients"),
                measured: format!("{:.2} ×", rate / scoped),
                met: rate >= 0.9 * scoped,
            });
        }
    }
    println!();
    check(s, totals);
    // Their autovacuum would otherwise run under the parts that follow.
    let mut admin = s.connect();
    for d in &DESIGNS {
        admin
            .batch_execute(&format!("DROP DATABASE {} WITH (FORCE)", d.database))
            .expect("DROP DATABASE");
    }
}
