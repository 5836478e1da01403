//! Throughput of the tool-call lifecycle at several client counts, three ways side by side:
//! the floor (bare single-row INSERT commits), the ledger's functions, and the same lifecycle
//! written application-side, the way a runtime without the ledger does it (SELECT ... FOR
//! UPDATE, INSERT and UPDATE round trips, redaction and hashing in the client, outbox rows).
//!
//! One lifecycle is three transactions: claim; begin; complete with a 2 KB result plus the tool
//! step's transition and a cost entry. The floor runs three INSERT transactions per lifecycle;
//! the notifying floor the same with a NOTIFY in each, as every ledger transaction has one:
//! PostgreSQL serialises the commits of notifying transactions (async.c's PreCommit_Notify takes
//! a cluster-wide lock held until after the commit record is flushed), which the plain floor
//! does not pay.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use postgres::Client;

use crate::designs::{
    app_schema, arguments, notify_setting, result_2kb, writer, Clients, Kind, DESIGNS, TENANT,
    TX_PER_LIFECYCLE, WORKSPACE,
};
use crate::{follower, median, waits, Settings, Target};

const N: usize = DESIGNS.len();

/// The index of the design of `kind` with `notify` (and no budgets).
fn design(kind: Kind, notify: Option<&str>) -> usize {
    DESIGNS
        .iter()
        .position(|d| d.kind == kind && d.notify == notify && !d.budgets)
        .expect("design in the table")
}

struct Shared {
    design: AtomicUsize,
    stop: AtomicBool,
    quit: AtomicBool,
    start: Barrier,
    done: Barrier,
    counts: [AtomicU64; N],
}

/// A figure for each design.
type PerDesign = [f64; N];

/// What one client count measured: per design, lifecycles/s, WAL bytes and machine CPU ms per
/// lifecycle (medians over the runs), and the wait samples when sampled.
pub struct Cell {
    rate: PerDesign,
    wal: PerDesign,
    cpu: PerDesign,
    waits: Option<Vec<waits::Tally>>,
}

/// Lifecycles per second of each design at `clients` clients, and the WAL bytes and machine
/// CPU milliseconds per lifecycle, each the median over `reps` runs; with `sample`, the wait
/// events of the writing backends sampled through the measured runs.
fn cell(s: &Settings, clients: usize, sample: bool) -> Cell {
    let shared = Arc::new(Shared {
        design: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        quit: AtomicBool::new(false),
        start: Barrier::new(clients + 1),
        done: Barrier::new(clients + 1),
        counts: Default::default(),
    });
    let ready = Arc::new(Barrier::new(clients + 1));
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let (shared, ready, conn) = (shared.clone(), ready.clone(), s.lifecycle_conn.clone());
            thread::spawn(move || {
                let mut c = writer(&conn);
                let mut designs = Clients::new(&mut c, i, &format!("lc-{clients}-{i}"));
                let (args, result) = (arguments(), result_2kb());
                ready.wait();
                loop {
                    shared.start.wait();
                    if shared.quit.load(Relaxed) {
                        break;
                    }
                    let d = shared.design.load(Relaxed);
                    c.batch_execute(&notify_setting(&DESIGNS[d]))
                        .expect("ledger.notify");
                    let mut n = 0;
                    while !shared.stop.load(Relaxed) {
                        designs.lifecycle(d, &mut c, &args, &result);
                        n += 1;
                    }
                    shared.counts[d].fetch_add(n, Relaxed);
                    shared.done.wait();
                }
            })
        })
        .collect();
    ready.wait();
    let mut stats = Client::connect(&s.conn, postgres::NoTls).expect("connect");
    let mut rates: [Vec<f64>; N] = Default::default();
    let mut wal: [Vec<f64>; N] = Default::default();
    let mut cpu: [Vec<f64>; N] = Default::default();
    let mut tallies: Vec<waits::Tally> = (0..N).map(|_| waits::Tally::default()).collect();

    // One short unmeasured round first, then the designs interleaved so drift hits them all.
    for rep in 0..=s.reps {
        for d in 0..N {
            shared.counts[d].store(0, Relaxed);
            let (wal0, cpu0) = (wal_position(&mut stats), cpu_ms());
            shared.design.store(d, Relaxed);
            shared.stop.store(false, Relaxed);
            shared.start.wait();
            let t0 = Instant::now();
            let secs = if rep == 0 { s.secs.min(1.0) } else { s.secs };
            let sampler = (sample && rep > 0).then(|| waits::Sampler::start(&s.conn));
            thread::sleep(Duration::from_secs_f64(secs));
            shared.stop.store(true, Relaxed);
            if let Some(sampler) = sampler {
                tallies[d].add(sampler.finish());
            }
            shared.done.wait();
            if rep > 0 {
                let n = shared.counts[d].load(Relaxed) as f64;
                rates[d].push(n / t0.elapsed().as_secs_f64());
                wal[d].push((wal_position(&mut stats) - wal0) / n);
                cpu[d].push((cpu_ms() - cpu0) / n);
            }
        }
        if rep == 0 {
            // Statistics for the warm-up's rows: on tables the planner believes empty it picks
            // secondary indexes and filters (README, Operations), which no running ledger sees.
            stats.batch_execute("ANALYZE").expect("ANALYZE");
        }
    }
    shared.quit.store(true, Relaxed);
    shared.start.wait();
    for h in handles {
        h.join().expect("client thread panicked");
    }
    let m = |xs: [Vec<f64>; N]| xs.map(|mut r| median(&mut r));
    Cell {
        rate: m(rates),
        wal: m(wal),
        cpu: m(cpu),
        waits: sample.then_some(tallies),
    }
}

/// Milliseconds of CPU (user + system, every process) the machine has spent since boot: the
/// benchmark runs beside the cluster, so this counts the backends, the client and the WAL writer.
pub fn cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    // user, nice, system, irq, softirq (USER_HZ = 100 on Linux)
    [0, 1, 2, 5, 6]
        .iter()
        .filter_map(|&i| ticks.get(i))
        .sum::<f64>()
        * 10.0
}

/// Bytes of WAL written so far in the cluster.
fn wal_position(c: &mut Client) -> f64 {
    c.query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::float8", &[])
        .expect("WAL position")
        .get(0)
}

/// Machine CPU ms per lifecycle of the ledger as released in 0.5.0, on this machine, at 1, 8 and
/// 32 clients (issue 28's measurement of a fresh clone): the baseline of the target "at most
/// 0.6 ×".
const CPU_050: [(usize, f64); 3] = [(1, 2.93), (8, 3.17), (32, 4.31)];

/// Lifecycles per design in the statement count.
const COUNTED: usize = 200;

/// Statements per lifecycle of each design, top-level (round trips) and nested (run inside
/// functions: SPI, SQL and PL/pgSQL), counted by pg_stat_statements in a session of its own, one
/// client, after a warm-up. The cluster loads pg_stat_statements with tracking off (bench.sh),
/// so only this session pays for it.
fn statements(s: &Settings) -> Option<Vec<(f64, f64)>> {
    let mut c = writer(&s.conn);
    let on = c.batch_execute(
        "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; \
         SET compute_query_id = on; SET pg_stat_statements.track = 'all'",
    );
    if let Err(e) = on {
        println!("(no statement count: {e})\n");
        return None;
    }
    let mut designs = Clients::new(&mut c, 0, "count");
    let (args, result) = (arguments(), result_2kb());
    let mut counts = Vec::new();
    let ledger = design(Kind::Ledger, None);
    for (d, each) in DESIGNS.iter().enumerate() {
        c.batch_execute(&notify_setting(each))
            .expect("ledger.notify");
        for _ in 0..10 {
            designs.lifecycle(d, &mut c, &args, &result);
        }
        c.batch_execute("SELECT pg_stat_statements_reset()")
            .expect("pg_stat_statements_reset");
        for _ in 0..COUNTED {
            designs.lifecycle(d, &mut c, &args, &result);
        }
        let row = c
            .query_one(
                "SELECT coalesce(sum(calls) FILTER (WHERE toplevel), 0)::float8, \
                        coalesce(sum(calls) FILTER (WHERE NOT toplevel), 0)::float8 \
                   FROM pg_stat_statements \
                  WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                    AND query NOT LIKE '%pg_stat_statements%'",
                &[],
            )
            .expect("pg_stat_statements");
        let per = |v: f64| v / COUNTED as f64;
        counts.push((per(row.get(0)), per(row.get(1))));
        if d == ledger {
            most_frequent_nested(&mut c);
        }
    }
    Some(counts)
}

/// The ledger lifecycle's most frequent nested statements, per lifecycle: where a cut pays.
fn most_frequent_nested(c: &mut Client) {
    let rows = c
        .query(
            "SELECT calls::float8, regexp_replace(query, '\\s+', ' ', 'g') \
               FROM pg_stat_statements \
              WHERE NOT toplevel \
                AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
              ORDER BY calls DESC, query LIMIT 12",
            &[],
        )
        .expect("pg_stat_statements");
    println!("The ledger lifecycle's most frequent nested statements:\n");
    println!("| per lifecycle | statement (first 100 characters) |");
    println!("|---:|---|");
    for r in rows {
        let query: String = r.get(1);
        let short: String = query.chars().take(100).collect();
        println!(
            "| {:.1} | `{}` |",
            r.get::<_, f64>(0) / COUNTED as f64,
            short.replace('|', "\\|").replace('`', "'")
        );
    }
    println!();
}

/// The client count whose runs the wait sampler watches: 32, or the largest of a smoke run.
fn sampled_clients(s: &Settings) -> Option<usize> {
    if s.clients.contains(&32) {
        Some(32)
    } else if s.smoke {
        s.clients.iter().copied().max()
    } else {
        None
    }
}

pub fn run(s: &Settings, targets: &mut Vec<Target>) {
    let mut c = s.connect();
    app_schema(&mut c);
    println!("## Tool-call lifecycle throughput\n");
    if let Some(rtt) = s.rtt {
        let ping = |conn: &str| {
            let mut c = Client::connect(conn, postgres::NoTls).expect("connect");
            let mut lat: Vec<f64> = (0..200)
                .map(|_| {
                    let t = Instant::now();
                    c.simple_query("SELECT 1").expect("SELECT 1");
                    t.elapsed().as_secs_f64() * 1000.0
                })
                .collect();
            median(&mut lat)
        };
        println!(
            "Clients connect through a proxy that adds {:.2} ms per round trip \
             (LEDGER_BENCH_RTT_MS): `SELECT 1` median {:.3} ms through it, {:.3} ms direct. \
             Its threads run on the same cores.\n",
            rtt.as_secs_f64() * 1000.0,
            ping(&s.lifecycle_conn),
            ping(&s.conn)
        );
    }
    println!(
        "Medians of {} runs of {} s each (designs interleaved). A lifecycle is claim; COMMIT; \
         begin; COMMIT; complete (2 KB result) + step transition + cost entry; COMMIT. \
         The floor is {} single-row INSERT commits per lifecycle; the notifying floor the same \
         with a NOTIFY in each, as every ledger transaction has. App-side + feed is the \
         application-side design that also keeps the ledger's run feed (gapless seq, event rows, \
         a NOTIFY per event), which the plain application-side design does not have. Each \
         ledger design's sessions set its `ledger.notify` ({}).\n",
        s.reps,
        s.secs,
        TX_PER_LIFECYCLE,
        DESIGNS
            .iter()
            .filter(|d| d.kind == Kind::Ledger)
            .map(|d| {
                format!(
                    "{}: {}",
                    d.name,
                    d.notify.unwrap_or(
                        "the default, `worker`: the notifier worker where the library is preloaded"
                    )
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    );
    let counts = statements(s);
    if let Some(counts) = &counts {
        println!(
            "Statements per lifecycle (pg_stat_statements, track = all, {COUNTED} lifecycles of \
             one client): top-level are the client's round trips, nested run inside functions.\n"
        );
        println!("| design | top-level | nested | all |");
        println!("|---|---:|---:|---:|");
        for (d, (top, nested)) in counts.iter().enumerate() {
            println!(
                "| {} | {top:.1} | {nested:.1} | {:.1} |",
                DESIGNS[d].name,
                top + nested
            );
        }
        println!();
    }
    let sampled = sampled_clients(s);
    let mut rows = Vec::new();
    for &n in &s.clients {
        rows.push((n, cell(s, n, Some(n) == sampled)));
    }
    let names: Vec<&str> = DESIGNS.iter().map(|d| d.name).collect();
    let table = |title: &str, what: &dyn Fn(&Cell) -> PerDesign, digits: usize| {
        println!("{title}\n");
        println!("| clients | {} |", names.join(" | "));
        println!("|---:|{}", "---:|".repeat(N));
        for (n, cell) in &rows {
            let cells: Vec<String> = what(cell).iter().map(|v| format!("{v:.digits$}")).collect();
            println!("| {n} | {} |", cells.join(" | "));
        }
        println!();
    };
    table("Lifecycles per second:", &|m| m.rate, 0);
    table(
        &format!(
            "Machine CPU per lifecycle, ms (user + system of every process, over the same runs: \
             backends, benchmark client, WAL writer; {} cores):",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        ),
        &|m| m.cpu,
        2,
    );
    table(
        "WAL bytes per lifecycle (over the same runs):",
        &|m| m.wal,
        0,
    );
    let budgeted = DESIGNS
        .iter()
        .position(|d| d.budgets)
        .expect("the budgets design");
    let [floor, notifying, ledger, inline, quiet, app, app_feed] = [
        design(Kind::Floor, None),
        design(Kind::NotifyingFloor, None),
        design(Kind::Ledger, None),
        design(Kind::Ledger, Some("inline")),
        design(Kind::Ledger, Some("off")),
        design(Kind::App, None),
        design(Kind::AppFeed, None),
    ];
    println!("Ratios:\n");
    println!("| clients | floor commits/s | ledger ÷ floor | ledger ÷ notifying floor | ledger ÷ app-side | ledger ÷ app-side + feed | ledger ÷ ledger inline | notify off ÷ floor | notify off ÷ app-side | budgets ÷ ledger |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (n, cell) in &rows {
        let r = &cell.rate;
        println!(
            "| {n} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r[floor] * TX_PER_LIFECYCLE,
            r[ledger] / r[floor],
            r[ledger] / r[notifying],
            r[ledger] / r[app],
            r[ledger] / r[app_feed],
            r[ledger] / r[inline],
            r[quiet] / r[floor],
            r[quiet] / r[app],
            r[budgeted] / r[ledger]
        );
    }
    println!();
    if let Some((n, tallies)) = rows
        .iter()
        .find_map(|(n, cell)| cell.waits.as_ref().map(|w| (n, w)))
    {
        waits::print(*n, &names, tallies);
    }
    check_counts(&mut c);
    for (n, cell) in &rows {
        let (r, n) = (&cell.rate, *n);
        // Issue 28's targets.
        if s.rtt.is_none() && (n == 8 || n == 32) {
            targets.push(Target {
                what: format!("lifecycles ≥ 1.0 × app-side + feed at {n} clients"),
                measured: format!("{:.2} ×", r[ledger] / r[app_feed]),
                met: r[ledger] >= r[app_feed],
            });
            targets.push(Target {
                what: format!("lifecycles ≥ 0.75 × app-side at {n} clients"),
                measured: format!("{:.2} ×", r[ledger] / r[app]),
                met: r[ledger] >= 0.75 * r[app],
            });
        }
        if let Some(rtt) = s.rtt {
            let want = match n {
                1 => Some(2.5),
                8 => Some(1.5),
                32 => Some(1.0),
                _ => None,
            };
            if let Some(want) = want {
                targets.push(Target {
                    what: format!(
                        "with a {:.2} ms round trip: lifecycles ≥ {want} × app-side at {n} clients",
                        rtt.as_secs_f64() * 1000.0
                    ),
                    measured: format!("{:.2} ×", r[ledger] / r[app]),
                    met: r[ledger] >= want * r[app],
                });
            }
        }
        // Issue 29's: what a run's budgets cost a lifecycle (two decisions and a cost counted).
        targets.push(Target {
            what: format!("lifecycles with budgets ≥ 0.9 × without at {n} clients"),
            measured: format!("{:.2} ×", r[budgeted] / r[ledger]),
            met: r[budgeted] >= 0.9 * r[ledger],
        });
        targets.push(Target {
            what: format!("WAL per lifecycle ≤ 8 KB at {n} clients"),
            measured: format!("{:.0} B", cell.wal[ledger]),
            met: cell.wal[ledger] <= 8192.0,
        });
        let cpu = cell.cpu[ledger];
        targets.push(Target {
            what: format!("machine CPU per lifecycle ≤ app-side + feed's at {n} clients"),
            measured: format!("{cpu:.2} vs {:.2} ms", cell.cpu[app_feed]),
            met: cpu <= cell.cpu[app_feed],
        });
        if let Some(&(_, before)) = CPU_050.iter().find(|(k, _)| *k == n) {
            targets.push(Target {
                what: format!(
                    "machine CPU per lifecycle ≤ 0.6 × 0.5.0's {before:.2} ms at {n} clients"
                ),
                measured: format!("{cpu:.2} ms ({:.2} ×)", cpu / before),
                met: cpu <= 0.6 * before,
            });
        }
    }
    follower::run(s, sampled.unwrap_or(32), targets);
}

/// Every lifecycle counted really happened: the ledger's succeeded calls and the application's
/// match what the clients counted (warm-up rounds included on both sides).
fn check_counts(c: &mut Client) {
    c.batch_execute(&format!(
        "SELECT ledger.set_scope('{TENANT}', '{WORKSPACE}')"
    ))
    .expect("set_scope");
    let row = c
        .query_one(
            "SELECT (SELECT count(*) FROM ledger.run_step_tool_calls WHERE status = 'succeeded'),
                    (SELECT count(*) FROM ledger.run_cost_entries),
                    (SELECT count(*) FROM app.run_step_tool_calls WHERE status = 'succeeded'),
                    (SELECT count(*) FROM app.run_cost_entries)",
            &[],
        )
        .expect("count check");
    let (l, lc, a, ac): (i64, i64, i64, i64) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert!(
        l > 0 && l == lc && a > 0 && a == ac,
        "incomplete lifecycles: {l} {lc} {a} {ac}"
    );
    // The application-side feed is what the ledger's is: 8 events per lifecycle, seqs 1..n per run.
    let row = c
        .query_one(
            "SELECT (SELECT count(*) FROM app.run_events),
                    (SELECT count(*) FROM app.runs r JOIN app.run_step_tool_calls t
                        ON t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id
                       AND t.run_id = r.id AND t.status = 'succeeded'
                      WHERE r.last_seq > 0),
                    (SELECT count(*) FROM (SELECT run_id FROM app.run_events GROUP BY run_id
                                            HAVING max(seq) <> count(*)) gaps)",
            &[],
        )
        .expect("feed check");
    let (events, fed, gaps): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert!(
        fed > 0 && events == 8 * fed && gaps == 0,
        "application-side feed: {events} events for {fed} lifecycles, {gaps} runs with gaps"
    );
    println!("Recorded: {l} ledger lifecycles and {a} application-side lifecycles ({fed} with the feed, {events} events), each with its cost entry.\n");
}
