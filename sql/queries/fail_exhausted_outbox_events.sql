-- Fails the claimed events $3, whose expired lease was their last attempt, at $4 (the clock).
UPDATE ledger.outbox
   SET status = 'failed', processed_at = $4,
       error_message = 'the lease of attempt ' || attempt_count::text || ' (lease owner '
                       || coalesce(lease_owner, '') || ') expired and no attempts are left',
       lease_owner = NULL, lease_expires_at = NULL
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = ANY($3)
