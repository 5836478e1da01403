-- Reports a failed attempt of event $3: back to pending ($4), due at $6 (the clock plus the
-- backoff), or failed at $7 (the clock).
UPDATE ledger.outbox
   SET status = $4, error_message = $5, lease_owner = NULL, lease_expires_at = NULL,
       available_at = CASE WHEN $4 = 'pending' THEN $6 ELSE available_at END,
       processed_at = CASE WHEN $4 = 'failed' THEN $7 END
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
