-- ledger 0.5.0 -> 0.6.0: budgets, time and fair dispatch. pgrx-tests/upgrade.sh checks that 0.5.0
-- (its own library, with rows written through it) updated with this script equals a fresh
-- install.

-- When a run may be claimed, and which first.
ALTER TABLE ledger.runs
    ADD COLUMN not_before timestamptz,
    ADD COLUMN priority integer NOT NULL DEFAULT 0,
    ADD COLUMN concurrency_key text;
COMMENT ON COLUMN ledger.runs.not_before IS 'ledger.claim_run does not hand the run out before this time (create_run''s, retry_run''s or replay_run''s not_before, or wait_run''s wake_at); NULL: at once.';
COMMENT ON COLUMN ledger.runs.priority IS 'ledger.claim_run hands out the highest priority first (-1000 to 1000, default 0; a retry or replay keeps its source''s), oldest first within one priority.';
DROP INDEX ledger.runs_live_idx;
DROP INDEX ledger.runs_live_dispatch_idx;
CREATE INDEX runs_live_idx ON ledger.runs (tenant_id, workspace_id, priority DESC, queued_at, id)
    WHERE status NOT IN ('succeeded', 'failed', 'canceled', 'expired');
CREATE INDEX runs_live_dispatch_idx ON ledger.runs (priority DESC, queued_at, id)
    WHERE status NOT IN ('succeeded', 'failed', 'canceled', 'expired');
COMMENT ON COLUMN ledger.runs.concurrency_key IS 'The key the run shares a limit with (ledger.set_concurrency_limit: at most so many runs of the key in flight); NULL: none. A retry or replay keeps its source''s.';
-- A claim counts the runs of a concurrency key in flight: only leased runs have a lease end (a
-- release and a terminal status clear it), so a burst of queued runs is not in this index.
CREATE INDEX runs_concurrency_idx ON ledger.runs (tenant_id, workspace_id, concurrency_key, lease_expires_at)
    WHERE concurrency_key IS NOT NULL AND lease_expires_at IS NOT NULL;
-- An idle worker asks when the next wait ends (ledger.next_wake), in its scope or across scopes:
-- only live runs given a wake time (a wait, a backoff) are here.
CREATE INDEX runs_wake_idx ON ledger.runs (tenant_id, workspace_id, not_before)
    WHERE not_before IS NOT NULL AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired');
CREATE INDEX runs_wake_dispatch_idx ON ledger.runs (not_before)
    WHERE not_before IS NOT NULL AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired');

-- Concurrency limits: at most max_in_flight runs of a key hold a live lease, and at most
-- max_per_window claims of its runs fall in one window of window_seconds (ledger.claim_run skips
-- the key's runs while either is full). A claim under a limit locks its row (SKIP LOCKED: a
-- claim never waits), counts and stamps it, so two claims cannot both take the last place.
CREATE TABLE ledger.concurrency_limits (
    tenant_id       text NOT NULL,
    workspace_id    text NOT NULL,
    concurrency_key text NOT NULL,
    max_in_flight   integer CHECK (max_in_flight BETWEEN 0 AND 100000),
    claimed_at      timestamptz,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    max_per_window  integer CHECK (max_per_window BETWEEN 0 AND 1000000),
    window_seconds  integer CHECK (window_seconds BETWEEN 1 AND 86400),
    window_start    timestamptz,
    window_claims   integer NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, workspace_id, concurrency_key),
    CONSTRAINT concurrency_limits_some_limit CHECK (max_in_flight IS NOT NULL OR max_per_window IS NOT NULL),
    CONSTRAINT concurrency_limits_rate CHECK ((max_per_window IS NULL) = (window_seconds IS NULL))
);
COMMENT ON TABLE ledger.concurrency_limits IS 'Limits of a concurrency_key (ledger.runs.concurrency_key): at most max_in_flight of its runs hold a live lease at once (ledger.set_concurrency_limit), and at most max_per_window claims of its runs in each window of window_seconds (ledger.set_rate_limit; a window starts at the first claim after the last one ended: window_start, window_claims so far). ledger.claim_run skips the key''s runs while either is full (0 pauses the key). claimed_at: the last claim under the limits. Written only through those functions and claim_run.';
ALTER TABLE ledger.concurrency_limits ENABLE ROW LEVEL SECURITY;
ALTER TABLE ledger.concurrency_limits FORCE ROW LEVEL SECURITY;
CREATE POLICY scope ON ledger.concurrency_limits
    USING (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace())
    WITH CHECK (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace());
ALTER TABLE ledger.concurrency_limits OWNER TO ledger_owner;
SELECT pg_catalog.pg_extension_config_dump('ledger.concurrency_limits', '');
CREATE POLICY dispatch_read ON ledger.concurrency_limits FOR SELECT TO ledger_dispatcher USING (true);

-- Turns of the operator's claim across scopes (claim_run with any_scope): when each scope was last
-- served, so the scope served longest ago goes first and one scope's burst cannot hold up another.
CREATE TABLE ledger.dispatch_turns (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    served_at    timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, workspace_id)
);
COMMENT ON TABLE ledger.dispatch_turns IS 'When claim_run(any_scope => true) last served each scope (picked one of its runs); the claim across scopes looks at the scope served longest ago (or never) first. Written only by claim_run.';
ALTER TABLE ledger.dispatch_turns ENABLE ROW LEVEL SECURITY;
ALTER TABLE ledger.dispatch_turns FORCE ROW LEVEL SECURITY;
CREATE POLICY scope ON ledger.dispatch_turns
    USING (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace())
    WITH CHECK (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace());
ALTER TABLE ledger.dispatch_turns OWNER TO ledger_owner;
SELECT pg_catalog.pg_extension_config_dump('ledger.dispatch_turns', '');
CREATE POLICY dispatch_read ON ledger.dispatch_turns FOR SELECT TO ledger_dispatcher USING (true);

-- Budgets: what the runs of a tenant (workspace_id NULL: every workspace of it), of a workspace
-- or one run may spend in a window (everything, or a UTC calendar day or month). unit is a
-- currency code (record_cost's amounts), tokens (record_cost's usage), tool_calls (executions
-- handed out by the tool-call claims) or llm_steps (create_step of an llm step). spent counts the
-- window that starts at window_start; a spend in a later window starts it over. Written only
-- through ledger.set_budget and the functions that spend.
CREATE TABLE ledger.budgets (
    tenant_id     text NOT NULL,
    workspace_id  text,
    run_id        text,
    unit          text NOT NULL,
    period        text NOT NULL CHECK (period IN ('total', 'day', 'month')),
    max_amount    numeric NOT NULL CHECK (max_amount >= 0),
    warn_ratio    numeric CHECK (warn_ratio > 0 AND warn_ratio <= 1),
    spent         numeric NOT NULL DEFAULT 0,
    window_start  timestamptz NOT NULL DEFAULT '-infinity',
    warned_window timestamptz,
    updated_by    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CHECK (run_id IS NULL OR workspace_id IS NOT NULL)
);
CREATE UNIQUE INDEX budgets_key ON ledger.budgets (tenant_id, workspace_id, run_id, unit, period) NULLS NOT DISTINCT;
COMMENT ON TABLE ledger.budgets IS 'Budgets of a tenant (workspace_id NULL), a workspace or a run (run_id): at most max_amount of unit (a currency code, tokens, tool_calls or llm_steps) per period (total, or a UTC day or month). spent counts the window starting at window_start; warned_window: the window whose warning (spent reached warn_ratio of max_amount) was written. Read it through ledger.budget_usage; written only through ledger.set_budget and the functions that spend.';

-- The start of the budget window containing `at`: a UTC day or month, or -infinity for total.
CREATE FUNCTION ledger.budget_window(period text, at timestamptz) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE period
        WHEN 'day' THEN pg_catalog.timezone('UTC', pg_catalog.date_trunc('day', pg_catalog.timezone('UTC', at)))
        WHEN 'month' THEN pg_catalog.timezone('UTC', pg_catalog.date_trunc('month', pg_catalog.timezone('UTC', at)))
        ELSE '-infinity'::timestamptz END;
COMMENT ON FUNCTION ledger.budget_window(text, timestamptz) IS 'The start of the budget window (period total, day or month, in UTC) that contains at; -infinity for total.';

-- What a budget has spent in the window that contains `at` (the time is an argument, so a write
-- statement passes its own and the function stays IMMUTABLE): spent when it counts that window.
CREATE FUNCTION ledger.budget_spent(period text, spent numeric, window_start timestamptz, at timestamptz) RETURNS numeric
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE WHEN window_start = ledger.budget_window(period, at) THEN spent ELSE 0 END;
COMMENT ON FUNCTION ledger.budget_spent(text, numeric, timestamptz, timestamptz) IS 'What a budget (its period, spent and window_start) has spent in the window that contains at: spent when it counts that window, else 0.';

-- A tenant's budget (workspace_id NULL) counts the spending of each of its workspaces.
ALTER TABLE ledger.budgets ENABLE ROW LEVEL SECURITY;
ALTER TABLE ledger.budgets FORCE ROW LEVEL SECURITY;
CREATE POLICY scope ON ledger.budgets
    USING (tenant_id = ledger.scope_tenant() AND (workspace_id IS NULL OR workspace_id = ledger.scope_workspace()))
    WITH CHECK (tenant_id = ledger.scope_tenant() AND (workspace_id IS NULL OR workspace_id = ledger.scope_workspace()));
ALTER TABLE ledger.budgets OWNER TO ledger_owner;
SELECT pg_catalog.pg_extension_config_dump('ledger.budgets', '');
CREATE POLICY dispatch_read ON ledger.budgets FOR SELECT TO ledger_dispatcher USING (true);

-- A tenant's budget limits every workspace of the tenant: only a role that may state each of them
-- sets one.
CREATE FUNCTION ledger_dispatch.tenant_granted(tenant_id text) RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT NOT EXISTS (SELECT 1 FROM ledger.scope_bindings b
                        WHERE b.grantee = pg_catalog.to_regrole(pg_catalog.quote_ident(session_user)))
        OR EXISTS (SELECT 1 FROM ledger.scope_grants g
                    WHERE g.grantee = pg_catalog.to_regrole(pg_catalog.quote_ident(session_user))
                      AND g.tenant_id = $1 AND g.workspace_id IS NULL)
$$;
COMMENT ON FUNCTION ledger_dispatch.tenant_granted(text) IS 'Whether the session''s login role may state every workspace of the tenant: it was never bound, or it has the tenant''s every-workspace grant.';

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

-- Approval deadlines: a pending approval past expires_at is expired (ledger.sweep_tool_calls, or
-- the next claim of its call) and no longer keeps its run from being claimed.
ALTER TABLE ledger.approval_requests ADD COLUMN expires_at timestamptz;
-- The sweep finds the pending approvals whose deadline passed (few: most approvals have none).
CREATE INDEX approval_requests_expiry_idx ON ledger.approval_requests (expires_at)
    WHERE status = 'pending' AND expires_at IS NOT NULL;
COMMENT ON TABLE ledger.approval_requests IS 'Human approvals a tool call waits for (status pending, approved, rejected, expired, canceled). Created by ledger.request_tool_approval, decided by ledger.resolve_approval; a pending approval past its expires_at is expired by ledger.sweep_tool_calls or by the next claim of its call, and no one may decide it any more.';
CREATE OR REPLACE FUNCTION ledger_dispatch.expired_tool_call_scopes()
    RETURNS TABLE (tenant_id text, workspace_id text)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT DISTINCT e.tenant_id, e.workspace_id
      FROM (SELECT t.tenant_id, t.workspace_id FROM ledger.run_step_tool_calls t
             WHERE t.completed_at IS NULL AND t.lease_expires_at <= clock_timestamp()
            UNION ALL
            SELECT a.tenant_id, a.workspace_id FROM ledger.approval_requests a
             WHERE a.status = 'pending' AND a.expires_at <= clock_timestamp()) e
     WHERE NOT EXISTS (SELECT FROM ledger.scope_bindings)
        OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = e.tenant_id
                      AND (g.workspace_id IS NULL OR g.workspace_id = e.workspace_id))
$$;
COMMENT ON FUNCTION ledger_dispatch.expired_tool_call_scopes() IS 'The scopes the session''s login role may state that have a tool call whose lease expired or a pending approval past its deadline (see ledger.sweep_tool_calls).';
CREATE OR REPLACE VIEW ledger.pending_approvals WITH (security_invoker = true) AS
    SELECT a.id, a.run_id, a.step_id, a.tool_call_record_id, t.tool_ref, a.title, a.policy_ref,
           a.details, a.created_at, a.expires_at, t.arguments
      FROM ledger.approval_requests a
      LEFT JOIN ledger.run_step_tool_calls t
        ON t.tenant_id = a.tenant_id AND t.workspace_id = a.workspace_id AND t.id = a.tool_call_record_id
     WHERE ledger.scope_required() AND a.status = 'pending'
       AND (a.expires_at IS NULL OR a.expires_at > clock_timestamp());
COMMENT ON VIEW ledger.pending_approvals IS 'Approvals waiting for a decision: ledger.resolve_approval(id, approved|rejected), before expires_at when they have one (past it they are expired, and no longer listed). arguments: the call''s arguments as stored (redacted), so that a person sees what they approve. Fails 42501 SCOPE_MISSING without a scope.';

-- The input mailbox: inputs sent to a run by key (ledger.send_input), and the keys its worker
-- waits for (ledger.wait_for_input). One row per run and key: a wait creates it without a
-- payload, the input fills it. payload is redacted; payload_sha256 hashes the input as sent, so
-- the same key sent again is recognised (or refused with another payload).
CREATE TABLE ledger.run_mailbox (
    tenant_id      text NOT NULL,
    workspace_id   text NOT NULL,
    id             text NOT NULL,
    run_id         text NOT NULL,
    input_key      text NOT NULL,
    payload        jsonb,
    payload_sha256 text,
    sender         text,
    received_at    timestamptz,
    waited_at      timestamptz,
    wait_deadline  timestamptz,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    UNIQUE (tenant_id, workspace_id, run_id, input_key),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    CHECK ((received_at IS NULL) = (payload_sha256 IS NULL))
);
COMMENT ON TABLE ledger.run_mailbox IS 'Inputs sent to runs by key (ledger.send_input: payload redacted, sender, received_at) and the keys their workers wait for (ledger.wait_for_input: waited_at, wait_deadline). One row per run and input_key. Written only through those functions.';
ALTER TABLE ledger.run_mailbox ENABLE ROW LEVEL SECURITY;
ALTER TABLE ledger.run_mailbox FORCE ROW LEVEL SECURITY;
CREATE POLICY scope ON ledger.run_mailbox
    USING (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace())
    WITH CHECK (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace());
ALTER TABLE ledger.run_mailbox OWNER TO ledger_owner;
SELECT pg_catalog.pg_extension_config_dump('ledger.run_mailbox', '');

-- Schedules: a cron expression read in a time zone creates a run at each firing
-- (ledger.fire_schedules, driven by pg_cron or a worker). next_fire_at is the next firing still
-- to run; a firing's run has request_id schedule:<id>:<firing in UTC>, so a firing creates one run
-- whoever fires it and however often. inputs are stored redacted, as the runs get them.
CREATE TABLE ledger.schedules (
    tenant_id       text NOT NULL,
    workspace_id    text NOT NULL,
    id              text NOT NULL,
    cron            text NOT NULL,
    time_zone       text NOT NULL,
    mode            text NOT NULL,
    kind            text,
    inputs          jsonb,
    priority        integer NOT NULL DEFAULT 0,
    concurrency_key text,
    catch_up        text NOT NULL CHECK (catch_up IN ('latest', 'all')),
    paused          boolean NOT NULL DEFAULT false,
    next_fire_at    timestamptz,
    last_fired_at   timestamptz,
    last_run_id     text,
    updated_by      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id)
);
-- The sweep finds the due schedules of every scope (few rows: one per schedule).
CREATE INDEX schedules_due_idx ON ledger.schedules (next_fire_at) WHERE NOT paused;
COMMENT ON TABLE ledger.schedules IS 'Named schedules (ledger.set_schedule): a cron expression in time_zone creates a run of mode, kind and inputs (redacted) at each firing, through ledger.fire_schedules. next_fire_at: the next firing still to run (NULL: the expression names no later time); catch_up: what a sweep does with firings missed while none ran (latest: one run for the most recent; all: one per firing, at most 100 per sweep). A paused schedule fires nothing, and its firings while paused are skipped.';
ALTER TABLE ledger.schedules ENABLE ROW LEVEL SECURITY;
ALTER TABLE ledger.schedules FORCE ROW LEVEL SECURITY;
CREATE POLICY scope ON ledger.schedules
    USING (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace())
    WITH CHECK (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace());
ALTER TABLE ledger.schedules OWNER TO ledger_owner;
SELECT pg_catalog.pg_extension_config_dump('ledger.schedules', '');
CREATE POLICY dispatch_read ON ledger.schedules FOR SELECT TO ledger_dispatcher USING (true);
CREATE FUNCTION ledger_dispatch.due_schedule_scopes()
    RETURNS TABLE (tenant_id text, workspace_id text)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT DISTINCT s.tenant_id, s.workspace_id FROM ledger.schedules s
     WHERE NOT s.paused AND s.next_fire_at <= clock_timestamp()
       AND (NOT EXISTS (SELECT FROM ledger.scope_bindings)
            OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = s.tenant_id
                          AND (g.workspace_id IS NULL OR g.workspace_id = s.workspace_id)))
$$;
COMMENT ON FUNCTION ledger_dispatch.due_schedule_scopes() IS 'The scopes the session''s login role may state that have a schedule due (see ledger.fire_schedules).';

-- When an idle worker's claim should next look (ledger.next_wake across scopes).
CREATE FUNCTION ledger_dispatch.next_wake() RETURNS timestamptz
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    -- As sql/queries/next_wake.sql does for one scope; each part is the first ahead in its
    -- index that belongs to a scope the login role may state.
    SELECT least(
        (SELECT r.not_before FROM ledger.runs r
          WHERE r.not_before > clock_timestamp() AND r.not_before < 'infinity'
            AND r.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
            AND (NOT EXISTS (SELECT FROM ledger.scope_bindings)
                 OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = r.tenant_id
                               AND (g.workspace_id IS NULL OR g.workspace_id = r.workspace_id)))
          ORDER BY r.not_before LIMIT 1),
        (SELECT a.expires_at FROM ledger.approval_requests a
          WHERE a.status = 'pending' AND a.expires_at > clock_timestamp()
            AND (NOT EXISTS (SELECT FROM ledger.scope_bindings)
                 OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = a.tenant_id
                               AND (g.workspace_id IS NULL OR g.workspace_id = a.workspace_id)))
          ORDER BY a.expires_at LIMIT 1),
        (SELECT min(l.window_start + make_interval(secs => l.window_seconds))
           FROM ledger.concurrency_limits l
          WHERE l.max_per_window <= l.window_claims
            AND l.window_start + make_interval(secs => l.window_seconds) > clock_timestamp()
            AND (NOT EXISTS (SELECT FROM ledger.scope_bindings)
                 OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = l.tenant_id
                               AND (g.workspace_id IS NULL OR g.workspace_id = l.workspace_id)))))
$$;
COMMENT ON FUNCTION ledger_dispatch.next_wake() IS 'When a run of any scope the session''s login role may state next becomes claimable by the clock alone (see ledger.next_wake): a wait''s or backoff''s not_before, a pending approval''s deadline, the end of a full rate window. NULL when none is ahead.';

-- What waits for people (ledger.inbox): in one scope, or (NULL tenant_id) in every scope the
-- session's login role may state. Each count with the oldest one's time.
CREATE FUNCTION ledger_dispatch.inbox(tenant_id text, workspace_id text)
    RETURNS TABLE (tenant_id text, workspace_id text,
                   calls_in_doubt bigint, oldest_in_doubt_at timestamptz,
                   pending_approvals bigint, oldest_approval_at timestamptz,
                   budget_stops bigint, oldest_budget_stop_at timestamptz,
                   failed_outbox_events bigint, oldest_failed_outbox_event_at timestamptz)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT w.tenant_id, w.workspace_id,
           count(*) FILTER (WHERE w.what = 'in_doubt'), min(w.since) FILTER (WHERE w.what = 'in_doubt'),
           count(*) FILTER (WHERE w.what = 'approval'), min(w.since) FILTER (WHERE w.what = 'approval'),
           count(*) FILTER (WHERE w.what = 'budget'), min(w.since) FILTER (WHERE w.what = 'budget'),
           count(*) FILTER (WHERE w.what = 'outbox'), min(w.since) FILTER (WHERE w.what = 'outbox')
      FROM (SELECT t.tenant_id, t.workspace_id, 'in_doubt' AS what, t.updated_at AS since
              FROM ledger.run_step_tool_calls t
             WHERE t.status = 'in_doubt' AND t.completed_at IS NULL
            UNION ALL
            SELECT a.tenant_id, a.workspace_id, 'approval', a.created_at FROM ledger.approval_requests a
             WHERE a.status = 'pending' AND (a.expires_at IS NULL OR a.expires_at > clock_timestamp())
            UNION ALL
            -- Stopped by a budget that is still used up (once raised, the run waits for a worker,
            -- not for a person).
            SELECT r.tenant_id, r.workspace_id, 'budget', r.updated_at FROM ledger.runs r
             WHERE r.status = 'paused' AND r.error_code = 'BUDGET_EXHAUSTED'
               AND EXISTS (SELECT 1 FROM ledger.budgets b
                            WHERE b.tenant_id = r.tenant_id
                              AND (b.workspace_id IS NULL OR b.workspace_id = r.workspace_id)
                              AND (b.run_id IS NULL OR b.run_id = r.id)
                              AND b.max_amount <= ledger.budget_spent(b.period, b.spent, b.window_start, now()))
            UNION ALL
            SELECT o.tenant_id, o.workspace_id, 'outbox', o.processed_at FROM ledger.outbox o
             WHERE o.status = 'failed') w
     WHERE CASE WHEN $1 IS NULL
                THEN NOT EXISTS (SELECT FROM ledger.scope_bindings)
                     OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = w.tenant_id
                                   AND (g.workspace_id IS NULL OR g.workspace_id = w.workspace_id))
                ELSE w.tenant_id = $1 AND w.workspace_id = $2 END
     GROUP BY w.tenant_id, w.workspace_id
     ORDER BY w.tenant_id, w.workspace_id
$$;
COMMENT ON FUNCTION ledger_dispatch.inbox(text, text) IS 'What waits for people (see ledger.inbox) in scope (tenant_id, workspace_id), or with NULL tenant_id in every scope the session''s login role may state that has something waiting: calls in doubt, pending approvals before their deadline, runs paused by a budget still used up, failed outbox events, each counted with the oldest one''s time.';

-- The operator's claim across scopes: due runs only, with room under their key and no budget
-- used up, the highest priority first.
CREATE OR REPLACE FUNCTION ledger_dispatch.next_run(modes text[], kinds text[])
    RETURNS TABLE (tenant_id text, workspace_id text, id text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    -- PL/pgSQL keeps this query's plan for the session; a SQL function's is made again at
    -- every call, which cost an across-scope claim about 2 ms.
    RETURN QUERY
    -- The scopes with a live run, one index probe each (a skip scan of runs_live_idx), however
    -- many runs are queued.
    WITH RECURSIVE s (tenant_id, workspace_id) AS (
        (SELECT r.tenant_id, r.workspace_id FROM ledger.runs r
          WHERE r.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
          ORDER BY r.tenant_id, r.workspace_id LIMIT 1)
        UNION ALL
        SELECT n.tenant_id, n.workspace_id FROM s CROSS JOIN LATERAL (
            SELECT r.tenant_id, r.workspace_id FROM ledger.runs r
             WHERE r.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
               AND (r.tenant_id, r.workspace_id) > (s.tenant_id, s.workspace_id)
             ORDER BY r.tenant_id, r.workspace_id LIMIT 1) n)
    -- Scopes take turns: the one served longest ago (never: first) is looked at first, so one
    -- scope's burst does not hold up another's run.
    SELECT c.tenant_id, c.workspace_id, c.id
      FROM (SELECT s.tenant_id, s.workspace_id FROM s
              LEFT JOIN ledger.dispatch_turns d
                ON d.tenant_id = s.tenant_id AND d.workspace_id = s.workspace_id
             WHERE NOT EXISTS (SELECT FROM ledger.scope_bindings)
                OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = s.tenant_id
                              AND (g.workspace_id IS NULL OR g.workspace_id = s.workspace_id))
             ORDER BY d.served_at NULLS FIRST, s.tenant_id, s.workspace_id) o
     -- Then that scope's claimable run of the highest priority, oldest first.
     CROSS JOIN LATERAL (
        SELECT r.tenant_id, r.workspace_id, r.id FROM ledger.runs r
         WHERE r.tenant_id = o.tenant_id AND r.workspace_id = o.workspace_id
           AND r.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
           AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= clock_timestamp())
           AND (r.not_before IS NULL OR r.not_before <= clock_timestamp())
           AND (r.status IN ('queued', 'retrying') OR r.run_token > 0)
           AND (modes IS NULL OR r.mode = ANY (modes)) AND (kinds IS NULL OR r.kind = ANY (kinds))
           AND NOT EXISTS (SELECT 1 FROM ledger.run_step_tool_calls t
                            WHERE t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id
                              AND t.run_id = r.id AND t.status = 'in_doubt')
           -- A re-run parked on a call in doubt in its lineage (it takes its ancestors' records)
           -- waits for the same person as the ancestor.
           AND NOT (r.status = 'paused' AND r.source_run_id IS NOT NULL AND EXISTS (
                 WITH RECURSIVE up (id, source_run_id) AS (
                     SELECT s.id, s.source_run_id FROM ledger.runs s
                      WHERE s.tenant_id = r.tenant_id AND s.workspace_id = r.workspace_id
                        AND s.id = r.source_run_id
                     UNION ALL
                     SELECT s.id, s.source_run_id FROM up
                       JOIN ledger.runs s ON s.tenant_id = r.tenant_id
                        AND s.workspace_id = r.workspace_id AND s.id = up.source_run_id)
                 SELECT 1 FROM up JOIN ledger.run_step_tool_calls t
                     ON t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id
                    AND t.run_id = up.id AND t.status = 'in_doubt'))
           AND NOT EXISTS (SELECT 1 FROM ledger.approval_requests a
                            WHERE a.tenant_id = r.tenant_id AND a.workspace_id = r.workspace_id
                              AND a.run_id = r.id AND a.status = 'pending'
                              AND (a.expires_at IS NULL OR a.expires_at > clock_timestamp()))
           -- No budget that applies to it is used up (claim_run checks it again in the run's scope).
           AND NOT EXISTS (SELECT 1 FROM ledger.budgets b
                            WHERE b.tenant_id = r.tenant_id
                              AND (b.workspace_id IS NULL OR b.workspace_id = r.workspace_id)
                              AND (b.run_id IS NULL OR b.run_id = r.id)
                              AND b.max_amount <= ledger.budget_spent(b.period, b.spent, b.window_start, now()))
           -- Its concurrency key has room (claim_run checks it again under the limit's lock); the
           -- full keys are found once (an uncorrelated subquery), not once per candidate.
           AND (r.concurrency_key IS NULL
                OR (r.tenant_id, r.workspace_id, r.concurrency_key) NOT IN (
                     SELECT l.tenant_id, l.workspace_id, l.concurrency_key
                       FROM ledger.concurrency_limits l
                      WHERE l.max_in_flight <= (SELECT count(*) FROM ledger.runs f
                              WHERE f.tenant_id = l.tenant_id AND f.workspace_id = l.workspace_id
                                AND f.concurrency_key = l.concurrency_key
                                AND f.lease_expires_at > clock_timestamp()
                                AND f.status NOT IN ('succeeded', 'failed', 'canceled', 'expired'))
                         OR (l.max_per_window <= l.window_claims
                             AND l.window_start + make_interval(secs => l.window_seconds) > clock_timestamp())))
         ORDER BY r.priority DESC, r.queued_at, r.id LIMIT 1
           FOR NO KEY UPDATE SKIP LOCKED) c
     LIMIT 1;
END
$$;
COMMENT ON FUNCTION ledger_dispatch.next_run(text[], text[]) IS 'The next claimable run of any scope the session''s login role may state (see ledger.claim_run): scopes take turns (the one served longest ago first, ledger.dispatch_turns), and within the scope the due run (not_before passed) of the highest priority, oldest first, that waits for no person (no call in doubt, none in the lineage of a paused re-run, no pending approval before its deadline), with no budget used up and whose concurrency key has room (in flight and in its rate window), locked; skips runs another transaction holds.';

-- Functions whose arguments changed (not_before, priority, concurrency_key, expires_in_seconds)
-- are dropped and created again; every other one is replaced below, which binds it to this
-- version's library.
DROP FUNCTION ledger.create_run(text, jsonb, text, text, text, text, text, text, text, integer, text, text, text, text);
DROP FUNCTION ledger.request_tool_approval(text, text, jsonb, text, text, text, text, jsonb, bigint);
DROP FUNCTION ledger.retry_run(text, jsonb);
DROP FUNCTION ledger.replay_run(text, jsonb);
CREATE OR REPLACE FUNCTION ledger.scope_tenant() RETURNS text LANGUAGE c STABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'scope_tenant_wrapper';
CREATE OR REPLACE FUNCTION ledger.scope_workspace() RETURNS text LANGUAGE c STABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'scope_workspace_wrapper';

-- This version's functions, as the generated install script creates them (CREATE OR REPLACE:
-- each is bound again to this version's library).
CREATE OR REPLACE FUNCTION "ack_outbox_events"(
	"lease_owner" TEXT, /* Option < & str > */
	"event_id" TEXT /* Option < & str > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE  
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'ack_outbox_event_wrapper';

CREATE OR REPLACE FUNCTION "ack_outbox_events"(
	"lease_owner" TEXT, /* Option < & str > */
	"event_ids" TEXT[] /* :: std :: option :: Option < Vec < Option < String > > > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'ack_outbox_events_wrapper';

CREATE OR REPLACE FUNCTION "add_task_checkpoint"(
	"task_id" TEXT, /* Option < & str > */
	"payload" jsonb /* Option < Jsonb > */
) RETURNS ledger.task_checkpoints /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'add_task_checkpoint_wrapper';

CREATE OR REPLACE FUNCTION "begin_tool_call"(
	"tool_call_record_id" TEXT, /* Option < & str > */
	"attempt" bigint /* Option < i64 > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'begin_tool_call_wrapper';

CREATE OR REPLACE FUNCTION "canonical_json"(
	"value" jsonb /* Jsonb */
) RETURNS TEXT /* Result < String, SqlError > */
IMMUTABLE STRICT PARALLEL SAFE
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'canonical_json_wrapper';

CREATE OR REPLACE FUNCTION "claim_outbox_events"(
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

CREATE OR REPLACE FUNCTION "claim_run"(
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

CREATE OR REPLACE FUNCTION "claim_tool_call"(
	"run_id" TEXT, /* Option < & str > */
	"tool_ref" TEXT, /* Option < & str > */
	"arguments" jsonb DEFAULT '{}', /* Option < Jsonb > */
	"tool_call_id" TEXT DEFAULT NULL, /* Option < & str > */
	"idempotency_key" TEXT DEFAULT NULL, /* Option < & str > */
	"step_id" TEXT DEFAULT NULL, /* Option < & str > */
	"lease_owner" TEXT DEFAULT NULL, /* Option < & str > */
	"timeout_seconds" INT DEFAULT 30, /* Option < i32 > */
	"retry_failed" bool DEFAULT false, /* Option < bool > */
	"approval" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"run_token" bigint DEFAULT NULL /* Option < i64 > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'claim_tool_call_wrapper';

CREATE OR REPLACE FUNCTION "claim_tool_calls"(
	"run_id" TEXT, /* Option < & str > */
	"calls" jsonb, /* Option < Jsonb > */
	"lease_owner" TEXT DEFAULT NULL, /* Option < & str > */
	"begin" bool DEFAULT false, /* Option < bool > */
	"run_token" bigint DEFAULT NULL /* Option < i64 > */
) RETURNS TABLE (
	"index" INT,  /* i32 */
	"claim" jsonb  /* Jsonb */
)
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'claim_tool_calls_wrapper';

CREATE OR REPLACE FUNCTION "complete_tool_call"(
	"tool_call_record_id" TEXT, /* Option < & str > */
	"attempt" bigint, /* Option < i64 > */
	"outcome" TEXT, /* Option < & str > */
	"result" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"error_message" TEXT DEFAULT NULL, /* Option < & str > */
	"metadata" jsonb DEFAULT NULL /* Option < Jsonb > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'complete_tool_call_wrapper';

CREATE OR REPLACE FUNCTION "copy_graph_thread"(
	"source_thread_id" TEXT, /* Option < & str > */
	"target_thread_id" TEXT /* Option < & str > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'copy_graph_thread_wrapper';

CREATE OR REPLACE FUNCTION "create_run"(
	"mode" TEXT, /* Option < & str > */
	"inputs" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"kind" TEXT DEFAULT NULL, /* Option < & str > */
	"subject_kind" TEXT DEFAULT NULL, /* Option < & str > */
	"subject_id" TEXT DEFAULT NULL, /* Option < & str > */
	"subject_version_id" TEXT DEFAULT NULL, /* Option < & str > */
	"request_id" TEXT DEFAULT NULL, /* Option < & str > */
	"parent_run_id" TEXT DEFAULT NULL, /* Option < & str > */
	"source_run_id" TEXT DEFAULT NULL, /* Option < & str > */
	"attempt_no" INT DEFAULT NULL, /* Option < i32 > */
	"run_id" TEXT DEFAULT NULL, /* Option < & str > */
	"user_id" TEXT DEFAULT NULL, /* Option < & str > */
	"trace_id" TEXT DEFAULT NULL, /* Option < & str > */
	"input_summary" TEXT DEFAULT NULL, /* Option < & str > */
	"not_before" timestamp with time zone DEFAULT NULL, /* Option < TimestampWithTimeZone > */
	"priority" INT DEFAULT 0, /* Option < i32 > */
	"concurrency_key" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.runs /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'create_run_wrapper';

CREATE OR REPLACE FUNCTION "create_step"(
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

CREATE OR REPLACE FUNCTION "create_task"(
	"task_type" TEXT, /* Option < & str > */
	"input" jsonb DEFAULT '{}', /* Option < Jsonb > */
	"run_id" TEXT DEFAULT NULL, /* Option < & str > */
	"task_id" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.tasks /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'create_task_wrapper';

CREATE OR REPLACE FUNCTION "delete_graph_checkpoints_for_runs"(
	"run_ids" TEXT[] /* :: std :: option :: Option < Vec < Option < String > > > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'delete_graph_checkpoints_for_runs_wrapper';

CREATE OR REPLACE FUNCTION "delete_graph_thread"(
	"thread_id" TEXT /* Option < & str > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'delete_graph_thread_wrapper';

CREATE OR REPLACE FUNCTION "drop_schedule"(
	"schedule_id" TEXT, /* Option < & str > */
	"actor" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS bool /* std :: result :: Result < bool, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'drop_schedule_wrapper';

CREATE OR REPLACE FUNCTION "events_since"(
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

CREATE OR REPLACE FUNCTION "find_tool_call"(
	"run_id" TEXT, /* Option < & str > */
	"tool_ref" TEXT, /* Option < & str > */
	"arguments" jsonb DEFAULT '{}', /* Option < Jsonb > */
	"tool_call_id" TEXT DEFAULT NULL, /* Option < & str > */
	"idempotency_key" TEXT DEFAULT NULL, /* Option < & str > */
	"retry_failed" bool DEFAULT false /* Option < bool > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'find_tool_call_wrapper';

CREATE OR REPLACE FUNCTION "fire_schedules"(
	"any_scope" bool DEFAULT false /* Option < bool > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'fire_schedules_wrapper';

CREATE OR REPLACE FUNCTION "get_artifact"(
	"artifact_id" TEXT /* Option < & str > */
) RETURNS bytea /* std :: result :: Result < Vec < u8 > , SqlError > */
STABLE SECURITY DEFINER PARALLEL SAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'get_artifact_wrapper';

CREATE OR REPLACE FUNCTION "grant_scope"(
	"role_name" TEXT, /* Option < & str > */
	"tenant_id" TEXT, /* Option < & str > */
	"workspace_id" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS bool /* std :: result :: Result < bool, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'grant_scope_wrapper';

CREATE OR REPLACE FUNCTION "graph_checkpoint_tuples"(
	"thread_id" TEXT DEFAULT NULL, /* Option < & str > */
	"checkpoint_ns" TEXT DEFAULT NULL, /* Option < & str > */
	"checkpoint_id" TEXT DEFAULT NULL, /* Option < & str > */
	"filter" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"before" TEXT DEFAULT NULL, /* Option < & str > */
	"max_checkpoints" INT DEFAULT NULL /* Option < i32 > */
) RETURNS TABLE (
	"thread_id" TEXT,  /* String */
	"checkpoint_ns" TEXT,  /* String */
	"checkpoint_id" TEXT,  /* String */
	"parent_checkpoint_id" TEXT,  /* Option < String > */
	"run_id" TEXT,  /* String */
	"checkpoint" jsonb,  /* Jsonb */
	"metadata" jsonb,  /* Jsonb */
	"channels" TEXT[],  /* Vec < String > */
	"blob_types" TEXT[],  /* Vec < String > */
	"blobs" bytea[],  /* Vec < :: std :: option :: Option < Vec < u8 > > > */
	"write_task_ids" TEXT[],  /* Vec < String > */
	"write_channels" TEXT[],  /* Vec < String > */
	"write_blob_types" TEXT[],  /* Vec < String > */
	"write_blobs" bytea[],  /* Vec < :: std :: option :: Option < Vec < u8 > > > */
	"write_task_paths" TEXT[]  /* Vec < String > */
)
STABLE SECURITY DEFINER PARALLEL SAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'graph_checkpoint_tuples_wrapper';

CREATE OR REPLACE FUNCTION "heartbeat_run"(
	"run_id" TEXT, /* Option < & str > */
	"run_token" bigint, /* Option < i64 > */
	"extend_seconds" INT DEFAULT NULL /* Option < i32 > */
) RETURNS timestamp with time zone /* std :: result :: Result < TimestampWithTimeZone, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'heartbeat_run_wrapper';

CREATE OR REPLACE FUNCTION "heartbeat_tool_call"(
	"tool_call_record_id" TEXT, /* Option < & str > */
	"attempt" bigint, /* Option < i64 > */
	"extend_seconds" INT DEFAULT NULL /* Option < i32 > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'heartbeat_tool_call_wrapper';

CREATE OR REPLACE FUNCTION "inbox"(
	"any_scope" bool DEFAULT false /* Option < bool > */
) RETURNS TABLE (
	"tenant_id" TEXT,  /* String */
	"workspace_id" TEXT,  /* String */
	"calls_in_doubt" bigint,  /* i64 */
	"oldest_in_doubt_at" timestamp with time zone,  /* Option < TimestampWithTimeZone > */
	"pending_approvals" bigint,  /* i64 */
	"oldest_approval_at" timestamp with time zone,  /* Option < TimestampWithTimeZone > */
	"budget_stops" bigint,  /* i64 */
	"oldest_budget_stop_at" timestamp with time zone,  /* Option < TimestampWithTimeZone > */
	"failed_outbox_events" bigint,  /* i64 */
	"oldest_failed_outbox_event_at" timestamp with time zone  /* Option < TimestampWithTimeZone > */
)
STABLE SECURITY DEFINER PARALLEL SAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'inbox_wrapper';

CREATE OR REPLACE FUNCTION "is_status"(
	"resource" TEXT, /* & str */
	"status" TEXT /* & str */
) RETURNS bool /* std :: result :: Result < bool, error :: SqlError > */
IMMUTABLE STRICT PARALLEL SAFE 
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'is_status_wrapper';

CREATE OR REPLACE FUNCTION "nack_outbox_events"(
	"lease_owner" TEXT, /* Option < & str > */
	"event_id" TEXT, /* Option < & str > */
	"error_message" TEXT /* Option < & str > */
) RETURNS SETOF ledger.outbox_event /* :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx :: pgbox :: AllocatedByRust
> */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE  
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'nack_outbox_event_wrapper';

CREATE OR REPLACE FUNCTION "nack_outbox_events"(
	"lease_owner" TEXT, /* Option < & str > */
	"event_ids" TEXT[], /* :: std :: option :: Option < Vec < Option < String > > > */
	"error_message" TEXT /* Option < & str > */
) RETURNS SETOF ledger.outbox_event /* :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx :: pgbox :: AllocatedByRust
> */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'nack_outbox_events_wrapper';

CREATE OR REPLACE FUNCTION "next_wake"(
	"any_scope" bool DEFAULT false /* Option < bool > */
) RETURNS timestamp with time zone /* std :: result :: Result < Option < TimestampWithTimeZone > , SqlError > */
STABLE SECURITY DEFINER PARALLEL SAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'next_wake_wrapper';

CREATE OR REPLACE FUNCTION "notifier_status"() RETURNS TABLE (
	"notify" TEXT,  /* String */
	"preloaded" bool,  /* bool */
	"worker_pid" INT,  /* Option < i32 > */
	"waiting" INT,  /* i32 */
	"capacity" INT,  /* i32 */
	"notifications_sent" bigint,  /* i64 */
	"sent_by_writers" bigint  /* i64 */
)
STRICT STABLE PARALLEL SAFE
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'notifier_status_wrapper';

CREATE OR REPLACE FUNCTION "otel_trace"(
	"run_id" TEXT, /* Option < & str > */
	"service_name" TEXT DEFAULT 'ledger' /* Option < & str > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
STABLE SECURITY DEFINER PARALLEL SAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'otel_trace_wrapper';

CREATE OR REPLACE FUNCTION "pause_schedule"(
	"schedule_id" TEXT, /* Option < & str > */
	"paused" bool DEFAULT true, /* Option < bool > */
	"actor" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.schedules /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'pause_schedule_wrapper';

CREATE OR REPLACE FUNCTION "prune_graph_threads"(
	"thread_ids" TEXT[], /* :: std :: option :: Option < Vec < Option < String > > > */
	"strategy" TEXT DEFAULT 'keep_latest' /* Option < & str > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'prune_graph_threads_wrapper';

CREATE OR REPLACE FUNCTION "purge_runs"(
	"older_than" interval, /* Option < Interval > */
	"batch" INT DEFAULT 1000 /* Option < i32 > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'purge_runs_wrapper';

CREATE OR REPLACE FUNCTION "put_artifact"(
	"run_id" TEXT, /* Option < & str > */
	"content" bytea, /* :: std :: option :: Option < Vec < u8 > > */
	"artifact_type" TEXT DEFAULT 'blob', /* Option < & str > */
	"mime" TEXT DEFAULT NULL, /* Option < & str > */
	"step_id" TEXT DEFAULT NULL, /* Option < & str > */
	"meta" jsonb DEFAULT NULL /* Option < Jsonb > */
) RETURNS ledger.run_artifacts /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'put_artifact_wrapper';

CREATE OR REPLACE FUNCTION "put_graph_checkpoint"(
	"run_id" TEXT, /* Option < & str > */
	"thread_id" TEXT, /* Option < & str > */
	"checkpoint_ns" TEXT, /* Option < & str > */
	"checkpoint_id" TEXT, /* Option < & str > */
	"checkpoint" jsonb, /* Option < Jsonb > */
	"metadata" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"parent_checkpoint_id" TEXT DEFAULT NULL, /* Option < & str > */
	"channels" TEXT[] DEFAULT '{}', /* :: std :: option :: Option < Vec < Option < String > > > */
	"versions" TEXT[] DEFAULT '{}', /* :: std :: option :: Option < Vec < Option < String > > > */
	"blob_types" TEXT[] DEFAULT '{}', /* :: std :: option :: Option < Vec < Option < String > > > */
	"blobs" bytea[] DEFAULT '{}' /* :: std :: option :: Option < Array < '_, & '_ [u8] > > */
) RETURNS VOID /* std :: result :: Result < (), SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'put_graph_checkpoint_wrapper';

CREATE OR REPLACE FUNCTION "put_graph_checkpoint_writes"(
	"thread_id" TEXT, /* Option < & str > */
	"checkpoint_ns" TEXT, /* Option < & str > */
	"checkpoint_id" TEXT, /* Option < & str > */
	"task_id" TEXT, /* Option < & str > */
	"idxs" INT[], /* :: std :: option :: Option < Vec < Option < i32 > > > */
	"channels" TEXT[], /* :: std :: option :: Option < Vec < Option < String > > > */
	"blob_types" TEXT[], /* :: std :: option :: Option < Vec < Option < String > > > */
	"blobs" bytea[], /* :: std :: option :: Option < Array < '_, & '_ [u8] > > */
	"task_path" TEXT DEFAULT '', /* Option < & str > */
	"upsert" bool DEFAULT false /* Option < bool > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'put_graph_checkpoint_writes_wrapper';

CREATE OR REPLACE FUNCTION "record_audit"(
	"run_id" TEXT, /* Option < & str > */
	"gateway_type" TEXT, /* Option < & str > */
	"outcome" TEXT, /* Option < & str > */
	"payload" jsonb DEFAULT '{}', /* Option < Jsonb > */
	"step_id" TEXT DEFAULT NULL, /* Option < & str > */
	"actor" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.audit_events /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'record_audit_wrapper';

CREATE OR REPLACE FUNCTION "record_citation"(
	"run_id" TEXT, /* Option < & str > */
	"citation" jsonb, /* Option < Jsonb > */
	"step_id" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.citations /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'record_citation_wrapper';

CREATE OR REPLACE FUNCTION "record_cost"(
	"run_id" TEXT, /* Option < & str > */
	"billing_basis" TEXT, /* Option < & str > */
	"billed_quantity" NUMERIC, /* Option < AnyNumeric > */
	"amount" NUMERIC DEFAULT NULL, /* Option < AnyNumeric > */
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
AS 'MODULE_PATHNAME', 'record_cost_wrapper';

CREATE OR REPLACE FUNCTION "record_cost"(
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

CREATE OR REPLACE FUNCTION "record_cost"(
	"run_id" TEXT, /* Option < & str > */
	"billing_basis" TEXT, /* Option < & str > */
	"billed_quantity" NUMERIC, /* Option < AnyNumeric > */
	"amount" bigint, /* Option < i64 > */
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
AS 'MODULE_PATHNAME', 'record_cost_integer_amount_wrapper';

CREATE OR REPLACE FUNCTION "record_feedback"(
	"run_id" TEXT, /* Option < & str > */
	"rating" INT, /* Option < i32 > */
	"category" TEXT DEFAULT 'general', /* Option < & str > */
	"comment" TEXT DEFAULT NULL, /* Option < & str > */
	"user_id" TEXT DEFAULT NULL, /* Option < & str > */
	"metadata" jsonb DEFAULT NULL /* Option < Jsonb > */
) RETURNS ledger.run_feedback /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'record_feedback_wrapper';

CREATE OR REPLACE FUNCTION "record_response_event"(
	"run_id" TEXT, /* Option < & str > */
	"event_type" TEXT, /* Option < & str > */
	"payload" jsonb DEFAULT '{}', /* Option < Jsonb > */
	"step_id" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.response_events /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'record_response_event_wrapper';

CREATE OR REPLACE FUNCTION "record_task_event"(
	"task_id" TEXT, /* Option < & str > */
	"event_type" TEXT, /* Option < & str > */
	"payload" jsonb DEFAULT '{}' /* Option < Jsonb > */
) RETURNS ledger.task_events /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'record_task_event_wrapper';

CREATE OR REPLACE FUNCTION "record_tool_call"(
	"run_id" TEXT, /* Option < & str > */
	"tool_ref" TEXT, /* Option < & str > */
	"arguments" jsonb, /* Option < Jsonb > */
	"outcome" TEXT, /* Option < & str > */
	"result" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"error_message" TEXT DEFAULT NULL, /* Option < & str > */
	"tool_call_id" TEXT DEFAULT NULL, /* Option < & str > */
	"idempotency_key" TEXT DEFAULT NULL, /* Option < & str > */
	"metadata" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"retry_failed" bool DEFAULT false, /* Option < bool > */
	"run_token" bigint DEFAULT NULL /* Option < i64 > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'record_tool_call_wrapper';

CREATE OR REPLACE FUNCTION "redact"(
	"value" jsonb /* Jsonb */
) RETURNS jsonb /* Result < Jsonb, SqlError > */
STRICT STABLE PARALLEL SAFE
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'redact_wrapper';

CREATE OR REPLACE FUNCTION "register_artifact"(
	"run_id" TEXT, /* Option < & str > */
	"storage_key" TEXT, /* Option < & str > */
	"size_bytes" bigint, /* Option < i64 > */
	"sha256" TEXT, /* Option < & str > */
	"artifact_type" TEXT DEFAULT 'file', /* Option < & str > */
	"mime" TEXT DEFAULT NULL, /* Option < & str > */
	"step_id" TEXT DEFAULT NULL, /* Option < & str > */
	"meta" jsonb DEFAULT NULL /* Option < Jsonb > */
) RETURNS ledger.run_artifacts /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'register_artifact_wrapper';

CREATE OR REPLACE FUNCTION "release_run"(
	"run_id" TEXT, /* Option < & str > */
	"run_token" bigint /* Option < i64 > */
) RETURNS VOID /* std :: result :: Result < (), SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'release_run_wrapper';

CREATE OR REPLACE FUNCTION "replay_bundle"(
	"run_id" TEXT /* Option < & str > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
STABLE SECURITY DEFINER PARALLEL SAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'replay_bundle_wrapper';

CREATE OR REPLACE FUNCTION "replay_outbox_event"(
	"event_id" TEXT /* Option < & str > */
) RETURNS ledger.outbox_event /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'replay_outbox_event_wrapper';

CREATE OR REPLACE FUNCTION "replay_outbox_event"(
	"event_id" TEXT, /* Option < & str > */
	"actor" TEXT, /* Option < & str > */
	"note" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.outbox_event /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE  
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'replay_outbox_event_by_wrapper';

CREATE OR REPLACE FUNCTION "replay_ready"(
	"run_id" TEXT /* Option < & str > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
STABLE SECURITY DEFINER PARALLEL SAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'replay_ready_wrapper';

CREATE OR REPLACE FUNCTION "replay_run"(
	"run_id" TEXT, /* Option < & str > */
	"inputs" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"not_before" timestamp with time zone DEFAULT NULL /* Option < TimestampWithTimeZone > */
) RETURNS ledger.runs /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'replay_run_wrapper';

CREATE OR REPLACE FUNCTION "replay_task"(
	"task_id" TEXT /* Option < & str > */
) RETURNS ledger.tasks /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'replay_task_wrapper';

CREATE OR REPLACE FUNCTION "request_hash"(
	"value" jsonb /* Jsonb */
) RETURNS TEXT /* Result < String, SqlError > */
IMMUTABLE STRICT PARALLEL SAFE
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'request_hash_wrapper';

CREATE OR REPLACE FUNCTION "request_tool_approval"(
	"run_id" TEXT, /* Option < & str > */
	"tool_ref" TEXT, /* Option < & str > */
	"arguments" jsonb, /* Option < Jsonb > */
	"tool_call_id" TEXT DEFAULT NULL, /* Option < & str > */
	"idempotency_key" TEXT DEFAULT NULL, /* Option < & str > */
	"title" TEXT DEFAULT NULL, /* Option < & str > */
	"policy_ref" TEXT DEFAULT NULL, /* Option < & str > */
	"details" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"run_token" bigint DEFAULT NULL, /* Option < i64 > */
	"expires_in_seconds" INT DEFAULT NULL /* Option < i32 > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'request_tool_approval_wrapper';

CREATE OR REPLACE FUNCTION "resolve_approval"(
	"approval_id" TEXT, /* Option < & str > */
	"decision" TEXT, /* Option < & str > */
	"actor" TEXT DEFAULT NULL, /* Option < & str > */
	"note" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'resolve_approval_wrapper';

CREATE OR REPLACE FUNCTION "resolve_tool_call"(
	"tool_call_record_id" TEXT, /* Option < & str > */
	"decision" TEXT, /* Option < & str > */
	"result" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"actor" TEXT DEFAULT NULL, /* Option < & str > */
	"note" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'resolve_tool_call_wrapper';

CREATE OR REPLACE FUNCTION "retry_run"(
	"run_id" TEXT, /* Option < & str > */
	"inputs" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"not_before" timestamp with time zone DEFAULT NULL /* Option < TimestampWithTimeZone > */
) RETURNS ledger.runs /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'retry_run_wrapper';

CREATE OR REPLACE FUNCTION "retry_task"(
	"task_id" TEXT /* Option < & str > */
) RETURNS ledger.tasks /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'retry_task_wrapper';

CREATE OR REPLACE FUNCTION "revoke_scope"(
	"role_name" TEXT, /* Option < & str > */
	"tenant_id" TEXT, /* Option < & str > */
	"workspace_id" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS bool /* std :: result :: Result < bool, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'revoke_scope_wrapper';

CREATE OR REPLACE FUNCTION "run_channel"(
	"run_id" TEXT /* Option < & str > */
) RETURNS TEXT /* std :: result :: Result < String, SqlError > */
STABLE SECURITY DEFINER PARALLEL SAFE
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'run_channel_wrapper';

CREATE OR REPLACE FUNCTION "run_evidence"(
	"run_id" TEXT /* Option < & str > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
STABLE SECURITY DEFINER PARALLEL SAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'run_evidence_wrapper';

CREATE OR REPLACE FUNCTION "run_inputs"(
	"run_id" TEXT /* Option < & str > */
) RETURNS jsonb /* std :: result :: Result < Option < Jsonb > , SqlError > */
STABLE SECURITY DEFINER PARALLEL SAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'run_inputs_wrapper';

CREATE OR REPLACE FUNCTION "scope_required"() RETURNS bool /* std :: result :: Result < bool, SqlError > */
STRICT STABLE PARALLEL SAFE
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'scope_required_wrapper';

CREATE OR REPLACE FUNCTION "send_input"(
	"run_id" TEXT, /* Option < & str > */
	"input_key" TEXT, /* Option < & str > */
	"payload" jsonb DEFAULT '{}', /* Option < Jsonb > */
	"sender" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'send_input_wrapper';

CREATE OR REPLACE FUNCTION "set_budget"(
	"unit" TEXT, /* Option < & str > */
	"max_amount" NUMERIC, /* Option < AnyNumeric > */
	"level" TEXT DEFAULT 'workspace', /* Option < & str > */
	"run_id" TEXT DEFAULT NULL, /* Option < & str > */
	"period" TEXT DEFAULT 'total', /* Option < & str > */
	"warn_ratio" NUMERIC DEFAULT 0.8, /* Option < AnyNumeric > */
	"actor" TEXT DEFAULT NULL, /* Option < & str > */
	"note" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS SETOF ledger.budget_usage /* :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx :: pgbox :: AllocatedByRust
> */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'set_budget_wrapper';

CREATE OR REPLACE FUNCTION "set_concurrency_limit"(
	"concurrency_key" TEXT, /* Option < & str > */
	"max_in_flight" INT /* Option < i32 > */
) RETURNS INT /* std :: result :: Result < Option < i32 > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'set_concurrency_limit_wrapper';

CREATE OR REPLACE FUNCTION "set_rate_limit"(
	"concurrency_key" TEXT, /* Option < & str > */
	"max_claims" INT, /* Option < i32 > */
	"per_seconds" INT DEFAULT 60 /* Option < i32 > */
) RETURNS INT /* std :: result :: Result < Option < i32 > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'set_rate_limit_wrapper';

CREATE OR REPLACE FUNCTION "set_schedule"(
	"schedule_id" TEXT, /* Option < & str > */
	"cron" TEXT, /* Option < & str > */
	"mode" TEXT, /* Option < & str > */
	"inputs" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"time_zone" TEXT DEFAULT 'UTC', /* Option < & str > */
	"kind" TEXT DEFAULT NULL, /* Option < & str > */
	"catch_up" TEXT DEFAULT 'latest', /* Option < & str > */
	"priority" INT DEFAULT 0, /* Option < i32 > */
	"concurrency_key" TEXT DEFAULT NULL, /* Option < & str > */
	"actor" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.schedules /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'set_schedule_wrapper';

CREATE OR REPLACE FUNCTION "set_scope"(
	"tenant_id" TEXT, /* Option < & str > */
	"workspace_id" TEXT, /* Option < & str > */
	"is_local" bool DEFAULT false /* Option < bool > */
) RETURNS VOID /* std :: result :: Result < (), SqlError > */
VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'set_scope_wrapper';

CREATE OR REPLACE FUNCTION "set_task_snapshot"(
	"task_id" TEXT, /* Option < & str > */
	"snapshot" jsonb /* Option < Jsonb > */
) RETURNS ledger.tasks /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'set_task_snapshot_wrapper';

CREATE OR REPLACE FUNCTION "status_transitions"() RETURNS TABLE (
	"resource" TEXT,  /* String */
	"from_status" TEXT,  /* String */
	"to_status" TEXT  /* String */
)
IMMUTABLE STRICT PARALLEL SAFE
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'status_transitions_wrapper';

CREATE OR REPLACE FUNCTION "sweep_tool_calls"(
	"any_scope" bool DEFAULT false /* Option < bool > */
) RETURNS INT /* std :: result :: Result < i32, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'sweep_tool_calls_wrapper';

CREATE OR REPLACE FUNCTION "transition_run"(
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

CREATE OR REPLACE FUNCTION "transition_step"(
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

CREATE OR REPLACE FUNCTION "transition_task"(
	"task_id" TEXT, /* Option < & str > */
	"to_status" TEXT, /* Option < & str > */
	"expected_status" TEXT DEFAULT NULL, /* Option < & str > */
	"progress" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"output" jsonb DEFAULT NULL, /* Option < Jsonb > */
	"error_code" TEXT DEFAULT NULL, /* Option < & str > */
	"error_message" TEXT DEFAULT NULL /* Option < & str > */
) RETURNS ledger.tasks /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'transition_task_wrapper';

CREATE OR REPLACE FUNCTION "unbind_scope"(
	"role_name" TEXT /* Option < & str > */
) RETURNS bool /* std :: result :: Result < bool, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'unbind_scope_wrapper';

CREATE OR REPLACE FUNCTION "wait_for_children"(
	"run_id" TEXT, /* Option < & str > */
	"run_token" bigint, /* Option < i64 > */
	"deadline" timestamp with time zone DEFAULT NULL /* Option < TimestampWithTimeZone > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'wait_for_children_wrapper';

CREATE OR REPLACE FUNCTION "wait_for_input"(
	"run_id" TEXT, /* Option < & str > */
	"run_token" bigint, /* Option < i64 > */
	"input_key" TEXT, /* Option < & str > */
	"deadline" timestamp with time zone DEFAULT NULL /* Option < TimestampWithTimeZone > */
) RETURNS jsonb /* std :: result :: Result < Jsonb, SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'wait_for_input_wrapper';

CREATE OR REPLACE FUNCTION "wait_run"(
	"run_id" TEXT, /* Option < & str > */
	"run_token" bigint, /* Option < i64 > */
	"wake_at" timestamp with time zone /* Option < TimestampWithTimeZone > */
) RETURNS ledger.runs /* std :: result :: Result < :: pgrx :: heap_tuple :: PgHeapTuple < '_, :: pgrx
:: pgbox :: AllocatedByRust > , SqlError > */
VOLATILE SECURITY DEFINER PARALLEL UNSAFE 
SET search_path TO pg_catalog, ledger, pg_temp
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'wait_run_wrapper';

-- Ownership, privileges and comments, as sql/finalize.sql gives a fresh install.

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
-- Except the blob store's lock rows, which hold nothing to read: no role but the owner has any
-- privilege on them, so no one else can lock them (that needs UPDATE) or see which scopes write.
REVOKE SELECT ON ledger.blob_locks FROM ledger_reader;
-- Nor on the run channels' key: a name computed without the ledger would let anyone LISTEN to a run.
REVOKE SELECT ON ledger.channel_key FROM ledger_reader;
GRANT EXECUTE ON FUNCTION
    ledger.set_scope(text, text, boolean),
    ledger.scope_tenant(),
    ledger.scope_required(),
    ledger.scope_workspace(),
    ledger.status_transitions(),
    ledger.is_status(text, text),
    ledger.notifier_status(),
    ledger.events_since(text, text, integer),
    ledger.run_channel(text),
    ledger.run_inputs(text),
    ledger.get_artifact(text),
    ledger.redact(jsonb),
    ledger.canonical_json(jsonb),
    ledger.request_hash(jsonb),
    ledger.replay_bundle(text),
    ledger.run_evidence(text),
    ledger.replay_ready(text),
    ledger.otel_trace(text, text),
    ledger.next_wake(boolean),
    ledger.inbox(boolean),
    ledger.graph_checkpoint_tuples(text, text, text, jsonb, text, integer),
    ledger.budget_window(text, timestamp with time zone),
    ledger.budget_spent(text, numeric, timestamp with time zone, timestamp with time zone)
    TO ledger_reader;

GRANT SELECT ON ledger.tool_calls_in_doubt, ledger.pending_approvals, ledger.run_overview,
    ledger.outbox_backlog, ledger.budget_usage TO ledger_reader;
-- The functions that decide and set budgets read them as people see them.
GRANT SELECT ON ledger.budget_usage TO ledger_owner;

-- Writers: everything a reader has, and every function. No INSERT, UPDATE or DELETE on any
-- table: the rules (status machine, event seq, redaction) live in the functions.
GRANT ledger_reader TO ledger_writer;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA ledger TO ledger_writer;

COMMENT ON FUNCTION ledger.set_scope(text, text, boolean) IS
    'Sets the caller''s scope (GUCs ledger.tenant_id, ledger.workspace_id) for the session, or with is_local => true for the current transaction only. Every other function refuses to run without it (42501 SCOPE_MISSING). The only way to set a scope: SET, set_config, ALTER ROLE ... SET and PGOPTIONS are refused (42501 SCOPE_SET_DIRECTLY). A login role bound by ledger.grant_scope may state only its granted scopes (42501 SCOPE_NOT_GRANTED).';
COMMENT ON FUNCTION ledger.scope_required() IS
    'true when a scope is set, else 42501 SCOPE_MISSING. The monitoring views filter on it, so that reading one without a scope fails instead of showing no rows.';
COMMENT ON FUNCTION ledger.notifier_status() IS
    'For members of ledger_operator or ledger_owner (and superusers): the counters move with every tenant''s commits (42501 OPERATOR_REQUIRED for anyone else). How this session''s writes notify (notify: worker, inline or off, as ledger.notify and the preload allow), whether the library is preloaded, and for this database: the notifier worker''s pid (NULL: none attached now; it starts with the next write and leaves after 2 s idle), channels waiting in its table, the table''s capacity (ledger.notifier_capacity), notifications the workers sent, and commits whose writers notified by themselves while preloaded (no worker attached, the table full).';
COMMENT ON FUNCTION ledger.is_status(text, text) IS
    'true when status is one of resource''s statuses (run, step, task or tool_call; 22023 STATUS_UNKNOWN for another resource). The tables'' status CHECKs call it.';
COMMENT ON FUNCTION ledger.status_transitions() IS
    'The status machine: every allowed (resource, from_status, to_status) for run, step and task. Statuses: queued, preparing, running, waiting_input, waiting_approval, paused, retrying, succeeded, failed, canceled, expired (+ skipped for steps). Terminal: succeeded, failed, canceled, expired, skipped.';
COMMENT ON FUNCTION ledger.create_run(text, jsonb, text, text, text, text, text, text, text, integer, text, text, text, text, timestamp with time zone, integer, text) IS
    'Creates a queued run, claimable (ledger.claim_run) from not_before (NULL: at once), the highest priority first (-1000 to 1000, default 0; 22023 PRIORITY_INVALID), within the limit of its concurrency_key (ledger.set_concurrency_limit). request_id (or a caller run_id) makes it idempotent (not_before, priority and concurrency_key are not compared); source_run_id and parent_run_id must exist in scope; attempt_no defaults to source.attempt_no + 1 and root_run_id to the source''s root. inputs (a JSON object) are redacted, then kept as stored: see ledger.run_inputs.';
COMMENT ON FUNCTION ledger.transition_run(text, text, text, text, text, text, text, bigint) IS
    'Moves a run to to_status if ledger.status_transitions() allows it (55000 TRANSITION_INVALID otherwise). With expected_status the move is conditional on it (40001 TRANSITION_CONFLICT). Moving to the current status returns the row unchanged. A terminal status ends the owner''s lease. run_token: the owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.run_inputs(text) IS
    'The inputs a run was created with, as stored (redacted), also when they were too large to keep inline.';
COMMENT ON FUNCTION ledger.create_step(text, text, text, text, text, text, text, bigint) IS
    'Adds a step to a run that exists in scope and is not terminal (55000 RUN_TERMINAL), numbered 1, 2, 3 within the run (step_no). A caller step_id, and a step_key within the run, are idempotent: the same step again returns it; another step_type (or a step_id and step_key naming different steps) fails 23505 IDEMPOTENCY_MISMATCH naming the field. run_token: the owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.transition_step(text, text, text, text, jsonb, text, text, jsonb, bigint) IS
    'Moves a step to to_status under the same rules as transition_run (steps also have skipped). metrics are merged into the existing object, top-level keys. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.events_since(text, text, integer) IS
    'The run''s events after after_event_id (from the start when NULL), ordered by their gapless seq. ends_run marks the event that moved the run to a terminal status: a follower may stop after it. An unknown after_event_id fails P0002 EVENT_NOT_FOUND. Client contract: LISTEN on ledger.run_channel(run_id) first, then call this with your cursor, and again on each notification.';
COMMENT ON FUNCTION ledger.run_channel(text) IS
    'The LISTEN/NOTIFY channel of a run. Commits that append to the run notify it with {"run_id","seq"}: events up to seq are committed (ledger.notify = inline: one per event, with event_id and event_type too). The name is keyed with a secret of the database that only the ledger reads (ledger.channel_key), so it cannot be computed from the run''s names: ask this function for it.';
COMMENT ON FUNCTION ledger.claim_tool_call(text, text, jsonb, text, text, text, text, integer, boolean, jsonb, bigint) IS
    'Claims a tool call for execution. Returns {outcome, tool_call, approval, response} with outcome claimed (execute it; tool_call.id is the tool_call_record_id the other tool-call functions take and tool_call.attempt your fencing token), replayed (response holds the last result; execute nothing), in_doubt (the request may have left; never retried automatically), busy (a live lease exists), waiting_approval or rejected. The lease is timeout_seconds plus a tenth (at least 5 s), never under 10 s. With approval {title, policy_ref, details, expires_in_seconds}, a new call is created waiting for it (as ledger.request_tool_approval does) and a known one answers its current outcome, so one call is right on every resume. Same key with another tool_ref or arguments: 23505 IDEMPOTENCY_MISMATCH. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.claim_tool_calls(text, jsonb, text, boolean, bigint) IS
    'Claims the tool calls of one model turn in one statement (one commit instead of one per call): calls is a JSON array of at most 100 objects with claim_tool_call''s per-call arguments (tool_ref, arguments, tool_call_id, idempotency_key, step_id, timeout_seconds, retry_failed, approval; an absent key takes that function''s default). Returns one row per element, in input order: index (from 0) and claim, what claim_tool_call returns for that call (claimed, replayed, in_doubt, busy, waiting_approval, rejected, purged). The run is locked and fenced by run_token once (40001 LEASE_STALE unless current). begin => true also begins every call that comes back claimed (its tool_call.status is running): COMMIT before any request leaves; after a crash past that commit they are in_doubt, never executed twice. Any refusal refuses the whole batch and writes nothing, its DETAIL naming the element (index): 22023 CALLS_NOT_ARRAY, CALLS_TOO_MANY, CALL_INVALID (with the key), CALLS_DUPLICATE (one idempotency_key or tool_call_id twice), or what claim_tool_call refuses.';
COMMENT ON FUNCTION ledger.begin_tool_call(text, bigint) IS
    'Marks the outbound boundary of the claimed attempt (status running, outbound_started_at). COMMIT it before the request leaves the process. A stale attempt fails 40001 LEASE_STALE.';
COMMENT ON FUNCTION ledger.heartbeat_tool_call(text, bigint, integer) IS
    'Extends the lease of the current attempt by extend_seconds (default: the claim''s lease).';
COMMENT ON FUNCTION ledger.complete_tool_call(text, bigint, text, jsonb, text, jsonb) IS
    'Records the end of the current attempt: outcome succeeded, failed, or unknown (sent, no answer: in_doubt). Fenced by attempt, not by the clock: accepted after the lease expired and from in_doubt. Results over 8192 bytes of canonical JSON are stored as a json artifact.';
COMMENT ON FUNCTION ledger.find_tool_call(text, text, jsonb, text, text, boolean) IS
    'Looks up a repeatable tool call (one its caller declares safe to repeat: a read, an idempotent API) before it runs. Returns {outcome, tool_call, approval, response} with outcome replayed (response holds the recorded result; run nothing), unrecorded (no result to replay: run the tool, then ledger.record_tool_call), or the in_doubt, busy, waiting_approval, rejected or purged of a side-effecting call under the key, which the repeatable path never overrides. Needs tool_call_id or idempotency_key (22023 ARGUMENT_REQUIRED); other input under the key: 23505 IDEMPOTENCY_MISMATCH. Writes nothing but a re-run''s first reuse of its lineage''s result (tool_call.replayed, as a claim).';
COMMENT ON FUNCTION ledger.record_tool_call(text, text, jsonb, text, jsonb, text, text, text, jsonb, boolean, bigint) IS
    'Records a repeatable tool call after it returned, in one statement: outcome succeeded (with its result) or failed (with error_message). Returns {outcome, tool_call, approval, response}: recorded (a new record, attempt 1, its tool step created finished), or when the key already has a record, that record''s answer and nothing written: replayed (the first record wins: response holds it), in_doubt, busy, waiting_approval, rejected or purged. retry_failed => true records over a failed call as its next attempt. Same key with another tool_ref or arguments: 23505 IDEMPOTENCY_MISMATCH. Results over 8192 bytes of canonical JSON are stored as a json artifact. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.resolve_tool_call(text, text, jsonb, text, text) IS
    'Resolves an in_doubt tool call with a person''s decision: succeeded or failed (with the evidence as result), or retry (the next claim executes again with attempt + 1). actor and note are recorded with an audit event.';
COMMENT ON FUNCTION ledger.sweep_tool_calls(boolean) IS
    'Moves every expired lease in the scope to in_doubt (the request left) or back to claimable (it did not), and expires every pending approval past its deadline (the call is rejected, its step expired, approval.expired in the feed and the outbox); returns how many. For pg_cron or a worker; never waits on busy rows. With any_scope => true (members of ledger_operator only), every scope''s.';
COMMENT ON FUNCTION ledger.request_tool_approval(text, text, jsonb, text, text, text, text, jsonb, bigint, integer) IS
    'Creates a tool call in waiting_approval and its approval request (outbox approval.requested). Claims of the same identity return waiting_approval while pending, claimed once approved, rejected once rejected or expired (expires_in_seconds: 1 second to a year; past it the approval expires, and no one may decide it). On a known call it answers the current outcome without claiming it (waiting_approval also once approved, replayed, in_doubt, busy, rejected); another tool_ref or arguments fail 23505 IDEMPOTENCY_MISMATCH. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.resolve_approval(text, text, text, text) IS
    'Decides a pending approval: approved or rejected, with the actor and a note. Repeating the same decision is a no-op; a different one fails 55000 APPROVAL_RESOLVED; past the approval''s deadline any fails 55000 APPROVAL_EXPIRED.';
COMMENT ON FUNCTION ledger.put_artifact(text, bytea, text, text, text, jsonb) IS
    'Stores bytes in the scope''s content-addressed blob store and records them as an artifact (storage_key blob:sha256:<hex>).';
COMMENT ON FUNCTION ledger.register_artifact(text, text, bigint, text, text, text, text, jsonb) IS
    'Records an artifact whose bytes live in an external store, with their size and sha256.';
COMMENT ON FUNCTION ledger.get_artifact(text) IS
    'The bytes of an artifact in the built-in store, verified against its sha256 (XX001 ARTIFACT_HASH_MISMATCH).';
COMMENT ON FUNCTION ledger.redact(jsonb) IS
    'The value as the ledger would store it: sensitive keys'' values and credential-like strings replaced by "[REDACTED]" (GUCs ledger.redact_keys, ledger.redact_values).';
COMMENT ON FUNCTION ledger.canonical_json(jsonb) IS
    'Canonical JSON text: object keys sorted by code point, no insignificant whitespace, numbers as jsonb prints them.';
COMMENT ON FUNCTION ledger.request_hash(jsonb) IS
    'Hex sha256 of ledger.canonical_json(value): the request_hash of a tool call with these arguments.';
COMMENT ON FUNCTION ledger.record_cost(text, text, numeric, numeric, text, text, jsonb, jsonb, text, text, text, text, text, text) IS
    'Records a cost entry: billed_quantity >= 0, amount >= 0 with a currency, usage with the known keys (or the OpenAI and Anthropic names, stored under the known keys) as non-negative integers. source_ref is idempotent per scope. Writes cost.recorded to the feed and the outbox.';
COMMENT ON FUNCTION ledger.record_cost(text, text, numeric, double precision, text, text, jsonb, jsonb, text, text, text, text, text, text) IS
    'ledger.record_cost with a double precision amount (a client''s float), taken as its shortest decimal text: 0.1 is stored as 0.1.';
COMMENT ON FUNCTION ledger.record_cost(text, text, numeric, bigint, text, text, jsonb, jsonb, text, text, text, text, text, text) IS
    'ledger.record_cost with a bigint amount (an integer literal past int4, a client''s large integer), stored exactly.';
COMMENT ON FUNCTION ledger.record_audit(text, text, text, jsonb, text, text) IS
    'Records an audit event for a run (gateway decisions, human interventions). The payload is redacted.';
COMMENT ON FUNCTION ledger.record_response_event(text, text, jsonb, text) IS
    'Records what a run showed its user (event_type: message, delta, ...). The payload is redacted.';
COMMENT ON FUNCTION ledger.record_citation(text, jsonb, text) IS
    'Records a knowledge citation of a run (an object: chunk_id, document_id, knowledge_id, ...). Redacted.';
COMMENT ON FUNCTION ledger.record_feedback(text, integer, text, text, text, jsonb) IS
    'Records a rating of a run (any integer scale) with an optional comment and metadata.';
COMMENT ON FUNCTION ledger.replay_bundle(text) IS
    'Everything about a run in one read (replay #1): {run, steps, artifacts, costs, approvals, feedback, mailbox, tool_calls, reused_tool_calls, budgets, budget_events, trace_spec}. mailbox holds the inputs sent to the run and those it waits for; budgets are the budgets that apply to the run as they stand now, budget_events its budget warnings and stops; reused_tool_calls are the finished calls of its source run whose results a retry or replay reused. Lists are complete and ordered; money is decimal strings per currency.';
COMMENT ON FUNCTION ledger.otel_trace(text, text) IS
    'A run as an OpenTelemetry trace: an OTLP/JSON ExportTraceServiceRequest following the GenAI semantic conventions (the run an invoke_agent span, llm steps chat spans with token usage, tool calls execute_tool spans, costs as ledger.cost.<currency> attributes, ledger ids on every span), for an OTLP/HTTP collector''s /v1/traces. Ids are derived from the run, so a second export is the same trace.';
COMMENT ON FUNCTION ledger.run_evidence(text) IS
    'The thirteen governance evidence items of a run, in order: each {key, status pass|warning|fail|not_applicable, label, summary, evidence_refs, missing}.';
COMMENT ON FUNCTION ledger.replay_ready(text) IS
    'Whether the ledger alone can replay the run: {"status": "pass"|"fail", "missing": [...]} over steps, response_events, costs, citations, tool_calls (its own or reused from its source), audits (each where applicable) and inputs (present and matching their sha256).';
COMMENT ON FUNCTION ledger.retry_run(text, jsonb, timestamp with time zone) IS
    'Retries a failed or canceled run (replay #4): a new queued run with the source''s mode, kind and subject pinned to its subject_version_id, source_run_id, attempt_no + 1, the same root_run_id, control_action retry, the source''s priority and concurrency_key, claimable from not_before (a backoff; NULL: at once), and the original inputs as stored unless inputs overrides them. The caller executes it; a tool call it claims with the same tool_call_id replays the result its lineage recorded (see claim_tool_call), one with the same explicit key too.';
COMMENT ON FUNCTION ledger.replay_run(text, jsonb, timestamp with time zone) IS
    'Replays a finished run (any terminal status) as a new run, like ledger.retry_run with control_action replay.';
COMMENT ON FUNCTION ledger.purge_runs(interval, integer) IS
    'Deletes up to batch terminal runs of the scope that ended more than older_than ago, with all their rows and the blobs nothing else refers to, keeping each tool call''s idempotency key as a tombstone. Skips runs with open tool calls or that other runs or tasks refer to (leaf first). Returns how many runs went.';
COMMENT ON FUNCTION ledger.put_graph_checkpoint(text, text, text, text, jsonb, jsonb, text, text[], text[], text[], bytea[]) IS
    'Stores a graph framework''s checkpoint (LangGraph) of thread_id and checkpoint_ns, written by the run run_id, with the channel values it introduces: entry i of channels, versions, blob_types and blobs is one channel''s new version, the serializer''s type and opaque bytes, stored as given and never redacted; checkpoint (without channel values) is stored as given, metadata redacted. A checkpoint stored again gets the new checkpoint and metadata.';
COMMENT ON FUNCTION ledger.put_graph_checkpoint_writes(text, text, text, text, integer[], text[], text[], bytea[], text, boolean) IS
    'Stores pending writes of task task_id against a graph checkpoint (stored before or after it: the framework stores both concurrently): entry i is write idxs[i] to channels[i], the serializer''s type and opaque bytes, never redacted. A write already stored is kept, or replaced with upsert. Returns how many writes were stored.';
COMMENT ON FUNCTION ledger.graph_checkpoint_tuples(text, text, text, jsonb, text, integer) IS
    'The graph checkpoints of the scope, newest first (by checkpoint id): of one thread, namespace or checkpoint when given, whose metadata contains filter, older than the checkpoint id before, at most max_checkpoints; each with the run that wrote it, the channel values its channel_versions name and its pending writes (parallel arrays of the serializer''s types and bytes, as stored).';
COMMENT ON FUNCTION ledger.delete_graph_thread(text) IS
    'Deletes every checkpoint, pending write and channel value of the graph thread, in every namespace. Returns how many checkpoints went.';
COMMENT ON FUNCTION ledger.copy_graph_thread(text, text) IS
    'Copies every checkpoint of source_thread_id (every namespace, with its pending writes and channel values, each still tied to the run that wrote it) to target_thread_id, keeping checkpoints the target already has. Returns how many were copied.';
COMMENT ON FUNCTION ledger.prune_graph_threads(text[], text) IS
    'Prunes graph threads: strategy keep_latest keeps the newest checkpoint of each namespace (with its writes and the values it names), delete removes everything (22023 STRATEGY_UNKNOWN otherwise). Returns how many checkpoints went.';
COMMENT ON FUNCTION ledger.delete_graph_checkpoints_for_runs(text[]) IS
    'Deletes the graph checkpoints (with their pending writes, and the channel values no remaining checkpoint names) written by the runs run_ids: ledger run ids, or the framework''s run ids as its metadata holds them (run_id). The runs stay. Returns how many checkpoints went.';
COMMENT ON FUNCTION ledger.claim_outbox_events(text, integer, integer, boolean) IS
    'Claims up to max_events (1 to 1000) due outbox events of the scope for lease_owner, oldest first: pending ones whose available_at has come and processing ones whose lease expired. Each becomes processing under a lease of lease_seconds (1 to 86400) and counts an attempt. FOR UPDATE SKIP LOCKED: never waits for another claimer. An expired lease on an event''s 64th attempt since its last replay fails it instead. Delivery is at least once: deduplicate on id. With any_scope => true (members of ledger_operator only), the oldest due events of every scope, each with its tenant_id and workspace_id.';
COMMENT ON FUNCTION ledger.ack_outbox_events(text, text[]) IS
    'Marks the listed events lease_owner holds as done and returns how many. Ids it does not hold (a lease re-taken by another claimer, an event already done) are ignored.';
COMMENT ON FUNCTION ledger.ack_outbox_events(text, text) IS
    'ledger.ack_outbox_events for one event: 1 if lease_owner held it and it is now done, else 0.';
COMMENT ON FUNCTION ledger.nack_outbox_events(text, text[], text) IS
    'Reports a failed delivery of the listed events lease_owner holds (55000 OUTBOX_NOT_LEASED for any other, and nothing changes): each is pending again after min(300, 2^(n-1)) seconds for its n-th attempt since its last replay, or failed after the 64th. error_message (8192 characters at most) is kept. Returns the events.';
COMMENT ON FUNCTION ledger.nack_outbox_events(text, text, text) IS
    'ledger.nack_outbox_events for one event.';
COMMENT ON FUNCTION ledger.replay_outbox_event(text) IS
    'Puts a failed outbox event back to pending, due now, with another 64 attempts (55000 OUTBOX_NOT_FAILED otherwise). attempt_count is kept; replay_count + 1. Notifies ledger_outbox.';
COMMENT ON FUNCTION ledger.replay_outbox_event(text, text, text) IS
    'ledger.replay_outbox_event by a person, who is named (actor; NULL or empty: 22023 ARGUMENT_REQUIRED), with its audit record in the same transaction: gateway_type outbox.replay, outcome replayed, for the event''s run (audit.recorded in its feed) or with no run if it has none; payload {outbox_event_id, event_type, replay_count, note}, redacted.';
COMMENT ON FUNCTION ledger.create_task(text, jsonb, text, text) IS
    'Creates a queued task of task_type with input (a JSON object, redacted), optionally for run_id (which must exist in scope). A caller task_id is idempotent: the same type and run return the task, anything else fails 23505 IDEMPOTENCY_MISMATCH. Writes task.created to ledger.task_events.';
COMMENT ON FUNCTION ledger.transition_task(text, text, text, jsonb, jsonb, text, text) IS
    'Moves a task to to_status under the run rules: a conditional update under the row lock (55000 TRANSITION_INVALID, 40001 TRANSITION_CONFLICT with expected_status; the current status returns the row unchanged). progress is merged by top-level key, output replaced (both JSON objects, redacted). Writes task.status.';
COMMENT ON FUNCTION ledger.add_task_checkpoint(text, jsonb) IS
    'Adds a checkpoint (payload: a JSON object, redacted) to a task that is not terminal (55000 TASK_TERMINAL), numbered 1, 2, 3, ... without gaps per task. Writes task.checkpoint.';
COMMENT ON FUNCTION ledger.record_task_event(text, text, jsonb) IS
    'Appends the caller''s event (payload: a JSON object, redacted) to a task''s history, in any status. The ledger''s own types task.created, task.status, task.checkpoint and task.snapshot are refused (22023 EVENT_TYPE_RESERVED).';
COMMENT ON FUNCTION ledger.set_task_snapshot(text, jsonb) IS
    'Stores the persisted execution snapshot (a JSON object, redacted) of a task that is not terminal (55000 TASK_TERMINAL); ledger.replay_task starts from it. Writes task.snapshot.';
COMMENT ON FUNCTION ledger.retry_task(text) IS
    'Retries a failed, canceled or expired task in place (55000 TRANSITION_INVALID otherwise; TASK_REPLAYED if it was replayed): retrying, then queued, as attempt_count + 1 with errors, output and times cleared and progress {"action": "requeued"}. Writes outbox task.retried.';
COMMENT ON FUNCTION ledger.replay_task(text) IS
    'Replays a task from its snapshot in one transaction and returns the NEW task: queued, same type and input, no run, replayed_from_task_id set, snapshot without task_id and run_id (top level and in payload). The old task goes to canceled (through retrying when terminal; succeeded fails 55000 TRANSITION_INVALID) with retried_as_task_id. No snapshot: 55000 TASK_RETRY_SNAPSHOT_MISSING, nothing changed. A task already replayed returns its replacement.';

-- Run leases, the operator role and scope grants (0.5.0).
COMMENT ON FUNCTION ledger.set_concurrency_limit(text, integer) IS
    'Lets at most max_in_flight (0 to 100000; 0 pauses the key; 22023 LIMIT_INVALID) runs of concurrency_key hold a live lease at once: ledger.claim_run skips the key''s runs while it is full, never waits, and no two claims can both take the last place. NULL max_in_flight removes the limit. Returns the limit in force.';
COMMENT ON FUNCTION ledger.set_rate_limit(text, integer, integer) IS
    'Lets at most max_claims (0 to 1000000; 0 pauses the key) claims of concurrency_key''s runs fall in one window of per_seconds (1 to 86400; 22023 LIMIT_INVALID): a window starts at the first claim after the last one ended, and while it is full ledger.claim_run skips the key''s runs (also by run_id) and never waits; no two claims can both take its last claim. It stands beside the key''s concurrency limit. NULL max_claims removes it. Returns the rate in force.';
COMMENT ON FUNCTION ledger.set_budget(text, numeric, text, text, text, numeric, text, text) IS
    'Sets a budget: at most max_amount (>= 0; 22023 AMOUNT_INVALID) of unit (a currency code such as USD, tokens, tool_calls or llm_steps; 22023 UNIT_INVALID) per period (total, day or month in UTC; 22023 PERIOD_UNKNOWN) for level workspace (the scope''s), tenant (every workspace of it; 42501 TENANT_NOT_GRANTED for a role bound to some of them) or run (run_id). NULL max_amount removes it. A decision to spend (claim_tool_call(s), create_step of an llm step, claim_run) is refused while a budget that applies is used up; record_cost never refuses. warn_ratio (0 to 1, default 0.8; NULL: no warning) writes budget.warning once per window. Audited (budget.set) with actor and note. Returns the budget as ledger.budget_usage shows it (no row once removed).';
COMMENT ON FUNCTION ledger.claim_run(text, text, text[], text[], integer, boolean) IS
    'Claims a run for lease_owner: run_id, or the claimable run of the scope (filtered by modes and kinds) with the highest priority, oldest first within it, FOR UPDATE SKIP LOCKED: never waits. Claimable: not terminal, no live lease, due (not_before NULL or passed), queued or retrying or claimed before (a run nobody ever claimed stays with its caller), and with room under its concurrency key''s limit (a full key''s runs are skipped, also by run_id); the oldest-first claim skips runs with a call in doubt or waiting for approval before its deadline (they wait for a person, whose decision makes them claimable). Each claim adds 1 to the run''s run_token, leases the run for lease_seconds (1 to 86400) and writes run.claimed to its feed; the status does not change. Returns no row when nothing is claimable, else a ledger.claimed_run (takeover: the lease of previous_owner had expired). any_scope => true: across scopes, for members of ledger_operator (42501 OPERATOR_REQUIRED); scopes take turns (the one served longest ago first, then its highest priority, oldest first).';
COMMENT ON FUNCTION ledger.heartbeat_run(text, bigint, integer) IS
    'Extends the owner''s lease by extend_seconds (default: the claim''s lease_seconds) from now and returns when it ends. Fenced by run_token (40001 LEASE_STALE), not by the clock: accepted after expiry until another worker takes the run over. A terminal run: 55000 RUN_TERMINAL.';
COMMENT ON FUNCTION ledger.release_run(text, bigint) IS
    'Gives up the owner''s run: claimable at once by anyone unless it is terminal, and run_token is over (40001 LEASE_STALE on any later write carrying it).';
COMMENT ON FUNCTION ledger.wait_run(text, bigint, timestamp with time zone) IS
    'Parks the owner''s run until wake_at (a durable wait): it moves to waiting_input (55000 TRANSITION_INVALID from a status that cannot), its lease is given up (run_token is over: 40001 LEASE_STALE on any later write carrying it), and claim_run hands it out again from wake_at on (not_before), so no worker holds or polls it meanwhile. Returns the run.';
COMMENT ON FUNCTION ledger.inbox(boolean) IS
    'What waits for people in the scope: calls in doubt, pending approvals (before their deadline), runs paused by a budget that is still used up (BUDGET_EXHAUSTED; raised, the run waits for a worker, not a person) and failed outbox events, each counted with the oldest one''s time (when it went in doubt, was asked, stopped, failed). One row for the scope, zeros when nothing waits. any_scope => true: one row per scope the session may state that has something waiting, for members of ledger_operator (42501 OPERATOR_REQUIRED).';
COMMENT ON FUNCTION ledger.next_wake(boolean) IS
    'When a run of the scope next becomes claimable by the clock alone: the nearest wake time ahead of a wait or backoff (not_before), deadline of a pending approval, or end of a full rate window; NULL when none is ahead. Anything else that makes a run claimable (a new run, a release, an input, a decision, a run ending) notifies channel ledger_runs at commit, so an idle worker listens there and sleeps until next_wake at most. any_scope => true: across every scope the session may state, for members of ledger_operator (42501 OPERATOR_REQUIRED).';
COMMENT ON FUNCTION ledger.send_input(text, text, jsonb, text) IS
    'Sends run run_id the input input_key (a label; keys starting with ledger: are the ledger''s own, 22023 INPUT_KEY_RESERVED): payload (any JSON, redacted before it is stored) from sender, kept in ledger.run_mailbox. The same key again with the same payload returns the input already there; another payload fails 23505 IDEMPOTENCY_MISMATCH; a terminal run takes none (55000 RUN_TERMINAL). A run parked waiting for the key (ledger.wait_for_input) becomes claimable at once. Writes input.received to the run''s feed and an audit row (input.send) with the sender. Returns the mailbox row.';
COMMENT ON FUNCTION ledger.wait_for_input(text, bigint, text, timestamp with time zone) IS
    'The owner''s run waits for input input_key: returns {status: received, input} when it was sent, {status: timed_out} when deadline has passed without it, else {status: waiting, input}: the run moves to waiting_input (55000 TRANSITION_INVALID from a status that cannot), its lease is given up (run_token is over: 40001 LEASE_STALE on any later write carrying it), and claim_run hands it out again when the input arrives or at the deadline (none: only the input wakes it). Call it again with the same key and deadline on resume.';
COMMENT ON FUNCTION ledger.wait_for_children(text, bigint, timestamp with time zone) IS
    'The owner''s run waits for its children (the runs created with parent_run_id => run_id): returns {status: done, children} when every one has ended, {status: timed_out, children} when deadline has passed first, else {status: waiting, children}: the run is parked as ledger.wait_for_input parks it and claimable again when its last child ends or at the deadline. children: [{run_id, status, output_summary, error_code, error_message}] oldest first. Each child''s end is also put in the parent''s mailbox (input_key ledger:child:<run_id>).';
COMMENT ON FUNCTION ledger.set_schedule(text, text, text, jsonb, text, text, text, integer, text, text) IS
    'Creates or replaces schedule schedule_id: at every time cron names (five fields, minute hour day-of-month month day-of-week, or @hourly, @daily, @weekly, @monthly, @yearly; 22023 CRON_INVALID) in time_zone (a name from pg_timezone_names; 22023 TIME_ZONE_UNKNOWN), ledger.fire_schedules creates a run of mode with kind, inputs (a JSON object, redacted when set), priority and concurrency_key, request_id schedule:<schedule_id>:<firing in UTC>. catch_up (latest or all; 22023 CATCH_UP_UNKNOWN): what a sweep does with firings it finds missed (one run for the most recent, or one per firing, at most 100 per sweep). The next firing counts from now; a paused schedule stays paused. Audited (schedule.set) with actor. Returns the schedule.';
COMMENT ON FUNCTION ledger.pause_schedule(text, boolean, text) IS
    'Pauses (paused true, the default) or resumes a schedule (P0002 SCHEDULE_NOT_FOUND): paused, it fires nothing; resumed, it fires from the next time its expression names, the firings while paused skipped. Audited (schedule.set, paused or resumed) with actor. Returns the schedule.';
COMMENT ON FUNCTION ledger.drop_schedule(text, text) IS
    'Removes a schedule (the runs it created stay); returns whether it existed. Audited (schedule.set, dropped) with actor.';
COMMENT ON FUNCTION ledger.fire_schedules(boolean) IS
    'Creates the runs of every due firing of the scope''s schedules (not paused, next_fire_at passed) and moves each to its next firing; returns how many firings it ran. A firing creates one run however many sweepers fire it (its request_id), and a schedule another sweeper holds is skipped, never waited for. Run it every minute (pg_cron, or a worker''s loop). With any_scope => true (members of ledger_operator only), every scope''s.';
COMMENT ON FUNCTION ledger.grant_scope(text, text, text) IS
    'Lets login role role_name state the tenant''s workspace (NULL: every workspace of the tenant) with ledger.set_scope. The first grant binds the role: set_scope refuses it any other scope (42501 SCOPE_NOT_GRANTED), and any_scope => true reaches only its granted scopes. Returns false when the grant existed. For the extension''s owner and superusers only.';
COMMENT ON FUNCTION ledger.revoke_scope(text, text, text) IS
    'Removes the grant of exactly this tenant and workspace (NULL: the every-workspace grant) from role_name; returns whether it existed. The role stays bound: with no grant left it may state no scope (ledger.unbind_scope unbinds it). For the extension''s owner and superusers only.';
COMMENT ON FUNCTION ledger.unbind_scope(text) IS
    'Unbinds login role role_name: removes its scope grants and its binding, so that it may state any scope again; returns whether it was bound. For the extension''s owner and superusers only.';

-- Grants decide who may state which scope: no application role may read or change them.
REVOKE SELECT ON ledger.scope_grants, ledger.scope_bindings FROM ledger_reader;
REVOKE EXECUTE ON FUNCTION ledger.grant_scope(text, text, text), ledger.revoke_scope(text, text, text),
    ledger.unbind_scope(text) FROM ledger_writer;

-- ledger_dispatcher: owns the functions that find work across scopes (see schema.sql).
ALTER FUNCTION ledger_dispatch.next_run(text[], text[]) OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.due_outbox_events(integer) OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.expired_tool_call_scopes() OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.due_schedule_scopes() OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.next_wake() OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.inbox(text, text) OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.scope_granted(text, text) OWNER TO ledger_owner;
ALTER FUNCTION ledger_dispatch.tenant_granted(text) OWNER TO ledger_owner;
GRANT USAGE ON SCHEMA ledger TO ledger_dispatcher;
GRANT EXECUTE ON FUNCTION ledger.scope_tenant(), ledger.scope_workspace(),
    ledger.budget_window(text, timestamp with time zone),
    ledger.budget_spent(text, numeric, timestamp with time zone, timestamp with time zone) TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, id, mode, kind, status, queued_at, lease_expires_at, run_token, source_run_id,
              not_before, priority, concurrency_key, error_code, updated_at),
      UPDATE (lease_owner) ON ledger.runs TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, id, status, available_at, lease_expires_at, processed_at),
      UPDATE (lease_owner) ON ledger.outbox TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, run_id, status, lease_expires_at, completed_at, updated_at) ON ledger.run_step_tool_calls TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, run_id, status, expires_at, created_at) ON ledger.approval_requests TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, concurrency_key, max_in_flight, max_per_window, window_seconds,
              window_start, window_claims) ON ledger.concurrency_limits TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, served_at) ON ledger.dispatch_turns TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, run_id, period, max_amount, spent, window_start) ON ledger.budgets TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, paused, next_fire_at) ON ledger.schedules TO ledger_dispatcher;
GRANT SELECT (grantee, tenant_id, workspace_id) ON ledger.scope_grants TO ledger_dispatcher;
GRANT SELECT (grantee) ON ledger.scope_bindings TO ledger_dispatcher;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA ledger_dispatch FROM PUBLIC;
GRANT USAGE ON SCHEMA ledger_dispatch TO ledger_owner, ledger_reader;
GRANT EXECUTE ON FUNCTION ledger_dispatch.next_run(text[], text[]),
    ledger_dispatch.due_outbox_events(integer),
    ledger_dispatch.expired_tool_call_scopes(),
    ledger_dispatch.due_schedule_scopes(),
    ledger_dispatch.next_wake(),
    ledger_dispatch.inbox(text, text),
    ledger_dispatch.scope_granted(text, text),
    ledger_dispatch.tenant_granted(text) TO ledger_owner;
-- set_scope runs as its caller.
GRANT EXECUTE ON FUNCTION ledger_dispatch.scope_granted(text, text) TO ledger_reader;

-- An operator is a writer that may also claim runs and outbox events, sweep leases and fire
-- schedules across scopes (any_scope => true).
GRANT ledger_writer TO ledger_operator;
