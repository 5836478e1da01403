-- Records a cost entry, or nothing when its source_ref was recorded before.
INSERT INTO ledger.run_cost_entries
       (tenant_id, workspace_id, id, run_id, step_id, billing_basis,
        billed_quantity, amount, currency, usage, pricing_snapshot, provider, model_ref, tool_ref,
        source_port, operation, source_ref)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)
ON CONFLICT DO NOTHING
RETURNING amount::text
