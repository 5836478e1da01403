//! The conditional status transition of a run, step or task: one UPDATE that moves the row from
//! the status it was read in (under its lock) to the next, stamping its times, and changes
//! nothing when another writer moved it first (40001 `TRANSITION_CONFLICT`).

use crate::db;
use crate::error::Result;
use crate::scope::Scope;
use ledger_model::status::{conflict, Resource, Status};
use pgrx::datum::DatumWithOid;

/// What a resource's transition writes besides the status and the times.
pub struct Columns {
    pub resource: Resource,
    pub table: &'static str,
    /// The resource's own `SET` clauses; their parameters are `$5`, `$6`, ... in the order of
    /// the values `write` is given.
    pub set: &'static str,
    /// A condition over those parameters under which the row starts over: `started_at` is
    /// cleared instead of stamped.
    pub restart: Option<&'static str>,
    /// The column `duration_ms` counts from when the row never started; None: no duration.
    pub duration_from: Option<&'static str>,
}

/// The UPDATE of `columns` with `own` parameters of its own: then `started` (`to` counts as
/// started), `terminal` (`to` is terminal) and `from` (the status the row must still be in).
fn statement(columns: &Columns, own: usize) -> String {
    let started = 5 + own;
    let (terminal, from) = (started + 1, started + 2);
    let Columns {
        table,
        set,
        restart,
        duration_from,
        ..
    } = columns;
    let restart = restart.map_or(String::new(), |r| format!("WHEN {r} THEN NULL "));
    let duration = duration_from.map_or(String::new(), |column| {
        format!(
            ", duration_ms = CASE WHEN ${terminal} THEN \
                 (extract(epoch FROM now() - coalesce(started_at, {column})) * 1000)::bigint END"
        )
    });
    format!(
        "UPDATE {table} SET status = $4, updated_at = now(), {set}, \
             started_at = CASE {restart}WHEN ${started} THEN coalesce(started_at, now()) \
                               ELSE started_at END, \
             ended_at = CASE WHEN ${terminal} THEN now() END{duration} \
          WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3 AND status = ${from} \
          RETURNING id"
    )
}

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
    let query = statement(columns, own.len());
    let mut args = scope.args([id.into(), to.as_str().into()]);
    args.extend(own);
    args.extend([
        to.is_started().into(),
        to.is_terminal().into(),
        from.as_str().into(),
    ]);
    match db::write_one(&query, &args, |r| db::req::<String>(r, 1))? {
        Some(_) => Ok(()),
        None => Err(conflict(columns.resource, id, from, to)),
    }
}
