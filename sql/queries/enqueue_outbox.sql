-- Writes an outbox row.
INSERT INTO ledger.outbox
       (tenant_id, workspace_id, id, event_type, run_id, task_id, subject, payload)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
