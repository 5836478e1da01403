-- What ledger.otel_trace reads about a run ($1, $2 scope, $3 run id), as one JSON document for
-- the pure core (model::otel::Facts). Times in microseconds since the epoch; money as text.
WITH costs AS (
    SELECT c.* FROM ledger.run_cost_entries c
     WHERE c.tenant_id = $1 AND c.workspace_id = $2 AND c.run_id = $3
)
SELECT json_build_object(
    'run', (SELECT json_build_object(
                'run_id', r.id, 'tenant_id', r.tenant_id, 'workspace_id', r.workspace_id,
                'trace_id', r.trace_id, 'request_id', r.request_id,
                'parent_run_id', r.parent_run_id,
                'parent_trace_id', (SELECT p.trace_id FROM ledger.runs p
                                     WHERE p.tenant_id = $1 AND p.workspace_id = $2 AND p.id = r.parent_run_id),
                'source_run_id', r.source_run_id,
                'source_trace_id', (SELECT s.trace_id FROM ledger.runs s
                                     WHERE s.tenant_id = $1 AND s.workspace_id = $2 AND s.id = r.source_run_id),
                'root_run_id', r.root_run_id, 'attempt_no', r.attempt_no, 'mode', r.mode,
                'kind', r.kind, 'subject_kind', r.subject_kind, 'subject_id', r.subject_id,
                'subject_version_id', r.subject_version_id, 'user_id', r.user_id,
                'status', r.status, 'error_code', r.error_code, 'error_message', r.error_message,
                'queued_us', (extract(epoch FROM r.queued_at) * 1000000)::bigint, 'started_us', (extract(epoch FROM r.started_at) * 1000000)::bigint,
                'ended_us', (extract(epoch FROM r.ended_at) * 1000000)::bigint)
              FROM ledger.runs r WHERE r.tenant_id = $1 AND r.workspace_id = $2 AND r.id = $3),
    'steps', (SELECT coalesce(json_agg(json_build_object(
                  'step_id', x.id, 'step_no', x.step_no, 'step_key', x.step_key,
                  'step_type', x.step_type, 'status', x.status,
                  'model', coalesce(x.metrics->>'model', x.metrics->>'model_ref'),
                  'error_code', x.error_code, 'error_message', x.error_message,
                  'created_us', (extract(epoch FROM x.created_at) * 1000000)::bigint, 'started_us', (extract(epoch FROM x.started_at) * 1000000)::bigint,
                  'ended_us', (extract(epoch FROM x.ended_at) * 1000000)::bigint) ORDER BY x.step_no), '[]')
                FROM ledger.run_steps x WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.run_id = $3),
    'tool_calls', (SELECT coalesce(json_agg(json_build_object(
                  'tool_call_record_id', x.id, 'step_id', x.step_id, 'tool_call_id', x.tool_call_id,
                  'tool_ref', x.tool_ref, 'status', x.status, 'attempt', x.attempt,
                  'error_code', x.error_code, 'error_message', x.error_message,
                  'created_us', (extract(epoch FROM x.created_at) * 1000000)::bigint, 'begun_us', (extract(epoch FROM x.outbound_started_at) * 1000000)::bigint,
                  'completed_us', (extract(epoch FROM x.completed_at) * 1000000)::bigint) ORDER BY x.created_at, x.id), '[]')
                FROM ledger.run_step_tool_calls x WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.run_id = $3),
    'usage', (SELECT coalesce(json_agg(json_build_object(
                  'step_id', u.step_id, 'total', u.total, 'entries', u.entries,
                  'prompt_tokens', u.prompt_tokens, 'completion_tokens', u.completion_tokens,
                  'cache_read_tokens', u.cache_read_tokens, 'cache_creation_tokens', u.cache_creation_tokens,
                  'reasoning_tokens', u.reasoning_tokens, 'providers', u.providers, 'models', u.models)), '[]')
                FROM (SELECT step_id, grouping(step_id) = 1 AS total, count(*) AS entries,
                             sum((usage->>'prompt_tokens')::numeric) AS prompt_tokens,
                             sum((usage->>'completion_tokens')::numeric) AS completion_tokens,
                             sum((usage->>'cache_read_tokens')::numeric) AS cache_read_tokens,
                             sum((usage->>'cache_creation_tokens')::numeric) AS cache_creation_tokens,
                             sum((usage->>'reasoning_tokens')::numeric) AS reasoning_tokens,
                             coalesce(array_agg(DISTINCT provider) FILTER (WHERE provider IS NOT NULL), '{}') AS providers,
                             coalesce(array_agg(DISTINCT model_ref) FILTER (WHERE model_ref IS NOT NULL), '{}') AS models
                        FROM costs GROUP BY GROUPING SETS ((step_id), ())) u),
    'money', (SELECT coalesce(json_agg(json_build_object(
                  'step_id', m.step_id, 'total', m.total, 'currency', m.currency, 'amount', m.amount::text)), '[]')
                FROM (SELECT step_id, grouping(step_id) = 1 AS total, currency, sum(amount) AS amount
                        FROM costs WHERE amount IS NOT NULL
                       GROUP BY GROUPING SETS ((step_id, currency), (currency))) m),
    'responses', (SELECT coalesce(json_agg(json_build_object(
                  'response_event_id', x.id, 'step_id', x.step_id, 'event_type', x.event_type,
                  'created_us', (extract(epoch FROM x.created_at) * 1000000)::bigint) ORDER BY x.created_at, x.id), '[]')
                FROM ledger.response_events x WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.run_id = $3),
    'approvals', (SELECT coalesce(json_agg(json_build_object(
                  'approval_id', x.id, 'tool_call_record_id', x.tool_call_record_id, 'step_id', x.step_id,
                  'status', x.status, 'actor', x.actor, 'created_us', (extract(epoch FROM x.created_at) * 1000000)::bigint,
                  'decided_us', (extract(epoch FROM x.decided_at) * 1000000)::bigint) ORDER BY x.created_at, x.id), '[]')
                FROM ledger.approval_requests x WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.run_id = $3),
    'budget_events', (SELECT coalesce(json_agg(json_build_object(
                  'event_type', e.event_type, 'decision', e.payload->>'decision',
                  'subject', e.payload->>'subject', 'level', e.payload->'budget'->>'level',
                  'unit', e.payload->'budget'->>'unit', 'period', e.payload->'budget'->>'period',
                  'max_amount', e.payload->'budget'->>'max_amount', 'spent', e.payload->'budget'->>'spent',
                  'created_us', (extract(epoch FROM e.created_at) * 1000000)::bigint) ORDER BY e.seq), '[]')
                FROM ledger.run_events e WHERE e.tenant_id = $1 AND e.workspace_id = $2 AND e.run_id = $3
                 AND e.event_type IN ('budget.warning', 'budget.exhausted')),
    'now_us', (extract(epoch FROM statement_timestamp()) * 1000000)::bigint)::text
