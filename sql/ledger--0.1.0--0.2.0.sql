-- ledger 0.1.0 -> 0.2.0. Every schema change of 0.2.0 is appended here, in the order it was
-- made; pgrx-tests/upgrade.sh checks that 0.1.0 updated with this script equals a fresh install.

-- The scope helpers become inlinable SQL-standard functions without a SET clause (owner, grants
-- and comments are kept by CREATE OR REPLACE).
CREATE OR REPLACE FUNCTION ledger.scope_tenant() RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
    RETURN nullif(pg_catalog.current_setting('ledger.tenant_id', true), '');
CREATE OR REPLACE FUNCTION ledger.scope_workspace() RETURNS text LANGUAGE sql STABLE PARALLEL SAFE
    RETURN nullif(pg_catalog.current_setting('ledger.workspace_id', true), '');
