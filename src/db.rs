//! A thin layer over SPI: run a query, map rows, turn SPI failures into `LedgerError`.
//! Reads use `select` (read-only, so they also work on a hot standby); writes use `update`.

use crate::error::{LedgerError, Result};
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

/// The first row a writing statement returns, if any.
pub fn write_one<R>(
    query: &str,
    args: &[DatumWithOid],
    f: impl FnOnce(&Row) -> Result<R>,
) -> Result<Option<R>> {
    Spi::connect_mut(|c| {
        c.update(query, None, args)?
            .next()
            .map(|row| f(&row))
            .transpose()
    })
}

/// A writing statement whose rows do not matter.
pub fn execute(query: &str, args: &[DatumWithOid]) -> Result<()> {
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
