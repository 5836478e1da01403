//! The ledger benchmark (BENCHMARKS.md). `make bench` (pgrx-tests/bench.sh) starts a durable
//! cluster with the extension and runs this against it; the results are printed as Markdown.
//!
//! Environment: LEDGER_BENCH_CONN (a libpq-style connection string, required) and
//! LEDGER_BENCH_SMOKE=1 for the 30-second smoke (same code paths, tiny sizes, no verdicts);
//! LEDGER_BENCH_CLIENTS=8,32 to measure throughput at other client counts;
//! LEDGER_BENCH_RTT_MS=0.5 to add that network round-trip time between those clients and the server;
//! LEDGER_BENCH_ONLY=lifecycle, turns, claims or reads to run one part alone.

mod claims;
mod designs;
mod follower;
mod latency;
mod lifecycle;
mod reads;
mod turns;
mod waits;

use std::time::Instant;

pub struct Settings {
    pub conn: String,
    /// What the lifecycle clients connect with: `conn`, or the delaying proxy in front of it.
    pub lifecycle_conn: String,
    /// LEDGER_BENCH_RTT_MS: the round-trip time the proxy adds.
    pub rtt: Option<std::time::Duration>,
    pub smoke: bool,
    /// Seconds per measured throughput run, and how many runs each median is over.
    pub secs: f64,
    pub reps: usize,
    pub clients: Vec<usize>,
    /// Runs and events per run in the events_since table.
    pub event_runs: usize,
    pub events_per_run: usize,
    pub page_queries: usize,
    pub bundle_steps: [usize; 2],
    pub bundle_calls: usize,
    pub wakeups: usize,
    pub redact_iters: usize,
    /// Queued runs in the busy scope of the claims table.
    pub claims_backlog: usize,
}

impl Settings {
    fn from_env() -> Settings {
        let conn = std::env::var("LEDGER_BENCH_CONN")
            .expect("LEDGER_BENCH_CONN must be set (run the benchmark through `make bench`)");
        if std::env::var("LEDGER_BENCH_SMOKE").as_deref() == Ok("1") {
            Settings {
                lifecycle_conn: conn.clone(),
                rtt: None,
                conn,
                smoke: true,
                secs: 1.0,
                reps: 1,
                clients: vec![1, 8],
                event_runs: 10,
                events_per_run: 1_000,
                page_queries: 100,
                bundle_steps: [100, 1_000],
                bundle_calls: 2,
                wakeups: 30,
                redact_iters: 3,
                claims_backlog: 1_000,
            }
        } else {
            Settings {
                lifecycle_conn: conn.clone(),
                rtt: None,
                conn,
                smoke: false,
                secs: 4.0,
                reps: 3,
                clients: vec![1, 8, 32, 128],
                event_runs: 100,
                events_per_run: 10_000,
                page_queries: 2_000,
                bundle_steps: [1_000, 10_000],
                bundle_calls: 5,
                wakeups: 300,
                redact_iters: 15,
                claims_backlog: 10_000,
            }
        }
    }

    /// LEDGER_BENCH_CLIENTS (e.g. `8,32`) replaces the client counts of the throughput table;
    /// LEDGER_BENCH_RTT_MS (e.g. `0.5`) puts that round-trip time between its clients and the
    /// server.
    fn with_overrides_from_env(mut self) -> Settings {
        if let Ok(ms) = std::env::var("LEDGER_BENCH_RTT_MS") {
            let ms: f64 = ms.parse().expect("LEDGER_BENCH_RTT_MS: milliseconds");
            let rtt = std::time::Duration::from_secs_f64(ms / 1000.0);
            self.lifecycle_conn = latency::start(&self.conn, rtt);
            self.rtt = Some(rtt);
        }
        if let Ok(list) = std::env::var("LEDGER_BENCH_CLIENTS") {
            self.clients = list
                .split(',')
                .map(|n| {
                    n.trim()
                        .parse()
                        .expect("LEDGER_BENCH_CLIENTS: numbers, comma-separated")
                })
                .collect();
        }
        self
    }

    pub fn connect(&self) -> postgres::Client {
        postgres::Client::connect(&self.conn, postgres::NoTls)
            .unwrap_or_else(|e| panic!("cannot connect with {:?}: {e}", self.conn))
    }
}

pub fn median(xs: &mut [f64]) -> f64 {
    assert!(!xs.is_empty(), "median of nothing");
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// The value below which `p` (0..1) of the sorted samples lie.
pub fn percentile(xs: &mut [f64], p: f64) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    let i = ((xs.len() as f64 - 1.0) * p).round() as usize;
    xs[i]
}

/// One verdict line of the targets table.
pub struct Target {
    pub what: String,
    pub measured: String,
    pub met: bool,
}

/// A table of verdicts under `title`, when there are any.
fn verdicts(title: &str, list: &[Target], smoke: bool) {
    if list.is_empty() {
        return;
    }
    println!("## {title}\n");
    println!("| target | measured | met |");
    println!("|---|---|---|");
    for t in list {
        let verdict = match (smoke, t.met) {
            (true, _) => "(smoke)",
            (false, true) => "yes",
            (false, false) => "**no**",
        };
        println!("| {} | {} | {} |", t.what, t.measured, verdict);
    }
    println!();
}

fn main() {
    // A panicking client thread would leave the others waiting at a barrier: end the process.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::exit(101);
    }));
    let s = Settings::from_env().with_overrides_from_env();
    let started = Instant::now();
    // Issues 28's and 29's targets; the reads' standing checks (earlier issues) get a table of
    // their own.
    let mut targets = Vec::new();
    let mut checks = Vec::new();
    println!(
        "# ledger benchmark{}\n",
        if s.smoke {
            " (smoke: tiny sizes, no verdicts)"
        } else {
            ""
        }
    );
    // LEDGER_BENCH_ONLY=turns (or lifecycle, claims, reads): one part alone.
    let only = std::env::var("LEDGER_BENCH_ONLY").ok();
    let part = |name: &str| only.as_deref().is_none_or(|o| o == name);
    if part("lifecycle") {
        lifecycle::run(&s, &mut targets);
    }
    if part("turns") {
        turns::run(&s, &mut targets);
    }
    if part("claims") {
        claims::run(&s, &mut targets);
    }
    if part("reads") {
        reads::run(&s, &mut checks);
    }
    verdicts("Targets", &targets, s.smoke);
    verdicts("Standing checks (reads, earlier issues)", &checks, s.smoke);
    println!(
        "\nbenchmark finished in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}
