-- Keeps the identity of every tool call of the runs $3 as a tombstone.
INSERT INTO ledger.tool_call_tombstones
       (tenant_id, workspace_id, idempotency_key, tool_ref, request_hash,
        status, tool_call_record_id, tool_call_id, run_id, completed_at)
SELECT tenant_id, workspace_id, idempotency_key, tool_ref, request_hash,
       status, id, tool_call_id, run_id, completed_at
  FROM ledger.run_step_tool_calls
 WHERE tenant_id = $1 AND workspace_id = $2 AND run_id = ANY($3)
ON CONFLICT DO NOTHING
