-- The ledger's own audit record of tool activity (gateway_type $6: tool_call.claim, .complete,
-- .replay, .resolve, approval.request, approval.decision), one insert.
INSERT INTO ledger.audit_events
       (tenant_id, workspace_id, id, run_id, step_id, gateway_type, outcome, actor, payload)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
