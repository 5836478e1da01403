-- Starts a new attempt of a call under a fresh lease (of $5 seconds, ending at $7), clearing the
-- last attempt's result.
UPDATE ledger.run_step_tool_calls
   SET status = 'claimed', attempt = attempt + 1, lease_owner = $4,
       lease_seconds = $5, lease_expires_at = $7,
       outbound_started_at = NULL, result = NULL, result_artifact_id = NULL,
       result_size_bytes = NULL, result_sha256 = NULL, metadata = '{}', error_code = NULL,
       error_message = NULL, completed_at = NULL, arguments = $6, updated_at = now()
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
RETURNING attempt
