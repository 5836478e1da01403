-- Creates a step, stamping its start and end when it is created started or finished.
INSERT INTO ledger.run_steps
       (tenant_id, workspace_id, id, run_id, step_key, step_type, node_id,
        status, input_summary, step_no, started_at, ended_at, duration_ms)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
        CASE WHEN $11 OR $12 THEN now() END, CASE WHEN $12 THEN now() END,
        CASE WHEN $12 THEN 0 END)
