-- Locks up to $4 runs finished more than $3 ago, with no open tool call, that nothing refers to.
SELECT coalesce(array_agg(id), '{}') FROM (
    SELECT r.id FROM ledger.runs r
     WHERE r.tenant_id = $1 AND r.workspace_id = $2
       AND r.status IN ('succeeded', 'failed', 'canceled', 'expired')
       AND r.ended_at < now() - $3
       AND NOT EXISTS (SELECT 1 FROM ledger.run_step_tool_calls t
                        WHERE t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id
                          AND t.run_id = r.id
                          AND t.status NOT IN ('succeeded', 'failed', 'rejected'))
       AND NOT EXISTS (SELECT 1 FROM ledger.runs c
                        WHERE c.tenant_id = r.tenant_id AND c.workspace_id = r.workspace_id
                          AND c.id <> r.id
                          AND (c.parent_run_id = r.id OR c.source_run_id = r.id
                               OR c.root_run_id = r.id))
       AND NOT EXISTS (SELECT 1 FROM ledger.tasks k
                        WHERE k.tenant_id = r.tenant_id AND k.workspace_id = r.workspace_id
                          AND k.run_id = r.id)
     ORDER BY r.ended_at, r.id LIMIT $4
       FOR UPDATE OF r SKIP LOCKED) p
