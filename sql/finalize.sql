-- ledger: ownership, privileges and comments. Runs last (finalize).

-- Every function belongs to ledger_owner, so SECURITY DEFINER functions run as a role that is
-- not a superuser and is still subject to the tables' forced row-level security.
DO $own$
DECLARE f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'ledger'::regnamespace LOOP
        EXECUTE format('ALTER FUNCTION %s OWNER TO ledger_owner', f);
    END LOOP;
END
$own$;

GRANT USAGE ON SCHEMA ledger TO ledger_owner, ledger_reader, ledger_writer;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA ledger FROM PUBLIC;

-- Readers: SELECT on the tables (rows filtered by scope) and the read functions.
GRANT SELECT ON ALL TABLES IN SCHEMA ledger TO ledger_reader;
GRANT EXECUTE ON FUNCTION
    ledger.set_scope(text, text, boolean),
    ledger.scope_tenant(),
    ledger.scope_workspace(),
    ledger.status_transitions(),
    ledger.events_since(text, text, integer),
    ledger.run_channel(text),
    ledger.run_inputs(text)
    TO ledger_reader;

-- Writers: everything a reader has, and every function. No INSERT, UPDATE or DELETE on any
-- table: the rules (status machine, event seq, redaction) live in the functions.
GRANT ledger_reader TO ledger_writer;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA ledger TO ledger_writer;

COMMENT ON FUNCTION ledger.set_scope(text, text, boolean) IS
    'Sets the caller''s scope (GUCs ledger.tenant_id, ledger.workspace_id) for the session, or with is_local => true for the current transaction only. Every other function refuses to run without it (42501 SCOPE_MISSING).';
COMMENT ON FUNCTION ledger.status_transitions() IS
    'The status machine: every allowed (resource, from_status, to_status) for run, step and task. Statuses: queued, preparing, running, waiting_input, waiting_approval, paused, retrying, succeeded, failed, canceled, expired (+ skipped for steps). Terminal: succeeded, failed, canceled, expired, skipped.';
COMMENT ON FUNCTION ledger.create_run(text, jsonb, text, text, text, text, text, text, text, integer, text, text, text, text) IS
    'Creates a queued run. request_id (or a caller run_id) makes it idempotent; source_run_id and parent_run_id must exist in scope; attempt_no defaults to source.attempt_no + 1 and root_run_id to the source''s root. inputs (a JSON object) are kept exactly: see ledger.run_inputs.';
COMMENT ON FUNCTION ledger.transition_run(text, text, text, text, text, text, text) IS
    'Moves a run to to_status if ledger.status_transitions() allows it (55000 TRANSITION_INVALID otherwise). With expected_status the move is conditional on it (40001 TRANSITION_CONFLICT). Moving to the current status returns the row unchanged.';
COMMENT ON FUNCTION ledger.run_inputs(text) IS
    'The exact inputs a run was created with, also when they were too large to keep inline.';
COMMENT ON FUNCTION ledger.create_step(text, text, text, text, text, text, text) IS
    'Adds a step to a run that exists in scope and is not terminal (55000 RUN_TERMINAL). A caller step_id is idempotent.';
COMMENT ON FUNCTION ledger.transition_step(text, text, text, text, jsonb, text, text, jsonb) IS
    'Moves a step to to_status under the same rules as transition_run (steps also have skipped). metrics are merged into the existing object, top-level keys.';
COMMENT ON FUNCTION ledger.events_since(text, text, integer) IS
    'The run''s events after after_event_id (from the start when NULL), ordered by their gapless seq. An unknown after_event_id fails P0002 EVENT_NOT_FOUND. Client contract: LISTEN on ledger.run_channel(run_id) first, then call this with your cursor, and again on each notification.';
COMMENT ON FUNCTION ledger.run_channel(text) IS
    'The LISTEN/NOTIFY channel of a run. Each event appended to the run notifies it at commit with {"run_id","seq","event_id","kind"}.';
