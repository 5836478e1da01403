-- Records the resolution of an in-doubt call as an audit event.
INSERT INTO ledger.audit_events
       (tenant_id, workspace_id, id, run_id, step_id, gateway_type, outcome, actor, payload)
VALUES ($1, $2, $3, $4, $5, 'tool_call.resolve', $6, $7, $8)
