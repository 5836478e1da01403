-- ledger: views for people at a psql prompt and for monitoring. security_invoker: the caller's
-- scope and privileges apply. Each filters on ledger.scope_required(), which fails 42501
-- SCOPE_MISSING without a scope: an empty answer from a monitor must mean "nothing to do", never
-- "no scope was set".

CREATE VIEW ledger.tool_calls_in_doubt WITH (security_invoker = true) AS
    SELECT t.id, t.run_id, t.step_id, t.tool_call_id, t.tool_ref, t.idempotency_key, t.attempt,
           t.lease_owner, t.outbound_started_at, t.error_code, t.error_message, t.updated_at
      FROM ledger.run_step_tool_calls t
     WHERE ledger.scope_required() AND t.status = 'in_doubt' AND t.completed_at IS NULL;
COMMENT ON VIEW ledger.tool_calls_in_doubt IS 'Tool calls whose request may have left without an answer, with the lease_owner that held the attempt when it went in doubt. Never retried automatically: decide each with ledger.resolve_tool_call(id, succeeded|failed|retry). Fails 42501 SCOPE_MISSING without a scope.';

CREATE VIEW ledger.pending_approvals WITH (security_invoker = true) AS
    SELECT a.id, a.run_id, a.step_id, a.tool_call_record_id, t.tool_ref, a.title, a.policy_ref,
           a.details, a.created_at, a.expires_at, t.arguments
      FROM ledger.approval_requests a
      LEFT JOIN ledger.run_step_tool_calls t
        ON t.tenant_id = a.tenant_id AND t.workspace_id = a.workspace_id AND t.id = a.tool_call_record_id
     WHERE ledger.scope_required() AND a.status = 'pending'
       AND (a.expires_at IS NULL OR a.expires_at > clock_timestamp());
COMMENT ON VIEW ledger.pending_approvals IS 'Approvals waiting for a decision: ledger.resolve_approval(id, approved|rejected), before expires_at when they have one (past it they are expired, and no longer listed). arguments: the call''s arguments as stored (redacted), so that a person sees what they approve. Fails 42501 SCOPE_MISSING without a scope.';

CREATE VIEW ledger.run_overview WITH (security_invoker = true) AS
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
COMMENT ON VIEW ledger.run_overview IS 'One line per run: status, step and tool-call counts (tool_calls_replayed: results this run reused from another run instead of executing, as a retry or replay reuses its source''s), cost per currency (decimal strings, never mixed), lineage, timing, request_id and user_id. Fails 42501 SCOPE_MISSING without a scope.';

CREATE VIEW ledger.outbox_backlog WITH (security_invoker = true) AS
    SELECT event_type, status, count(*) AS events, min(occurred_at) AS oldest,
           max(attempt_count) AS max_attempts
      FROM ledger.outbox
     WHERE ledger.scope_required() AND status <> 'done'
     GROUP BY event_type, status;
COMMENT ON VIEW ledger.outbox_backlog IS 'Outbox rows not yet done, by event type and status, with the oldest and the most attempts. Fails 42501 SCOPE_MISSING without a scope.';

ALTER VIEW ledger.tool_calls_in_doubt OWNER TO ledger_owner;
ALTER VIEW ledger.pending_approvals OWNER TO ledger_owner;
ALTER VIEW ledger.run_overview OWNER TO ledger_owner;
ALTER VIEW ledger.outbox_backlog OWNER TO ledger_owner;

CREATE VIEW ledger.budget_usage WITH (security_invoker = true) AS
    SELECT b.tenant_id, b.workspace_id,
           CASE WHEN b.run_id IS NOT NULL THEN 'run' WHEN b.workspace_id IS NOT NULL THEN 'workspace'
                ELSE 'tenant' END AS level,
           b.run_id, b.unit, b.period, b.max_amount, u.spent,
           GREATEST(b.max_amount - u.spent, 0) AS remaining, u.spent >= b.max_amount AS exhausted,
           b.warn_ratio, b.warned_window IS NOT DISTINCT FROM w.start AS warned,
           NULLIF(w.start, '-infinity') AS window_start,
           CASE b.period WHEN 'day' THEN w.start + interval '1 day'
                         WHEN 'month' THEN pg_catalog.timezone('UTC', pg_catalog.timezone('UTC', w.start) + interval '1 month')
           END AS window_end,
           b.updated_by, b.updated_at
      FROM ledger.budgets b
     CROSS JOIN LATERAL (SELECT ledger.budget_window(b.period, now()) AS start) w
     CROSS JOIN LATERAL (SELECT ledger.budget_spent(b.period, b.spent, b.window_start, now()) AS spent) u
     WHERE ledger.scope_required();
COMMENT ON VIEW ledger.budget_usage IS 'The budgets of the scope (its workspace''s, its runs'' and its tenant''s) in the window of now: spent, remaining, exhausted (a decision to spend is refused: budget_exhausted), warned (the warning of this window was written), and when the window ends (NULL for total). Raise one with ledger.set_budget. Fails 42501 SCOPE_MISSING without a scope.';
