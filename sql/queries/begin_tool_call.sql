-- Marks the outbound boundary of a claimed call ($4, the clock) and renews its lease (to $5).
UPDATE ledger.run_step_tool_calls
   SET status = 'running', outbound_started_at = $4, lease_expires_at = $5,
       updated_at = now()
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
