-- The run part of a trace spec: its identity, lineage, subject, status, times and error.
SELECT jsonb_build_object(
           'run_id', x.id, 'tenant_id', x.tenant_id, 'workspace_id', x.workspace_id,
           'trace_id', x.trace_id, 'request_id', x.request_id, 'parent_run_id', x.parent_run_id,
           'source_run_id', x.source_run_id, 'attempt_no', x.attempt_no, 'mode', x.mode,
           'kind', x.kind, 'subject_kind', x.subject_kind, 'subject_id', x.subject_id,
           'subject_version_id', x.subject_version_id, 'status', x.status,
           'input_summary', x.input_summary, 'output_summary', x.output_summary,
           'started_at', x.started_at, 'ended_at', x.ended_at, 'duration_ms', x.duration_ms,
           'error_code', x.error_code, 'error_message', x.error_message,
           'error_step_id', x.error_step_id)
  FROM ledger.runs x
 WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.id = $3
