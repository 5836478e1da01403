-- Marks the events $3 that $4 holds as done at $5 (the clock); returns how many.
WITH a AS (
    UPDATE ledger.outbox
       SET status = 'done', processed_at = $5,
           lease_owner = NULL, lease_expires_at = NULL
     WHERE tenant_id = $1 AND workspace_id = $2 AND id = ANY($3)
       AND status = 'processing' AND lease_owner = $4
    RETURNING 1)
SELECT count(*)::int FROM a
