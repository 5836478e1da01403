-- ledger 0.4.0 -> 0.5.0: workers (run ownership with leases and fencing, resuming a crashed
-- run, approvals and evidence that survive a resume). pgrx-tests/upgrade.sh checks that 0.4.0
-- (its own library, with rows written through it) updated with this script equals a fresh
-- install.

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
