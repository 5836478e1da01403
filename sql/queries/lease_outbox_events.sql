-- Leases the claimed events $3 to $4 for $5 seconds and counts an attempt.
UPDATE ledger.outbox
   SET status = 'processing', lease_owner = $4,
       lease_expires_at = clock_timestamp() + make_interval(secs => $5),
       attempt_count = attempt_count + 1
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = ANY($3)
