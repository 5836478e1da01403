-- Creates a step, numbered after the run's last one (the caller holds the run's lock), stamping
-- its start and end when it is created started or finished, with what a finished one holds.
INSERT INTO ledger.run_steps
       (tenant_id, workspace_id, id, run_id, step_key, step_type, node_id,
        status, input_summary, step_no, started_at, ended_at, duration_ms,
        output_summary, metrics, error_code, error_message, error_details)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9,
        (SELECT coalesce(max(s.step_no), 0) + 1 FROM ledger.run_steps s
          WHERE s.tenant_id = $1 AND s.workspace_id = $2 AND s.run_id = $4),
        CASE WHEN $10 OR $11 THEN now() END, CASE WHEN $11 THEN now() END,
        CASE WHEN $11 THEN 0 END, $12, coalesce($13, '{}'), $14, $15, $16)
