-- Creates the replay $4 of task $3: its type and input, with the snapshot $5.
INSERT INTO ledger.tasks
       (tenant_id, workspace_id, id, task_type, input, snapshot, replayed_from_task_id)
SELECT tenant_id, workspace_id, $4, task_type, input, $5, id FROM ledger.tasks
 WHERE tenant_id = $1 AND workspace_id = $2 AND id = $3
