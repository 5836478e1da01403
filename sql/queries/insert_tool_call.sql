-- Creates a tool call (claimed under a lease ending at $16, or waiting), or nothing when its key
-- is taken.
INSERT INTO ledger.run_step_tool_calls
       (tenant_id, workspace_id, id, run_id, step_id, tool_call_id,
        tool_ref, idempotency_key, request_hash, arguments, status, attempt, lease_owner,
        lease_seconds, lease_expires_at, approval_id)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, CASE WHEN $12 THEN 1 ELSE 0 END, $13,
        $14, $16, $15)
ON CONFLICT DO NOTHING
RETURNING id
