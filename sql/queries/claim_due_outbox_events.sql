-- Locks up to $3 due events of the scope, oldest first, skipping those another claimer holds.
WITH due AS (
    SELECT id, attempt_count, replay_count FROM ledger.outbox
     WHERE tenant_id = $1 AND workspace_id = $2 AND status IN ('pending', 'processing')
       AND available_at <= (SELECT clock_timestamp())
       AND (status = 'pending' OR lease_expires_at <= (SELECT clock_timestamp()))
     ORDER BY available_at, id LIMIT $3
       FOR UPDATE SKIP LOCKED)
SELECT array_agg(id), array_agg(attempt_count), array_agg(replay_count) FROM due
