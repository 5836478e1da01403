-- Writes an outbox row and notifies ledger_outbox with its id (delivered at commit).
WITH o AS (
    INSERT INTO ledger.outbox
           (tenant_id, workspace_id, id, event_type, run_id, task_id, subject, payload)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
    RETURNING id)
SELECT pg_catalog.pg_notify('ledger_outbox', o.id) FROM o
