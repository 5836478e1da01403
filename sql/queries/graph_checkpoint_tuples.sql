-- The checkpoints of scope ($1, $2), newest first: of thread $3, namespace $4, checkpoint $5
-- when given, whose metadata contains $6, older than $7, at most $8; each with the channel values
-- its channel_versions name and its pending writes, as parallel arrays. The page is chosen first,
-- and each value is looked up by its key: the planner cannot know that a checkpoint names only a
-- few channels, and would otherwise hash all the thread's values for every checkpoint (LIMIT 1,
-- the one row of a primary key, keeps the lookup a lateral one).
SELECT c.thread_id, c.checkpoint_ns, c.checkpoint_id, c.parent_checkpoint_id, c.run_id, c.checkpoint, c.metadata,
       b.channels, b.blob_types, b.blobs,
       w.task_ids, w.channels, w.blob_types, w.blobs, w.task_paths
  FROM (SELECT * FROM ledger.graph_checkpoints c
         WHERE c.tenant_id = $1 AND c.workspace_id = $2
           AND ($3::text IS NULL OR c.thread_id = $3)
           AND ($4::text IS NULL OR c.checkpoint_ns = $4)
           AND ($5::text IS NULL OR c.checkpoint_id = $5)
           AND ($6::jsonb IS NULL OR c.metadata @> $6)
           AND ($7::text IS NULL OR c.checkpoint_id < $7)
         ORDER BY c.checkpoint_id DESC, c.thread_id, c.checkpoint_ns
         LIMIT $8) c
 CROSS JOIN LATERAL (
       SELECT coalesce(array_agg(v.channel ORDER BY v.channel), '{}') AS channels,
              coalesce(array_agg(s.blob_type ORDER BY v.channel), '{}') AS blob_types,
              coalesce(array_agg(s.blob ORDER BY v.channel), '{}') AS blobs
         FROM jsonb_each_text(CASE jsonb_typeof(c.checkpoint->'channel_versions')
                                WHEN 'object' THEN c.checkpoint->'channel_versions' ELSE '{}' END)
              AS v (channel, version)
        CROSS JOIN LATERAL (
              SELECT s.blob_type, s.blob FROM ledger.graph_checkpoint_blobs s
               WHERE s.tenant_id = c.tenant_id AND s.workspace_id = c.workspace_id
                 AND s.thread_id = c.thread_id AND s.checkpoint_ns = c.checkpoint_ns
                 AND s.channel = v.channel AND s.version = v.version
               LIMIT 1) s) b
 CROSS JOIN LATERAL (
       SELECT coalesce(array_agg(x.task_id ORDER BY x.task_path, x.task_id, x.idx), '{}') AS task_ids,
              coalesce(array_agg(x.channel ORDER BY x.task_path, x.task_id, x.idx), '{}') AS channels,
              coalesce(array_agg(x.blob_type ORDER BY x.task_path, x.task_id, x.idx), '{}') AS blob_types,
              coalesce(array_agg(x.blob ORDER BY x.task_path, x.task_id, x.idx), '{}') AS blobs,
              coalesce(array_agg(x.task_path ORDER BY x.task_path, x.task_id, x.idx), '{}') AS task_paths
         FROM ledger.graph_checkpoint_writes x
        WHERE x.tenant_id = c.tenant_id AND x.workspace_id = c.workspace_id AND x.thread_id = c.thread_id
          AND x.checkpoint_ns = c.checkpoint_ns AND x.checkpoint_id = c.checkpoint_id) w
 ORDER BY c.checkpoint_id DESC, c.thread_id, c.checkpoint_ns
