-- Moves a call to in_doubt: its lease released, its outcome unknown. lease_owner stays: it names
-- the worker that held the attempt, which is where a person looks first.
UPDATE ledger.run_step_tool_calls
   SET status = 'in_doubt', lease_expires_at = NULL,
       error_code = 'OUTCOME_UNKNOWN', error_message = coalesce($4, error_message),
       updated_at = now()
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
