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

/// True when a scope is set, else 42501 `SCOPE_MISSING`. The monitoring views filter on it, so
/// that one read without a scope fails instead of answering "no rows", which looks healthy.
#[pg_extern(stable, parallel_safe)]
#[search_path(pg_catalog, ledger, pg_temp)]
pub fn scope_required() -> std::result::Result<bool, SqlError> {
    current()?;
    Ok(true)
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

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, error_of, one, set_scope};
    use pgrx::prelude::*;

    /// `SET` and `set_config` go through the same check as `set_scope`: a name that would look
    /// like another tenant's (an invisible character, a newline, a bidi override, a trailing
    /// space) or does not fit an index row is refused, and the scope stays what it was.
    #[pg_test]
    fn scope_names_set_by_hand_are_checked_like_set_scope() {
        set_scope("t-guc", "w");
        for (statement, argument) in [
            (r"SET ledger.tenant_id = E'acme\u200b'", "tenant_id"),
            (r"SET LOCAL ledger.tenant_id = E'acme\n'", "tenant_id"),
            (r"SET ledger.workspace_id = 'support '", "workspace_id"),
            (
                r"SELECT set_config('ledger.tenant_id', E'run\u202e1', false)",
                "tenant_id",
            ),
            (
                r"SELECT set_config('ledger.tenant_id', E'\ufeffacme', true)",
                "tenant_id",
            ),
            (
                r"SELECT set_config('ledger.workspace_id', repeat('x', 3200), true)",
                "workspace_id",
            ),
        ] {
            let e = error_of(statement);
            assert_eq!(e.sqlstate, "22023", "{statement}: {e:?}");
            assert!(
                e.message.starts_with(&format!("ledger: {argument} ")),
                "{statement}: {e:?}"
            );
            assert_eq!(e.detail["code"], "ID_INVALID", "{statement}: {e:?}");
            assert_eq!(e.detail["argument"], argument, "{statement}: {e:?}");
        }
        assert_eq!(
            one::<String>("SELECT ledger.scope_tenant() || '/' || ledger.scope_workspace()"),
            "t-guc/w"
        );
        // set_scope keeps its own refusal.
        assert_error(
            r"SELECT ledger.set_scope(E'acme\u200b', 'w')",
            "22023",
            "ID_INVALID",
        );
        // Valid names, empty (unset) and RESET pass.
        Spi::run(
            "SET LOCAL ledger.tenant_id = 'acme-2'; SET LOCAL ledger.workspace_id = 'röm/7:α'",
        )
        .unwrap();
        assert!(one::<bool>(
            "SELECT ledger.create_run('chat', run_id => 'by-hand')::text LIKE '(acme-2,röm/7:α,by-hand,%'"
        ));
        Spi::run("SELECT set_config('ledger.tenant_id', '', true)").unwrap();
        assert_error("SELECT ledger.create_run('chat')", "42501", "SCOPE_MISSING");
        Spi::run("RESET ledger.tenant_id").unwrap();
        assert_eq!(
            one::<i64>("SELECT count(*) FROM ledger.runs WHERE tenant_id NOT IN ('t-guc', 'acme-2') AND tenant_id LIKE '%acme%'"),
            0
        );
    }
}
