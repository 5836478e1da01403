//! Notifications off the writers' commits.
//!
//! PostgreSQL serialises the commits of notifying transactions on a cluster-wide lock held
//! through the WAL flush. With the library in `shared_preload_libraries` and `ledger.notify =
//! worker` (the default), a writer sends no NOTIFY: it remembers what its transaction tells which
//! channel, reserves room in a shared table before its commit, publishes there at commit and sets
//! its database's notifier worker's latch. The worker sends one notification per channel from its
//! own short transactions, which write no WAL worth flushing and hold the lock for microseconds.
//! The table's rules are `ledger_model::notifier`.
//!
//! A writer notifies by itself (as `inline` does) whenever the worker cannot be counted on: none
//! attached or its heartbeat stale, the table full, more channels than one transaction may reserve
//! (`notifier::TRANSACTION_CHANNELS`), or an id too long for it. It asks the
//! postmaster for a worker when none is on its way. Workers leave after a short idle spell, so that
//! their database can be dropped.

use crate::channels;
use crate::error::{Result, SqlError};
use crate::guc::{self, NotifyMode};
use crate::scope::{self, Scope};
use ledger_model::notifier::{self, Attach, Channel, Decision, News, Note, Prepared, Wakeups};
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, pg_sys, IntoDatum, PGRXSharedMemory, PgLwLock};
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(Default)]
struct Table(Wakeups);

// SAFETY: plain data without pointers (heapless containers and integers); the latch addresses
// it holds point into shared memory, mapped at the same address in every backend.
unsafe impl PGRXSharedMemory for Table {}

static TABLE: PgLwLock<Table> = unsafe { PgLwLock::new(c"ledger_notifier") };

/// Set in `_PG_init` when the library is preloaded: only then is `TABLE` in shared memory.
static PRELOADED: AtomicBool = AtomicBool::new(false);

/// How this session's writes notify.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    Off,
    Inline,
    Worker,
}

pub fn mode() -> Mode {
    match guc::NOTIFY.get() {
        NotifyMode::Off => Mode::Off,
        NotifyMode::Inline => Mode::Inline,
        NotifyMode::Worker | NotifyMode::On if preloaded() => Mode::Worker,
        NotifyMode::Worker | NotifyMode::On => Mode::Inline,
    }
}

fn preloaded() -> bool {
    PRELOADED.load(Ordering::Relaxed)
}

/// Called by `_PG_init`: with the preload, the shared table and the transaction callback.
// pg_shmem_init! tests pgrx's pg13/pg14 features, which this crate does not declare.
#[allow(unexpected_cfgs)]
pub fn init() {
    // SAFETY: read while the postmaster loads the library, or in a backend loading it later.
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    pg_shmem_init!(TABLE);
    PRELOADED.store(true, Ordering::Relaxed);
    // SAFETY: a plain C callback, registered once; children of the postmaster inherit it.
    unsafe { pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut()) };
}

/// What this transaction has to tell, waiting for its end. Runs coalesce to their last seq.
#[derive(Default)]
struct Pending {
    runs: Vec<([u8; 16], String, i64)>,
    outbox: Option<String>,
    /// Some run may have become claimable (`ledger_runs`).
    runs_ready: bool,
    /// Room reserved at pre-commit (`Decision::Worker`): publish at commit, release at abort.
    reserved: Option<usize>,
    /// The xid of a transaction being prepared.
    prepared: u32,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.runs.is_empty() && self.outbox.is_none() && !self.runs_ready
    }

    fn news(&self) -> Vec<News<'_>> {
        let runs = self.runs.iter().map(|(digest, run_id, seq)| News {
            channel: Channel::Run(*digest),
            subject: run_id,
            seq: *seq,
        });
        let outbox = self.outbox.iter().map(|id| News {
            channel: Channel::Outbox,
            subject: id,
            seq: 0,
        });
        let ready = self.runs_ready.then_some(News {
            channel: Channel::Runs,
            subject: "",
            seq: 0,
        });
        runs.chain(outbox).chain(ready).collect()
    }
}

thread_local! {
    static PENDING: RefCell<Pending> = RefCell::default();
}

/// Events up to `seq` of the run are written in this transaction (worker mode).
pub fn run_news(scope: &Scope, run_id: &str, seq: i64) -> Result<()> {
    let digest = channels::run_digest(scope, run_id)?;
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        match p.runs.iter_mut().find(|(d, _, _)| *d == digest) {
            Some(entry) => entry.2 = entry.2.max(seq),
            None => p.runs.push((digest, run_id.to_owned(), seq)),
        }
    });
    Ok(())
}

/// An outbox event was written in this transaction (worker mode).
pub fn outbox_news(id: &str) {
    PENDING.with(|p| p.borrow_mut().outbox = Some(id.to_owned()));
}

/// Some run may have become claimable in this transaction (created, released, woken, decided
/// for, or a place under a limit freed): tells `ledger_runs`' listeners, idle workers, at commit,
/// as `ledger.notify` says.
pub fn runs_ready() {
    match mode() {
        Mode::Off => {}
        Mode::Inline => notify(notifier::RUNS_CHANNEL, ""),
        Mode::Worker => PENDING.with(|p| p.borrow_mut().runs_ready = true),
    }
}

/// `pg_notify(channel, payload)`, queued for this transaction's commit.
pub fn notify(channel: &str, payload: &str) {
    // SAFETY: pg_notify is a built-in taking two text arguments; both datums are live here.
    unsafe {
        pgrx::direct_function_call_as_datum(
            |fcinfo| pg_sys::pg_notify(fcinfo),
            &[channel.into_datum(), payload.into_datum()],
        );
    }
}

fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

fn database() -> u32 {
    // SAFETY: a backend-global set at connection.
    unsafe { pg_sys::MyDatabaseId }.to_u32()
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut c_void) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_PRE_COMMIT => before_commit(false),
        XACT_EVENT_PRE_PREPARE => before_commit(true),
        XACT_EVENT_COMMIT => after_commit(),
        XACT_EVENT_PREPARE => after_commit(),
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT => {
            let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
            if let Some(reserved) = pending.reserved {
                TABLE.exclusive().0.release(database(), reserved);
            }
        }
        _ => {}
    }
}

/// Reserves room for this transaction's news, or notifies now when the worker cannot be counted
/// on. A transaction being prepared keeps its news in the table whatever the decision (a
/// transaction that notified cannot be prepared); a worker is on its way or attached. It keeps
/// at most `TRANSACTION_CHANNELS` channels there (the outbox's and `ledger_runs`' first), since they wait until it
/// ends: followers of the other runs it wrote to read on their backstop timer.
fn before_commit(preparing: bool) {
    let (decision, reserved) = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        if p.is_empty() {
            return (None, 0);
        }
        if preparing {
            let room = notifier::TRANSACTION_CHANNELS
                - usize::from(p.outbox.is_some())
                - usize::from(p.runs_ready);
            p.runs.truncate(room);
        }
        let news = p.news();
        let limit = guc::NOTIFIER_CAPACITY.get().max(1) as usize;
        let decision = TABLE.exclusive().0.reserve(database(), &news, limit, now());
        (Some(decision), news.len())
    });
    let Some(decision) = decision else {
        return;
    };
    if let Decision::Writer { start: true } = decision {
        start_worker();
    }
    match decision {
        Decision::Worker => PENDING.with(|p| p.borrow_mut().reserved = Some(reserved)),
        Decision::Writer { .. } if preparing => PENDING.with(|p| p.borrow_mut().reserved = Some(0)),
        Decision::Writer { .. } => {
            let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
            for news in pending.news() {
                let Note { channel, payload } = news.note();
                notify(&channel, &payload);
            }
        }
    }
    if preparing {
        // SAFETY: the transaction being prepared has its xid (it wrote).
        let xid = unsafe { pg_sys::GetTopTransactionIdIfAny() };
        PENDING.with(|p| p.borrow_mut().prepared = xid.into_inner());
    }
}

/// Publishes what was reserved and wakes the worker. Must not fail: the transaction is committed.
fn after_commit() {
    let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let Some(reserved) = pending.reserved else {
        return;
    };
    let latch = TABLE
        .exclusive()
        .0
        .publish(database(), pending.prepared, pending.news(), reserved);
    if latch != 0 {
        // SAFETY: the latch of a live worker's PGPROC, in shared memory; setting the latch of a
        // process that has just exited is harmless.
        unsafe { pg_sys::SetLatch(latch as *mut pg_sys::Latch) };
    }
}

/// Asks the postmaster for this database's worker; a refusal (no free background worker slot) is
/// noted so that the next writer asks again.
fn start_worker() {
    let oid = database();
    let started = BackgroundWorkerBuilder::new(&format!("ledger notifier for database {oid}"))
        .set_type("ledger notifier")
        .set_library("ledger")
        .set_function("ledger_notifier_main")
        .set_argument(Some(pg_sys::Datum::from(oid)))
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(1)))
        .load_dynamic();
    if started.is_err() {
        TABLE.exclusive().0.start_refused(oid);
    }
}

/// The notifier of one database (its oid is the argument). Exits 0 when it has nothing to do
/// (idle, or another worker serves the database), 1 on SIGTERM with entries still waiting, so
/// that the postmaster restarts it a second later.
#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn ledger_notifier_main(arg: pg_sys::Datum) {
    let oid = arg.value() as u32;
    // It reads no configuration: SIGTERM is the only signal it handles.
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGTERM);
    // SAFETY: a backend-global.
    let pid = unsafe { pg_sys::MyProcPid };
    if TABLE.exclusive().0.attach(oid, pid, now()) == Attach::Leave {
        return;
    }
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from(oid)), None);
    // SAFETY: registered once; the callback only takes the table's lock.
    unsafe { pg_sys::before_shmem_exit(Some(on_worker_exit), pg_sys::Datum::from(oid)) };
    // SAFETY: after connecting, MyLatch is this process's latch in shared memory.
    let latch = unsafe { pg_sys::MyLatch } as usize;
    TABLE.exclusive().0.attached(oid, pid, latch, now());

    let mut notes = Vec::new();
    let mut idle_since = now();
    loop {
        // SAFETY: the flag pgrx's SIGTERM handler sets; read, never consumed.
        if unsafe { (&raw const pg_sys::ShutdownRequestPending).read_volatile() } != 0 {
            if TABLE.exclusive().0.detach(oid, pid) {
                // SAFETY: leaves the process; the postmaster restarts it after bgw_restart_time.
                unsafe { pg_sys::proc_exit(1) };
            }
            return;
        }
        let parked = {
            let mut table = TABLE.exclusive();
            let parked = table.0.take(oid, prepared_outcome, &mut notes);
            table.0.heartbeat(oid, pid, now());
            parked
        };
        if !notes.is_empty() {
            let batch = std::mem::take(&mut notes);
            BackgroundWorker::transaction(move || {
                for note in &batch {
                    notify(&note.channel, &note.payload);
                }
            });
            idle_since = now();
        } else if parked == 0
            && now() - idle_since > notifier::IDLE_EXIT_US
            && TABLE.exclusive().0.leave_if_idle(oid, pid)
        {
            return;
        }
        let wait_ms = if parked > 0 { 100 } else { 500 };
        // SAFETY: waits on this process's latch; the postmaster's death ends the process.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                wait_ms,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        pgrx::check_for_interrupts!();
    }
}

/// Where a prepared transaction stands. The proc array first: a transaction ending updates the
/// commit log before it leaves the proc array, so once it is not in progress its status is final.
fn prepared_outcome(xid: u32) -> Prepared {
    let xid = pg_sys::TransactionId::from_inner(xid);
    // SAFETY: both only read shared state (the proc array, the commit log). The worker asks
    // within 100 ms of the transaction's end (it polls while entries are parked), long before
    // VACUUM could truncate the commit log past that xid.
    unsafe {
        if pg_sys::TransactionIdIsInProgress(xid) {
            Prepared::InProgress
        } else if pg_sys::TransactionIdDidCommit(xid) {
            Prepared::Committed
        } else {
            Prepared::Aborted
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_worker_exit(_code: i32, arg: pg_sys::Datum) {
    // SAFETY: a backend-global.
    let pid = unsafe { pg_sys::MyProcPid };
    TABLE.exclusive().0.detach(arg.value() as u32, pid);
}

/// The state of the notification path, for this session and its database: for operators and
/// the owner only, since its counters move with every tenant's commits. No table access, so it
/// runs as its caller (whose membership it checks); stable like PostgreSQL's statistics
/// functions, which read shared counters too.
#[allow(clippy::type_complexity)]
#[pg_extern(stable, parallel_safe)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn notifier_status() -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(notify, String),
            name!(preloaded, bool),
            name!(worker_pid, Option<i32>),
            name!(waiting, i32),
            name!(capacity, i32),
            name!(notifications_sent, i64),
            name!(sent_by_writers, i64),
        ),
    >,
    SqlError,
> {
    notifier::check_status_reader(
        scope::is_operator()? || scope::caller_is_member("ledger_owner")?,
    )?;
    let mode = match mode() {
        Mode::Off => "off",
        Mode::Inline => "inline",
        Mode::Worker => "worker",
    };
    let db = preloaded()
        .then(|| TABLE.share().0.database(database()))
        .flatten()
        .unwrap_or_default();
    Ok(TableIterator::once((
        mode.to_owned(),
        preloaded(),
        (db.pid != 0).then_some(db.pid),
        db.waiting as i32,
        guc::NOTIFIER_CAPACITY.get().min(notifier::CAPACITY as i32),
        db.sent as i64,
        db.by_writers as i64,
    )))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one};
    use pgrx::prelude::*;

    #[pg_test]
    fn without_the_preload_worker_means_inline() {
        assert_eq!(one::<String>("SHOW ledger.notify"), "worker");
        let (notify, preloaded, pid) = Spi::get_three::<String, bool, i32>(
            "SELECT notify, preloaded, worker_pid FROM ledger.notifier_status()",
        )
        .unwrap();
        assert_eq!(
            (notify.as_deref(), preloaded, pid),
            (Some("inline"), Some(false), None)
        );
    }

    /// Its counters move with every tenant's commits: operators and the owner (and superusers)
    /// read them, a writer or a reader gets 42501 OPERATOR_REQUIRED.
    #[pg_test]
    fn the_status_is_for_operators_and_the_owner_only() {
        for role in ["ledger_reader", "ledger_writer"] {
            Spi::run(&format!("SET LOCAL ROLE {role}")).unwrap();
            assert_error(
                "SELECT * FROM ledger.notifier_status()",
                "42501",
                "OPERATOR_REQUIRED",
            );
            Spi::run("RESET ROLE").unwrap();
        }
        for role in ["ledger_operator", "ledger_owner"] {
            Spi::run(&format!("SET LOCAL ROLE {role}")).unwrap();
            assert_eq!(
                one::<i32>("SELECT capacity FROM ledger.notifier_status()"),
                1024,
                "{role}"
            );
            Spi::run("RESET ROLE").unwrap();
        }
    }

    #[pg_test]
    fn the_three_modes_and_the_old_boolean_are_accepted() {
        for (set, shown, effective) in [
            ("inline", "inline", "inline"),
            ("off", "off", "off"),
            ("on", "on", "inline"),
            ("worker", "worker", "inline"),
        ] {
            Spi::run(&format!("SET LOCAL ledger.notify = {set}")).unwrap();
            assert_eq!(one::<String>("SHOW ledger.notify"), shown);
            assert_eq!(
                one::<String>("SELECT notify FROM ledger.notifier_status()"),
                effective
            );
        }
    }

    #[pg_test(error = "invalid value for parameter \"ledger.notify\": \"sometimes\"")]
    fn an_unknown_mode_is_refused() {
        Spi::run("SET LOCAL ledger.notify = sometimes").unwrap();
    }
}
