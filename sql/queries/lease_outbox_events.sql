-- Leases the claimed events $3 to $4 until $5 and counts an attempt.
UPDATE ledger.outbox
   SET status = 'processing', lease_owner = $4,
       lease_expires_at = $5,
       attempt_count = attempt_count + 1
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = ANY($3)
