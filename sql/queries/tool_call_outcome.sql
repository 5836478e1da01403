-- What every tool-call function returns: the outcome $4, the call, its approval and response $5.
SELECT jsonb_build_object(
           'outcome', $4::text,
           'tool_call', to_jsonb(t) - 'tenant_id' - 'workspace_id' - 'result',
           'approval', (SELECT to_jsonb(a) - 'tenant_id' - 'workspace_id'
                          FROM ledger.approval_requests a
                         WHERE a.tenant_id = t.tenant_id AND a.workspace_id = t.workspace_id
                           AND a.id = t.approval_id),
           'response', $5::jsonb)
  FROM ledger.run_step_tool_calls t
 WHERE t.tenant_id = $1 AND t.workspace_id = $2 AND t.id = $3
