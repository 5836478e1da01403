//! The caller's scope (tenant, workspace): stated with `ledger.set_scope` (which keeps the GUCs
//! it sets to itself and to the scopes granted to the session's login role), required by every
//! function that touches ledger rows.

use crate::db;
use crate::error::{raise, Code, LedgerError, Result, SqlError};
use crate::guc;
use ledger_model::args::{optional_id, required_id, required_label};
use ledger_model::ids;
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

/// The tenant of the current scope, NULL when unset: the predicate of every row-level security
/// policy. sql/schema.sql creates it (before the policies that call it), so no SQL is generated.
#[pg_extern(sql = false)]
fn scope_tenant() -> Option<String> {
    guc::string(&guc::TENANT_ID)
}

/// The workspace of the current scope, NULL when unset; like `scope_tenant`.
#[pg_extern(sql = false)]
fn scope_workspace() -> Option<String> {
    guc::string(&guc::WORKSPACE_ID)
}

/// True when a scope is set, else 42501 `SCOPE_MISSING`. The monitoring views filter on it, so
/// that one read without a scope fails instead of answering "no rows", which looks healthy.
#[pg_extern(stable, parallel_safe)]
#[search_path(pg_catalog, ledger, pg_temp)]
pub fn scope_required() -> std::result::Result<bool, SqlError> {
    current()?;
    Ok(true)
}

/// Sets the scope GUCs, for the transaction or the session, in one statement: with
/// `check_grant`, only if the session's login role may state the scope (its scope grants), and
/// returns whether it did.
fn state(scope: &Scope, local: bool, check_grant: bool) -> Result<bool> {
    // A read-only statement (set_config writes no row), so the scope can be set on a hot standby.
    // OFFSET 0 keeps the grant check one evaluation, not one per reference to g.
    let stated = guc::stating(|| {
        db::select_one(
            "SELECT g, CASE WHEN g THEN pg_catalog.set_config('ledger.tenant_id', $1, $3) END, \
                    CASE WHEN g THEN pg_catalog.set_config('ledger.workspace_id', $2, $3) END \
               FROM (SELECT NOT $4 OR ledger_dispatch.scope_granted($1, $2) AS g OFFSET 0) AS granted",
            &[
                scope.tenant.as_str().into(),
                scope.workspace.as_str().into(),
                local.into(),
                check_grant.into(),
            ],
            |r| db::req::<bool>(r, 1),
        )
    })?;
    Ok(stated == Some(true))
}

/// `each` in every scope that `listing` (a `ledger_dispatch` function's query naming
/// `tenant_id, workspace_id`) returns, each within its own scope, summed: the work of an
/// `any_scope => true` call, for members of ledger_operator only (42501 `OPERATOR_REQUIRED`).
pub fn across(listing: &str, mut each: impl FnMut(&Scope) -> Result<i32>) -> Result<i32> {
    ledger_model::run_leases::check_any_scope(is_operator()?, None)?;
    let scopes = db::select(listing, &[], |r| {
        Ok(Scope {
            tenant: db::req(r, 1)?,
            workspace: db::req(r, 2)?,
        })
    })?;
    let mut total = 0;
    for scope in scopes {
        total += within(&scope, || each(&scope))?;
    }
    Ok(total)
}

/// Runs `f` in a row's scope for an operator's cross-scope call, then puts back exactly the
/// scope the session had (session value, transaction-local value or none). A function's SET
/// clause restores only the parameters it names, so without this the row's scope would outlive
/// the call for the rest of a transaction block. If `f` raises a PostgreSQL error, the
/// (sub)transaction's abort restores the parameters instead.
pub fn within<T>(scope: &Scope, f: impl FnOnce() -> Result<T>) -> Result<T> {
    // SAFETY: opens a GUC nest level that is closed below on every Rust path; an ERROR unwinds
    // through the (sub)transaction abort, which closes every nest level above its own.
    let level = unsafe { pgrx::pg_sys::NewGUCNestLevel() };
    let out = state(scope, true, false).and_then(|_| f());
    // SAFETY: `false` restores each parameter set at this level (or deeper) to its prior value,
    // as the server does for the GUC changes of an index's functions.
    unsafe { pgrx::pg_sys::AtEOXact_GUC(false, level) };
    out
}

/// Whether the caller (the role in force outside this SECURITY DEFINER function, so `SET ROLE`
/// counts) is a member of `ledger_operator`.
pub fn is_operator() -> Result<bool> {
    caller_is_member("ledger_operator")
}

/// Whether the caller (as for `is_operator`) is a member of `role`; superusers are members of
/// every role.
pub fn caller_is_member(role: &str) -> Result<bool> {
    // SAFETY: reads the backend's outer user id, which a SECURITY DEFINER call does not change.
    let caller = unsafe { pgrx::pg_sys::GetOuterUserId() };
    Ok(db::select_one(
        "SELECT pg_catalog.pg_has_role($1, $2, 'MEMBER')",
        &[caller.into(), role.into()],
        |r| db::req::<bool>(r, 1),
    )?
    .unwrap_or(false))
}

/// Sets the scope for the session, or with `is_local` for the current transaction only (use
/// that behind a transaction-pooling proxy). A login role bound by scope grants may state only
/// a scope granted to it (42501 `SCOPE_NOT_GRANTED`).
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
    let scope = Scope {
        tenant: tenant.to_owned(),
        workspace: workspace.to_owned(),
    };
    if !state(&scope, is_local.unwrap_or(false), true)? {
        raise(
            LedgerError::new(
                Code::ScopeNotGranted,
                "this login role is bound to other scopes (ledger.scope_grants)",
            )
            .with("tenant_id", tenant)
            .with("workspace_id", workspace),
        );
    }
    Ok(())
}

/// The role a grant names (P0002 `ROLE_NOT_FOUND`), found by to_regrole rather than by reading
/// pg_roles, which a distributed engine does not route (quote_ident keeps the exact name).
fn role_oid(role_name: Option<&str>) -> Result<pgrx::pg_sys::Oid> {
    let name = required_label("role_name", role_name)?;
    db::select_one(
        "SELECT pg_catalog.to_regrole(pg_catalog.quote_ident($1))::oid",
        &[name.into()],
        |r| db::opt::<pgrx::pg_sys::Oid>(r, 1),
    )?
    .flatten()
    .ok_or_else(|| LedgerError::not_found(Code::RoleNotFound, "role", name))
}

/// Runs `statement` (`$1` the role, `$2` the tenant, `$3` the workspace) for the grant the
/// arguments name, once they are checked; whether it returned its row.
fn write_grant(
    statement: &str,
    role_name: Option<&str>,
    tenant_id: Option<&str>,
    workspace_id: Option<&str>,
) -> Result<bool> {
    let role = role_oid(role_name)?;
    let tenant = required_id("tenant_id", tenant_id)?;
    ids::validate("tenant_id", tenant)?;
    let workspace = optional_id("workspace_id", workspace_id)?;
    if let Some(w) = workspace {
        ids::validate("workspace_id", w)?;
    }
    Ok(db::write_one(
        statement,
        &[role.into(), tenant.into(), workspace.into()],
        |r| db::req::<bool>(r, 1),
    )?
    .unwrap_or(false))
}

/// grant_scope's statement: binds the role on its first grant.
const GRANT: &str = "WITH bound AS (INSERT INTO ledger.scope_bindings (grantee) \
                                     VALUES ($1::oid::regrole) ON CONFLICT DO NOTHING) \
                     INSERT INTO ledger.scope_grants (grantee, tenant_id, workspace_id) \
                     VALUES ($1::oid::regrole, $2, $3) ON CONFLICT DO NOTHING RETURNING true";

/// Lets login role `role_name` state the tenant's workspace (NULL: every workspace of it) with
/// set_scope; its first grant binds it to its grants until `unbind_scope`. Returns false when it
/// had this grant.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn grant_scope(
    role_name: Option<&str>,
    tenant_id: Option<&str>,
    workspace_id: default!(Option<&str>, "NULL"),
) -> std::result::Result<bool, SqlError> {
    Ok(write_grant(GRANT, role_name, tenant_id, workspace_id)?)
}

/// revoke_scope's statement: leaves the binding (see revoke_scope).
const REVOKE: &str = "DELETE FROM ledger.scope_grants \
                       WHERE grantee = $1::oid::regrole AND tenant_id = $2 \
                         AND workspace_id IS NOT DISTINCT FROM $3 RETURNING true";

/// Removes one grant (exactly this tenant and workspace, NULL matching the every-workspace
/// grant); returns whether it existed. The role stays bound: a role whose last grant goes may
/// state no scope, since a revocation that unbound it would open every scope.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn revoke_scope(
    role_name: Option<&str>,
    tenant_id: Option<&str>,
    workspace_id: default!(Option<&str>, "NULL"),
) -> std::result::Result<bool, SqlError> {
    Ok(write_grant(REVOKE, role_name, tenant_id, workspace_id)?)
}

/// Unbinds a login role: removes its grants and its binding, so that it may state any scope
/// again; returns whether it was bound. The one way back from a binding, and an explicit one.
#[pg_extern(volatile, parallel_unsafe, security_definer, requires = ["ledger_schema"])]
#[search_path(pg_catalog, ledger, pg_temp)]
fn unbind_scope(role_name: Option<&str>) -> std::result::Result<bool, SqlError> {
    let role = role_oid(role_name)?;
    Ok(db::write_one(
        "WITH grants AS (DELETE FROM ledger.scope_grants WHERE grantee = $1::oid::regrole) \
         DELETE FROM ledger.scope_bindings WHERE grantee = $1::oid::regrole RETURNING true",
        &[role.into()],
        |r| db::req::<bool>(r, 1),
    )?
    .unwrap_or(false))
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use crate::testing::{assert_error, error_of, one, set_scope};
    use pgrx::prelude::*;

    /// `SET` and `set_config` go through the same check as `set_scope`: a name that would look
    /// like another tenant's (an invisible character, a newline, a bidi override, a trailing
    /// space) or does not fit an index row is refused, and the scope stays what it was. A valid
    /// one is refused as well: only `set_scope` states a scope.
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
        // A valid name is refused too, by SET and set_config: only set_scope states a scope.
        for statement in [
            "SET LOCAL ledger.tenant_id = 'acme-2'",
            "SELECT set_config('ledger.workspace_id', 'röm/7:α', true)",
        ] {
            assert_error(statement, "42501", "SCOPE_SET_DIRECTLY");
        }
        // set_scope states it; empty (unset) and RESET pass.
        set_scope("acme-2", "röm/7:α");
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
