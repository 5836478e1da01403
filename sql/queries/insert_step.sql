-- Creates a step, numbered after the run's last one (the caller holds the run's lock), stamping
-- its start and end ($12, the transaction's time) when it is created started or finished, with
-- what a finished one holds. An INSERT ... SELECT over the run's steps (an aggregate: always one
-- row), not a subquery in VALUES.
INSERT INTO ledger.run_steps
       (tenant_id, workspace_id, id, run_id, step_key, step_type, node_id,
        status, input_summary, step_no, started_at, ended_at, duration_ms,
        output_summary, metrics, error_code, error_message, error_details)
SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, coalesce(max(s.step_no), 0) + 1,
       CASE WHEN $10 OR $11 THEN $12 END, CASE WHEN $11 THEN $12 END, CASE WHEN $11 THEN 0 END,
       $13, coalesce($14, '{}'), $15, $16, $17
  FROM ledger.run_steps s
 WHERE s.tenant_id = $1 AND s.workspace_id = $2 AND s.run_id = $4
