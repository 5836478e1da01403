//! A thin layer over SPI: run a query, map rows, turn SPI failures into `LedgerError`.
//! Reads use `select` (read-only, so they also work on a hot standby); writes use `update`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::error::{spi_failed, LedgerError, Result};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiHeapTupleData};
use pgrx::{FromDatum, IntoDatum};

pub type Row<'a> = SpiHeapTupleData<'a>;

/// A kept plan is found again by its text, argument types and whether it may write.
type PlanKey = (bool, String, Vec<pg_sys::Oid>);

/// More distinct statements than the ledger has; reaching it means texts are being generated.
const MAX_PLANS: usize = 1024;

thread_local! {
    /// Every statement prepared once per backend and kept (SPI_keepplan). Parsing, rewriting
    /// (row-level security) and planning each statement on every call was most of a call's
    /// time; PostgreSQL's plan cache revalidates kept plans after DDL or a role change.
    static PLANS: RefCell<HashMap<PlanKey, Rc<OwnedPreparedStatement>>> = RefCell::new(HashMap::new());
}

/// The kept plan of `query` for these arguments, prepared on first use.
fn plan(
    c: &SpiClient<'_>,
    query: &str,
    args: &[DatumWithOid],
    mutating: bool,
) -> Result<Rc<OwnedPreparedStatement>> {
    let key: PlanKey = (
        mutating,
        query.to_owned(),
        args.iter().map(|a| a.oid()).collect(),
    );
    // The map is not borrowed while preparing or executing: either may run ledger functions.
    if let Some(found) = PLANS.with(|p| p.borrow().get(&key).cloned()) {
        return Ok(found);
    }
    let oids: Vec<PgOid> = key.2.iter().map(|&o| PgOid::from(o)).collect();
    let prepared = if mutating {
        c.prepare_mut(query, &oids).map_err(spi_failed)?
    } else {
        c.prepare(query, &oids).map_err(spi_failed)?
    };
    let kept = Rc::new(prepared.keep());
    PLANS.with(|p| {
        let mut plans = p.borrow_mut();
        if plans.len() >= MAX_PLANS {
            plans.clear();
        }
        plans.insert(key, kept.clone());
    });
    Ok(kept)
}

/// A read-only query; `f` maps each row.
pub fn select<R>(
    query: &str,
    args: &[DatumWithOid],
    mut f: impl FnMut(&Row) -> Result<R>,
) -> Result<Vec<R>> {
    Spi::connect(|c| {
        let p = plan(c, query, args, false)?;
        c.select(&*p, None, args)
            .map_err(spi_failed)?
            .map(|row| f(&row))
            .collect()
    })
}

/// The first row of a read-only query, if any.
pub fn select_one<R>(
    query: &str,
    args: &[DatumWithOid],
    f: impl FnOnce(&Row) -> Result<R>,
) -> Result<Option<R>> {
    Spi::connect(|c| {
        let p = plan(c, query, args, false)?;
        c.select(&*p, Some(1), args)
            .map_err(spi_failed)?
            .next()
            .map(|row| f(&row))
            .transpose()
    })
}

/// Every write goes through here first: in a read-only transaction PostgreSQL would fail the
/// row lock or the XID assignment with an internal error (XX000 on a hot standby) instead.
fn writable() -> Result<()> {
    // SAFETY: a backend-global flag, set at transaction start (always on during recovery).
    if unsafe { pg_sys::XactReadOnly } {
        return Err(LedgerError::read_only());
    }
    Ok(())
}

/// The first row a writing statement returns, if any.
pub fn write_one<R>(
    query: &str,
    args: &[DatumWithOid],
    f: impl FnOnce(&Row) -> Result<R>,
) -> Result<Option<R>> {
    writable()?;
    Spi::connect_mut(|c| {
        let p = plan(c, query, args, true)?;
        c.update(&*p, None, args)
            .map_err(spi_failed)?
            .next()
            .map(|row| f(&row))
            .transpose()
    })
}

/// A writing statement whose rows do not matter.
pub fn execute(query: &str, args: &[DatumWithOid]) -> Result<()> {
    writable()?;
    Spi::connect_mut(|c| {
        let p = plan(c, query, args, true)?;
        c.update(&*p, None, args).map_err(spi_failed)?;
        Ok(())
    })
}

/// `now()`, the transaction's start, as a statement's parameter. Write statements take their times
/// as parameters: a distributed engine refuses `now()` inside CASE or COALESCE of a write.
pub fn now() -> Result<TimestampWithTimeZone> {
    now_plus(0)
}

/// `now() + make_interval(secs => seconds)`: a deadline counted from the transaction's start, as
/// the rows it writes record their creation.
pub fn now_plus(seconds: i64) -> Result<TimestampWithTimeZone> {
    // SAFETY: reads the backend's transaction start time, set when the transaction began.
    let start = unsafe { pg_sys::GetCurrentTransactionStartTimestamp() };
    timestamp(start.saturating_add(seconds.saturating_mul(1_000_000)))
}

/// `clock_timestamp()`, the time of this call, as a statement's parameter (lease arithmetic):
/// a distributed engine refuses VOLATILE functions in an UPDATE.
pub fn clock() -> Result<TimestampWithTimeZone> {
    clock_plus(0)
}

/// `clock_timestamp() + make_interval(secs => seconds)`: when a lease or a backoff starting now
/// ends (an interval of seconds alone is that many microseconds in every time zone).
pub fn clock_plus(seconds: i64) -> Result<TimestampWithTimeZone> {
    // SAFETY: reads the system clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    timestamp(now.saturating_add(seconds.saturating_mul(1_000_000)))
}

fn timestamp(t: pg_sys::TimestampTz) -> Result<TimestampWithTimeZone> {
    TimestampWithTimeZone::try_from(t)
        .map_err(|e| LedgerError::internal(format!("the clock is out of range: {e}")))
}

/// Column `ordinal` (1-based), NULL as `None`.
pub fn opt<T: FromDatum + IntoDatum>(row: &Row, ordinal: usize) -> Result<Option<T>> {
    row.get::<T>(ordinal).map_err(spi_failed)
}

/// Column `ordinal` (1-based) of a NOT NULL column.
pub fn req<T: FromDatum + IntoDatum>(row: &Row, ordinal: usize) -> Result<T> {
    opt(row, ordinal)?
        .ok_or_else(|| LedgerError::internal(format!("column {ordinal} is unexpectedly NULL")))
}
