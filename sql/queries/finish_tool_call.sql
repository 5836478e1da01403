-- Records a call's final result (inline, or as an artifact) and releases its lease.
UPDATE ledger.run_step_tool_calls
   SET status = $4, result = $5, result_artifact_id = $6, result_size_bytes = $7,
       result_sha256 = $8, metadata = $9, error_code = $10, error_message = $11,
       lease_owner = NULL, lease_expires_at = NULL, completed_at = now(), updated_at = now()
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
