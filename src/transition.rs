//! The conditional status transition of a run, step or task: one UPDATE that moves the row from
//! the status it was read in (under its lock) to the next, stamping its times, and changes
//! nothing when another writer moved it first (40001 `TRANSITION_CONFLICT`). The statement is
//! `ledger_model::transition`'s.

use crate::db;
use crate::error::{LedgerError, Result};
use crate::scope::Scope;
use ledger_model::status::{conflict, Status};
use ledger_model::transition::{statement, Columns};
use pgrx::datum::DatumWithOid;

/// Moves row `id` from `from` to `to`, writing the resource's own columns (`own`, as `set` uses
/// them); 40001 `TRANSITION_CONFLICT` when the row is no longer in `from`.
pub fn write<'a>(
    scope: &'a Scope,
    columns: &Columns,
    id: &'a str,
    from: Status,
    to: Status,
    own: Vec<DatumWithOid<'a>>,
) -> Result<()> {
    if own.len() != columns.own {
        return Err(LedgerError::internal(
            "a transition's own parameters do not match its set",
        ));
    }
    let query = statement(columns);
    let mut args = scope.args([id.into(), to.as_str().into()]);
    args.extend(own);
    args.extend([
        to.is_started().into(),
        to.is_terminal().into(),
        from.as_str().into(),
        db::now()?.into(),
    ]);
    match db::write_one(&query, &args, |r| db::req::<String>(r, 1))? {
        Some(_) => Ok(()),
        None => Err(conflict(columns.resource, id, from, to)),
    }
}
