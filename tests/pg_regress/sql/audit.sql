-- The function audit (README "Function audit"): every function of the extension, with its
-- volatility, strictness, parallel marking and security, must be in the list below, where each
-- SECURITY DEFINER function has its written reason. A new function, or a changed marking, fails
-- here until it is reviewed and written down.
CREATE TEMP TABLE audit (name text PRIMARY KEY, volatility text, strict boolean, parallel text,
                         security text, reason text NOT NULL CHECK (reason <> ''));
INSERT INTO audit VALUES
-- Pure: no table access, no reason to be anything but INVOKER.
  ('canonical_json',  'immutable', true,  'safe',   'invoker', 'pure function of its argument'),
  ('request_hash',    'immutable', true,  'safe',   'invoker', 'pure function of its argument'),
  ('status_transitions', 'immutable', true, 'safe', 'invoker', 'a constant table'),
  ('is_status',       'immutable', true,  'safe',   'invoker', 'a constant vocabulary; the status CHECKs call it'),
  ('notifier_status', 'stable',    true,  'safe',   'invoker', 'reads shared counters and GUCs, no table; checks the caller is an operator or the owner'),
  ('redact',          'stable',    true,  'safe',   'invoker', 'reads the redaction GUCs'),
  ('scope_tenant',    'stable',    false, 'safe',   'invoker', 'reads a GUC; used by the RLS policies'),
  ('scope_workspace', 'stable',    false, 'safe',   'invoker', 'reads a GUC; used by the RLS policies'),
  ('scope_required',  'stable',    true,  'safe',   'invoker', 'reads the scope GUCs; used by the views'),
  ('set_scope',       'volatile',  false, 'unsafe', 'invoker', 'sets GUCs; a SET clause would undo is_local'),
  ('budget_window',   'immutable', false, 'safe',   'invoker', 'pure: a budget window''s start; budget_usage and the claims call it'),
  ('budget_spent',    'immutable', false, 'safe',   'invoker', 'pure: a budget''s spending in the window of its time argument'),
-- Readers: explicit scope filters, and as ledger_owner forced RLS applies on top of them even
-- when the caller is a superuser or has BYPASSRLS.
  ('events_since',    'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller'),
  ('run_channel',     'stable', false, 'safe', 'definer', 'reader: the channel key, which only ledger_owner reads'),
  ('run_inputs',      'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller'),
  ('get_artifact',    'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller'),
  ('replay_bundle',   'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller'),
  ('run_evidence',    'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller'),
  ('replay_ready',    'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller'),
  ('otel_trace',      'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller'),
  ('next_wake',       'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller; across scopes through ledger_dispatch'),
  ('inbox',           'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller; across scopes through ledger_dispatch'),
  ('graph_checkpoint_tuples', 'stable', false, 'safe', 'definer', 'reader: RLS as ledger_owner under any caller'),
-- Writers: no application role may INSERT, UPDATE or DELETE any table; these functions are the
-- only write path, so the rules (status machine, seq, redaction, fencing) cannot be skipped.
  ('create_run',          'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('transition_run',      'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('claim_run',           'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('heartbeat_run',       'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('release_run',         'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('wait_run',            'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('send_input',          'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('wait_for_input',      'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('wait_for_children',   'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('set_schedule',        'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('pause_schedule',      'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('drop_schedule',       'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('fire_schedules',      'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('set_concurrency_limit', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('set_rate_limit',        'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('set_budget',          'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('retry_run',           'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('replay_run',          'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('create_step',         'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('transition_step',     'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('claim_tool_call',     'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('claim_tool_calls',    'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('begin_tool_call',     'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('heartbeat_tool_call', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('complete_tool_call',  'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('resolve_tool_call',   'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('find_tool_call',      'volatile', false, 'unsafe', 'definer', 'writer: a lookup that writes a re-run''s first reuse'),
  ('record_tool_call',    'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('sweep_tool_calls',    'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('request_tool_approval', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('resolve_approval',    'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('put_artifact',        'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('register_artifact',   'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('record_cost',         'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('record_audit',        'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('record_response_event', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('record_citation',     'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('record_feedback',     'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('create_task',         'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('transition_task',     'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('add_task_checkpoint', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('record_task_event',   'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('set_task_snapshot',   'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('retry_task',          'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('replay_task',         'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('claim_outbox_events', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('ack_outbox_events',   'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('nack_outbox_events',  'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('replay_outbox_event', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('purge_runs',          'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('put_graph_checkpoint', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('put_graph_checkpoint_writes', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('delete_graph_thread', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('copy_graph_thread',   'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('prune_graph_threads', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
  ('delete_graph_checkpoints_for_runs', 'volatile', false, 'unsafe', 'definer', 'writer: the only write path'),
-- Scope grants: only ledger_owner may write ledger.scope_grants and ledger.scope_bindings;
-- EXECUTE for the owner and superusers only.
  ('grant_scope',         'volatile', false, 'unsafe', 'definer', 'owner only: writes the scope grants'),
  ('revoke_scope',        'volatile', false, 'unsafe', 'definer', 'owner only: writes the scope grants'),
  ('unbind_scope',        'volatile', false, 'unsafe', 'definer', 'owner only: writes the scope grants');

CREATE TEMP VIEW actual AS
SELECT p.proname::text AS name,
       CASE p.provolatile WHEN 'i' THEN 'immutable' WHEN 's' THEN 'stable' ELSE 'volatile' END AS volatility,
       p.proisstrict AS strict,
       CASE p.proparallel WHEN 's' THEN 'safe' WHEN 'r' THEN 'restricted' ELSE 'unsafe' END AS parallel,
       CASE WHEN p.prosecdef THEN 'definer' ELSE 'invoker' END AS security
  FROM pg_proc p WHERE p.pronamespace = 'ledger'::regnamespace;

-- Differences from the written audit (none expected).
SELECT coalesce(a.name, w.name) AS name, a.volatility, a.strict, a.parallel, a.security,
       w.volatility AS audit_volatility, w.strict AS audit_strict, w.parallel AS audit_parallel,
       w.security AS audit_security
  FROM actual a FULL JOIN audit w USING (name)
 WHERE (a.volatility, a.strict, a.parallel, a.security)
       IS DISTINCT FROM (w.volatility, w.strict, w.parallel, w.security)
 ORDER BY 1;

-- A reader can execute no writer. (Pinned search_path, COMMENTs, owners and no PUBLIC grants
-- are checked by the #[pg_test]s in src/lib.rs.)
SELECT w.name FROM audit w JOIN pg_proc p ON p.proname = w.name
                           AND p.pronamespace = 'ledger'::regnamespace
 WHERE w.volatility = 'volatile' AND w.name <> 'set_scope'
   AND has_function_privilege('ledger_reader', p.oid, 'EXECUTE')
 ORDER BY 1;

-- The parallel-safe readers give the same answers when a parallel worker runs them (the scope
-- GUCs reach the worker; a SECURITY DEFINER function's SET search_path is allowed there).
SET ROLE ledger_writer;
SELECT ledger.set_scope('acme', 'audit');
SELECT (ledger.create_run('chat', run_id => 'audit-run', inputs => '{"q": "hello"}')).id;
SELECT (ledger.create_step('audit-run', 'llm', step_id => 'audit-step')).id;
SELECT (ledger.transition_step('audit-step', 'running')).status;
SELECT artifact_type FROM ledger.put_artifact('audit-run', convert_to('bytes', 'UTF8'), 'file');
SELECT id AS artifact FROM ledger.run_artifacts WHERE run_id = 'audit-run' \gset
\set readers 'SELECT md5(concat_ws(''|'', string_agg(event_id || seq, '',''), ledger.run_channel(''audit-run''), ledger.run_inputs(''audit-run''), ledger.get_artifact(:''artifact''), ledger.replay_bundle(''audit-run''), ledger.run_evidence(''audit-run''), ledger.replay_ready(''audit-run''), ledger.redact(''{"password": "x"}''))) AS answer FROM ledger.events_since(''audit-run'')'
:readers \gset serial_
SELECT set_config(CASE WHEN current_setting('server_version_num')::int >= 160000
                       THEN 'debug_parallel_query' ELSE 'force_parallel_mode' END, 'on', false)
       IS NOT NULL AS parallel_forced;
-- The plan really runs them in a worker. (No ORDER BY in the aggregate: events_since returns
-- seq order, and PostgreSQL 16 and later would plan a Sort for it that 15 does not show.)
EXPLAIN (COSTS OFF) :readers;
:readers \gset parallel_
SELECT :'serial_answer' = :'parallel_answer' AS same_in_parallel;
