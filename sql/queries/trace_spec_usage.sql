-- The usage summary of a trace spec: the usage counters of the run's cost entries, summed.
SELECT jsonb_build_object(
           'tokens_prompt', coalesce(sum((x.usage->>'prompt_tokens')::numeric), 0),
           'tokens_completion', coalesce(sum((x.usage->>'completion_tokens')::numeric), 0),
           'embedding_count', coalesce(sum((x.usage->>'embedding_count')::numeric), 0),
           'rerank_count', coalesce(sum((x.usage->>'rerank_count')::numeric), 0),
           'ms_total', coalesce(sum((x.usage->>'latency_ms')::numeric), 0),
           'storage_bytes', coalesce(sum((x.usage->>'storage_bytes')::numeric), 0),
           'request_count', coalesce(sum((x.usage->>'request_count')::numeric), 0),
           'vector_count', coalesce(sum((x.usage->>'vector_count')::numeric), 0))
  FROM ledger.run_cost_entries x
 WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.run_id = $3
