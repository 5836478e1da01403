-- Reports a failed attempt of event $3: back to pending ($4) after $6 seconds, or failed.
UPDATE ledger.outbox
   SET status = $4, error_message = $5, lease_owner = NULL, lease_expires_at = NULL,
       available_at = CASE WHEN $4 = 'pending' THEN clock_timestamp() + make_interval(secs => $6)
                           ELSE available_at END,
       processed_at = CASE WHEN $4 = 'failed' THEN clock_timestamp() END
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
