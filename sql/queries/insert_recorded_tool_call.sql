-- Records a call already executed (a repeatable tool's outcome, attempt 1, never leased), or
-- nothing when its key or its tool_call_id in the run is taken.
INSERT INTO ledger.run_step_tool_calls
       (tenant_id, workspace_id, id, run_id, step_id, tool_call_id, tool_ref, idempotency_key,
        request_hash, arguments, status, attempt, lease_seconds, result, result_artifact_id,
        result_size_bytes, result_sha256, metadata, error_code, error_message, completed_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 1, $12, $13, $14, $15, $16, $17, $18, $19,
        now())
ON CONFLICT DO NOTHING
RETURNING id
