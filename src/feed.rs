//! The run event feed (replay #2: catch up after a dropped connection). Every event written is an
//! `Event` of `ledger_model::events`.
//!
//! Every write that concerns a run appends to `run_events` in the caller's transaction. The seq
//! comes from `runs.last_seq`, bumped under the run's row lock, so seq N+1 cannot commit before
//! seq N: a reader that has seen N never misses anything below it.
//!
//! The tool-call functions collect the events they produce (`collected`) and write them at the
//! end of the call: one bump of `last_seq` by their count under the run's row lock, one
//! multi-row INSERT in the order they were produced, one NOTIFY each. The events, their seqs and
//! the notifications are the same as one at a time; a failed call writes none of them.
//!
//! Appending takes the run as this call holds it (`rows::HeldRun`, its `last_seq` as read under
//! the run's lock): while collecting, no one else can move it, so the events' seqs are allocated
//! after it without a statement. A seq needed before the end (`step.created`, written right
//! after the step it names) is so reserved in the batch, and the one bump at the end covers it
//! too.

use std::cell::RefCell;

use crate::channels;
use crate::db;
use crate::error::{raise, Code, LedgerError, Result, SqlError};
use crate::jsonb::Jsonb;
use crate::notifier;
use crate::rows::{self, HeldRun};
use crate::scope::{self, Scope};
use ledger_model::args::{optional_id, required_id};
use ledger_model::events::{self, Event};
use ledger_model::ids;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use serde_json::json;

/// An event appended during a function call and not yet written. `seq` is None until allocated.
struct Pending {
    id: String,
    seq: Option<i64>,
    event_type: &'static str,
    step_id: Option<String>,
    payload: Jsonb,
}

/// The unwritten events of one run, in the order they were produced.
struct Batch {
    scope: Scope,
    run_id: String,
    events: Vec<Pending>,
    /// The run's `last_seq` in the database, when this call holds the run's lock and knows it;
    /// the batch's seqs are then allocated after it, without a statement.
    known: Option<i64>,
    /// How many seqs after `known` the batch has allocated (not in the database yet).
    reserved: i64,
}

impl Batch {
    fn is_for(&self, scope: &Scope, run_id: &str) -> bool {
        same_run(&self.scope, &self.run_id, scope, run_id)
    }

    fn unallocated(&self) -> i64 {
        self.events.iter().filter(|e| e.seq.is_none()).count() as i64
    }

    /// Gives the unallocated events the seqs up to `last`, in order.
    fn allocate(&mut self, last: i64) {
        ledger_model::feed::allocate(self.events.iter_mut().map(|e| &mut e.seq), last);
    }
}

/// The `last_seq` of a run as it is in the database, known while collecting.
struct Known {
    scope: Scope,
    run_id: String,
    last_seq: i64,
}

#[derive(Default)]
struct Collector {
    open: bool,
    batch: Option<Batch>,
    /// The `last_seq` of every run this call has bumped, as it is now in the database: the call
    /// holds those runs' locks to the end of the transaction, so no one else moves it.
    known: Vec<Known>,
}

impl Collector {
    fn known(&self, scope: &Scope, run_id: &str) -> Option<i64> {
        self.known
            .iter()
            .find(|k| same_run(&k.scope, &k.run_id, scope, run_id))
            .map(|k| k.last_seq)
    }

    fn remember(&mut self, scope: &Scope, run_id: &str, last_seq: i64) {
        match self
            .known
            .iter_mut()
            .find(|k| same_run(&k.scope, &k.run_id, scope, run_id))
        {
            Some(k) => k.last_seq = last_seq,
            None => self.known.push(Known {
                scope: scope.clone(),
                run_id: run_id.to_owned(),
                last_seq,
            }),
        }
    }
}

fn same_run(a: &Scope, a_run: &str, b: &Scope, b_run: &str) -> bool {
    a_run == b_run && a.tenant == b.tenant && a.workspace == b.workspace
}

thread_local! {
    /// While a function call collects its events (`collected`), they wait here and are written
    /// together: one bump of `last_seq` and one multi-row INSERT instead of one pair per event.
    static COLLECTOR: RefCell<Collector> = RefCell::default();
}

/// Runs a function call's body collecting its events, and writes them together when it
/// succeeds. After an error (which rolls the transaction back) they are discarded. Nested, the
/// inner call's events are written with the outer call's.
pub fn collected<T, E: From<LedgerError>>(
    body: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    let collecting = Collecting::open();
    let out = body()?;
    collecting.finish()?;
    Ok(out)
}

/// Owns the collector while open; dropped unfinished, it discards the collected events.
struct Collecting {
    owner: bool,
}

impl Collecting {
    fn open() -> Collecting {
        COLLECTOR.with(|c| {
            let mut c = c.borrow_mut();
            let owner = !c.open;
            c.open = true;
            Collecting { owner }
        })
    }

    fn finish(self) -> Result<()> {
        if !self.owner {
            return Ok(());
        }
        let batch = COLLECTOR.with(|c| {
            let mut c = c.borrow_mut();
            c.open = false;
            c.known.clear();
            c.batch.take()
        });
        batch.map_or(Ok(()), write)
    }
}

impl Drop for Collecting {
    fn drop(&mut self) {
        if self.owner {
            COLLECTOR.with(|c| *c.borrow_mut() = Collector::default());
        }
    }
}

/// The pending batch of this run (a batch of another run is written first). The collector is
/// never borrowed across SPI calls. While collecting, the run's `last_seq` is known: as this
/// call has moved it, else as read under the run's lock (`run`).
fn take_batch(scope: &Scope, run: HeldRun) -> Result<Batch> {
    let pending = COLLECTOR.with(|c| c.borrow_mut().batch.take());
    match pending {
        Some(b) if b.is_for(scope, run.id) => Ok(b),
        other => {
            if let Some(b) = other {
                write(b)?;
            }
            Ok(Batch {
                scope: scope.clone(),
                run_id: run.id.to_owned(),
                events: Vec::new(),
                known: COLLECTOR.with(|c| {
                    let c = c.borrow();
                    c.open
                        .then(|| c.known(scope, run.id).unwrap_or(run.last_seq))
                }),
                reserved: 0,
            })
        }
    }
}

/// Puts the batch back while collecting, else writes it.
fn keep_or_write(batch: Batch) -> Result<()> {
    let rest = COLLECTOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.open {
            c.batch = Some(batch);
            None
        } else {
            Some(batch)
        }
    });
    rest.map_or(Ok(()), write)
}

/// Locks the run's row and moves its `last_seq` on by `k`; returns the new `last_seq`.
fn bump(scope: &Scope, run_id: &str, k: i64) -> Result<i64> {
    db::write_one(
        "UPDATE ledger.runs SET last_seq = last_seq + $4 \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 RETURNING last_seq",
        &scope.args([run_id.into(), k.into()]),
        |r| db::req::<i64>(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found(Code::RunNotFound, "run", run_id))
}

/// Most events one INSERT writes: the statement text depends on the count (a kept plan each).
const EVENTS_PER_INSERT: usize = 8;

/// Gives the batch's events their seqs. With the run's `last_seq` known (this call holds the
/// run's lock) that needs no statement, and the bump is left to `write`, after the INSERT; else
/// `last_seq` is bumped now, which locks the run, and the seqs come from it.
fn settle(batch: &mut Batch) -> Result<Option<Bump>> {
    let missing = batch.unallocated();
    let (last, bump) = match batch.known {
        Some(known) => {
            let last = known + batch.reserved + missing;
            (
                last,
                (last > known).then_some(Bump {
                    from: known,
                    to: last,
                }),
            )
        }
        None if missing > 0 => (self::bump(&batch.scope, &batch.run_id, missing)?, None),
        None => return Ok(None),
    };
    batch.allocate(last);
    remember(batch, last);
    Ok(bump)
}

/// A move of a held run's `last_seq` still to write.
struct Bump {
    from: i64,
    to: i64,
}

/// Remembers the run's `last_seq` while collecting.
fn remember(batch: &Batch, last: i64) {
    COLLECTOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.open {
            c.remember(&batch.scope, &batch.run_id, last);
        }
    });
}

/// Writes the events with one INSERT per `EVENTS_PER_INSERT`, then moves `last_seq` of a held run
/// past them. Inserted first, the events' foreign-key checks find the run's row as this call
/// locked it, instead of locking the new version the bump makes (a WAL record). Inline, the run's
/// channel is notified once per event, in seq order (delivered at commit); through the notifier,
/// the transaction's last seq of the run is told at commit. The notifications carry ids only: any
/// role may LISTEN on any channel.
fn write(mut batch: Batch) -> Result<()> {
    let pending = settle(&mut batch)?;
    let mode = notifier::mode();
    let inline = mode == notifier::Mode::Inline;
    let channel = inline
        .then(|| channels::run_channel(&batch.scope, &batch.run_id))
        .transpose()?;
    for chunk in batch.events.chunks(EVENTS_PER_INSERT) {
        let mut args: Vec<DatumWithOid> = batch
            .scope
            .args([batch.run_id.as_str().into(), channel.as_deref().into()]);
        for e in chunk {
            let seq = e
                .seq
                .ok_or_else(|| LedgerError::internal("event seq was not allocated"))?;
            let note = inline.then(|| {
                json!({"run_id": batch.run_id, "seq": seq, "event_id": e.id, "event_type": e.event_type})
                    .to_string()
            });
            args.extend([
                e.id.as_str().into(),
                seq.into(),
                e.event_type.into(),
                e.step_id.as_deref().into(),
                e.payload.clone().into(),
                note.into(),
            ]);
        }
        db::execute(
            &ledger_model::feed::insert_statement(chunk.len(), inline),
            &args,
        )?;
    }
    if mode == notifier::Mode::Worker {
        if let Some(last) = batch.events.iter().filter_map(|e| e.seq).max() {
            notifier::run_news(&batch.scope, &batch.run_id, last)?;
        }
    }
    if let Some(Bump { from, to }) = pending {
        if bump(&batch.scope, &batch.run_id, to - from)? != to {
            return Err(LedgerError::internal("last_seq moved under the run's lock"));
        }
    }
    Ok(())
}

/// Allocates the held run's next event seq (with the seqs of the events collected before it,
/// so seq order stays the order events were produced). While collecting it is reserved in the
/// batch, after the run's `last_seq` as known, and written with the batch's one bump; otherwise
/// `last_seq` is bumped now.
pub fn next_seq(scope: &Scope, run: HeldRun) -> Result<i64> {
    let mut batch = take_batch(scope, run)?;
    let next = batch.unallocated() + 1;
    let seq = match batch.known {
        Some(known) => {
            let seq = known + batch.reserved + next;
            batch.reserved += next;
            seq
        }
        None => bump(scope, run.id, next)?,
    };
    batch.allocate(seq - 1);
    keep_or_write(batch)?;
    Ok(seq)
}

/// Adds the event with an already allocated seq (written now, or with the collected ones).
pub fn insert(
    scope: &Scope,
    run: HeldRun,
    seq: i64,
    step_id: Option<&str>,
    event: &Event,
) -> Result<()> {
    push(scope, run, Some(seq), step_id, event)
}

/// Appends one event to the held run's feed (its seq allocated when it is written).
pub fn append(scope: &Scope, run: HeldRun, step_id: Option<&str>, event: &Event) -> Result<()> {
    push(scope, run, None, step_id, event)
}

fn push(
    scope: &Scope,
    run: HeldRun,
    seq: Option<i64>,
    step_id: Option<&str>,
    event: &Event,
) -> Result<()> {
    let mut batch = take_batch(scope, run)?;
    batch.events.push(Pending {
        id: ids::new_id("evt"),
        seq,
        event_type: event.event_type(),
        step_id: step_id.map(str::to_owned),
        payload: Jsonb::from(&event.payload()),
    });
    keep_or_write(batch)
}

pub const MAX_EVENTS_PER_CALL: i32 = 10_000;

/// The run's events after `after_event_id` (from the start when NULL), in seq order.
#[allow(clippy::type_complexity)]
#[pg_extern(stable, parallel_safe, security_definer)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn events_since(
    run_id: Option<&str>,
    after_event_id: default!(Option<&str>, "NULL"),
    max_events: default!(Option<i32>, 1000),
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(event_id, String),
            name!(seq, i64),
            name!(event_type, String),
            name!(step_id, Option<String>),
            name!(payload, Jsonb),
            name!(created_at, TimestampWithTimeZone),
            name!(ends_run, bool),
        ),
    >,
    SqlError,
> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    ids::validate("run_id", run_id)?;
    let limit = max_events.ok_or_else(|| LedgerError::required("max_events"))?;
    if !(1..=MAX_EVENTS_PER_CALL).contains(&limit) {
        raise(
            LedgerError::new(Code::LimitInvalid, "max_events must be between 1 and 10000")
                .with("argument", "max_events")
                .with("value", limit),
        );
    }
    rows::run_exists(&scope, run_id)?;
    let after = match optional_id("after_event_id", after_event_id)? {
        None => 0,
        Some(event_id) => db::select_one(
            "SELECT seq FROM ledger.run_events \
              WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 AND run_id = $4",
            &scope.args([event_id.into(), run_id.into()]),
            |r| db::req::<i64>(r, 1),
        )?
        .ok_or_else(|| {
            LedgerError::not_found(Code::EventNotFound, "event", event_id).with("run_id", run_id)
        })?,
    };
    let rows = db::select(
        "SELECT id, seq, event_type, step_id, payload, created_at FROM ledger.run_events \
          WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = $3 AND seq > $4 \
          ORDER BY seq LIMIT $5",
        &scope.args([run_id.into(), after.into(), i64::from(limit).into()]),
        |r| {
            let event_type = db::req::<String>(r, 3)?;
            let payload = db::req::<Jsonb>(r, 5)?;
            let ends_run = events::ends_run(&event_type, payload.as_str());
            Ok((
                db::req::<String>(r, 1)?,
                db::req::<i64>(r, 2)?,
                event_type,
                db::opt::<String>(r, 4)?,
                payload,
                db::req::<TimestampWithTimeZone>(r, 6)?,
                ends_run,
            ))
        },
    )?;
    Ok(TableIterator::new(rows))
}

/// The NOTIFY channel of a run in the current scope.
#[pg_extern(stable, parallel_safe, security_definer)]
#[search_path(pg_catalog, ledger, pg_temp)]
fn run_channel(run_id: Option<&str>) -> std::result::Result<String, SqlError> {
    let scope = scope::current()?;
    let run_id = required_id("run_id", run_id)?;
    ids::validate("run_id", run_id)?;
    Ok(channels::run_channel(&scope, run_id)?)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, one, set_scope};
    use pgrx::prelude::*;

    fn setup_run_with_events() {
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r')").unwrap();
        Spi::run("SELECT ledger.transition_run('r', 'running')").unwrap();
        Spi::run("SELECT ledger.create_step('r', 'llm', step_id => 's')").unwrap();
        Spi::run("SELECT ledger.transition_step('s', 'running')").unwrap();
        Spi::run("SELECT ledger.transition_step('s', 'succeeded')").unwrap();
        Spi::run("SELECT ledger.transition_run('r', 'succeeded')").unwrap();
    }

    #[pg_test]
    fn events_since_reads_from_a_cursor_in_seq_order() {
        set_scope("t-feed", "w");
        setup_run_with_events();
        assert_eq!(
            one::<String>("SELECT string_agg(seq || ':' || event_type, ',' ORDER BY seq) FROM ledger.events_since('r')"),
            "1:run.created,2:run.status,3:step.created,4:step.status,5:step.status,6:run.status"
        );
        let cursor = one::<String>("SELECT event_id FROM ledger.events_since('r') WHERE seq = 3");
        assert_eq!(
            one::<String>(&format!("SELECT string_agg(seq::text, ',' ORDER BY seq) FROM ledger.events_since('r', '{cursor}')")),
            "4,5,6"
        );
        assert_eq!(
            one::<String>(&format!(
                "SELECT string_agg(seq::text, ',') FROM ledger.events_since('r', '{cursor}', 2)"
            )),
            "4,5"
        );
        // The follower's end of the stream: only the run's terminal status event ends it.
        assert_eq!(
            one::<String>(
                "SELECT string_agg(seq::text, ',') FROM ledger.events_since('r') WHERE ends_run"
            ),
            "6"
        );
        let last = one::<String>("SELECT event_id FROM ledger.events_since('r') WHERE seq = 6");
        assert_eq!(
            one::<i64>(&format!(
                "SELECT count(*) FROM ledger.events_since('r', '{last}')"
            )),
            0
        );
        assert!(one::<bool>(
            "SELECT bool_and(event_id LIKE 'evt\\_%') FROM ledger.events_since('r')"
        ));
        assert!(one::<bool>(
            "SELECT step_id = 's' FROM ledger.events_since('r') WHERE seq = 4"
        ));
    }

    #[pg_test]
    fn a_cursor_that_is_not_an_event_of_the_run_is_refused() {
        set_scope("t-feed-cursor", "w");
        setup_run_with_events();
        Spi::run("SELECT ledger.create_run('chat', run_id => 'r2')").unwrap();
        let other = one::<String>("SELECT event_id FROM ledger.events_since('r2')");
        let e = assert_error(
            &format!("SELECT * FROM ledger.events_since('r', '{other}')"),
            "P0002",
            "EVENT_NOT_FOUND",
        );
        assert_eq!(e.detail["run_id"], "r");
        assert_error(
            "SELECT * FROM ledger.events_since('r', 'evt_nope')",
            "P0002",
            "EVENT_NOT_FOUND",
        );
        assert_error(
            "SELECT * FROM ledger.events_since('nope')",
            "P0002",
            "RUN_NOT_FOUND",
        );
        assert_error(
            "SELECT * FROM ledger.events_since('r', NULL, 0)",
            "22023",
            "LIMIT_INVALID",
        );
        assert_error(
            "SELECT * FROM ledger.events_since('r', NULL, 10001)",
            "22023",
            "LIMIT_INVALID",
        );
        assert_error(
            "SELECT * FROM ledger.events_since(NULL)",
            "22023",
            "ARGUMENT_REQUIRED",
        );
        // An empty or malformed cursor is a bad argument, as an id is everywhere.
        for cursor in ["''", "'a b'"] {
            assert_error(
                &format!("SELECT * FROM ledger.events_since('r', {cursor})"),
                "22023",
                "ID_INVALID",
            );
        }
    }

    /// A channel is keyed with the database's secret: 0.4.0's unkeyed digest of the public names
    /// (what a role without any ledger grant computed to LISTEN) is not it, and no application
    /// role can read the key (tests/notifier.rs reads it as each of them).
    #[pg_test]
    fn run_channels_are_keyed_with_a_secret_no_application_role_reads() {
        set_scope("acme", "support");
        let unkeyed = one::<String>(
            "SELECT 'ledger_run_' || left(encode(sha256(convert_to('acme', 'UTF8') || '\\x00'::bytea \
               || convert_to('support', 'UTF8') || '\\x00'::bytea || convert_to('order-4f05', 'UTF8')), 'hex'), 32)",
        );
        let channel = one::<String>("SELECT ledger.run_channel('order-4f05')");
        assert!(channel.starts_with("ledger_run_") && channel.len() == unkeyed.len());
        assert_ne!(channel, unkeyed);
        Spi::run("CREATE ROLE ledger_test_no_grant").unwrap();
        for role in [
            "ledger_reader",
            "ledger_writer",
            "ledger_operator",
            "ledger_test_no_grant",
            "public",
        ] {
            assert!(
                !one::<bool>(&format!(
                    "SELECT has_table_privilege('{role}', 'ledger.channel_key', 'SELECT, INSERT, UPDATE, DELETE, TRUNCATE')"
                )),
                "{role}"
            );
        }
        assert_eq!(one::<i64>("SELECT count(*) FROM ledger.channel_key"), 1);
    }

    #[pg_test]
    fn run_channels_are_per_scope_and_fit_a_channel_name() {
        set_scope("t-chan", "w");
        let a = one::<String>("SELECT ledger.run_channel('r')");
        assert!(a.starts_with("ledger_run_") && a.len() <= 63);
        let long = "r".repeat(128);
        assert!(one::<String>(&format!("SELECT ledger.run_channel('{long}')")).len() <= 63);
        set_scope("t-chan-2", "w");
        assert_ne!(one::<String>("SELECT ledger.run_channel('r')"), a);
    }

    #[pg_test]
    fn outbox_rows_are_written_with_the_fact() {
        set_scope("t-outbox", "w");
        setup_run_with_events();
        assert_eq!(
            one::<String>("SELECT string_agg(event_type || ':' || status, ',' ORDER BY occurred_at, event_type) FROM ledger.outbox"),
            "run.created:pending,run.status.updated:pending"
        );
        assert!(one::<bool>(
            "SELECT bool_and(id LIKE 'obx\\_%' AND run_id = 'r') FROM ledger.outbox"
        ));
        assert_eq!(
            one::<String>("SELECT (payload->>'from') || '->' || (payload->>'to') FROM ledger.outbox WHERE event_type = 'run.status.updated'"),
            "running->succeeded"
        );
    }
}
