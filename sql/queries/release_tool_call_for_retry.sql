-- Makes an in-doubt call claimable again, with no lease.
UPDATE ledger.run_step_tool_calls
   SET status = 'claimed', lease_owner = NULL, lease_expires_at = NULL,
       outbound_started_at = NULL, updated_at = now()
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
