-- Records an artifact of a run.
INSERT INTO ledger.run_artifacts
       (tenant_id, workspace_id, id, run_id, step_id, artifact_type,
        mime, size_bytes, sha256, storage_key, meta)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
