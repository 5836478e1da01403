-- Fails the claimed events $3, whose expired lease was their last attempt.
UPDATE ledger.outbox
   SET status = 'failed', processed_at = clock_timestamp(),
       error_message = format('the lease of attempt %s (lease owner %s) expired and no attempts are left',
                              attempt_count, lease_owner),
       lease_owner = NULL, lease_expires_at = NULL
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = ANY($3)
