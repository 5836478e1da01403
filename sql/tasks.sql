-- ledger: tasks, their checkpoints and their events. Runs after schema.sql.
--
-- Foreign keys: tasks -> runs, tasks -> tasks (replay lineage), checkpoints and events -> tasks,
-- outbox -> tasks. No cycle through another table, so pg_dump can order the data.

CREATE TABLE ledger.tasks (
    tenant_id             text NOT NULL,
    workspace_id          text NOT NULL,
    id                    text NOT NULL,
    run_id                text,
    task_type             text NOT NULL CHECK (task_type <> ''),
    status                text NOT NULL DEFAULT 'queued',  -- CHECK: ledger.is_status (lib.rs)
    input                 jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(input) = 'object'),
    progress              jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(progress) = 'object'),
    output                jsonb CHECK (jsonb_typeof(output) = 'object'),
    snapshot              jsonb CHECK (jsonb_typeof(snapshot) = 'object'),
    error_code            text,
    error_message         text CHECK (char_length(error_message) <= 8192),
    attempt_count         integer NOT NULL DEFAULT 1 CHECK (attempt_count >= 1),
    replayed_from_task_id text,
    retried_as_task_id    text,
    last_checkpoint_no    bigint NOT NULL DEFAULT 0 CHECK (last_checkpoint_no >= 0),
    started_at            timestamptz,
    ended_at              timestamptz,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, replayed_from_task_id) REFERENCES ledger.tasks (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, retried_as_task_id) REFERENCES ledger.tasks (tenant_id, workspace_id, id)
);
CREATE INDEX tasks_run_idx ON ledger.tasks (tenant_id, workspace_id, run_id, status) WHERE run_id IS NOT NULL;
CREATE INDEX tasks_status_idx ON ledger.tasks (tenant_id, workspace_id, status, updated_at);
CREATE INDEX tasks_type_idx ON ledger.tasks (tenant_id, workspace_id, task_type, status);
CREATE INDEX tasks_replayed_from_idx ON ledger.tasks (tenant_id, workspace_id, replayed_from_task_id)
    WHERE replayed_from_task_id IS NOT NULL;
COMMENT ON TABLE ledger.tasks IS 'One row per task (a unit of background work, optionally of a run). Same eleven statuses and transitions as runs; see ledger.status_transitions(). Written only through ledger.create_task, transition_task, add_task_checkpoint, set_task_snapshot, retry_task and replay_task.';
COMMENT ON COLUMN ledger.tasks.progress IS 'A JSON object; transition_task merges it by top-level key.';
COMMENT ON COLUMN ledger.tasks.snapshot IS 'The persisted execution snapshot replay_task starts a new task from (redacted, a JSON object).';
COMMENT ON COLUMN ledger.tasks.attempt_count IS 'The attempt this task is on: 1 when created, + 1 on each retry_task.';
COMMENT ON COLUMN ledger.tasks.last_checkpoint_no IS 'The checkpoint_no of the newest checkpoint; bumping it under the row lock makes checkpoint numbers gapless.';
COMMENT ON COLUMN ledger.tasks.retried_as_task_id IS 'The task replay_task created from this one (this one was then canceled).';

CREATE TABLE ledger.task_checkpoints (
    tenant_id     text NOT NULL,
    workspace_id  text NOT NULL,
    id            text NOT NULL,
    task_id       text NOT NULL,
    checkpoint_no bigint NOT NULL CHECK (checkpoint_no >= 1),
    payload       jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(payload) = 'object'),
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    UNIQUE (tenant_id, workspace_id, task_id, checkpoint_no),
    FOREIGN KEY (tenant_id, workspace_id, task_id) REFERENCES ledger.tasks (tenant_id, workspace_id, id)
);
COMMENT ON TABLE ledger.task_checkpoints IS 'Checkpoints of a task, numbered 1, 2, 3, ... without gaps per task. Payloads are redacted. Written only through ledger.add_task_checkpoint.';

CREATE TABLE ledger.task_events (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    id           text NOT NULL,
    task_id      text NOT NULL,
    event_type   text NOT NULL CHECK (event_type <> ''),
    payload      jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(payload) = 'object'),
    -- clock_timestamp, not now(): a transaction that writes several events keeps their order.
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, task_id) REFERENCES ledger.tasks (tenant_id, workspace_id, id)
);
CREATE INDEX task_events_task_idx ON ledger.task_events (tenant_id, workspace_id, task_id, created_at);
COMMENT ON TABLE ledger.task_events IS 'Append-only history of a task: task.created, task.status, task.checkpoint, task.snapshot (written by the ledger) and the caller''s own events (ledger.record_task_event). Payloads are redacted.';

-- The outbox's task.retried rows name their task.
ALTER TABLE ledger.outbox
    ADD FOREIGN KEY (tenant_id, workspace_id, task_id) REFERENCES ledger.tasks (tenant_id, workspace_id, id);

DO $rls$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['tasks', 'task_checkpoints', 'task_events'] LOOP
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
