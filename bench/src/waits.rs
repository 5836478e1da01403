//! What the writing backends wait on: `pg_stat_activity` sampled through a design's runs.
//! `Lock:object` is the cluster-wide lock PostgreSQL takes for a notifying commit (async.c's
//! PreCommit_Notify, held through the commit's WAL flush): the share of samples there is the
//! share of the writers' time spent queueing for it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use postgres::Client;

use crate::designs::WRITER;

/// How often the sampler looks.
const EVERY: Duration = Duration::from_millis(10);

/// Samples of active writing backends: one per backend per look.
#[derive(Default)]
pub struct Tally {
    pub samples: u64,
    pub lock_object: u64,
    /// Samples per wait (`type:event`, or `CPU` when the backend waited on nothing).
    by_wait: BTreeMap<String, u64>,
}

impl Tally {
    pub fn share(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.lock_object as f64 / self.samples as f64
        }
    }

    pub fn add(&mut self, other: Tally) {
        self.samples += other.samples;
        self.lock_object += other.lock_object;
        for (k, v) in other.by_wait {
            *self.by_wait.entry(k).or_default() += v;
        }
    }

    /// The most frequent waits, with their counts.
    fn top(&self, k: usize) -> String {
        let mut waits: Vec<_> = self.by_wait.iter().collect();
        waits.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        waits
            .iter()
            .take(k)
            .map(|(w, n)| format!("{w} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A thread that samples the writers until `finish`.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    handle: thread::JoinHandle<Tally>,
}

impl Sampler {
    pub fn start(conn: &str) -> Sampler {
        let mut c = Client::connect(conn, postgres::NoTls).expect("connect");
        let look = c
            .prepare(&format!(
                "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity \
                  WHERE application_name = '{WRITER}' AND state = 'active'"
            ))
            .expect("prepare the sampler");
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = thread::spawn(move || {
            let mut tally = Tally::default();
            while !flag.load(Relaxed) {
                for row in c.query(&look, &[]).expect("pg_stat_activity") {
                    let wait: String = row.get(0);
                    tally.samples += 1;
                    if wait == "Lock:object" {
                        tally.lock_object += 1;
                    }
                    *tally.by_wait.entry(wait).or_default() += 1;
                }
                thread::sleep(EVERY);
            }
            tally
        });
        Sampler { stop, handle }
    }

    pub fn finish(self) -> Tally {
        self.stop.store(true, Relaxed);
        self.handle.join().expect("sampler thread")
    }
}

/// The table of waits per design at `clients` clients.
pub fn print(clients: usize, names: &[&str], tallies: &[Tally]) {
    println!(
        "What the writing backends waited on at {clients} clients (`pg_stat_activity` every {} ms \
         through the measured runs, active writing backends only; CPU: waiting on nothing):\n",
        EVERY.as_millis()
    );
    println!("| design | samples | `Lock:object` | share | most frequent |");
    println!("|---|---:|---:|---:|---|");
    for (name, t) in names.iter().zip(tallies) {
        println!(
            "| {name} | {} | {} | {:.1} % | {} |",
            t.samples,
            t.lock_object,
            t.share() * 100.0,
            t.top(3)
        );
    }
    println!();
}
