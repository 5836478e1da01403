-- Marks the outbound boundary of a claimed call and renews its lease.
UPDATE ledger.run_step_tool_calls
   SET status = 'running', outbound_started_at = clock_timestamp(),
       lease_expires_at = clock_timestamp() + make_interval(secs => lease_seconds),
       updated_at = now()
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
