//! A thin layer over SPI: run a query, map rows, turn SPI failures into `LedgerError`.
//! Reads use `select` (read-only, so they also work on a hot standby); writes use `update`.

use crate::error::{LedgerError, Result};
use crate::scope::Scope;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::SpiHeapTupleData;
use pgrx::{FromDatum, IntoDatum};

pub type Row<'a> = SpiHeapTupleData<'a>;

/// A read-only query; `f` maps each row.
pub fn select<R>(
    query: &str,
    args: &[DatumWithOid],
    mut f: impl FnMut(&Row) -> Result<R>,
) -> Result<Vec<R>> {
    Spi::connect(|c| c.select(query, None, args)?.map(|row| f(&row)).collect())
}

/// The first row of a read-only query, if any.
pub fn select_one<R>(
    query: &str,
    args: &[DatumWithOid],
    f: impl FnOnce(&Row) -> Result<R>,
) -> Result<Option<R>> {
    Spi::connect(|c| {
        c.select(query, Some(1), args)?
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
        c.update(query, None, args)?
            .next()
            .map(|row| f(&row))
            .transpose()
    })
}

/// A writing statement whose rows do not matter.
pub fn execute(query: &str, args: &[DatumWithOid]) -> Result<()> {
    writable()?;
    Spi::connect_mut(|c| c.update(query, None, args).map(|_| ()))?;
    Ok(())
}

/// Column `ordinal` (1-based), NULL as `None`.
pub fn opt<T: FromDatum + IntoDatum>(row: &Row, ordinal: usize) -> Result<Option<T>> {
    Ok(row.get::<T>(ordinal)?)
}

/// Column `ordinal` (1-based) of a NOT NULL column.
pub fn req<T: FromDatum + IntoDatum>(row: &Row, ordinal: usize) -> Result<T> {
    opt(row, ordinal)?
        .ok_or_else(|| LedgerError::internal(format!("column {ordinal} is unexpectedly NULL")))
}

/// The whole row `id` of `table` in the scope, as the table's composite type, or P0002 `code`.
/// `table` is always a literal of the caller's, never user input.
pub fn scoped_row<T: FromDatum + IntoDatum>(
    scope: &Scope,
    table: &str,
    id: &str,
    code: &'static str,
    what: &str,
) -> Result<T> {
    select_one(
        &format!("SELECT x FROM {table} x WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3"),
        &[
            scope.tenant.as_str().into(),
            scope.workspace.as_str().into(),
            id.into(),
        ],
        |r| req(r, 1),
    )?
    .ok_or_else(|| LedgerError::not_found(code, what, id))
}
