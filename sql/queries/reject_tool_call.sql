-- Rejects a call whose approval was rejected.
UPDATE ledger.run_step_tool_calls
   SET status = 'rejected', error_code = 'TOOL_APPROVAL_REJECTED',
       error_message = 'Tool call was rejected', completed_at = now(), updated_at = now()
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
