-- ledger 0.4.0 -> 0.5.0: workers (run ownership with leases and fencing, resuming a crashed
-- run, approvals and evidence that survive a resume). pgrx-tests/upgrade.sh checks that 0.4.0
-- (its own library, with rows written through it) updated with this script equals a fresh
-- install.

-- Run ownership: the owner's lease and the fencing token.
ALTER TABLE ledger.runs
    ADD COLUMN lease_owner text,
    ADD COLUMN lease_expires_at timestamptz,
    ADD COLUMN lease_seconds integer CHECK (lease_seconds BETWEEN 1 AND 86400),
    ADD COLUMN run_token bigint NOT NULL DEFAULT 0 CHECK (run_token >= 0);
-- Claiming a run (ledger.claim_run) scans the scope's live runs oldest first; the operator's
-- claim across scopes scans them all.
CREATE INDEX runs_live_idx ON ledger.runs (tenant_id, workspace_id, queued_at, id)
    WHERE status NOT IN ('succeeded', 'failed', 'canceled', 'expired');
CREATE INDEX runs_live_dispatch_idx ON ledger.runs (queued_at, id)
    WHERE status NOT IN ('succeeded', 'failed', 'canceled', 'expired');
COMMENT ON COLUMN ledger.runs.lease_owner IS 'The worker that claimed the run (ledger.claim_run); NULL when no one ever did or the owner released it.';
COMMENT ON COLUMN ledger.runs.lease_expires_at IS 'When the owner''s lease ends unless ledger.heartbeat_run extends it; NULL when released or the run is terminal. An expired lease lets another worker take the run over.';
COMMENT ON COLUMN ledger.runs.run_token IS 'The fencing token: + 1 on every claim. Writes that carry a run_token must carry this one while the owner holds the run (40001 LEASE_STALE otherwise).';

DO $roles$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'ledger_operator') THEN
        CREATE ROLE ledger_operator NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'ledger_dispatcher') THEN
        CREATE ROLE ledger_dispatcher NOLOGIN;
    END IF;
END
$roles$;

-- What ledger.claim_run returns: the claimed run with its scope, its token and what a worker
-- resuming it needs.
CREATE TYPE ledger.claimed_run AS (
    tenant_id        text,
    workspace_id     text,
    run_id           text,
    run_token        bigint,
    lease_owner      text,
    lease_expires_at timestamptz,
    takeover         boolean,
    previous_owner   text,
    status           text,
    mode             text,
    kind             text,
    attempt_no       integer,
    source_run_id    text,
    inputs           jsonb,
    steps            jsonb,
    tool_calls       jsonb,
    approvals        jsonb,
    last_event_id    text
);
COMMENT ON TYPE ledger.claimed_run IS 'A run as ledger.claim_run hands it to a worker: its scope, run_token (the fencing token to pass to the writes), the lease, whether it was taken over from previous_owner, the run''s status and labels, its inputs (ledger.run_inputs), its steps [{id, step_key, step_type, status}], tool calls [{id, tool_call_id, idempotency_key, tool_ref, status, attempt}] and pending approvals [{id, tool_call_record_id}] in creation order, and last_event_id (the cursor for ledger.events_since).';
ALTER TYPE ledger.claimed_run OWNER TO ledger_owner;

-- Work across scopes, for members of ledger_operator. Row-level security stays as it is for
-- every role; the one exception is ledger_dispatcher, a NOLOGIN role that owns the three
-- functions below and whose policies (a policy for one role is not evaluated for any other)
-- let it see and lock the rows a claim or a sweep needs, in every scope. It has SELECT on
-- those columns and UPDATE on lease_owner only (FOR NO KEY UPDATE needs UPDATE on a column);
-- its policies' WITH CHECK (false) refuses any write anyway. Only ledger_owner may call the
-- functions: claim_run, claim_outbox_events and sweep_tool_calls do, for operators, then
-- switch to each row's scope for the ordinary scoped claim.
CREATE SCHEMA ledger_dispatch;
COMMENT ON SCHEMA ledger_dispatch IS 'Internal: the functions the ledger''s own functions use to find work across scopes for members of ledger_operator. Only ledger_owner may use it.';
CREATE POLICY dispatch_read ON ledger.runs FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_lock ON ledger.runs FOR UPDATE TO ledger_dispatcher USING (true) WITH CHECK (false);
CREATE POLICY dispatch_read ON ledger.outbox FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_lock ON ledger.outbox FOR UPDATE TO ledger_dispatcher USING (true) WITH CHECK (false);
CREATE POLICY dispatch_read ON ledger.run_step_tool_calls FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_read ON ledger.approval_requests FOR SELECT TO ledger_dispatcher USING (true);
CREATE INDEX outbox_dispatch_idx ON ledger.outbox (available_at, id) WHERE status IN ('pending', 'processing');

CREATE FUNCTION ledger_dispatch.next_run(modes text[], kinds text[])
    RETURNS TABLE (tenant_id text, workspace_id text, id text)
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT r.tenant_id, r.workspace_id, r.id FROM ledger.runs r
     WHERE r.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
       AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= clock_timestamp())
       AND (r.status IN ('queued', 'retrying') OR r.run_token > 0)
       AND (modes IS NULL OR r.mode = ANY (modes)) AND (kinds IS NULL OR r.kind = ANY (kinds))
       AND NOT EXISTS (SELECT 1 FROM ledger.run_step_tool_calls t
                        WHERE t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id
                          AND t.run_id = r.id AND t.status = 'in_doubt')
       AND NOT EXISTS (SELECT 1 FROM ledger.approval_requests a
                        WHERE a.tenant_id = r.tenant_id AND a.workspace_id = r.workspace_id
                          AND a.run_id = r.id AND a.status = 'pending')
     ORDER BY r.queued_at, r.id LIMIT 1
       FOR NO KEY UPDATE SKIP LOCKED
$$;
COMMENT ON FUNCTION ledger_dispatch.next_run(text[], text[]) IS 'The oldest claimable run of any scope (see ledger.claim_run) that waits for no person, locked; skips runs another transaction holds.';

CREATE FUNCTION ledger_dispatch.due_outbox_events(max_events integer)
    RETURNS TABLE (tenant_id text, workspace_id text, id text)
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT o.tenant_id, o.workspace_id, o.id FROM ledger.outbox o
     WHERE o.status IN ('pending', 'processing') AND o.available_at <= clock_timestamp()
       AND (o.status = 'pending' OR o.lease_expires_at <= clock_timestamp())
     ORDER BY o.available_at, o.id LIMIT max_events
       FOR NO KEY UPDATE SKIP LOCKED
$$;
COMMENT ON FUNCTION ledger_dispatch.due_outbox_events(integer) IS 'Up to max_events due outbox events of any scope (see ledger.claim_outbox_events), oldest first, locked; skips events another transaction holds.';

CREATE FUNCTION ledger_dispatch.expired_tool_call_scopes()
    RETURNS TABLE (tenant_id text, workspace_id text)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT DISTINCT t.tenant_id, t.workspace_id FROM ledger.run_step_tool_calls t
     WHERE t.lease_expires_at <= clock_timestamp()
$$;
COMMENT ON FUNCTION ledger_dispatch.expired_tool_call_scopes() IS 'The scopes that have a tool call whose lease expired (see ledger.sweep_tool_calls).';

-- Scope grants: which scopes a login role may state with ledger.set_scope. A role with no
-- grant is unbound (any scope, as before 0.5.0). Only ledger_owner's functions read the table.
CREATE TABLE ledger.scope_grants (
    grantee      regrole NOT NULL,
    tenant_id    text NOT NULL,
    workspace_id text,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX scope_grants_key ON ledger.scope_grants (grantee, tenant_id, workspace_id) NULLS NOT DISTINCT;
COMMENT ON TABLE ledger.scope_grants IS 'The scopes a login role may state with ledger.set_scope (workspace_id NULL: every workspace of the tenant). A role with at least one grant is bound: set_scope refuses it any other scope (42501 SCOPE_NOT_GRANTED). Written by ledger.grant_scope and ledger.revoke_scope; no role but ledger_owner has any privilege on it.';
ALTER TABLE ledger.scope_grants ENABLE ROW LEVEL SECURITY;
ALTER TABLE ledger.scope_grants FORCE ROW LEVEL SECURITY;
CREATE POLICY owner_only ON ledger.scope_grants TO ledger_owner USING (true) WITH CHECK (true);
ALTER TABLE ledger.scope_grants OWNER TO ledger_owner;
SELECT pg_catalog.pg_extension_config_dump('ledger.scope_grants', '');

-- set_scope runs as its caller, who cannot read the grants: it asks this function, which
-- answers for the session's login role only.
CREATE FUNCTION ledger_dispatch.scope_granted(tenant_id text, workspace_id text) RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT NOT EXISTS (SELECT 1 FROM ledger.scope_grants g
                        WHERE g.grantee = (SELECT oid FROM pg_roles WHERE rolname = session_user))
        OR EXISTS (SELECT 1 FROM ledger.scope_grants g
                    WHERE g.grantee = (SELECT oid FROM pg_roles WHERE rolname = session_user)
                      AND g.tenant_id = $1 AND (g.workspace_id IS NULL OR g.workspace_id = $2))
$$;
COMMENT ON FUNCTION ledger_dispatch.scope_granted(text, text) IS 'Whether the session''s login role (session_user, which SET ROLE does not change) may state this scope: it has no grant at all (unbound), or one for the tenant and this workspace or every workspace.';

-- The run's writes take the owner's run_token (last argument); the outbox claim and the sweep
-- take any_scope. Old signatures go, the new ones are created as the install script does.
DROP FUNCTION ledger.transition_run(text, text, text, text, text, text, text);
DROP FUNCTION ledger.create_step(text, text, text, text, text, text, text);
DROP FUNCTION ledger.transition_step(text, text, text, text, jsonb, text, text, jsonb);
DROP FUNCTION ledger.claim_tool_call(text, text, jsonb, text, text, text, text, integer, boolean);
DROP FUNCTION ledger.request_tool_approval(text, text, jsonb, text, text, text, text, jsonb);
DROP FUNCTION ledger.claim_outbox_events(text, integer, integer);
DROP FUNCTION ledger.sweep_tool_calls();

-- This version's functions, as the generated install script creates them.
CREATE  FUNCTION "claim_outbox_events"(
	"lease_owner" TEXT, /* Option < & str > */
	"max_events" INT DEFAULT 50, /* Option < i32 > */
	"lease_seconds" INT DEFAULT 60, /* Option < i32 > */
	"any_scope" bool DEFAULT false /* Option < bool > */
) RETURNS SETOF ledger.outbox_event /* :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx :: pgbox :: AllocatedByRust
> */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'claim_outbox_events_wrapper';

CREATE  FUNCTION "claim_run"(
	"lease_owner" TEXT, /* Option < & str > */
	"run_id" TEXT DEFAULT NULL, /* Option < & str > */
	"modes" TEXT[] DEFAULT NULL, /* :: std :: option :: Option < Vec < Option < String > > > */
	"kinds" TEXT[] DEFAULT NULL, /* :: std :: option :: Option < Vec < Option < String > > > */
	"lease_seconds" INT DEFAULT 60, /* Option < i32 > */
	"any_scope" bool DEFAULT false /* Option < bool > */
) RETURNS SETOF ledger.claimed_run /* :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx :: pgbox :: AllocatedByRust
> */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'claim_run_wrapper';

CREATE  FUNCTION "claim_tool_call"(
	"run_id" TEXT, /* Option < & str > */
	"tool_ref" TEXT, /* Option < & str > */
	"arguments" jsonb DEFAULT '{}', /* Option < Jsonb > */
	"tool_call_id" TEXT DEFAULT NULL, /* Option < & str > */
	"idempotency_key" TEXT DEFAULT NULL, /* Option < & str > */
	"step_id" TEXT DEFAULT NULL, /* Option < & str > */
	"lease_owner" TEXT DEFAULT NULL, /* Option < & str > */
	"timeout_seconds" INT DEFAULT 30, /* Option < i32 > */
	"retry_failed" bool DEFAULT false, /* Option < bool > */
	"run_token" bigint DEFAULT NULL /* Option < i64 > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'claim_tool_call_wrapper';

CREATE  FUNCTION "create_step"(
	"run_id" TEXT, /* Option < & str > */
	"step_type" TEXT, /* Option < & str > */
	"step_key" TEXT DEFAULT NULL, /* Option < & str > */
	"node_id" TEXT DEFAULT NULL, /* Option < & str > */
	"input_summary" TEXT DEFAULT NULL, /* Option < & str > */
	"status" TEXT DEFAULT 'queued', /* Option < & str > */
	"step_id" TEXT DEFAULT NULL, /* Option < & str > */
	"run_token" bigint DEFAULT NULL /* Option < i64 > */
) RETURNS ledger.run_steps /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'create_step_wrapper';

CREATE  FUNCTION "grant_scope"(
	"role_name" TEXT, /* Option < & str > */
	"tenant_id" TEXT, /* Option < & str > */
	"workspace_id" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS bool /* std :: result :: Result < bool, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'grant_scope_wrapper';

CREATE  FUNCTION "heartbeat_run"(
	"run_id" TEXT, /* Option < & str > */
	"run_token" bigint, /* Option < i64 > */
	"extend_seconds" INT DEFAULT NULL /* Option < i32 > */
) RETURNS timestamp with time zone /* std :: result :: Result < TimestampWithTimeZone, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'heartbeat_run_wrapper';

CREATE  FUNCTION "release_run"(
	"run_id" TEXT, /* Option < & str > */
	"run_token" bigint /* Option < i64 > */
) RETURNS VOID /* std :: result :: Result < (), SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'release_run_wrapper';

CREATE  FUNCTION "request_tool_approval"(
	"run_id" TEXT, /* Option < & str > */
	"tool_ref" TEXT, /* Option < & str > */
	"arguments" jsonb, /* Option < Jsonb > */
	"tool_call_id" TEXT DEFAULT NULL, /* Option < & str > */
	"idempotency_key" TEXT DEFAULT NULL, /* Option < & str > */
	"title" TEXT DEFAULT NULL, /* Option < & str > */
	"policy_ref" TEXT DEFAULT NULL, /* Option < & str > */
	"details" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"run_token" bigint DEFAULT NULL /* Option < i64 > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'request_tool_approval_wrapper';

CREATE  FUNCTION "revoke_scope"(
	"role_name" TEXT, /* Option < & str > */
	"tenant_id" TEXT, /* Option < & str > */
	"workspace_id" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS bool /* std :: result :: Result < bool, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'revoke_scope_wrapper';

CREATE  FUNCTION "sweep_tool_calls"(
	"any_scope" bool DEFAULT false /* Option < bool > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'sweep_tool_calls_wrapper';

CREATE  FUNCTION "transition_run"(
	"run_id" TEXT, /* Option < & str > */
	"to_status" TEXT, /* Option < & str > */
	"expected_status" TEXT DEFAULT NULL, /* Option < & str > */
	"output_summary" TEXT DEFAULT NULL, /* Option < & str > */
	"error_code" TEXT DEFAULT NULL, /* Option < & str > */
	"error_message" TEXT DEFAULT NULL, /* Option < & str > */
	"error_step_id" TEXT DEFAULT NULL, /* Option < & str > */
	"run_token" bigint DEFAULT NULL /* Option < i64 > */
) RETURNS ledger.runs /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'transition_run_wrapper';

CREATE  FUNCTION "transition_step"(
	"step_id" TEXT, /* Option < & str > */
	"to_status" TEXT, /* Option < & str > */
	"expected_status" TEXT DEFAULT NULL, /* Option < & str > */
	"output_summary" TEXT DEFAULT NULL, /* Option < & str > */
	"metrics" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"error_code" TEXT DEFAULT NULL, /* Option < & str > */
	"error_message" TEXT DEFAULT NULL, /* Option < & str > */
	"error_details" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"run_token" bigint DEFAULT NULL /* Option < i64 > */
) RETURNS ledger.run_steps /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'transition_step_wrapper';

ALTER FUNCTION ledger.transition_run(text, text, text, text, text, text, text, bigint) OWNER TO ledger_owner;
ALTER FUNCTION ledger.create_step(text, text, text, text, text, text, text, bigint) OWNER TO ledger_owner;
ALTER FUNCTION ledger.transition_step(text, text, text, text, jsonb, text, text, jsonb, bigint) OWNER TO ledger_owner;
ALTER FUNCTION ledger.claim_tool_call(text, text, jsonb, text, text, text, text, integer, boolean, bigint) OWNER TO ledger_owner;
ALTER FUNCTION ledger.request_tool_approval(text, text, jsonb, text, text, text, text, jsonb, bigint) OWNER TO ledger_owner;
ALTER FUNCTION ledger.claim_outbox_events(text, integer, integer, boolean) OWNER TO ledger_owner;
ALTER FUNCTION ledger.sweep_tool_calls(boolean) OWNER TO ledger_owner;
ALTER FUNCTION ledger.claim_run(text, text, text[], text[], integer, boolean) OWNER TO ledger_owner;
ALTER FUNCTION ledger.heartbeat_run(text, bigint, integer) OWNER TO ledger_owner;
ALTER FUNCTION ledger.release_run(text, bigint) OWNER TO ledger_owner;
ALTER FUNCTION ledger.grant_scope(text, text, text) OWNER TO ledger_owner;
ALTER FUNCTION ledger.revoke_scope(text, text, text) OWNER TO ledger_owner;
-- New and re-created functions: EXECUTE for writers (the grant functions: the owner only).
REVOKE ALL ON FUNCTION ledger.transition_run(text, text, text, text, text, text, text, bigint),
    ledger.create_step(text, text, text, text, text, text, text, bigint),
    ledger.transition_step(text, text, text, text, jsonb, text, text, jsonb, bigint),
    ledger.claim_tool_call(text, text, jsonb, text, text, text, text, integer, boolean, bigint),
    ledger.request_tool_approval(text, text, jsonb, text, text, text, text, jsonb, bigint),
    ledger.claim_outbox_events(text, integer, integer, boolean),
    ledger.sweep_tool_calls(boolean),
    ledger.claim_run(text, text, text[], text[], integer, boolean),
    ledger.heartbeat_run(text, bigint, integer),
    ledger.release_run(text, bigint),
    ledger.grant_scope(text, text, text),
    ledger.revoke_scope(text, text, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ledger.transition_run(text, text, text, text, text, text, text, bigint),
    ledger.create_step(text, text, text, text, text, text, text, bigint),
    ledger.transition_step(text, text, text, text, jsonb, text, text, jsonb, bigint),
    ledger.claim_tool_call(text, text, jsonb, text, text, text, text, integer, boolean, bigint),
    ledger.request_tool_approval(text, text, jsonb, text, text, text, text, jsonb, bigint),
    ledger.claim_outbox_events(text, integer, integer, boolean),
    ledger.sweep_tool_calls(boolean),
    ledger.claim_run(text, text, text[], text[], integer, boolean),
    ledger.heartbeat_run(text, bigint, integer),
    ledger.release_run(text, bigint) TO ledger_writer;

COMMENT ON FUNCTION ledger.transition_run(text, text, text, text, text, text, text, bigint) IS
    'Moves a run to to_status if ledger.status_transitions() allows it (55000 TRANSITION_INVALID otherwise). With expected_status the move is conditional on it (40001 TRANSITION_CONFLICT). Moving to the current status returns the row unchanged. A terminal status ends the owner''s lease. run_token: the owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.create_step(text, text, text, text, text, text, text, bigint) IS
    'Adds a step to a run that exists in scope and is not terminal (55000 RUN_TERMINAL). A caller step_id is idempotent. run_token: the owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.transition_step(text, text, text, text, jsonb, text, text, jsonb, bigint) IS
    'Moves a step to to_status under the same rules as transition_run (steps also have skipped). metrics are merged into the existing object, top-level keys. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.claim_tool_call(text, text, jsonb, text, text, text, text, integer, boolean, bigint) IS
    'Claims a tool call for execution. Returns {outcome, tool_call, approval, response} with outcome claimed (execute it; tool_call.id is the tool_call_record_id the other tool-call functions take and tool_call.attempt your fencing token), replayed (response holds the last result; execute nothing), in_doubt (the request may have left; never retried automatically), busy (a live lease exists), waiting_approval or rejected. Same key with another tool_ref or arguments: 23505 IDEMPOTENCY_MISMATCH. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.request_tool_approval(text, text, jsonb, text, text, text, text, jsonb, bigint) IS
    'Creates a tool call in waiting_approval and its approval request (outbox approval.requested). Claims of the same identity return waiting_approval while pending, claimed once approved, rejected once rejected. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.claim_outbox_events(text, integer, integer, boolean) IS
    'Claims up to max_events (1 to 1000) due outbox events of the scope for lease_owner, oldest first: pending ones whose available_at has come and processing ones whose lease expired. Each becomes processing under a lease of lease_seconds (1 to 86400) and counts an attempt. FOR UPDATE SKIP LOCKED: never waits for another claimer. An expired lease on an event''s 64th attempt since its last replay fails it instead. Delivery is at least once: deduplicate on id. With any_scope => true (members of ledger_operator only), the oldest due events of every scope, each with its tenant_id and workspace_id.';
COMMENT ON FUNCTION ledger.sweep_tool_calls(boolean) IS
    'Moves every expired lease in the scope to in_doubt (the request left) or back to claimable (it did not); returns how many. For pg_cron or a worker; never waits on busy rows. With any_scope => true (members of ledger_operator only), every scope''s.';
COMMENT ON FUNCTION ledger.set_scope(text, text, boolean) IS
    'Sets the caller''s scope (GUCs ledger.tenant_id, ledger.workspace_id) for the session, or with is_local => true for the current transaction only. Every other function refuses to run without it (42501 SCOPE_MISSING). The only way to set a scope: SET, set_config, ALTER ROLE ... SET and PGOPTIONS are refused (42501 SCOPE_SET_DIRECTLY). A login role bound by ledger.grant_scope may state only its granted scopes (42501 SCOPE_NOT_GRANTED).';

-- Run ownership, the operator role and scope grants (0.5.0).
COMMENT ON FUNCTION ledger.claim_run(text, text, text[], text[], integer, boolean) IS
    'Claims a run for lease_owner: run_id, or the oldest claimable run of the scope (filtered by modes and kinds), FOR UPDATE SKIP LOCKED: never waits. Claimable: not terminal, no live lease, and queued or retrying or claimed before (a run nobody ever claimed stays with its caller); the oldest-first claim skips runs with a call in doubt or waiting for approval (they wait for a person, whose decision makes them claimable). Each claim adds 1 to the run''s run_token, leases the run for lease_seconds (1 to 86400) and writes run.claimed to its feed; the status does not change. Returns no row when nothing is claimable, else a ledger.claimed_run (takeover: the lease of previous_owner had expired). any_scope => true: across scopes, for members of ledger_operator (42501 OPERATOR_REQUIRED).';
COMMENT ON FUNCTION ledger.heartbeat_run(text, bigint, integer) IS
    'Extends the owner''s lease by extend_seconds (default: the claim''s lease_seconds) from now and returns when it ends. Fenced by run_token (40001 LEASE_STALE), not by the clock: accepted after expiry until another worker takes the run over. A terminal run: 55000 RUN_TERMINAL.';
COMMENT ON FUNCTION ledger.release_run(text, bigint) IS
    'Gives up the owner''s run: claimable at once by anyone unless it is terminal, and run_token is over (40001 LEASE_STALE on any later write carrying it).';
COMMENT ON FUNCTION ledger.grant_scope(text, text, text) IS
    'Lets login role role_name state the tenant''s workspace (NULL: every workspace of the tenant) with ledger.set_scope. A role with at least one grant is bound: set_scope refuses it any other scope (42501 SCOPE_NOT_GRANTED). Returns false when the grant existed. For the extension''s owner and superusers only.';
COMMENT ON FUNCTION ledger.revoke_scope(text, text, text) IS
    'Removes the grant of exactly this tenant and workspace (NULL: the every-workspace grant) from role_name; returns whether it existed. A role left with no grant is unbound again. For the extension''s owner and superusers only.';

-- Grants decide who may state which scope: no application role may read or change them.
REVOKE SELECT ON ledger.scope_grants FROM ledger_reader;
REVOKE EXECUTE ON FUNCTION ledger.grant_scope(text, text, text), ledger.revoke_scope(text, text, text)
    FROM ledger_writer;

-- ledger_dispatcher: owns the functions that find work across scopes (see schema.sql).
ALTER FUNCTION ledger_dispatch.next_run(text[], text[]) OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.due_outbox_events(integer) OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.expired_tool_call_scopes() OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.scope_granted(text, text) OWNER TO ledger_owner;
GRANT USAGE ON SCHEMA ledger TO ledger_dispatcher;
GRANT EXECUTE ON FUNCTION ledger.scope_tenant(), ledger.scope_workspace() TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, id, mode, kind, status, queued_at, lease_expires_at, run_token),
      UPDATE (lease_owner) ON ledger.runs TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, id, status, available_at, lease_expires_at),
      UPDATE (lease_owner) ON ledger.outbox TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, run_id, status, lease_expires_at) ON ledger.run_step_tool_calls TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, run_id, status) ON ledger.approval_requests TO ledger_dispatcher;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA ledger_dispatch FROM PUBLIC;
GRANT USAGE ON SCHEMA ledger_dispatch TO ledger_owner, ledger_reader;
GRANT EXECUTE ON FUNCTION ledger_dispatch.next_run(text[], text[]),
    ledger_dispatch.due_outbox_events(integer),
    ledger_dispatch.expired_tool_call_scopes(),
    ledger_dispatch.scope_granted(text, text) TO ledger_owner;
-- set_scope runs as its caller.
GRANT EXECUTE ON FUNCTION ledger_dispatch.scope_granted(text, text) TO ledger_reader;

-- An operator is a writer that may also claim runs and outbox events and sweep leases across
-- scopes (any_scope => true).
GRANT ledger_writer TO ledger_operator;
-- Monitoring views fail without a scope (ledger.scope_required), run_overview gains created_at,
-- request_id, user_id and tool_calls_replayed; the in-doubt view keeps the worker that held the
-- attempt (the query that marks a call in doubt no longer clears lease_owner).
CREATE  FUNCTION "scope_required"() RETURNS bool /* std :: result :: Result < bool, SqlError > */
STRICT STABLE PARALLEL SAFE
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'scope_required_wrapper';
ALTER FUNCTION ledger.scope_required() OWNER TO ledger_owner;
REVOKE ALL ON FUNCTION ledger.scope_required() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ledger.scope_required() TO ledger_reader, ledger_writer;
COMMENT ON FUNCTION ledger.scope_required() IS
    'true when a scope is set, else 42501 SCOPE_MISSING. The monitoring views filter on it, so that reading one without a scope fails instead of showing no rows.';

CREATE OR REPLACE VIEW ledger.tool_calls_in_doubt WITH (security_invoker = true) AS
    SELECT t.id, t.run_id, t.step_id, t.tool_call_id, t.tool_ref, t.idempotency_key, t.attempt,
           t.lease_owner, t.outbound_started_at, t.error_code, t.error_message, t.updated_at
      FROM ledger.run_step_tool_calls t
     WHERE ledger.scope_required() AND t.status = 'in_doubt';
COMMENT ON VIEW ledger.tool_calls_in_doubt IS 'Tool calls whose request may have left without an answer, with the lease_owner that held the attempt when it went in doubt. Never retried automatically: decide each with ledger.resolve_tool_call(id, succeeded|failed|retry). Fails 42501 SCOPE_MISSING without a scope.';

CREATE OR REPLACE VIEW ledger.pending_approvals WITH (security_invoker = true) AS
    SELECT a.id, a.run_id, a.step_id, a.tool_call_record_id, t.tool_ref, a.title, a.policy_ref,
           a.details, a.created_at
      FROM ledger.approval_requests a
      LEFT JOIN ledger.run_step_tool_calls t
        ON t.tenant_id = a.tenant_id AND t.workspace_id = a.workspace_id AND t.id = a.tool_call_record_id
     WHERE ledger.scope_required() AND a.status = 'pending';
COMMENT ON VIEW ledger.pending_approvals IS 'Approvals waiting for a decision: ledger.resolve_approval(id, approved|rejected). Fails 42501 SCOPE_MISSING without a scope.';

CREATE OR REPLACE VIEW ledger.run_overview WITH (security_invoker = true) AS
    SELECT r.id, r.status, r.mode, r.kind, r.subject_kind, r.subject_id, r.attempt_no,
           r.source_run_id, r.parent_run_id, r.root_run_id, r.control_action,
           (SELECT count(*) FROM ledger.run_steps s
             WHERE s.tenant_id = r.tenant_id AND s.workspace_id = r.workspace_id AND s.run_id = r.id) AS steps,
           (SELECT count(*) FROM ledger.run_step_tool_calls t
             WHERE t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id AND t.run_id = r.id) AS tool_calls,
           (SELECT count(*) FROM ledger.run_step_tool_calls t
             WHERE t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id AND t.run_id = r.id
               AND t.status = 'in_doubt') AS tool_calls_in_doubt,
           (SELECT coalesce(jsonb_object_agg(c.currency, c.total::text ORDER BY c.currency), '{}')
              FROM (SELECT currency, sum(amount) AS total FROM ledger.run_cost_entries e
                     WHERE e.tenant_id = r.tenant_id AND e.workspace_id = r.workspace_id AND e.run_id = r.id
                       AND e.amount IS NOT NULL GROUP BY currency) c) AS cost,
           r.error_code, r.queued_at, r.started_at, r.ended_at, r.duration_ms,
           r.created_at, r.request_id, r.user_id,
           (SELECT count(*) FROM ledger.run_events v
             WHERE v.tenant_id = r.tenant_id AND v.workspace_id = r.workspace_id AND v.run_id = r.id
               AND v.event_type = 'tool_call.replayed') AS tool_calls_replayed
      FROM ledger.runs r
     WHERE ledger.scope_required();
COMMENT ON VIEW ledger.run_overview IS 'One line per run: status, step and tool-call counts (tool_calls_replayed: results this run took from the ledger instead of executing, such as a retry reusing its source''s), cost per currency (decimal strings, never mixed), lineage, timing, request_id and user_id. Fails 42501 SCOPE_MISSING without a scope.';

CREATE OR REPLACE VIEW ledger.outbox_backlog WITH (security_invoker = true) AS
    SELECT event_type, status, count(*) AS events, min(occurred_at) AS oldest,
           max(attempt_count) AS max_attempts
      FROM ledger.outbox
     WHERE ledger.scope_required() AND status <> 'done'
     GROUP BY event_type, status;
COMMENT ON VIEW ledger.outbox_backlog IS 'Outbox rows not yet done, by event type and status, with the oldest and the most attempts. Fails 42501 SCOPE_MISSING without a scope.';


-- events_since says which event ended the run (ends_run), so a follower knows when to stop.
DROP FUNCTION ledger.events_since(text, text, integer);
CREATE  FUNCTION "events_since"(
	"run_id" TEXT, /* Option < & str > */
	"after_event_id" TEXT DEFAULT NULL, /* Option < & str > */
	"max_events" INT DEFAULT 1000 /* Option < i32 > */
) RETURNS TABLE (
	"event_id" TEXT,  /* String */
	"seq" bigint,  /* i64 */
	"event_type" TEXT,  /* String */
	"step_id" TEXT,  /* Option < String > */
	"payload" jsonb,  /* Jsonb */
	"created_at" timestamp with time zone,  /* TimestampWithTimeZone */
	"ends_run" bool  /* bool */
)
STABLE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'events_since_wrapper';
ALTER FUNCTION ledger.events_since(text, text, integer) OWNER TO ledger_owner;
REVOKE ALL ON FUNCTION ledger.events_since(text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ledger.events_since(text, text, integer) TO ledger_reader, ledger_writer;
COMMENT ON FUNCTION ledger.events_since(text, text, integer) IS
    'The run''s events after after_event_id (from the start when NULL), ordered by their gapless seq. ends_run marks the event that moved the run to a terminal status: a follower may stop after it. An unknown after_event_id fails P0002 EVENT_NOT_FOUND. Client contract: LISTEN on ledger.run_channel(run_id) first, then call this with your cursor, and again on each notification.';

-- record_cost takes a double precision amount too (what a client's float binds as).
CREATE  FUNCTION "record_cost"(
	"run_id" TEXT, /* Option < & str > */
	"billing_basis" TEXT, /* Option < & str > */
	"billed_quantity" NUMERIC, /* Option < AnyNumeric > */
	"amount" double precision, /* Option < f64 > */
	"currency" TEXT DEFAULT NULL, /* Option < & str > */
	"step_id" TEXT DEFAULT NULL, /* Option < & str > */
	"usage" jsonb DEFAULT '{}', /* Option < Jsonb > */
	"pricing_snapshot" jsonb DEFAULT '{}', /* Option < Jsonb > */
	"provider" TEXT DEFAULT NULL, /* Option < & str > */
	"model_ref" TEXT DEFAULT NULL, /* Option < & str > */
	"tool_ref" TEXT DEFAULT NULL, /* Option < & str > */
	"source_port" TEXT DEFAULT NULL, /* Option < & str > */
	"operation" TEXT DEFAULT NULL, /* Option < & str > */
	"source_ref" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.run_cost_entries /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE  
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'record_cost_float_amount_wrapper';
ALTER FUNCTION ledger.record_cost(text, text, numeric, double precision, text, text, jsonb, jsonb, text, text, text, text, text, text) OWNER TO ledger_owner;
REVOKE ALL ON FUNCTION ledger.record_cost(text, text, numeric, double precision, text, text, jsonb, jsonb, text, text, text, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ledger.record_cost(text, text, numeric, double precision, text, text, jsonb, jsonb, text, text, text, text, text, text) TO ledger_writer;
COMMENT ON FUNCTION ledger.record_cost(text, text, numeric, numeric, text, text, jsonb, jsonb, text, text, text, text, text, text) IS
    'Records a cost entry: billed_quantity >= 0, amount >= 0 with a currency, usage with the known keys (or the OpenAI and Anthropic names, stored under the known keys) as non-negative integers. source_ref is idempotent per scope. Writes cost.recorded to the feed and the outbox.';
COMMENT ON FUNCTION ledger.record_cost(text, text, numeric, double precision, text, text, jsonb, jsonb, text, text, text, text, text, text) IS
    'ledger.record_cost with a double precision amount (a client''s float), taken as its shortest decimal text: 0.1 is stored as 0.1.';
