-- Records the decision on an approval: its status, who decided, the note and when.
UPDATE ledger.approval_requests
   SET status = $4, actor = $5, note = $6, decided_at = now(), updated_at = now()
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
