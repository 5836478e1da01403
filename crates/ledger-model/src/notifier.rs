//! The notifier's table of wake-ups: which channels have committed news that no listener has been
//! told about yet, per database, and the state of each database's notifier worker.
//!
//! The extension keeps one table in shared memory under a lock (`src/notifier.rs`). Before its
//! commit a writer reserves room for its channels, or learns that it must notify by itself (no
//! live worker, or the table is full: nothing is ever dropped); at commit it publishes them and
//! wakes the worker, which takes what is ready and sends one notification per channel. A run's
//! later commits raise the seq of the entry already waiting, so a burst on one run costs one
//! notification. Entries of a prepared transaction wait until it ends, and are sent only if it
//! committed. One transaction reserves at most `TRANSACTION_CHANNELS` channels: beyond it, an
//! ordinary commit notifies by itself, and a prepared transaction parks only that many (see
//! `src/notifier.rs`), so that no single transaction holds the table.

use crate::error::{Code, LedgerError, Result};
use crate::hash;
use heapless::{FnvIndexMap, String};

/// Most entries the table holds (a power of two, as the map requires). A writer that finds it
/// full notifies by itself.
pub const CAPACITY: usize = 1024;

/// Most channels one transaction may reserve (a sixteenth of the largest table): a prepared
/// transaction's news waits there until it ends, and one transaction must not hold the table.
pub const TRANSACTION_CHANNELS: usize = 64;

/// `ledger.notifier_status()` shows the whole database's notification traffic (every tenant's
/// commits move its counters): for operators and the ledger's owner only, 42501
/// `OPERATOR_REQUIRED` for anyone else.
pub fn check_status_reader(operator_or_owner: bool) -> Result<()> {
    if operator_or_owner {
        return Ok(());
    }
    Err(LedgerError::new(Code::OperatorRequired,
        "notifier_status shows every scope's notifications: for members of ledger_operator or ledger_owner",
    )
    .with("role", "ledger_operator"))
}

/// Where a prepared transaction whose news waits in the table stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prepared {
    InProgress,
    Committed,
    /// Rolled back: its news is dropped, since nothing it wrote is visible.
    Aborted,
}

/// Most databases with a notifier at once; a writer of any other database notifies by itself.
pub const DATABASES: usize = 32;

/// A worker whose heartbeat is older than this is taken for gone (microseconds).
pub const STALE_US: i64 = 2_000_000;

/// A start that has not attached after this long is taken for failed (microseconds).
pub const START_TIMEOUT_US: i64 = 5_000_000;

/// After this long without anything to send, the worker leaves (microseconds), so that a
/// database it is connected to can be dropped or used as a template.
pub const IDLE_EXIT_US: i64 = 2_000_000;

/// Attempts to start a worker that never attached before its database's entries are dropped
/// (the database is gone, or cannot be connected to).
pub const MAX_FAILED_STARTS: u32 = 3;

/// The channel of a run's feed (`ledger_run_` and 32 hex digits of its digest), of the outbox, or
/// of idle workers (`ledger_runs`: some run may have become claimable).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Channel {
    Run([u8; 16]),
    Outbox,
    Runs,
}

/// The channel idle workers listen on.
pub const RUNS_CHANNEL: &str = "ledger_runs";

impl Channel {
    pub fn name(&self) -> std::string::String {
        match self {
            Channel::Run(digest) => format!("{}{}", hash::RUN_CHANNEL_PREFIX, hash::hex(digest)),
            Channel::Outbox => "ledger_outbox".to_owned(),
            Channel::Runs => RUNS_CHANNEL.to_owned(),
        }
    }
}

/// What a committed transaction tells a channel: the run and its last seq, or the last outbox
/// event's id (seq 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct News<'a> {
    pub channel: Channel,
    pub subject: &'a str,
    pub seq: i64,
}

/// A notification to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub channel: std::string::String,
    pub payload: std::string::String,
}

impl News<'_> {
    pub fn note(&self) -> Note {
        Note {
            channel: self.channel.name(),
            payload: payload(self.channel, self.subject, self.seq),
        }
    }
}

/// A run channel's payload is `{"run_id", "seq"}` (events up to `seq` are committed); the
/// outbox channel's is an event id, as when writers notify by themselves; `ledger_runs`' is
/// empty (it names no scope).
fn payload(channel: Channel, subject: &str, seq: i64) -> std::string::String {
    match channel {
        Channel::Run(_) => serde_json::json!({"run_id": subject, "seq": seq}).to_string(),
        Channel::Outbox => subject.to_owned(),
        Channel::Runs => std::string::String::new(),
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    database: u32,
    /// The prepared transaction the news waits for, 0 when committed.
    prepared: u32,
    channel: Channel,
}

/// Most bytes of a subject (a run or outbox event id) the table keeps; news about a longer one is
/// sent by its writer.
pub const SUBJECT_BYTES: usize = 128;

#[derive(Clone, Debug)]
struct Wake {
    subject: String<SUBJECT_BYTES>,
    seq: i64,
}

/// One database's notifier. `oid` 0: a free slot.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct Database {
    pub oid: u32,
    /// The worker's process id, 0 when none is attached.
    pub pid: i32,
    /// The worker's latch (an address in shared memory), set to wake it.
    pub latch: usize,
    pub heartbeat: i64,
    /// When a writer asked the postmaster for a worker (or it started connecting).
    pub starting_since: Option<i64>,
    pub failed_starts: u32,
    /// Room reserved by writers between their pre-commit and commit.
    pub reserved: u32,
    /// Entries waiting in the table.
    pub waiting: u32,
    /// Notifications the workers sent, and commits whose writer notified by itself.
    pub sent: u64,
    pub by_writers: u64,
}

impl Database {
    fn live(&self, now: i64) -> bool {
        self.pid != 0 && now - self.heartbeat < STALE_US
    }

    fn starting(&self, now: i64) -> bool {
        self.starting_since
            .is_some_and(|t| now - t < START_TIMEOUT_US)
    }

    fn free(&self, now: i64) -> bool {
        self.oid == 0
            || (self.pid == 0 && !self.starting(now) && self.waiting == 0 && self.reserved == 0)
    }
}

/// What a writer does at pre-commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Room is reserved: publish at commit (or release at abort).
    Worker,
    /// Notify now, by itself; `start`: and ask the postmaster for a worker (it is the first to
    /// find none on its way).
    Writer { start: bool },
}

/// What a starting worker does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach {
    /// Connect, then `attached`.
    Connect,
    /// Another worker serves the database, or there is nothing to do: leave (exit 0).
    Leave,
}

pub struct Wakeups {
    entries: FnvIndexMap<Key, Wake, CAPACITY>,
    databases: [Database; DATABASES],
    reserved: usize,
}

impl Default for Wakeups {
    fn default() -> Self {
        Wakeups {
            entries: FnvIndexMap::new(),
            databases: [Database::default(); DATABASES],
            reserved: 0,
        }
    }
}

impl Wakeups {
    fn slot(&self, oid: u32) -> Option<usize> {
        self.databases.iter().position(|d| d.oid == oid)
    }

    /// The database's slot, claiming a free one (None: all in use).
    fn slot_or_claim(&mut self, oid: u32, now: i64) -> Option<usize> {
        if let Some(i) = self.slot(oid) {
            return Some(i);
        }
        let i = self.databases.iter().position(|d| d.free(now))?;
        self.databases[i] = Database {
            oid,
            ..Database::default()
        };
        Some(i)
    }

    pub fn database(&self, oid: u32) -> Option<Database> {
        self.slot(oid).map(|i| self.databases[i])
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A writer of `oid` about to commit `news`. `limit` caps the table below `CAPACITY`
    /// (`ledger.notifier_capacity`); more than `TRANSACTION_CHANNELS` channels are the writer's
    /// to send.
    pub fn reserve(&mut self, oid: u32, news: &[News], limit: usize, now: i64) -> Decision {
        let Some(i) = self.slot_or_claim(oid, now) else {
            return Decision::Writer { start: false };
        };
        let channels = news.len();
        let fits = channels <= TRANSACTION_CHANNELS
            && news.iter().all(|n| n.subject.len() <= SUBJECT_BYTES);
        let room = limit.min(CAPACITY);
        let db = &mut self.databases[i];
        if fits && db.live(now) && self.entries.len() + self.reserved + channels <= room {
            db.reserved += channels as u32;
            self.reserved += channels;
            return Decision::Worker;
        }
        db.by_writers += 1;
        let start = !db.live(now) && !db.starting(now);
        if start {
            db.starting_since = Some(now);
        }
        Decision::Writer { start }
    }

    /// The postmaster refused the worker (no free background worker slot): the next writer
    /// may ask again.
    pub fn start_refused(&mut self, oid: u32) {
        if let Some(i) = self.slot(oid) {
            self.databases[i].starting_since = None;
        }
    }

    /// Gives back a reservation (the transaction aborted).
    pub fn release(&mut self, oid: u32, channels: usize) {
        if let Some(i) = self.slot(oid) {
            let db = &mut self.databases[i];
            db.reserved = db.reserved.saturating_sub(channels as u32);
        }
        self.reserved = self.reserved.saturating_sub(channels);
    }

    /// Publishes what a transaction reserved room for at commit (`prepared` 0) or at PREPARE
    /// (its xid), releasing the reservation; returns the worker's latch to set (0: none).
    /// Never fails: the reservation made the room.
    pub fn publish<'a>(
        &mut self,
        oid: u32,
        prepared: u32,
        news: impl IntoIterator<Item = News<'a>>,
        reserved: usize,
    ) -> usize {
        self.release(oid, reserved);
        let Some(i) = self.slot(oid) else {
            return 0;
        };
        for n in news {
            let key = Key {
                database: oid,
                prepared,
                channel: n.channel,
            };
            match self.entries.get_mut(&key) {
                Some(w) => {
                    if n.seq >= w.seq {
                        if let Ok(subject) = String::try_from(n.subject) {
                            w.seq = n.seq;
                            w.subject = subject;
                        }
                    }
                }
                None => {
                    let Ok(subject) = String::try_from(n.subject) else {
                        continue;
                    };
                    let wake = Wake {
                        subject,
                        seq: n.seq,
                    };
                    if self.entries.insert(key, wake).is_ok() {
                        self.databases[i].waiting += 1;
                    }
                }
            }
        }
        self.databases[i].latch
    }

    /// Takes the database's entries that are ready (committed, or of a prepared transaction that
    /// committed) as notifications, and drops those of a prepared transaction rolled back;
    /// returns how many prepared ones still wait.
    pub fn take(
        &mut self,
        oid: u32,
        prepared: impl Fn(u32) -> Prepared,
        out: &mut Vec<Note>,
    ) -> usize {
        let mut parked = 0;
        self.entries.retain(|k, w| {
            if k.database != oid {
                return true;
            }
            if k.prepared != 0 {
                match prepared(k.prepared) {
                    Prepared::InProgress => {
                        parked += 1;
                        return true;
                    }
                    Prepared::Aborted => return false,
                    Prepared::Committed => {}
                }
            }
            out.push(
                News {
                    channel: k.channel,
                    subject: &w.subject,
                    seq: w.seq,
                }
                .note(),
            );
            false
        });
        if let Some(i) = self.slot(oid) {
            let db = &mut self.databases[i];
            db.waiting = parked as u32;
            db.sent += out.len() as u64;
        }
        parked
    }

    /// A worker for `oid` starting. `restarted`: by the postmaster after an exit, not asked for
    /// by a writer. It leaves when another live worker serves the database, when there is nothing
    /// to do after a restart, and when too many starts failed before it (the entries are
    /// dropped: the database is gone or refuses connections; followers catch up on their poll).
    pub fn attach(&mut self, oid: u32, pid: i32, now: i64) -> Attach {
        let Some(i) = self.slot_or_claim(oid, now) else {
            return Attach::Leave;
        };
        let db = &mut self.databases[i];
        if db.pid != 0 && db.pid != pid && db.live(now) {
            return Attach::Leave;
        }
        let asked = db.starting(now);
        if !asked && db.waiting == 0 && db.reserved == 0 {
            db.pid = 0;
            return Attach::Leave;
        }
        if db.failed_starts >= MAX_FAILED_STARTS {
            self.entries.retain(|k, _| k.database != oid);
            let db = &mut self.databases[i];
            *db = Database {
                oid,
                ..Database::default()
            };
            return Attach::Leave;
        }
        db.failed_starts += 1;
        // connecting: writers wait for it rather than ask for another
        db.starting_since = Some(now);
        Attach::Connect
    }

    /// The worker is connected and serves the database from now on.
    pub fn attached(&mut self, oid: u32, pid: i32, latch: usize, now: i64) {
        if let Some(i) = self.slot(oid) {
            let db = &mut self.databases[i];
            db.pid = pid;
            db.latch = latch;
            db.heartbeat = now;
            db.starting_since = None;
            db.failed_starts = 0;
        }
    }

    pub fn heartbeat(&mut self, oid: u32, pid: i32, now: i64) {
        if let Some(i) = self.slot(oid) {
            if self.databases[i].pid == pid {
                self.databases[i].heartbeat = now;
            }
        }
    }

    /// The worker may leave when nothing waits and nobody holds a reservation (a writer between
    /// pre-commit and commit counts on it); it is detached when it may.
    pub fn leave_if_idle(&mut self, oid: u32, pid: i32) -> bool {
        let Some(i) = self.slot(oid) else {
            return true;
        };
        let db = &mut self.databases[i];
        if db.waiting != 0 || db.reserved != 0 {
            return false;
        }
        if db.pid == pid {
            db.pid = 0;
            db.latch = 0;
        }
        true
    }

    /// The worker's process is exiting; true when entries still wait (it should be restarted).
    pub fn detach(&mut self, oid: u32, pid: i32) -> bool {
        let Some(i) = self.slot(oid) else {
            return false;
        };
        let db = &mut self.databases[i];
        if db.pid == pid {
            db.pid = 0;
            db.latch = 0;
        }
        db.waiting != 0 || db.reserved != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Class;

    const DB: u32 = 16384;
    const S: i64 = 1_000_000;

    fn run(n: u8) -> Channel {
        Channel::Run([n; 16])
    }

    fn news(channel: Channel, subject: &str, seq: i64) -> News<'_> {
        News {
            channel,
            subject,
            seq,
        }
    }

    /// `k` pieces of news about short ids.
    fn some(k: usize) -> Vec<News<'static>> {
        (0..k).map(|i| news(run(i as u8), "run_x", 1)).collect()
    }

    /// A table whose worker for DB attached at `now`.
    fn served(now: i64) -> Wakeups {
        let mut w = Wakeups::default();
        assert_eq!(
            w.reserve(DB, &some(1), CAPACITY, now),
            Decision::Writer { start: true }
        );
        assert_eq!(w.attach(DB, 42, now), Attach::Connect);
        w.attached(DB, 42, 0xbeef, now);
        w
    }

    fn taken(w: &mut Wakeups, oid: u32) -> Vec<Note> {
        let mut out = Vec::new();
        w.take(oid, |_| Prepared::Committed, &mut out);
        out
    }

    #[test]
    fn the_first_writer_starts_a_worker_and_the_next_ones_wait_for_it_to_attach() {
        let mut w = Wakeups::default();
        assert_eq!(
            w.reserve(DB, &some(1), CAPACITY, 0),
            Decision::Writer { start: true }
        );
        assert_eq!(
            w.reserve(DB, &some(1), CAPACITY, S),
            Decision::Writer { start: false }
        );
        // a start that never attached is given up after START_TIMEOUT_US
        assert_eq!(
            w.reserve(DB, &some(1), CAPACITY, START_TIMEOUT_US + 1),
            Decision::Writer { start: true }
        );
        assert_eq!(w.database(DB).unwrap().by_writers, 3);
    }

    #[test]
    fn commits_coalesce_per_channel_with_the_highest_seq() {
        let mut w = served(0);
        for seq in [3, 5, 4] {
            assert_eq!(w.reserve(DB, &some(2), CAPACITY, S), Decision::Worker);
            let latch = w.publish(
                DB,
                0,
                [
                    news(run(1), "run_a", seq),
                    news(Channel::Outbox, "obx_1", 0),
                ],
                2,
            );
            assert_eq!(latch, 0xbeef);
        }
        assert_eq!(w.len(), 2);
        let mut notes = taken(&mut w, DB);
        notes.sort_by(|a, b| a.channel.cmp(&b.channel));
        assert_eq!(
            notes,
            vec![
                Note {
                    channel: "ledger_outbox".into(),
                    payload: "obx_1".into()
                },
                Note {
                    channel: format!("ledger_run_{}", "01".repeat(16)),
                    payload: r#"{"run_id":"run_a","seq":5}"#.into()
                },
            ]
        );
        assert!(w.is_empty());
        let db = w.database(DB).unwrap();
        assert_eq!((db.waiting, db.reserved, db.sent), (0, 0, 2));
    }

    #[test]
    fn a_full_table_sends_writers_to_notify_themselves_and_nothing_is_dropped() {
        let mut w = served(0);
        assert_eq!(w.reserve(DB, &some(2), 3, S), Decision::Worker);
        // reserved room counts: 2 of 3 are promised
        assert_eq!(
            w.reserve(DB, &some(2), 3, S),
            Decision::Writer { start: false }
        );
        assert_eq!(w.reserve(DB, &some(1), 3, S), Decision::Worker);
        w.publish(DB, 0, [news(run(1), "a", 1), news(run(2), "b", 1)], 2);
        w.publish(DB, 0, [news(run(3), "c", 1)], 1);
        assert_eq!(
            w.reserve(DB, &some(1), 3, S),
            Decision::Writer { start: false }
        );
        assert_eq!(taken(&mut w, DB).len(), 3);
        assert_eq!(w.reserve(DB, &some(1), 3, S), Decision::Worker);
    }

    #[test]
    fn an_abort_gives_the_room_back() {
        let mut w = served(0);
        assert_eq!(w.reserve(DB, &some(3), 3, S), Decision::Worker);
        assert!(!w.leave_if_idle(DB, 42), "a writer counts on the worker");
        w.release(DB, 3);
        assert_eq!(w.reserve(DB, &some(3), 3, S), Decision::Worker);
        w.release(DB, 3);
        assert!(w.leave_if_idle(DB, 42));
        assert_eq!(w.database(DB).unwrap().pid, 0);
    }

    #[test]
    fn a_stale_worker_sends_writers_to_notify_themselves_and_start_another() {
        let mut w = served(0);
        assert_eq!(
            w.reserve(DB, &some(1), CAPACITY, STALE_US - 1),
            Decision::Worker
        );
        w.publish(DB, 0, [news(run(1), "a", 1)], 1);
        assert_eq!(
            w.reserve(DB, &some(1), CAPACITY, STALE_US),
            Decision::Writer { start: true }
        );
        // the new worker leaves: the old one is alive again and serves the database
        w.heartbeat(DB, 42, STALE_US + 1);
        assert_eq!(w.attach(DB, 43, STALE_US + 2), Attach::Leave);
        assert_eq!(taken(&mut w, DB).len(), 1);
    }

    #[test]
    fn a_worker_restarted_with_nothing_to_do_leaves_and_one_with_work_stays() {
        let mut w = served(0);
        assert_eq!(w.reserve(DB, &some(1), CAPACITY, S), Decision::Worker);
        w.publish(DB, 0, [news(run(1), "a", 7)], 1);
        assert!(w.detach(DB, 42), "entries wait: restart");
        assert_eq!(w.attach(DB, 43, 2 * S), Attach::Connect);
        w.attached(DB, 43, 0xf00d, 2 * S);
        assert_eq!(taken(&mut w, DB).len(), 1);
        assert!(!w.detach(DB, 43));
        assert_eq!(w.attach(DB, 44, 3 * S), Attach::Leave);
    }

    #[test]
    fn a_database_that_cannot_be_connected_to_is_given_up() {
        let mut w = Wakeups::default();
        w.reserve(DB, &some(1), CAPACITY, 0);
        for n in 0..MAX_FAILED_STARTS {
            assert_eq!(w.attach(DB, 50 + n as i32, 1), Attach::Connect);
        }
        assert_eq!(w.attach(DB, 60, 2), Attach::Leave);
        assert_eq!(w.database(DB).unwrap().failed_starts, 0);
    }

    #[test]
    fn prepared_news_waits_for_the_prepared_transaction() {
        let mut w = served(0);
        assert_eq!(w.reserve(DB, &some(1), CAPACITY, S), Decision::Worker);
        w.publish(DB, 777, [news(run(1), "a", 2)], 1);
        let mut out = Vec::new();
        let in_progress = |xid| match xid {
            777 => Prepared::InProgress,
            _ => Prepared::Committed,
        };
        assert_eq!(w.take(DB, in_progress, &mut out), 1);
        assert!(out.is_empty());
        assert!(!w.leave_if_idle(DB, 42));
        assert_eq!(w.take(DB, |_| Prepared::Committed, &mut out), 0);
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn the_status_is_for_operators_and_owners() {
        assert!(check_status_reader(true).is_ok());
        let e = check_status_reader(false).unwrap_err();
        assert_eq!(
            (e.class(), e.code),
            (Class::Privilege, Code::OperatorRequired)
        );
        assert_eq!(e.detail["role"], "ledger_operator");
    }

    #[test]
    fn a_rolled_back_prepared_transaction_wakes_nobody() {
        let mut w = served(0);
        assert_eq!(w.reserve(DB, &some(2), CAPACITY, S), Decision::Worker);
        w.publish(DB, 777, [news(run(1), "a", 2), news(run(2), "b", 1)], 2);
        assert_eq!(w.reserve(DB, &some(1), CAPACITY, S), Decision::Worker);
        w.publish(DB, 0, [news(run(3), "c", 4)], 1);
        let mut out = Vec::new();
        assert_eq!(w.take(DB, |_| Prepared::Aborted, &mut out), 0);
        assert_eq!(out.len(), 1, "only the committed news: {out:?}");
        assert!(out[0].payload.contains("\"c\""));
        assert!(w.is_empty());
        assert_eq!(w.database(DB).unwrap().waiting, 0);
        assert!(w.leave_if_idle(DB, 42));
    }

    #[test]
    fn one_transaction_reserves_at_most_its_bound() {
        let mut w = served(0);
        // Beyond the bound the writer sends its news itself; the room stays free for others.
        assert_eq!(
            w.reserve(DB, &some(TRANSACTION_CHANNELS + 1), CAPACITY, S),
            Decision::Writer { start: false }
        );
        assert_eq!(
            w.reserve(DB, &some(TRANSACTION_CHANNELS), CAPACITY, S),
            Decision::Worker
        );
        // ... and other writers' news still fits beside the largest reservation.
        assert_eq!(w.reserve(DB, &some(1), CAPACITY, S), Decision::Worker);
    }

    #[test]
    fn databases_are_served_apart_and_slots_are_reused() {
        let mut w = served(0);
        assert_eq!(
            w.reserve(7, &some(1), CAPACITY, 0),
            Decision::Writer { start: true }
        );
        assert_eq!(w.attach(7, 70, 0), Attach::Connect);
        w.attached(7, 70, 0x70, 0);
        assert_eq!(w.reserve(DB, &some(1), CAPACITY, 0), Decision::Worker);
        assert_eq!(w.reserve(7, &some(1), CAPACITY, 0), Decision::Worker);
        assert_eq!(w.publish(DB, 0, [news(run(1), "a", 1)], 1), 0xbeef);
        assert_eq!(w.publish(7, 0, [news(run(1), "a", 1)], 1), 0x70);
        assert_eq!(taken(&mut w, 7).len(), 1);
        assert_eq!(w.len(), 1, "the other database's entry stays");
        // every slot taken: the next database's writers notify by themselves
        for oid in 100..(100 + DATABASES as u32 - 2) {
            w.reserve(oid, &some(1), CAPACITY, 0);
        }
        assert_eq!(
            w.reserve(99, &some(1), CAPACITY, 1),
            Decision::Writer { start: false }
        );
        // a slot whose start timed out with nothing waiting is free again
        assert_eq!(
            w.reserve(99, &some(1), CAPACITY, START_TIMEOUT_US + 1),
            Decision::Writer { start: true }
        );
    }

    #[test]
    fn news_about_a_long_id_is_sent_by_its_writer() {
        let mut w = served(0);
        let long = "r".repeat(SUBJECT_BYTES + 1);
        assert_eq!(
            w.reserve(DB, &[news(run(1), &long, 1)], CAPACITY, S),
            Decision::Writer { start: false }
        );
    }
}
