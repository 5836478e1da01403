-- ledger: a graph framework's checkpoints (LangGraph's BaseCheckpointSaver), their channel
-- values and pending writes. Runs after schema.sql.
--
-- The state (channel values, writes) is the framework serializer's opaque bytes, stored and
-- returned byte for byte, never redacted; only the metadata is. A channel's value is stored once
-- per (thread, namespace, channel, version), so a long thread does not store its whole state at
-- every step. Foreign key: checkpoints -> runs (the invocation that wrote it, so purge_runs
-- takes them); writes may arrive before their checkpoint and go with it.

CREATE TABLE ledger.graph_checkpoints (
    tenant_id            text NOT NULL,
    workspace_id         text NOT NULL,
    thread_id            text NOT NULL CHECK (thread_id <> ''),
    checkpoint_ns        text NOT NULL DEFAULT '',
    checkpoint_id        text NOT NULL CHECK (checkpoint_id <> ''),
    parent_checkpoint_id text,
    run_id               text NOT NULL,
    checkpoint           jsonb NOT NULL CHECK (jsonb_typeof(checkpoint) = 'object'),
    metadata             jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object'),
    created_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, thread_id, checkpoint_ns, checkpoint_id),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id)
);
CREATE INDEX graph_checkpoints_run_idx ON ledger.graph_checkpoints (tenant_id, workspace_id, run_id);
COMMENT ON TABLE ledger.graph_checkpoints IS 'A graph framework''s checkpoints (LangGraph), per thread and namespace, each tied to the ledger run of the invocation that wrote it. checkpoint is the framework''s checkpoint without its channel values (ids, versions; stored as given); metadata is redacted. Written only through ledger.put_graph_checkpoint, copy_graph_thread; removed by delete_graph_thread, prune_graph_threads, delete_graph_checkpoints_for_runs and purge_runs.';
COMMENT ON COLUMN ledger.graph_checkpoints.checkpoint IS 'The checkpoint without channel_values: its channel_versions name the graph_checkpoint_blobs rows that hold the values.';

CREATE TABLE ledger.graph_checkpoint_blobs (
    tenant_id     text NOT NULL,
    workspace_id  text NOT NULL,
    thread_id     text NOT NULL,
    checkpoint_ns text NOT NULL DEFAULT '',
    channel       text NOT NULL,
    version       text NOT NULL,
    blob_type     text NOT NULL,
    blob          bytea,
    PRIMARY KEY (tenant_id, workspace_id, thread_id, checkpoint_ns, channel, version)
);
COMMENT ON TABLE ledger.graph_checkpoint_blobs IS 'The channel values of graph checkpoints: the serializer''s type and opaque bytes, once per (thread, namespace, channel, version), never redacted. Removed with the last checkpoint of the thread that names the version.';

CREATE TABLE ledger.graph_checkpoint_writes (
    tenant_id     text NOT NULL,
    workspace_id  text NOT NULL,
    thread_id     text NOT NULL,
    checkpoint_ns text NOT NULL DEFAULT '',
    checkpoint_id text NOT NULL,
    task_id       text NOT NULL,
    idx           integer NOT NULL,
    channel       text NOT NULL,
    blob_type     text NOT NULL,
    blob          bytea,
    task_path     text NOT NULL DEFAULT '',
    PRIMARY KEY (tenant_id, workspace_id, thread_id, checkpoint_ns, checkpoint_id, task_id, idx)
);
COMMENT ON TABLE ledger.graph_checkpoint_writes IS 'Pending writes of a graph checkpoint''s tasks: the serializer''s type and opaque bytes, never redacted. Written only through ledger.put_graph_checkpoint_writes, possibly before their checkpoint (the framework stores both concurrently, hence no foreign key); they go with their checkpoint.';

DO $rls$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['graph_checkpoints', 'graph_checkpoint_blobs', 'graph_checkpoint_writes'] LOOP
        EXECUTE format('ALTER TABLE ledger.%I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE ledger.%I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format(
            'CREATE POLICY scope ON ledger.%I USING (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace())'
            ' WITH CHECK (tenant_id = ledger.scope_tenant() AND workspace_id = ledger.scope_workspace())', t);
        EXECUTE format('ALTER TABLE ledger.%I OWNER TO ledger_owner', t);
        PERFORM pg_catalog.pg_extension_config_dump(format('ledger.%I', t)::regclass, '');
    END LOOP;
END
$rls$;
