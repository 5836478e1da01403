-- What the evidence rules look at of the run itself, and whether its inputs can be recovered
-- (read back and verified, as ledger.run_inputs and ledger.retry_run do).
SELECT x.id, x.tenant_id, x.workspace_id, x.user_id, x.mode, x.kind, x.subject_kind,
       x.subject_id, x.subject_version_id,
       x.inputs IS NOT NULL OR x.input_summary IS NULL OR EXISTS (
           SELECT 1 FROM ledger.blobs b
            WHERE b.tenant_id = x.tenant_id AND b.workspace_id = x.workspace_id
              AND b.sha256 = x.inputs_sha256 AND b.size_bytes = octet_length(b.content)
              AND b.sha256 = encode(sha256(b.content), 'hex'))
  FROM ledger.runs x
 WHERE x.tenant_id = $1 AND x.workspace_id = $2 AND x.id = $3
