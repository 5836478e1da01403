-- Puts a failed event back to pending, due at $4 (the clock), and counts the replay.
UPDATE ledger.outbox
   SET status = 'pending', replay_count = replay_count + 1,
       available_at = $4, lease_owner = NULL, lease_expires_at = NULL,
       processed_at = NULL
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
