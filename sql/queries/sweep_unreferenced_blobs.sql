-- Deletes the scope's blobs that no run input and no artifact refers to.
DELETE FROM ledger.blobs b
 WHERE b.tenant_id = $1 AND b.workspace_id = $2
   AND NOT EXISTS (SELECT 1 FROM ledger.runs r
                    WHERE r.tenant_id = b.tenant_id AND r.workspace_id = b.workspace_id
                      AND r.inputs_sha256 = b.sha256)
   AND NOT EXISTS (SELECT 1 FROM ledger.run_artifacts a
                    WHERE a.tenant_id = b.tenant_id AND a.workspace_id = b.workspace_id
                      AND a.storage_key = 'blob:sha256:' || b.sha256)
