-- Rejects a call whose approval was rejected or expired ($4 the error code, $5 its message).
UPDATE ledger.run_step_tool_calls
   SET status = 'rejected', error_code = $4, error_message = $5, completed_at = now(), updated_at = now()
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
