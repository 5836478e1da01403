-- ledger 0.3.0 -> 0.4.0: hardening (redaction of every JSON and free-text argument, bounded
-- arguments, one lock order for claims, scope names checked wherever they are read). The SQL
-- API keeps its names and arguments; pgrx-tests/upgrade.sh checks that 0.3.0 (its own library,
-- with rows written through it) updated with this script equals a fresh install.

-- The blob store's lock: a row per scope in a table only ledger_owner can touch, instead of an
-- advisory lock whose key any role could take (blocking the scope's blob writers) or see in
-- pg_locks. Scopes that already have blobs get their row, so that the purge's sweep finds it.
CREATE TABLE ledger.blob_locks (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    PRIMARY KEY (tenant_id, workspace_id)
);
COMMENT ON TABLE ledger.blob_locks IS 'One row per scope that has blobs, locked by the functions alone: blob writers take it FOR KEY SHARE, the purge''s sweep of unreferenced blobs FOR UPDATE SKIP LOCKED, so a blob a transaction is about to reference is never swept. No role but ledger_owner has any privilege on it, so no one else can take or watch these locks.';
ALTER TABLE ledger.blob_locks ENABLE ROW LEVEL SECURITY;
ALTER TABLE ledger.blob_locks FORCE ROW LEVEL SECURITY;
CREATE POLICY scope ON ledger.blob_locks
    USING (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace())
    WITH CHECK (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace());
ALTER TABLE ledger.blob_locks OWNER TO ledger_owner;
SELECT pg_catalog.pg_extension_config_dump('ledger.blob_locks', '');
REVOKE ALL ON ledger.blob_locks FROM PUBLIC;
INSERT INTO ledger.blob_locks (tenant_id, workspace_id)
    SELECT DISTINCT tenant_id, workspace_id FROM ledger.blobs;
