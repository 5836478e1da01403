-- Creates a run, or nothing when its id or its request_id exists; returns the new run's
-- last_seq, which its first events follow.
INSERT INTO ledger.runs
       (tenant_id, workspace_id, id, mode, kind, subject_kind, subject_id,
        subject_version_id, user_id, trace_id, request_id, parent_run_id, source_run_id,
        root_run_id, attempt_no, input_summary, inputs, inputs_sha256, inputs_size_bytes,
        control_action, not_before, priority, concurrency_key)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
        $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23)
ON CONFLICT DO NOTHING
RETURNING last_seq
