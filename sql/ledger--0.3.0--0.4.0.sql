-- ledger 0.3.0 -> 0.4.0: hardening (redaction of every JSON and free-text argument, bounded
-- arguments, one lock order for claims, scope names checked wherever they are read). The SQL
-- API keeps its names and arguments; pgrx-tests/upgrade.sh checks that 0.3.0 (its own library,
-- with rows written through it) updated with this script equals a fresh install.

-- Run inputs are redacted like every JSON argument.
COMMENT ON FUNCTION ledger.create_run(text, jsonb, text, text, text, text, text, text, text, integer, text, text, text, text) IS
    'Creates a queued run. request_id (or a caller run_id) makes it idempotent; source_run_id and parent_run_id must exist in scope; attempt_no defaults to source.attempt_no + 1 and root_run_id to the source''s root. inputs (a JSON object) are redacted, then kept as stored: see ledger.run_inputs.';
COMMENT ON FUNCTION ledger.run_inputs(text) IS
    'The inputs a run was created with, as stored (redacted), also when they were too large to keep inline.';
COMMENT ON FUNCTION ledger.retry_run(text, jsonb) IS
    'Retries a failed or canceled run (replay #4): a new queued run with the source''s mode, kind and subject pinned to its subject_version_id, source_run_id, attempt_no + 1, the same root_run_id, control_action retry, and the original inputs as stored unless inputs overrides them. The caller executes it; its tool calls with unchanged keys replay from the ledger.';

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
