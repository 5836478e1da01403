-- The record of tool_call_id $4 that the nearest ancestor of run $3 (following source_run_id,
-- in scope) holds under its default key tool:<ancestor>:<tool_call_id>: one walk up the lineage.
WITH RECURSIVE up (id, source_run_id, depth) AS (
    SELECT r.id, r.source_run_id, 0
      FROM ledger.runs r
     WHERE r.tenant_id = $1 AND r.workspace_id = $2 AND r.id = $3
    UNION ALL
    SELECT r.id, r.source_run_id, up.depth + 1
      FROM up
      JOIN ledger.runs r ON r.tenant_id = $1 AND r.workspace_id = $2 AND r.id = up.source_run_id
)
SELECT t.id
  FROM up
  JOIN ledger.run_step_tool_calls t
    ON t.tenant_id = $1 AND t.workspace_id = $2
   AND t.idempotency_key = 'tool:' || up.id || ':' || $4
 WHERE up.depth > 0
 ORDER BY up.depth
 LIMIT 1
