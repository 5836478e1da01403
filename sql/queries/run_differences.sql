-- The run a repeated create_run names (by request_id first, else by id), and the fields in which
-- this request differs from the one that created it: the same key must mean the same run. A
-- summary counts only when the caller gave one (the default one is derived from the inputs).
-- The parameters are insert_run.sql's, numbered alike, then $24: the summary the caller gave.
-- When a run may start, its priority and its concurrency key are not compared: they say how to
-- dispatch the run, not which run it is (a repeated request may compute its time anew).
SELECT id, array_remove(ARRAY[
         CASE WHEN mode IS DISTINCT FROM $4 THEN 'mode' END,
         CASE WHEN kind IS DISTINCT FROM $5 THEN 'kind' END,
         CASE WHEN subject_kind IS DISTINCT FROM $6 THEN 'subject_kind' END,
         CASE WHEN subject_id IS DISTINCT FROM $7 THEN 'subject_id' END,
         CASE WHEN subject_version_id IS DISTINCT FROM $8 THEN 'subject_version_id' END,
         CASE WHEN user_id IS DISTINCT FROM $9 THEN 'user_id' END,
         CASE WHEN trace_id IS DISTINCT FROM $10 THEN 'trace_id' END,
         CASE WHEN parent_run_id IS DISTINCT FROM $12 THEN 'parent_run_id' END,
         CASE WHEN source_run_id IS DISTINCT FROM $13 THEN 'source_run_id' END,
         CASE WHEN attempt_no IS DISTINCT FROM $15 THEN 'attempt_no' END,
         CASE WHEN inputs IS DISTINCT FROM $17 OR inputs_sha256 IS DISTINCT FROM $18 THEN 'inputs' END,
         CASE WHEN $24 IS NOT NULL AND input_summary IS DISTINCT FROM $24 THEN 'input_summary' END
       ], NULL)
  FROM ledger.runs
 WHERE tenant_id = $1 AND workspace_id = $2 AND (id = $3 OR request_id = $11)
 ORDER BY request_id IS NOT DISTINCT FROM $11 DESC
 LIMIT 1
