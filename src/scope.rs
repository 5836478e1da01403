//! The caller's scope (tenant, workspace): stated with `ledger.set_scope` or the GUCs, required
//! by every function that touches ledger rows.

use crate::error::{LedgerError, Result, SqlError};
use crate::guc;
use crate::model::args::required_id;
use crate::model::ids;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

#[derive(Clone, Debug)]
pub struct Scope {
    pub tenant: String,
    pub workspace: String,
}

impl Scope {
    /// The arguments of a statement over the scope's rows: `$1` the tenant, `$2` the workspace,
    /// then `rest` from `$3` on.
    pub fn args<'a>(
        &'a self,
        rest: impl IntoIterator<Item = DatumWithOid<'a>>,
    ) -> Vec<DatumWithOid<'a>> {
        let mut args = vec![self.tenant.as_str().into(), self.workspace.as_str().into()];
        args.extend(rest);
        args
    }
}

/// The current scope, or 42501 `SCOPE_MISSING`.
pub fn current() -> Result<Scope> {
    match (
        guc::string(&guc::TENANT_ID),
        guc::string(&guc::WORKSPACE_ID),
    ) {
        (Some(tenant), Some(workspace)) => Ok(Scope { tenant, workspace }),
        _ => Err(LedgerError::scope_missing()),
    }
}

/// Sets the scope for the session, or with `is_local` for the current transaction only (use
/// that behind a transaction-pooling proxy).
///
/// This is the one ledger function without a pinned `search_path`: a `SET` clause on a function
/// restores every `SET LOCAL` made inside it at function exit, which would undo `is_local`. It
/// resolves no names of its own (the one query it runs is schema-qualified).
#[pg_extern(volatile, parallel_unsafe)]
fn set_scope(
    tenant_id: Option<&str>,
    workspace_id: Option<&str>,
    is_local: default!(Option<bool>, false),
) -> std::result::Result<(), SqlError> {
    let tenant = required_id("tenant_id", tenant_id)?;
    let workspace = required_id("workspace_id", workspace_id)?;
    ids::validate("tenant_id", tenant)?;
    ids::validate("workspace_id", workspace)?;
    let local = is_local.unwrap_or(false);
    // A read-only statement (set_config writes no row), so the scope can be set on a hot standby.
    crate::db::select_one(
        "SELECT pg_catalog.set_config('ledger.tenant_id', $1, $3), \
                pg_catalog.set_config('ledger.workspace_id', $2, $3)",
        &[tenant.into(), workspace.into(), local.into()],
        |_| Ok(()),
    )?;
    Ok(())
}
