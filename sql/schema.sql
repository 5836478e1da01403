-- ledger: tables, row-level security and roles. Runs first (bootstrap); the schema itself is
-- created by CREATE EXTENSION from the control file.
--
-- Security model: application roles get SELECT only; every write goes through the ledger
-- functions, which are SECURITY DEFINER and owned by the non-superuser role ledger_owner.
-- FORCE ROW LEVEL SECURITY makes the policies apply to that owner too, so a function can never
-- touch another scope's row either.

DO $roles$
BEGIN
    -- Roles are cluster-wide: a second database installing the extension finds them present.
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'ledger_owner') THEN
        CREATE ROLE ledger_owner NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'ledger_reader') THEN
        CREATE ROLE ledger_reader NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'ledger_writer') THEN
        CREATE ROLE ledger_writer NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'ledger_operator') THEN
        CREATE ROLE ledger_operator NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'ledger_dispatcher') THEN
        CREATE ROLE ledger_dispatcher NOLOGIN;
    END IF;
END
$roles$;

-- The scope predicate every policy uses. NULL when no scope is set, so nothing matches.
-- C functions of this library (src/scope.rs), so that a policy's first use loads the library:
-- its check hooks then drop a scope the session set by hand before it loaded (only set_scope
-- states a scope), and no such value ever reaches a policy. No SET clause: they resolve no
-- names, and a SET clause would make every evaluation switch search_path.
CREATE FUNCTION ledger.scope_tenant() RETURNS text LANGUAGE c STABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'scope_tenant_wrapper';
CREATE FUNCTION ledger.scope_workspace() RETURNS text LANGUAGE c STABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'scope_workspace_wrapper';
COMMENT ON FUNCTION ledger.scope_tenant() IS 'The tenant of the current ledger scope (GUC ledger.tenant_id), NULL when unset. Used by every row-level security policy.';
COMMENT ON FUNCTION ledger.scope_workspace() IS 'The workspace of the current ledger scope (GUC ledger.workspace_id), NULL when unset. Used by every row-level security policy.';

CREATE TABLE ledger.blobs (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    sha256       text NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    size_bytes   bigint NOT NULL CHECK (size_bytes >= 0),
    content      bytea NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, sha256)
);
COMMENT ON TABLE ledger.blobs IS 'Content-addressed bytes, one row per distinct content per scope (no cross-scope dedup: it would leak existence). Holds large run inputs and, later, artifacts.';

CREATE TABLE ledger.blob_locks (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    PRIMARY KEY (tenant_id, workspace_id)
);
COMMENT ON TABLE ledger.blob_locks IS 'One row per scope that has blobs, locked by the functions alone: blob writers take it FOR KEY SHARE, the purge''s sweep of unreferenced blobs FOR UPDATE SKIP LOCKED, so a blob a transaction is about to reference is never swept. No role but ledger_owner has any privilege on it, so no one else can take or watch these locks.';

CREATE TABLE ledger.runs (
    tenant_id          text NOT NULL,
    workspace_id       text NOT NULL,
    id                 text NOT NULL,
    mode               text NOT NULL,
    kind               text NOT NULL,
    subject_kind       text NOT NULL,
    subject_id         text,
    subject_version_id text,
    user_id            text,
    trace_id           text,
    request_id         text,
    parent_run_id      text,
    source_run_id      text,
    root_run_id        text NOT NULL,
    attempt_no         integer NOT NULL DEFAULT 1 CHECK (attempt_no >= 1),
    control_action     text CHECK (control_action IN ('retry', 'replay')),
    status             text NOT NULL DEFAULT 'queued',  -- CHECK: ledger.is_status (lib.rs)
    input_summary      text CHECK (char_length(input_summary) <= 8192),
    inputs             jsonb,
    inputs_sha256      text,
    inputs_size_bytes  bigint,
    output_summary     text CHECK (char_length(output_summary) <= 8192),
    error_code         text,
    error_message      text CHECK (char_length(error_message) <= 8192),
    error_step_id      text,
    last_seq           bigint NOT NULL DEFAULT 0,
    queued_at          timestamptz NOT NULL DEFAULT now(),
    started_at         timestamptz,
    ended_at           timestamptz,
    duration_ms        bigint,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    lease_owner        text,
    lease_expires_at   timestamptz,
    lease_seconds      integer CHECK (lease_seconds BETWEEN 1 AND 86400),
    run_token          bigint NOT NULL DEFAULT 0 CHECK (run_token >= 0),
    -- No CHECK on priority (-1000 to 1000): create_run checks it, and a CHECK is parsed again at
    -- every update of the row (about four per tool call).
    not_before         timestamptz,
    priority           integer NOT NULL DEFAULT 0,
    concurrency_key    text,
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, parent_run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, source_run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, root_run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, inputs_sha256) REFERENCES ledger.blobs (tenant_id, workspace_id, sha256),
    CHECK (inputs IS NULL OR inputs_sha256 IS NULL)
);
CREATE UNIQUE INDEX runs_request_id_key ON ledger.runs (tenant_id, workspace_id, request_id)
    WHERE request_id IS NOT NULL;
CREATE INDEX runs_parent_idx ON ledger.runs (tenant_id, workspace_id, parent_run_id) WHERE parent_run_id IS NOT NULL;
CREATE INDEX runs_source_idx ON ledger.runs (tenant_id, workspace_id, source_run_id) WHERE source_run_id IS NOT NULL;
CREATE INDEX runs_root_idx ON ledger.runs (tenant_id, workspace_id, root_run_id, attempt_no);
CREATE INDEX runs_subject_idx ON ledger.runs (tenant_id, workspace_id, subject_kind, subject_id, created_at);
CREATE INDEX runs_status_idx ON ledger.runs (tenant_id, workspace_id, status, updated_at);
COMMENT ON TABLE ledger.runs IS 'One row per run. status is one of queued, preparing, running, waiting_input, waiting_approval, paused, retrying, succeeded, failed, canceled, expired; see ledger.status_transitions(). Written only through ledger.create_run and ledger.transition_run.';
COMMENT ON COLUMN ledger.runs.inputs IS 'The exact inputs when their JSON text is at most 8192 bytes; larger inputs live in ledger.blobs (inputs_sha256). Read them with ledger.run_inputs(run_id).';
COMMENT ON COLUMN ledger.runs.last_seq IS 'The seq of the newest event in ledger.run_events; bumping it under the row lock makes seq gapless and commit-ordered.';
COMMENT ON COLUMN ledger.runs.not_before IS 'ledger.claim_run does not hand the run out before this time (create_run''s, retry_run''s or replay_run''s not_before, or wait_run''s wake_at); NULL: at once.';
COMMENT ON COLUMN ledger.runs.priority IS 'ledger.claim_run hands out the highest priority first (-1000 to 1000, default 0; a retry or replay keeps its source''s), oldest first within one priority.';
COMMENT ON COLUMN ledger.runs.concurrency_key IS 'The key the run shares a limit with (ledger.set_concurrency_limit: at most so many runs of the key in flight); NULL: none. A retry or replay keeps its source''s.';
COMMENT ON COLUMN ledger.runs.root_run_id IS 'The first run of a retry/replay chain (itself when the run has no source).';
-- Claiming a run (ledger.claim_run) scans the scope's live runs by priority, oldest first; the
-- operator's claim across scopes scans them all.
CREATE INDEX runs_live_idx ON ledger.runs (tenant_id, workspace_id, priority DESC, queued_at, id)
    WHERE status NOT IN ('succeeded', 'failed', 'canceled', 'expired');
CREATE INDEX runs_live_dispatch_idx ON ledger.runs (priority DESC, queued_at, id)
    WHERE status NOT IN ('succeeded', 'failed', 'canceled', 'expired');
-- A claim counts the runs of a concurrency key in flight: only leased runs have a lease end (a
-- release and a terminal status clear it), so a burst of queued runs is not in this index.
CREATE INDEX runs_concurrency_idx ON ledger.runs (tenant_id, workspace_id, concurrency_key, lease_expires_at)
    WHERE concurrency_key IS NOT NULL AND lease_expires_at IS NOT NULL;
-- An idle worker asks when the next wait ends (ledger.next_wake), in its scope or across scopes:
-- only live runs given a wake time (a wait, a backoff) are here.
CREATE INDEX runs_wake_idx ON ledger.runs (tenant_id, workspace_id, not_before)
    WHERE not_before IS NOT NULL AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired');
CREATE INDEX runs_wake_dispatch_idx ON ledger.runs (not_before)
    WHERE not_before IS NOT NULL AND status NOT IN ('succeeded', 'failed', 'canceled', 'expired');
-- The operator console lists a scope's runs newest first with keyset paging on (created_at, id):
-- all of them, by status, or by user; each page is one short index scan at any number of runs.
CREATE INDEX runs_created_idx ON ledger.runs (tenant_id, workspace_id, created_at, id);
CREATE INDEX runs_status_created_idx ON ledger.runs (tenant_id, workspace_id, status, created_at, id);
CREATE INDEX runs_user_created_idx ON ledger.runs (tenant_id, workspace_id, user_id, created_at, id)
    WHERE user_id IS NOT NULL;
COMMENT ON COLUMN ledger.runs.lease_owner IS 'The worker that claimed the run (ledger.claim_run); NULL when no one ever did or the owner released it.';
COMMENT ON COLUMN ledger.runs.lease_expires_at IS 'When the owner''s lease ends unless ledger.heartbeat_run extends it; NULL when released or the run is terminal. An expired lease lets another worker take the run over.';
COMMENT ON COLUMN ledger.runs.run_token IS 'The fencing token: + 1 on every claim. Writes that carry a run_token must carry this one while the owner holds the run (40001 LEASE_STALE otherwise).';

CREATE TABLE ledger.run_steps (
    tenant_id      text NOT NULL,
    workspace_id   text NOT NULL,
    id             text NOT NULL,
    run_id         text NOT NULL,
    step_key       text,
    step_type      text NOT NULL,
    node_id        text,
    status         text NOT NULL DEFAULT 'queued',  -- CHECK: ledger.is_status (lib.rs)
    input_summary  text CHECK (char_length(input_summary) <= 8192),
    output_summary text CHECK (char_length(output_summary) <= 8192),
    metrics        jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metrics) = 'object'),
    error_code     text,
    error_message  text CHECK (char_length(error_message) <= 8192),
    error_details  jsonb,
    started_at     timestamptz,
    ended_at       timestamptz,
    duration_ms    bigint,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- Creation order within a run: 1, 2, 3, ... (ids never order anything).
    step_no        bigint NOT NULL,
    PRIMARY KEY (tenant_id, workspace_id, id),
    UNIQUE (tenant_id, workspace_id, run_id, step_no),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id)
);
COMMENT ON TABLE ledger.run_steps IS 'Steps of a run (llm, retrieval, tool, workflow_node, ...). Same statuses as runs plus skipped. Written only through ledger.create_step and ledger.transition_step.';
-- A caller finds its step again by key: ledger.create_step with a known step_key returns it.
CREATE UNIQUE INDEX run_steps_step_key_idx ON ledger.run_steps (tenant_id, workspace_id, run_id, step_key)
    WHERE step_key IS NOT NULL;

-- runs.error_step_id is checked by ledger.transition_run, not by a foreign key: one would make
-- runs and run_steps a foreign-key cycle, and pg_dump could no longer order their data so that
-- pg_restore loads it.

CREATE TABLE ledger.run_events (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    id           text NOT NULL,
    run_id       text NOT NULL,
    seq          bigint NOT NULL CHECK (seq >= 1),
    event_type   text NOT NULL,
    step_id      text,
    payload      jsonb NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    UNIQUE (tenant_id, workspace_id, run_id, seq)
);
-- No foreign keys on the feed and the audit records (the two append-only logs), unlike every
-- other table: only the ledger's functions write them, after locking the run they name and
-- reading the step (rows::lock_owner, feed::append), and purge_runs locks a run before deleting
-- its rows, so the run and step always exist. Their checks were 20 of a tool call's 68 nested
-- statements and about 9 % of its backend CPU (BENCHMARKS.md, "Targets").
COMMENT ON TABLE ledger.run_events IS 'The per-run change feed (catch-up, replay #2). seq is gapless per run and follows commit order. Read it with ledger.events_since.';

CREATE TABLE ledger.outbox (
    tenant_id        text NOT NULL,
    workspace_id     text NOT NULL,
    id               text NOT NULL,
    event_type       text NOT NULL,
    run_id           text,
    task_id          text,
    subject          text,
    payload          jsonb NOT NULL DEFAULT '{}',
    status           text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'processing', 'done', 'failed')),
    available_at     timestamptz NOT NULL DEFAULT now(),
    attempt_count    integer NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_expires_at timestamptz,
    error_message    text,
    replay_count     integer NOT NULL DEFAULT 0,
    occurred_at      timestamptz NOT NULL DEFAULT now(),
    processed_at     timestamptz,
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id)
);
CREATE INDEX outbox_due_idx ON ledger.outbox (tenant_id, workspace_id, status, available_at);
CREATE INDEX outbox_claim_idx ON ledger.outbox (tenant_id, workspace_id, available_at, id) WHERE status IN ('pending', 'processing');
COMMENT ON TABLE ledger.outbox IS 'Transactional outbox: facts for other systems, written in the same transaction as the fact (run.created, terminal run.status.updated, ...). Each insert notifies channel ledger_outbox.';

-- What the outbox functions return: an event as its consumer sees it, without the lease holder.
CREATE TYPE ledger.outbox_event AS (
    tenant_id        text,
    workspace_id     text,
    id               text,
    event_type       text,
    run_id           text,
    task_id          text,
    subject          text,
    payload          jsonb,
    status           text,
    attempt_count    integer,
    replay_count     integer,
    available_at     timestamptz,
    lease_expires_at timestamptz,
    error_message    text,
    occurred_at      timestamptz,
    processed_at     timestamptz
);
COMMENT ON TYPE ledger.outbox_event IS 'An outbox event as ledger.claim_outbox_events, nack_outbox_events and replay_outbox_event return it: the ledger.outbox row without its lease holder. lease_expires_at is when a claim''s lease ends; error_message is the last failed delivery''s.';
ALTER TYPE ledger.outbox_event OWNER TO ledger_owner;

-- What ledger.claim_run returns: the claimed run with its scope, its token and what a worker
-- resuming it needs.
CREATE TYPE ledger.claimed_run AS (
    tenant_id        text,
    workspace_id     text,
    run_id           text,
    run_token        bigint,
    lease_owner      text,
    lease_expires_at timestamptz,
    takeover         boolean,
    previous_owner   text,
    status           text,
    mode             text,
    kind             text,
    attempt_no       integer,
    source_run_id    text,
    inputs           jsonb,
    steps            jsonb,
    tool_calls       jsonb,
    approvals        jsonb,
    last_event_id    text
);
COMMENT ON TYPE ledger.claimed_run IS 'A run as ledger.claim_run hands it to a worker: its scope, run_token (the fencing token to pass to the writes), the lease, whether it was taken over from previous_owner, the run''s status and labels, its inputs (ledger.run_inputs), its steps [{id, step_key, step_type, status}], tool calls [{id, tool_call_id, idempotency_key, tool_ref, status, attempt}] and pending approvals [{id, tool_call_record_id}] in creation order, and last_event_id (the cursor for ledger.events_since).';
ALTER TYPE ledger.claimed_run OWNER TO ledger_owner;

CREATE TABLE ledger.run_artifacts (
    tenant_id     text NOT NULL,
    workspace_id  text NOT NULL,
    id            text NOT NULL,
    run_id        text NOT NULL,
    step_id       text,
    artifact_type text NOT NULL CHECK (artifact_type IN ('file', 'log', 'blob', 'json')),
    mime          text,
    size_bytes    bigint NOT NULL CHECK (size_bytes >= 0),
    sha256        text NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    storage_key   text NOT NULL CHECK (storage_key <> ''),
    meta          jsonb NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, step_id) REFERENCES ledger.run_steps (tenant_id, workspace_id, id)
);
CREATE INDEX run_artifacts_run_idx ON ledger.run_artifacts (tenant_id, workspace_id, run_id, created_at);
COMMENT ON TABLE ledger.run_artifacts IS 'Files, logs, blobs and JSON documents of a run; immutable. storage_key blob:sha256:<hex> means the bytes are in ledger.blobs (read them, verified, with ledger.get_artifact); any other key is a URI of an external store.';

CREATE TABLE ledger.approval_requests (
    tenant_id      text NOT NULL,
    workspace_id   text NOT NULL,
    id             text NOT NULL,
    run_id         text NOT NULL,
    step_id        text,
    tool_call_record_id text,
    status         text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'approved', 'rejected', 'expired', 'canceled')),
    title          text,
    policy_ref     text,
    details        jsonb NOT NULL DEFAULT '{}',
    actor          text,
    note           text,
    decided_at     timestamptz,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    expires_at     timestamptz,
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, step_id) REFERENCES ledger.run_steps (tenant_id, workspace_id, id)
);
CREATE INDEX approval_requests_status_idx ON ledger.approval_requests (tenant_id, workspace_id, status, created_at);
-- The sweep finds the pending approvals whose deadline passed (few: most approvals have none).
CREATE INDEX approval_requests_expiry_idx ON ledger.approval_requests (expires_at)
    WHERE status = 'pending' AND expires_at IS NOT NULL;
COMMENT ON TABLE ledger.approval_requests IS 'Human approvals a tool call waits for (status pending, approved, rejected, expired, canceled). Created by ledger.request_tool_approval, decided by ledger.resolve_approval; a pending approval past its expires_at is expired by ledger.sweep_tool_calls or by the next claim of its call, and no one may decide it any more.';

CREATE TABLE ledger.run_step_tool_calls (
    tenant_id           text NOT NULL,
    workspace_id        text NOT NULL,
    id                  text NOT NULL,
    run_id              text NOT NULL,
    step_id             text NOT NULL,
    tool_call_id        text NOT NULL,
    tool_ref            text NOT NULL,
    idempotency_key     text NOT NULL,
    request_hash        text NOT NULL CHECK (request_hash ~ '^[0-9a-f]{64}$'),
    arguments           jsonb NOT NULL DEFAULT '{}',
    status              text NOT NULL,  -- CHECK: ledger.is_status (lib.rs)
    attempt             bigint NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    lease_owner         text,
    lease_seconds       integer NOT NULL CHECK (lease_seconds >= 1),
    lease_expires_at    timestamptz,
    outbound_started_at timestamptz,
    result              jsonb,
    result_artifact_id  text,
    result_size_bytes   bigint,
    result_sha256       text,
    metadata            jsonb NOT NULL DEFAULT '{}',
    error_code          text,
    error_message       text CHECK (char_length(error_message) <= 8192),
    approval_id         text,
    completed_at        timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    UNIQUE (tenant_id, workspace_id, step_id),
    UNIQUE (tenant_id, workspace_id, run_id, tool_call_id),
    UNIQUE (tenant_id, workspace_id, idempotency_key),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, step_id) REFERENCES ledger.run_steps (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, result_artifact_id) REFERENCES ledger.run_artifacts (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, approval_id) REFERENCES ledger.approval_requests (tenant_id, workspace_id, id)
);
-- The calls not finished yet (completed_at NULL): what a sweep looks for expired leases in and
-- what the in-doubt view lists. No column that begin, heartbeat or a sweep's release changes is
-- in an index, so those updates are HOT (no new index entries).
CREATE INDEX run_step_tool_calls_open_idx ON ledger.run_step_tool_calls (tenant_id, workspace_id, id)
    WHERE completed_at IS NULL;
COMMENT ON TABLE ledger.run_step_tool_calls IS 'Durable tool-call records (one per tool step): claim, lease and attempt (the fencing token), the redacted arguments and canonical request_hash, the result (inline up to 8192 bytes, else an artifact) and the in_doubt status for calls whose request may have left without an answer. Statuses: waiting_approval, claimed, running, succeeded, failed, in_doubt, rejected.';
COMMENT ON COLUMN ledger.run_step_tool_calls.attempt IS 'The fencing token: every begin, heartbeat and complete must carry the current attempt (40001 LEASE_STALE otherwise).';
COMMENT ON COLUMN ledger.run_step_tool_calls.arguments IS 'The arguments after redaction, or {truncated, size_bytes, request_hash, argument_names} when their redacted canonical JSON exceeds 8192 bytes.';

CREATE TABLE ledger.tool_call_tombstones (
    tenant_id           text NOT NULL,
    workspace_id        text NOT NULL,
    idempotency_key     text NOT NULL,
    tool_ref            text NOT NULL,
    request_hash        text NOT NULL,
    status              text NOT NULL,
    tool_call_record_id text NOT NULL,
    tool_call_id        text NOT NULL,
    run_id              text NOT NULL,
    completed_at        timestamptz,
    purged_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, idempotency_key)
);
COMMENT ON TABLE ledger.tool_call_tombstones IS 'The idempotency keys of tool calls whose runs were purged, with their identity and final status, so that a late duplicate gets outcome purged instead of executing again. run_id names a run that no longer exists (no foreign key).';

CREATE TABLE ledger.audit_events (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    id           text NOT NULL,
    run_id       text,
    step_id      text,
    gateway_type text NOT NULL,
    outcome      text NOT NULL,
    actor        text,
    payload      jsonb NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- No foreign keys: see ledger.run_events.
    PRIMARY KEY (tenant_id, workspace_id, id)
);
CREATE INDEX audit_events_run_idx ON ledger.audit_events (tenant_id, workspace_id, run_id, created_at);
COMMENT ON TABLE ledger.audit_events IS 'Audit records: governance decisions and human interventions (ledger.record_audit), and the tool activity the ledger records itself: gateway_type tool_call.claim, tool_call.complete, tool_call.resolve (an in-doubt call resolved), tool_call.replay (a re-run reused a result), approval.request, approval.decision and outbox.replay (ledger.replay_outbox_event by a named person). Payloads are redacted.';

CREATE TABLE ledger.run_cost_entries (
    tenant_id        text NOT NULL,
    workspace_id     text NOT NULL,
    id               text NOT NULL,
    run_id           text NOT NULL,
    step_id          text,
    billing_basis    text NOT NULL CHECK (billing_basis <> ''),
    billed_quantity  numeric NOT NULL CHECK (billed_quantity >= 0),
    amount           numeric CHECK (amount >= 0),
    currency         text CHECK (currency ~ '^[A-Z][A-Z0-9_]{1,15}$'),
    usage            jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(usage) = 'object'),
    pricing_snapshot jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(pricing_snapshot) = 'object'),
    provider         text,
    model_ref        text,
    tool_ref         text,
    source_port      text,
    operation        text,
    source_ref       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, step_id) REFERENCES ledger.run_steps (tenant_id, workspace_id, id),
    CHECK (amount IS NULL OR currency IS NOT NULL)
);
CREATE UNIQUE INDEX run_cost_entries_source_ref_key ON ledger.run_cost_entries (tenant_id, workspace_id, source_ref)
    WHERE source_ref IS NOT NULL;
CREATE INDEX run_cost_entries_run_idx ON ledger.run_cost_entries (tenant_id, workspace_id, run_id, created_at);
COMMENT ON TABLE ledger.run_cost_entries IS 'Cost and usage entries of a run. Money is numeric, never float, and never summed across currencies. usage keys: prompt_tokens, completion_tokens, total_tokens, cache_read_tokens, cache_creation_tokens, reasoning_tokens, latency_ms, request_count, embedding_count, rerank_count, vector_count, storage_bytes. source_ref is idempotent per scope.';

CREATE TABLE ledger.response_events (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    id           text NOT NULL,
    run_id       text NOT NULL,
    step_id      text,
    event_type   text NOT NULL CHECK (event_type <> ''),
    payload      jsonb NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, step_id) REFERENCES ledger.run_steps (tenant_id, workspace_id, id)
);
CREATE INDEX response_events_run_idx ON ledger.response_events (tenant_id, workspace_id, run_id, created_at);
COMMENT ON TABLE ledger.response_events IS 'What a chat or agent run said to its user, event by event (message, delta, tool output shown, ...). Payloads are redacted.';

CREATE TABLE ledger.citations (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    id           text NOT NULL,
    run_id       text NOT NULL,
    step_id      text,
    citation     jsonb NOT NULL CHECK (jsonb_typeof(citation) = 'object'),
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, step_id) REFERENCES ledger.run_steps (tenant_id, workspace_id, id)
);
CREATE INDEX citations_run_idx ON ledger.citations (tenant_id, workspace_id, run_id, created_at);
COMMENT ON TABLE ledger.citations IS 'Knowledge a run cited (chunk_id, document_id, knowledge_id, ...). Redacted.';

CREATE TABLE ledger.run_feedback (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    id           text NOT NULL,
    run_id       text NOT NULL,
    rating       integer NOT NULL,
    category     text NOT NULL DEFAULT 'general' CHECK (category <> ''),
    comment      text CHECK (char_length(comment) <= 8192),
    user_id      text,
    metadata     jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object'),
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id)
);
CREATE INDEX run_feedback_run_idx ON ledger.run_feedback (tenant_id, workspace_id, run_id, created_at);
COMMENT ON TABLE ledger.run_feedback IS 'Ratings and comments people gave a run.';

-- Concurrency limits: at most max_in_flight runs of a key hold a live lease, and at most
-- max_per_window claims of its runs fall in one window of window_seconds (ledger.claim_run skips
-- the key's runs while either is full). A claim under a limit locks its row (SKIP LOCKED: a
-- claim never waits), counts and stamps it, so two claims cannot both take the last place.
CREATE TABLE ledger.concurrency_limits (
    tenant_id       text NOT NULL,
    workspace_id    text NOT NULL,
    concurrency_key text NOT NULL,
    max_in_flight   integer CHECK (max_in_flight BETWEEN 0 AND 100000),
    claimed_at      timestamptz,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    max_per_window  integer CHECK (max_per_window BETWEEN 0 AND 1000000),
    window_seconds  integer CHECK (window_seconds BETWEEN 1 AND 86400),
    window_start    timestamptz,
    window_claims   integer NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, workspace_id, concurrency_key),
    CONSTRAINT concurrency_limits_some_limit CHECK (max_in_flight IS NOT NULL OR max_per_window IS NOT NULL),
    CONSTRAINT concurrency_limits_rate CHECK ((max_per_window IS NULL) = (window_seconds IS NULL))
);
COMMENT ON TABLE ledger.concurrency_limits IS 'Limits of a concurrency_key (ledger.runs.concurrency_key): at most max_in_flight of its runs hold a live lease at once (ledger.set_concurrency_limit), and at most max_per_window claims of its runs in each window of window_seconds (ledger.set_rate_limit; a window starts at the first claim after the last one ended: window_start, window_claims so far). ledger.claim_run skips the key''s runs while either is full (0 pauses the key). claimed_at: the last claim under the limits. Written only through those functions and claim_run.';

-- The input mailbox: inputs sent to a run by key (ledger.send_input), and the keys its worker
-- waits for (ledger.wait_for_input). One row per run and key: a wait creates it without a
-- payload, the input fills it. payload is redacted; payload_sha256 hashes the input as sent, so
-- the same key sent again is recognised (or refused with another payload).
CREATE TABLE ledger.run_mailbox (
    tenant_id      text NOT NULL,
    workspace_id   text NOT NULL,
    id             text NOT NULL,
    run_id         text NOT NULL,
    input_key      text NOT NULL,
    payload        jsonb,
    payload_sha256 text,
    sender         text,
    received_at    timestamptz,
    waited_at      timestamptz,
    wait_deadline  timestamptz,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id),
    UNIQUE (tenant_id, workspace_id, run_id, input_key),
    FOREIGN KEY (tenant_id, workspace_id, run_id) REFERENCES ledger.runs (tenant_id, workspace_id, id),
    CHECK ((received_at IS NULL) = (payload_sha256 IS NULL))
);
COMMENT ON TABLE ledger.run_mailbox IS 'Inputs sent to runs by key (ledger.send_input: payload redacted, sender, received_at) and the keys their workers wait for (ledger.wait_for_input: waited_at, wait_deadline). One row per run and input_key. Written only through those functions.';

-- Schedules: a cron expression read in a time zone creates a run at each firing
-- (ledger.fire_schedules, driven by pg_cron or a worker). next_fire_at is the next firing still
-- to run; a firing's run has request_id schedule:<id>:<firing in UTC>, so a firing creates one run
-- whoever fires it and however often. inputs are stored redacted, as the runs get them.
CREATE TABLE ledger.schedules (
    tenant_id       text NOT NULL,
    workspace_id    text NOT NULL,
    id              text NOT NULL,
    cron            text NOT NULL,
    time_zone       text NOT NULL,
    mode            text NOT NULL,
    kind            text,
    inputs          jsonb,
    priority        integer NOT NULL DEFAULT 0,
    concurrency_key text,
    catch_up        text NOT NULL CHECK (catch_up IN ('latest', 'all')),
    paused          boolean NOT NULL DEFAULT false,
    next_fire_at    timestamptz,
    last_fired_at   timestamptz,
    last_run_id     text,
    updated_by      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, workspace_id, id)
);
-- The sweep finds the due schedules of every scope (few rows: one per schedule).
CREATE INDEX schedules_due_idx ON ledger.schedules (next_fire_at) WHERE NOT paused;
COMMENT ON TABLE ledger.schedules IS 'Named schedules (ledger.set_schedule): a cron expression in time_zone creates a run of mode, kind and inputs (redacted) at each firing, through ledger.fire_schedules. next_fire_at: the next firing still to run (NULL: the expression names no later time); catch_up: what a sweep does with firings missed while none ran (latest: one run for the most recent; all: one per firing, at most 100 per sweep). A paused schedule fires nothing, and its firings while paused are skipped.';

-- Turns of the operator's claim across scopes (claim_run with any_scope): when each scope was last
-- served, so the scope served longest ago goes first and one scope's burst cannot hold up another.
CREATE TABLE ledger.dispatch_turns (
    tenant_id    text NOT NULL,
    workspace_id text NOT NULL,
    served_at    timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, workspace_id)
);
COMMENT ON TABLE ledger.dispatch_turns IS 'When claim_run(any_scope => true) last served each scope (picked one of its runs); the claim across scopes looks at the scope served longest ago (or never) first. Written only by claim_run.';

-- Budgets: what the runs of a tenant (workspace_id NULL: every workspace of it), of a workspace
-- or one run may spend in a window (everything, or a UTC calendar day or month). unit is a
-- currency code (record_cost's amounts), tokens (record_cost's usage), tool_calls (executions
-- handed out by the tool-call claims) or llm_steps (create_step of an llm step). spent counts the
-- window that starts at window_start; a spend in a later window starts it over. Written only
-- through ledger.set_budget and the functions that spend.
CREATE TABLE ledger.budgets (
    tenant_id     text NOT NULL,
    workspace_id  text,
    run_id        text,
    unit          text NOT NULL,
    period        text NOT NULL CHECK (period IN ('total', 'day', 'month')),
    max_amount    numeric NOT NULL CHECK (max_amount >= 0),
    warn_ratio    numeric CHECK (warn_ratio > 0 AND warn_ratio <= 1),
    spent         numeric NOT NULL DEFAULT 0,
    window_start  timestamptz NOT NULL DEFAULT '-infinity',
    warned_window timestamptz,
    updated_by    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CHECK (run_id IS NULL OR workspace_id IS NOT NULL)
);
CREATE UNIQUE INDEX budgets_key ON ledger.budgets (tenant_id, workspace_id, run_id, unit, period) NULLS NOT DISTINCT;
COMMENT ON TABLE ledger.budgets IS 'Budgets of a tenant (workspace_id NULL), a workspace or a run (run_id): at most max_amount of unit (a currency code, tokens, tool_calls or llm_steps) per period (total, or a UTC day or month). spent counts the window starting at window_start; warned_window: the window whose warning (spent reached warn_ratio of max_amount) was written. Read it through ledger.budget_usage; written only through ledger.set_budget and the functions that spend.';

-- The start of the budget window containing `at`: a UTC day or month, or -infinity for total.
CREATE FUNCTION ledger.budget_window(period text, at timestamptz) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE period
        WHEN 'day' THEN pg_catalog.timezone('UTC', pg_catalog.date_trunc('day', pg_catalog.timezone('UTC', at)))
        WHEN 'month' THEN pg_catalog.timezone('UTC', pg_catalog.date_trunc('month', pg_catalog.timezone('UTC', at)))
        ELSE '-infinity'::timestamptz END;
COMMENT ON FUNCTION ledger.budget_window(text, timestamptz) IS 'The start of the budget window (period total, day or month, in UTC) that contains at; -infinity for total.';

-- What a budget has spent in the window that contains `at` (the time is an argument, so a write
-- statement passes its own and the function stays IMMUTABLE): spent when it counts that window.
CREATE FUNCTION ledger.budget_spent(period text, spent numeric, window_start timestamptz, at timestamptz) RETURNS numeric
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN CASE WHEN window_start = ledger.budget_window(period, at) THEN spent ELSE 0 END;
COMMENT ON FUNCTION ledger.budget_spent(text, numeric, timestamptz, timestamptz) IS 'What a budget (its period, spent and window_start) has spent in the window that contains at: spent when it counts that window, else 0.';

-- Row-level security on every table, forced so that the owning role is filtered too.
DO $rls$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['blobs', 'blob_locks', 'runs', 'run_steps', 'run_events', 'outbox', 'run_artifacts',
                             'approval_requests', 'run_step_tool_calls', 'audit_events', 'run_cost_entries',
                             'response_events', 'citations', 'run_feedback', 'tool_call_tombstones',
                             'concurrency_limits', 'dispatch_turns', 'run_mailbox', 'schedules'] LOOP
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
-- A tenant's budget (workspace_id NULL) counts the spending of each of its workspaces.
ALTER TABLE ledger.budgets ENABLE ROW LEVEL SECURITY;
ALTER TABLE ledger.budgets FORCE ROW LEVEL SECURITY;
CREATE POLICY scope ON ledger.budgets
    USING (tenant_id = ledger.scope_tenant() AND (workspace_id IS NULL OR workspace_id = ledger.scope_workspace()))
    WITH CHECK (tenant_id = ledger.scope_tenant() AND (workspace_id IS NULL OR workspace_id = ledger.scope_workspace()));
ALTER TABLE ledger.budgets OWNER TO ledger_owner;
SELECT pg_catalog.pg_extension_config_dump('ledger.budgets', '');

-- Work across scopes, for members of ledger_operator. Row-level security stays as it is for
-- every role; the one exception is ledger_dispatcher, a NOLOGIN role that owns the three
-- functions below and whose policies (a policy for one role is not evaluated for any other)
-- let it see and lock the rows a claim or a sweep needs, in every scope. It has SELECT on
-- those columns and UPDATE on lease_owner only (FOR NO KEY UPDATE needs UPDATE on a column);
-- its policies' WITH CHECK (false) refuses any write anyway. Only ledger_owner may call the
-- functions: claim_run, claim_outbox_events and sweep_tool_calls do, for operators, then
-- switch to each row's scope for the ordinary scoped claim.
CREATE SCHEMA ledger_dispatch;
COMMENT ON SCHEMA ledger_dispatch IS 'Internal: the functions the ledger''s own functions use to find work across scopes for members of ledger_operator. Only ledger_owner may use it.';
CREATE POLICY dispatch_read ON ledger.runs FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_lock ON ledger.runs FOR UPDATE TO ledger_dispatcher USING (true) WITH CHECK (false);
CREATE POLICY dispatch_read ON ledger.outbox FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_lock ON ledger.outbox FOR UPDATE TO ledger_dispatcher USING (true) WITH CHECK (false);
CREATE POLICY dispatch_read ON ledger.run_step_tool_calls FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_read ON ledger.approval_requests FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_read ON ledger.concurrency_limits FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_read ON ledger.dispatch_turns FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_read ON ledger.schedules FOR SELECT TO ledger_dispatcher USING (true);
CREATE POLICY dispatch_read ON ledger.budgets FOR SELECT TO ledger_dispatcher USING (true);
CREATE INDEX outbox_dispatch_idx ON ledger.outbox (available_at, id) WHERE status IN ('pending', 'processing');

-- Scope grants: which scopes a login role may state with ledger.set_scope. A role is bound by
-- its first grant and stays bound (with no grant left it may state no scope) until
-- ledger.unbind_scope: revoking never fails open. A role never bound is unbound (any scope, as
-- before 0.5.0). Only ledger_owner's functions write the tables; ledger_dispatcher reads the
-- session's own login role's rows, to keep a bound operator's cross-scope work in its scopes.
CREATE TABLE ledger.scope_grants (
    grantee      regrole NOT NULL,
    tenant_id    text NOT NULL,
    workspace_id text,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX scope_grants_key ON ledger.scope_grants (grantee, tenant_id, workspace_id) NULLS NOT DISTINCT;
COMMENT ON TABLE ledger.scope_grants IS 'The scopes a bound login role may state with ledger.set_scope (workspace_id NULL: every workspace of the tenant); set_scope refuses it any other scope (42501 SCOPE_NOT_GRANTED). Written by ledger.grant_scope, ledger.revoke_scope and ledger.unbind_scope; no role but ledger_owner has any privilege on it.';
CREATE TABLE ledger.scope_bindings (
    grantee    regrole NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX scope_bindings_key ON ledger.scope_bindings (grantee);
COMMENT ON TABLE ledger.scope_bindings IS 'The login roles bound to their scope grants (ledger.scope_grants): bound by their first grant, unbound only by ledger.unbind_scope. A bound role with no grant left may state no scope.';
DO $bind$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['scope_grants', 'scope_bindings'] LOOP
        EXECUTE format('ALTER TABLE ledger.%I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE ledger.%I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format('CREATE POLICY owner_only ON ledger.%I TO ledger_owner USING (true) WITH CHECK (true)', t);
        EXECUTE format('CREATE POLICY dispatch_read ON ledger.%I FOR SELECT TO ledger_dispatcher'
                       ' USING (grantee = pg_catalog.to_regrole(pg_catalog.quote_ident(session_user)))', t);
        EXECUTE format('ALTER TABLE ledger.%I OWNER TO ledger_owner', t);
        PERFORM pg_catalog.pg_extension_config_dump(format('ledger.%I', t)::regclass, '');
    END LOOP;
END
$bind$;

-- set_scope runs as its caller, who cannot read the grants: it asks this function, which
-- answers for the session's login role only.
-- The role is found by to_regrole (quote_ident keeps a mixed-case name), not by reading
-- pg_roles, a catalog view that a distributed engine's planner does not route.
CREATE FUNCTION ledger_dispatch.scope_granted(tenant_id text, workspace_id text) RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT NOT EXISTS (SELECT 1 FROM ledger.scope_bindings b
                        WHERE b.grantee = pg_catalog.to_regrole(pg_catalog.quote_ident(session_user)))
        OR EXISTS (SELECT 1 FROM ledger.scope_grants g
                    WHERE g.grantee = pg_catalog.to_regrole(pg_catalog.quote_ident(session_user))
                      AND g.tenant_id = $1 AND (g.workspace_id IS NULL OR g.workspace_id = $2))
$$;
COMMENT ON FUNCTION ledger_dispatch.scope_granted(text, text) IS 'Whether the session''s login role (session_user, which SET ROLE does not change) may state this scope: it was never bound, or it has a grant for the tenant and this workspace or every workspace.';

-- A tenant's budget limits every workspace of the tenant: only a role that may state each of them
-- sets one.
CREATE FUNCTION ledger_dispatch.tenant_granted(tenant_id text) RETURNS boolean
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT NOT EXISTS (SELECT 1 FROM ledger.scope_bindings b
                        WHERE b.grantee = pg_catalog.to_regrole(pg_catalog.quote_ident(session_user)))
        OR EXISTS (SELECT 1 FROM ledger.scope_grants g
                    WHERE g.grantee = pg_catalog.to_regrole(pg_catalog.quote_ident(session_user))
                      AND g.tenant_id = $1 AND g.workspace_id IS NULL)
$$;
COMMENT ON FUNCTION ledger_dispatch.tenant_granted(text) IS 'Whether the session''s login role may state every workspace of the tenant: it was never bound, or it has the tenant''s every-workspace grant.';


CREATE FUNCTION ledger_dispatch.next_run(modes text[], kinds text[])
    RETURNS TABLE (tenant_id text, workspace_id text, id text)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    -- PL/pgSQL keeps this query's plan for the session; a SQL function's is made again at
    -- every call, which cost an across-scope claim about 2 ms.
    RETURN QUERY
    -- The scopes with a live run, one index probe each (a skip scan of runs_live_idx), however
    -- many runs are queued.
    WITH RECURSIVE s (tenant_id, workspace_id) AS (
        (SELECT r.tenant_id, r.workspace_id FROM ledger.runs r
          WHERE r.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
          ORDER BY r.tenant_id, r.workspace_id LIMIT 1)
        UNION ALL
        SELECT n.tenant_id, n.workspace_id FROM s CROSS JOIN LATERAL (
            SELECT r.tenant_id, r.workspace_id FROM ledger.runs r
             WHERE r.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
               AND (r.tenant_id, r.workspace_id) > (s.tenant_id, s.workspace_id)
             ORDER BY r.tenant_id, r.workspace_id LIMIT 1) n)
    -- Scopes take turns: the one served longest ago (never: first) is looked at first, so one
    -- scope's burst does not hold up another's run.
    SELECT c.tenant_id, c.workspace_id, c.id
      FROM (SELECT s.tenant_id, s.workspace_id FROM s
              LEFT JOIN ledger.dispatch_turns d
                ON d.tenant_id = s.tenant_id AND d.workspace_id = s.workspace_id
             WHERE NOT EXISTS (SELECT FROM ledger.scope_bindings)
                OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = s.tenant_id
                              AND (g.workspace_id IS NULL OR g.workspace_id = s.workspace_id))
             ORDER BY d.served_at NULLS FIRST, s.tenant_id, s.workspace_id) o
     -- Then that scope's claimable run of the highest priority, oldest first.
     CROSS JOIN LATERAL (
        SELECT r.tenant_id, r.workspace_id, r.id FROM ledger.runs r
         WHERE r.tenant_id = o.tenant_id AND r.workspace_id = o.workspace_id
           AND r.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
           AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= clock_timestamp())
           AND (r.not_before IS NULL OR r.not_before <= clock_timestamp())
           AND (r.status IN ('queued', 'retrying') OR r.run_token > 0)
           AND (modes IS NULL OR r.mode = ANY (modes)) AND (kinds IS NULL OR r.kind = ANY (kinds))
           AND NOT EXISTS (SELECT 1 FROM ledger.run_step_tool_calls t
                            WHERE t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id
                              AND t.run_id = r.id AND t.status = 'in_doubt')
           -- A re-run parked on a call in doubt in its lineage (it takes its ancestors' records)
           -- waits for the same person as the ancestor.
           AND NOT (r.status = 'paused' AND r.source_run_id IS NOT NULL AND EXISTS (
                 WITH RECURSIVE up (id, source_run_id) AS (
                     SELECT s.id, s.source_run_id FROM ledger.runs s
                      WHERE s.tenant_id = r.tenant_id AND s.workspace_id = r.workspace_id
                        AND s.id = r.source_run_id
                     UNION ALL
                     SELECT s.id, s.source_run_id FROM up
                       JOIN ledger.runs s ON s.tenant_id = r.tenant_id
                        AND s.workspace_id = r.workspace_id AND s.id = up.source_run_id)
                 SELECT 1 FROM up JOIN ledger.run_step_tool_calls t
                     ON t.tenant_id = r.tenant_id AND t.workspace_id = r.workspace_id
                    AND t.run_id = up.id AND t.status = 'in_doubt'))
           AND NOT EXISTS (SELECT 1 FROM ledger.approval_requests a
                            WHERE a.tenant_id = r.tenant_id AND a.workspace_id = r.workspace_id
                              AND a.run_id = r.id AND a.status = 'pending'
                              AND (a.expires_at IS NULL OR a.expires_at > clock_timestamp()))
           -- No budget that applies to it is used up (claim_run checks it again in the run's scope).
           AND NOT EXISTS (SELECT 1 FROM ledger.budgets b
                            WHERE b.tenant_id = r.tenant_id
                              AND (b.workspace_id IS NULL OR b.workspace_id = r.workspace_id)
                              AND (b.run_id IS NULL OR b.run_id = r.id)
                              AND b.max_amount <= ledger.budget_spent(b.period, b.spent, b.window_start, now()))
           -- Its concurrency key has room (claim_run checks it again under the limit's lock); the
           -- full keys are found once (an uncorrelated subquery), not once per candidate.
           AND (r.concurrency_key IS NULL
                OR (r.tenant_id, r.workspace_id, r.concurrency_key) NOT IN (
                     SELECT l.tenant_id, l.workspace_id, l.concurrency_key
                       FROM ledger.concurrency_limits l
                      WHERE l.max_in_flight <= (SELECT count(*) FROM ledger.runs f
                              WHERE f.tenant_id = l.tenant_id AND f.workspace_id = l.workspace_id
                                AND f.concurrency_key = l.concurrency_key
                                AND f.lease_expires_at > clock_timestamp()
                                AND f.status NOT IN ('succeeded', 'failed', 'canceled', 'expired'))
                         OR (l.max_per_window <= l.window_claims
                             AND l.window_start + make_interval(secs => l.window_seconds) > clock_timestamp())))
         ORDER BY r.priority DESC, r.queued_at, r.id LIMIT 1
           FOR NO KEY UPDATE SKIP LOCKED) c
     LIMIT 1;
END
$$;
COMMENT ON FUNCTION ledger_dispatch.next_run(text[], text[]) IS 'The next claimable run of any scope the session''s login role may state (see ledger.claim_run): scopes take turns (the one served longest ago first, ledger.dispatch_turns), and within the scope the due run (not_before passed) of the highest priority, oldest first, that waits for no person (no call in doubt, none in the lineage of a paused re-run, no pending approval before its deadline), with no budget used up and whose concurrency key has room (in flight and in its rate window), locked; skips runs another transaction holds.';

CREATE FUNCTION ledger_dispatch.due_outbox_events(max_events integer)
    RETURNS TABLE (tenant_id text, workspace_id text, id text)
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT o.tenant_id, o.workspace_id, o.id FROM ledger.outbox o
     WHERE o.status IN ('pending', 'processing') AND o.available_at <= clock_timestamp()
       AND (o.status = 'pending' OR o.lease_expires_at <= clock_timestamp())
       AND (NOT EXISTS (SELECT FROM ledger.scope_bindings)
            OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = o.tenant_id
                          AND (g.workspace_id IS NULL OR g.workspace_id = o.workspace_id)))
     ORDER BY o.available_at, o.id LIMIT max_events
       FOR NO KEY UPDATE SKIP LOCKED
$$;
COMMENT ON FUNCTION ledger_dispatch.due_outbox_events(integer) IS 'Up to max_events due outbox events of any scope the session''s login role may state (see ledger.claim_outbox_events), oldest first, locked; skips events another transaction holds.';

CREATE FUNCTION ledger_dispatch.due_schedule_scopes()
    RETURNS TABLE (tenant_id text, workspace_id text)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT DISTINCT s.tenant_id, s.workspace_id FROM ledger.schedules s
     WHERE NOT s.paused AND s.next_fire_at <= clock_timestamp()
       AND (NOT EXISTS (SELECT FROM ledger.scope_bindings)
            OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = s.tenant_id
                          AND (g.workspace_id IS NULL OR g.workspace_id = s.workspace_id)))
$$;
COMMENT ON FUNCTION ledger_dispatch.due_schedule_scopes() IS 'The scopes the session''s login role may state that have a schedule due (see ledger.fire_schedules).';

CREATE FUNCTION ledger_dispatch.next_wake() RETURNS timestamptz
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    -- As sql/queries/next_wake.sql does for one scope; each part is the first ahead in its
    -- index that belongs to a scope the login role may state.
    SELECT least(
        (SELECT r.not_before FROM ledger.runs r
          WHERE r.not_before > clock_timestamp() AND r.not_before < 'infinity'
            AND r.status NOT IN ('succeeded', 'failed', 'canceled', 'expired')
            AND (NOT EXISTS (SELECT FROM ledger.scope_bindings)
                 OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = r.tenant_id
                               AND (g.workspace_id IS NULL OR g.workspace_id = r.workspace_id)))
          ORDER BY r.not_before LIMIT 1),
        (SELECT a.expires_at FROM ledger.approval_requests a
          WHERE a.status = 'pending' AND a.expires_at > clock_timestamp()
            AND (NOT EXISTS (SELECT FROM ledger.scope_bindings)
                 OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = a.tenant_id
                               AND (g.workspace_id IS NULL OR g.workspace_id = a.workspace_id)))
          ORDER BY a.expires_at LIMIT 1),
        (SELECT min(l.window_start + make_interval(secs => l.window_seconds))
           FROM ledger.concurrency_limits l
          WHERE l.max_per_window <= l.window_claims
            AND l.window_start + make_interval(secs => l.window_seconds) > clock_timestamp()
            AND (NOT EXISTS (SELECT FROM ledger.scope_bindings)
                 OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = l.tenant_id
                               AND (g.workspace_id IS NULL OR g.workspace_id = l.workspace_id)))))
$$;
COMMENT ON FUNCTION ledger_dispatch.next_wake() IS 'When a run of any scope the session''s login role may state next becomes claimable by the clock alone (see ledger.next_wake): a wait''s or backoff''s not_before, a pending approval''s deadline, the end of a full rate window. NULL when none is ahead.';

-- What waits for people (ledger.inbox): in one scope, or (NULL tenant_id) in every scope the
-- session's login role may state. Each count with the oldest one's time.
CREATE FUNCTION ledger_dispatch.inbox(tenant_id text, workspace_id text)
    RETURNS TABLE (tenant_id text, workspace_id text,
                   calls_in_doubt bigint, oldest_in_doubt_at timestamptz,
                   pending_approvals bigint, oldest_approval_at timestamptz,
                   budget_stops bigint, oldest_budget_stop_at timestamptz,
                   failed_outbox_events bigint, oldest_failed_outbox_event_at timestamptz)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT w.tenant_id, w.workspace_id,
           count(*) FILTER (WHERE w.what = 'in_doubt'), min(w.since) FILTER (WHERE w.what = 'in_doubt'),
           count(*) FILTER (WHERE w.what = 'approval'), min(w.since) FILTER (WHERE w.what = 'approval'),
           count(*) FILTER (WHERE w.what = 'budget'), min(w.since) FILTER (WHERE w.what = 'budget'),
           count(*) FILTER (WHERE w.what = 'outbox'), min(w.since) FILTER (WHERE w.what = 'outbox')
      FROM (SELECT t.tenant_id, t.workspace_id, 'in_doubt' AS what, t.updated_at AS since
              FROM ledger.run_step_tool_calls t
             WHERE t.status = 'in_doubt' AND t.completed_at IS NULL
            UNION ALL
            SELECT a.tenant_id, a.workspace_id, 'approval', a.created_at FROM ledger.approval_requests a
             WHERE a.status = 'pending' AND (a.expires_at IS NULL OR a.expires_at > clock_timestamp())
            UNION ALL
            -- Stopped by a budget that is still used up (once raised, the run waits for a worker,
            -- not for a person).
            SELECT r.tenant_id, r.workspace_id, 'budget', r.updated_at FROM ledger.runs r
             WHERE r.status = 'paused' AND r.error_code = 'BUDGET_EXHAUSTED'
               AND EXISTS (SELECT 1 FROM ledger.budgets b
                            WHERE b.tenant_id = r.tenant_id
                              AND (b.workspace_id IS NULL OR b.workspace_id = r.workspace_id)
                              AND (b.run_id IS NULL OR b.run_id = r.id)
                              AND b.max_amount <= ledger.budget_spent(b.period, b.spent, b.window_start, now()))
            UNION ALL
            SELECT o.tenant_id, o.workspace_id, 'outbox', o.processed_at FROM ledger.outbox o
             WHERE o.status = 'failed') w
     WHERE CASE WHEN $1 IS NULL
                THEN NOT EXISTS (SELECT FROM ledger.scope_bindings)
                     OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = w.tenant_id
                                   AND (g.workspace_id IS NULL OR g.workspace_id = w.workspace_id))
                ELSE w.tenant_id = $1 AND w.workspace_id = $2 END
     GROUP BY w.tenant_id, w.workspace_id
     ORDER BY w.tenant_id, w.workspace_id
$$;
COMMENT ON FUNCTION ledger_dispatch.inbox(text, text) IS 'What waits for people (see ledger.inbox) in scope (tenant_id, workspace_id), or with NULL tenant_id in every scope the session''s login role may state that has something waiting: calls in doubt, pending approvals before their deadline, runs paused by a budget still used up, failed outbox events, each counted with the oldest one''s time.';

CREATE FUNCTION ledger_dispatch.expired_tool_call_scopes()
    RETURNS TABLE (tenant_id text, workspace_id text)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT DISTINCT e.tenant_id, e.workspace_id
      FROM (SELECT t.tenant_id, t.workspace_id FROM ledger.run_step_tool_calls t
             WHERE t.completed_at IS NULL AND t.lease_expires_at <= clock_timestamp()
            UNION ALL
            SELECT a.tenant_id, a.workspace_id FROM ledger.approval_requests a
             WHERE a.status = 'pending' AND a.expires_at <= clock_timestamp()) e
     WHERE NOT EXISTS (SELECT FROM ledger.scope_bindings)
        OR EXISTS (SELECT FROM ledger.scope_grants g WHERE g.tenant_id = e.tenant_id
                      AND (g.workspace_id IS NULL OR g.workspace_id = e.workspace_id))
$$;
COMMENT ON FUNCTION ledger_dispatch.expired_tool_call_scopes() IS 'The scopes the session''s login role may state that have a tool call whose lease expired or a pending approval past its deadline (see ledger.sweep_tool_calls).';

-- The key of the run channels' names (ledger.run_channel): any role may LISTEN on any channel,
-- so a name must not be computable from a run's public names. Only ledger_owner (the functions)
-- reads it. pg_dump keeps it, so that channels survive a restore: the restore adds the dumped
-- row beside the one its CREATE EXTENSION made, and the oldest row is the key in force.
CREATE TABLE ledger.channel_key (
    key        bytea NOT NULL CHECK (pg_catalog.length(key) = 32),
    created_at timestamptz NOT NULL DEFAULT pg_catalog.now()
);
COMMENT ON TABLE ledger.channel_key IS 'The secret run channel names are keyed with (HMAC-SHA-256 of tenant, workspace and run id; ledger.run_channel). The oldest row is in force. No role but ledger_owner has any privilege on it.';
-- 32 bytes from two random UUIDs (pg_strong_random, 244 random bits), without pgcrypto.
INSERT INTO ledger.channel_key (key)
    SELECT pg_catalog.sha256(pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                             || pg_catalog.uuid_send(pg_catalog.gen_random_uuid()));
ALTER TABLE ledger.channel_key ENABLE ROW LEVEL SECURITY;
ALTER TABLE ledger.channel_key FORCE ROW LEVEL SECURITY;
CREATE POLICY owner_only ON ledger.channel_key TO ledger_owner USING (true) WITH CHECK (true);
ALTER TABLE ledger.channel_key OWNER TO ledger_owner;
SELECT pg_catalog.pg_extension_config_dump('ledger.channel_key', '');
