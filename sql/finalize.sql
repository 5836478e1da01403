-- ledger: ownership, privileges and comments. Runs last (finalize).

-- Every function belongs to ledger_owner, so SECURITY DEFINER functions run as a role that is
-- not a superuser and is still subject to the tables' forced row-level security.
DO $own$
DECLARE f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
              WHERE p.pronamespace = 'ledger'::regnamespace LOOP
        EXECUTE format('ALTER FUNCTION %s OWNER TO ledger_owner', f);
    END LOOP;
END
$own$;

GRANT USAGE ON SCHEMA ledger TO ledger_owner, ledger_reader, ledger_writer;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA ledger FROM PUBLIC;

-- Readers: SELECT on the tables (rows filtered by scope) and the read functions.
GRANT SELECT ON ALL TABLES IN SCHEMA ledger TO ledger_reader;
-- Except the blob store's lock rows, which hold nothing to read: no role but the owner has any
-- privilege on them, so no one else can lock them (that needs UPDATE) or see which scopes write.
REVOKE SELECT ON ledger.blob_locks FROM ledger_reader;
-- Nor on the run channels' key: a name computed without the ledger would let anyone LISTEN to a run.
REVOKE SELECT ON ledger.channel_key FROM ledger_reader;
GRANT EXECUTE ON FUNCTION
    ledger.set_scope(text, text, boolean),
    ledger.scope_tenant(),
    ledger.scope_required(),
    ledger.scope_workspace(),
    ledger.status_transitions(),
    ledger.is_status(text, text),
    ledger.notifier_status(),
    ledger.events_since(text, text, integer),
    ledger.run_channel(text),
    ledger.run_inputs(text),
    ledger.get_artifact(text),
    ledger.redact(jsonb),
    ledger.canonical_json(jsonb),
    ledger.request_hash(jsonb),
    ledger.replay_bundle(text),
    ledger.run_evidence(text),
    ledger.replay_ready(text),
    ledger.otel_trace(text, text),
    ledger.next_wake(boolean),
    ledger.inbox(boolean),
    ledger.graph_checkpoint_tuples(text, text, text, jsonb, text, integer),
    ledger.budget_window(text, timestamp with time zone),
    ledger.budget_spent(text, numeric, timestamp with time zone, timestamp with time zone)
    TO ledger_reader;

GRANT SELECT ON ledger.tool_calls_in_doubt, ledger.pending_approvals, ledger.run_overview,
    ledger.outbox_backlog, ledger.budget_usage TO ledger_reader;
-- The functions that decide and set budgets read them as people see them.
GRANT SELECT ON ledger.budget_usage TO ledger_owner;

-- Writers: everything a reader has, and every function. No INSERT, UPDATE or DELETE on any
-- table: the rules (status machine, event seq, redaction) live in the functions.
GRANT ledger_reader TO ledger_writer;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA ledger TO ledger_writer;

COMMENT ON FUNCTION ledger.set_scope(text, text, boolean) IS
    'Sets the caller''s scope (GUCs ledger.tenant_id, ledger.workspace_id) for the session, or with is_local => true for the current transaction only. Every other function refuses to run without it (42501 SCOPE_MISSING). The only way to set a scope: SET, set_config, ALTER ROLE ... SET and PGOPTIONS are refused (42501 SCOPE_SET_DIRECTLY). A login role bound by ledger.grant_scope may state only its granted scopes (42501 SCOPE_NOT_GRANTED).';
COMMENT ON FUNCTION ledger.scope_required() IS
    'true when a scope is set, else 42501 SCOPE_MISSING. The monitoring views filter on it, so that reading one without a scope fails instead of showing no rows.';
COMMENT ON FUNCTION ledger.notifier_status() IS
    'For members of ledger_operator or ledger_owner (and superusers): the counters move with every tenant''s commits (42501 OPERATOR_REQUIRED for anyone else). How this session''s writes notify (notify: worker, inline or off, as ledger.notify and the preload allow), whether the library is preloaded, and for this database: the notifier worker''s pid (NULL: none attached now; it starts with the next write and leaves after 2 s idle), channels waiting in its table, the table''s capacity (ledger.notifier_capacity), notifications the workers sent, and commits whose writers notified by themselves while preloaded (no worker attached, the table full).';
COMMENT ON FUNCTION ledger.is_status(text, text) IS
    'true when status is one of resource''s statuses (run, step, task or tool_call; 22023 STATUS_UNKNOWN for another resource). The tables'' status CHECKs call it.';
COMMENT ON FUNCTION ledger.status_transitions() IS
    'The status machine: every allowed (resource, from_status, to_status) for run, step and task. Statuses: queued, preparing, running, waiting_input, waiting_approval, paused, retrying, succeeded, failed, canceled, expired (+ skipped for steps). Terminal: succeeded, failed, canceled, expired, skipped.';
COMMENT ON FUNCTION ledger.create_run(text, jsonb, text, text, text, text, text, text, text, integer, text, text, text, text, timestamp with time zone, integer, text) IS
    'Creates a queued run, claimable (ledger.claim_run) from not_before (NULL: at once), the highest priority first (-1000 to 1000, default 0; 22023 PRIORITY_INVALID), within the limit of its concurrency_key (ledger.set_concurrency_limit). request_id (or a caller run_id) makes it idempotent (not_before, priority and concurrency_key are not compared); source_run_id and parent_run_id must exist in scope; attempt_no defaults to source.attempt_no + 1 and root_run_id to the source''s root. inputs (a JSON object) are redacted, then kept as stored: see ledger.run_inputs.';
COMMENT ON FUNCTION ledger.transition_run(text, text, text, text, text, text, text, bigint) IS
    'Moves a run to to_status if ledger.status_transitions() allows it (55000 TRANSITION_INVALID otherwise). With expected_status the move is conditional on it (40001 TRANSITION_CONFLICT). Moving to the current status returns the row unchanged. A terminal status ends the owner''s lease. run_token: the owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.run_inputs(text) IS
    'The inputs a run was created with, as stored (redacted), also when they were too large to keep inline.';
COMMENT ON FUNCTION ledger.create_step(text, text, text, text, text, text, text, bigint) IS
    'Adds a step to a run that exists in scope and is not terminal (55000 RUN_TERMINAL), numbered 1, 2, 3 within the run (step_no). A caller step_id, and a step_key within the run, are idempotent: the same step again returns it; another step_type (or a step_id and step_key naming different steps) fails 23505 IDEMPOTENCY_MISMATCH naming the field. run_token: the owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.transition_step(text, text, text, text, jsonb, text, text, jsonb, bigint) IS
    'Moves a step to to_status under the same rules as transition_run (steps also have skipped). metrics are merged into the existing object, top-level keys. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.events_since(text, text, integer) IS
    'The run''s events after after_event_id (from the start when NULL), ordered by their gapless seq. ends_run marks the event that moved the run to a terminal status: a follower may stop after it. An unknown after_event_id fails P0002 EVENT_NOT_FOUND. Client contract: LISTEN on ledger.run_channel(run_id) first, then call this with your cursor, and again on each notification.';
COMMENT ON FUNCTION ledger.run_channel(text) IS
    'The LISTEN/NOTIFY channel of a run. Commits that append to the run notify it with {"run_id","seq"}: events up to seq are committed (ledger.notify = inline: one per event, with event_id and event_type too). The name is keyed with a secret of the database that only the ledger reads (ledger.channel_key), so it cannot be computed from the run''s names: ask this function for it.';
COMMENT ON FUNCTION ledger.claim_tool_call(text, text, jsonb, text, text, text, text, integer, boolean, jsonb, bigint) IS
    'Claims a tool call for execution. Returns {outcome, tool_call, approval, response} with outcome claimed (execute it; tool_call.id is the tool_call_record_id the other tool-call functions take and tool_call.attempt your fencing token), replayed (response holds the last result; execute nothing), in_doubt (the request may have left; never retried automatically), busy (a live lease exists), waiting_approval or rejected. The lease is timeout_seconds plus a tenth (at least 5 s), never under 10 s. With approval {title, policy_ref, details, expires_in_seconds}, a new call is created waiting for it (as ledger.request_tool_approval does) and a known one answers its current outcome, so one call is right on every resume. Same key with another tool_ref or arguments: 23505 IDEMPOTENCY_MISMATCH. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.claim_tool_calls(text, jsonb, text, boolean, bigint) IS
    'Claims the tool calls of one model turn in one statement (one commit instead of one per call): calls is a JSON array of at most 100 objects with claim_tool_call''s per-call arguments (tool_ref, arguments, tool_call_id, idempotency_key, step_id, timeout_seconds, retry_failed, approval; an absent key takes that function''s default). Returns one row per element, in input order: index (from 0) and claim, what claim_tool_call returns for that call (claimed, replayed, in_doubt, busy, waiting_approval, rejected, purged). The run is locked and fenced by run_token once (40001 LEASE_STALE unless current). begin => true also begins every call that comes back claimed (its tool_call.status is running): COMMIT before any request leaves; after a crash past that commit they are in_doubt, never executed twice. Any refusal refuses the whole batch and writes nothing, its DETAIL naming the element (index): 22023 CALLS_NOT_ARRAY, CALLS_TOO_MANY, CALL_INVALID (with the key), CALLS_DUPLICATE (one idempotency_key or tool_call_id twice), or what claim_tool_call refuses.';
COMMENT ON FUNCTION ledger.begin_tool_call(text, bigint) IS
    'Marks the outbound boundary of the claimed attempt (status running, outbound_started_at). COMMIT it before the request leaves the process. A stale attempt fails 40001 LEASE_STALE.';
COMMENT ON FUNCTION ledger.heartbeat_tool_call(text, bigint, integer) IS
    'Extends the lease of the current attempt by extend_seconds (default: the claim''s lease).';
COMMENT ON FUNCTION ledger.complete_tool_call(text, bigint, text, jsonb, text, jsonb) IS
    'Records the end of the current attempt: outcome succeeded, failed, or unknown (sent, no answer: in_doubt). Fenced by attempt, not by the clock: accepted after the lease expired and from in_doubt. Results over 8192 bytes of canonical JSON are stored as a json artifact.';
COMMENT ON FUNCTION ledger.find_tool_call(text, text, jsonb, text, text, boolean) IS
    'Looks up a repeatable tool call (one its caller declares safe to repeat: a read, an idempotent API) before it runs. Returns {outcome, tool_call, approval, response} with outcome replayed (response holds the recorded result; run nothing), unrecorded (no result to replay: run the tool, then ledger.record_tool_call), or the in_doubt, busy, waiting_approval, rejected or purged of a side-effecting call under the key, which the repeatable path never overrides. Needs tool_call_id or idempotency_key (22023 ARGUMENT_REQUIRED); other input under the key: 23505 IDEMPOTENCY_MISMATCH. Writes nothing but a re-run''s first reuse of its lineage''s result (tool_call.replayed, as a claim).';
COMMENT ON FUNCTION ledger.record_tool_call(text, text, jsonb, text, jsonb, text, text, text, jsonb, boolean, bigint) IS
    'Records a repeatable tool call after it returned, in one statement: outcome succeeded (with its result) or failed (with error_message). Returns {outcome, tool_call, approval, response}: recorded (a new record, attempt 1, its tool step created finished), or when the key already has a record, that record''s answer and nothing written: replayed (the first record wins: response holds it), in_doubt, busy, waiting_approval, rejected or purged. retry_failed => true records over a failed call as its next attempt. Same key with another tool_ref or arguments: 23505 IDEMPOTENCY_MISMATCH. Results over 8192 bytes of canonical JSON are stored as a json artifact. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.resolve_tool_call(text, text, jsonb, text, text) IS
    'Resolves an in_doubt tool call with a person''s decision: succeeded or failed (with the evidence as result), or retry (the next claim executes again with attempt + 1). actor and note are recorded with an audit event.';
COMMENT ON FUNCTION ledger.sweep_tool_calls(boolean) IS
    'Moves every expired lease in the scope to in_doubt (the request left) or back to claimable (it did not), and expires every pending approval past its deadline (the call is rejected, its step expired, approval.expired in the feed and the outbox); returns how many. For pg_cron or a worker; never waits on busy rows. With any_scope => true (members of ledger_operator only), every scope''s.';
COMMENT ON FUNCTION ledger.request_tool_approval(text, text, jsonb, text, text, text, text, jsonb, bigint, integer) IS
    'Creates a tool call in waiting_approval and its approval request (outbox approval.requested). Claims of the same identity return waiting_approval while pending, claimed once approved, rejected once rejected or expired (expires_in_seconds: 1 second to a year; past it the approval expires, and no one may decide it). On a known call it answers the current outcome without claiming it (waiting_approval also once approved, replayed, in_doubt, busy, rejected); another tool_ref or arguments fail 23505 IDEMPOTENCY_MISMATCH. run_token: the run owner''s fencing token (40001 LEASE_STALE unless current).';
COMMENT ON FUNCTION ledger.resolve_approval(text, text, text, text) IS
    'Decides a pending approval: approved or rejected, with the actor and a note. Repeating the same decision is a no-op; a different one fails 55000 APPROVAL_RESOLVED; past the approval''s deadline any fails 55000 APPROVAL_EXPIRED.';
COMMENT ON FUNCTION ledger.put_artifact(text, bytea, text, text, text, jsonb) IS
    'Stores bytes in the scope''s content-addressed blob store and records them as an artifact (storage_key blob:sha256:<hex>).';
COMMENT ON FUNCTION ledger.register_artifact(text, text, bigint, text, text, text, text, jsonb) IS
    'Records an artifact whose bytes live in an external store, with their size and sha256.';
COMMENT ON FUNCTION ledger.get_artifact(text) IS
    'The bytes of an artifact in the built-in store, verified against its sha256 (XX001 ARTIFACT_HASH_MISMATCH).';
COMMENT ON FUNCTION ledger.redact(jsonb) IS
    'The value as the ledger would store it: sensitive keys'' values and credential-like strings replaced by "[REDACTED]" (GUCs ledger.redact_keys, ledger.redact_values).';
COMMENT ON FUNCTION ledger.canonical_json(jsonb) IS
    'Canonical JSON text: object keys sorted by code point, no insignificant whitespace, numbers as jsonb prints them.';
COMMENT ON FUNCTION ledger.request_hash(jsonb) IS
    'Hex sha256 of ledger.canonical_json(value): the request_hash of a tool call with these arguments.';
COMMENT ON FUNCTION ledger.record_cost(text, text, numeric, numeric, text, text, jsonb, jsonb, text, text, text, text, text, text) IS
    'Records a cost entry: billed_quantity >= 0, amount >= 0 with a currency, usage with the known keys (or the OpenAI and Anthropic names, stored under the known keys) as non-negative integers. source_ref is idempotent per scope. Writes cost.recorded to the feed and the outbox.';
COMMENT ON FUNCTION ledger.record_cost(text, text, numeric, double precision, text, text, jsonb, jsonb, text, text, text, text, text, text) IS
    'ledger.record_cost with a double precision amount (a client''s float), taken as its shortest decimal text: 0.1 is stored as 0.1.';
COMMENT ON FUNCTION ledger.record_cost(text, text, numeric, bigint, text, text, jsonb, jsonb, text, text, text, text, text, text) IS
    'ledger.record_cost with a bigint amount (an integer literal past int4, a client''s large integer), stored exactly.';
COMMENT ON FUNCTION ledger.record_audit(text, text, text, jsonb, text, text) IS
    'Records an audit event for a run (gateway decisions, human interventions). The payload is redacted.';
COMMENT ON FUNCTION ledger.record_response_event(text, text, jsonb, text) IS
    'Records what a run showed its user (event_type: message, delta, ...). The payload is redacted.';
COMMENT ON FUNCTION ledger.record_citation(text, jsonb, text) IS
    'Records a knowledge citation of a run (an object: chunk_id, document_id, knowledge_id, ...). Redacted.';
COMMENT ON FUNCTION ledger.record_feedback(text, integer, text, text, text, jsonb) IS
    'Records a rating of a run (any integer scale) with an optional comment and metadata.';
COMMENT ON FUNCTION ledger.replay_bundle(text) IS
    'Everything about a run in one read (replay #1): {run, steps, artifacts, costs, approvals, feedback, mailbox, tool_calls, reused_tool_calls, budgets, budget_events, trace_spec}. mailbox holds the inputs sent to the run and those it waits for; budgets are the budgets that apply to the run as they stand now, budget_events its budget warnings and stops; reused_tool_calls are the finished calls of its source run whose results a retry or replay reused. Lists are complete and ordered; money is decimal strings per currency.';
COMMENT ON FUNCTION ledger.otel_trace(text, text) IS
    'A run as an OpenTelemetry trace: an OTLP/JSON ExportTraceServiceRequest following the GenAI semantic conventions (the run an invoke_agent span, llm steps chat spans with token usage, tool calls execute_tool spans, costs as ledger.cost.<currency> attributes, ledger ids on every span), for an OTLP/HTTP collector''s /v1/traces. Ids are derived from the run, so a second export is the same trace.';
COMMENT ON FUNCTION ledger.run_evidence(text) IS
    'The thirteen governance evidence items of a run, in order: each {key, status pass|warning|fail|not_applicable, label, summary, evidence_refs, missing}.';
COMMENT ON FUNCTION ledger.replay_ready(text) IS
    'Whether the ledger alone can replay the run: {"status": "pass"|"fail", "missing": [...]} over steps, response_events, costs, citations, tool_calls (its own or reused from its source), audits (each where applicable) and inputs (present and matching their sha256).';
COMMENT ON FUNCTION ledger.retry_run(text, jsonb, timestamp with time zone) IS
    'Retries a failed or canceled run (replay #4): a new queued run with the source''s mode, kind and subject pinned to its subject_version_id, source_run_id, attempt_no + 1, the same root_run_id, control_action retry, the source''s priority and concurrency_key, claimable from not_before (a backoff; NULL: at once), and the original inputs as stored unless inputs overrides them. The caller executes it; a tool call it claims with the same tool_call_id replays the result its lineage recorded (see claim_tool_call), one with the same explicit key too.';
COMMENT ON FUNCTION ledger.replay_run(text, jsonb, timestamp with time zone) IS
    'Replays a finished run (any terminal status) as a new run, like ledger.retry_run with control_action replay.';
COMMENT ON FUNCTION ledger.purge_runs(interval, integer) IS
    'Deletes up to batch terminal runs of the scope that ended more than older_than ago, with all their rows and the blobs nothing else refers to, keeping each tool call''s idempotency key as a tombstone. Skips runs with open tool calls or that other runs or tasks refer to (leaf first). Returns how many runs went.';
COMMENT ON FUNCTION ledger.put_graph_checkpoint(text, text, text, text, jsonb, jsonb, text, text[], text[], text[], bytea[]) IS
    'Stores a graph framework''s checkpoint (LangGraph) of thread_id and checkpoint_ns, written by the run run_id, with the channel values it introduces: entry i of channels, versions, blob_types and blobs is one channel''s new version, the serializer''s type and opaque bytes, stored as given and never redacted; checkpoint (without channel values) is stored as given, metadata redacted. A checkpoint stored again gets the new checkpoint and metadata.';
COMMENT ON FUNCTION ledger.put_graph_checkpoint_writes(text, text, text, text, integer[], text[], text[], bytea[], text, boolean) IS
    'Stores pending writes of task task_id against a graph checkpoint (stored before or after it: the framework stores both concurrently): entry i is write idxs[i] to channels[i], the serializer''s type and opaque bytes, never redacted. A write already stored is kept, or replaced with upsert. Returns how many writes were stored.';
COMMENT ON FUNCTION ledger.graph_checkpoint_tuples(text, text, text, jsonb, text, integer) IS
    'The graph checkpoints of the scope, newest first (by checkpoint id): of one thread, namespace or checkpoint when given, whose metadata contains filter, older than the checkpoint id before, at most max_checkpoints; each with the run that wrote it, the channel values its channel_versions name and its pending writes (parallel arrays of the serializer''s types and bytes, as stored).';
COMMENT ON FUNCTION ledger.delete_graph_thread(text) IS
    'Deletes every checkpoint, pending write and channel value of the graph thread, in every namespace. Returns how many checkpoints went.';
COMMENT ON FUNCTION ledger.copy_graph_thread(text, text) IS
    'Copies every checkpoint of source_thread_id (every namespace, with its pending writes and channel values, each still tied to the run that wrote it) to target_thread_id, keeping checkpoints the target already has. Returns how many were copied.';
COMMENT ON FUNCTION ledger.prune_graph_threads(text[], text) IS
    'Prunes graph threads: strategy keep_latest keeps the newest checkpoint of each namespace (with its writes and the values it names), delete removes everything (22023 STRATEGY_UNKNOWN otherwise). Returns how many checkpoints went.';
COMMENT ON FUNCTION ledger.delete_graph_checkpoints_for_runs(text[]) IS
    'Deletes the graph checkpoints (with their pending writes, and the channel values no remaining checkpoint names) written by the runs run_ids: ledger run ids, or the framework''s run ids as its metadata holds them (run_id). The runs stay. Returns how many checkpoints went.';
COMMENT ON FUNCTION ledger.claim_outbox_events(text, integer, integer, boolean) IS
    'Claims up to max_events (1 to 1000) due outbox events of the scope for lease_owner, oldest first: pending ones whose available_at has come and processing ones whose lease expired. Each becomes processing under a lease of lease_seconds (1 to 86400) and counts an attempt. FOR UPDATE SKIP LOCKED: never waits for another claimer. An expired lease on an event''s 64th attempt since its last replay fails it instead. Delivery is at least once: deduplicate on id. With any_scope => true (members of ledger_operator only), the oldest due events of every scope, each with its tenant_id and workspace_id.';
COMMENT ON FUNCTION ledger.ack_outbox_events(text, text[]) IS
    'Marks the listed events lease_owner holds as done and returns how many. Ids it does not hold (a lease re-taken by another claimer, an event already done) are ignored.';
COMMENT ON FUNCTION ledger.ack_outbox_events(text, text) IS
    'ledger.ack_outbox_events for one event: 1 if lease_owner held it and it is now done, else 0.';
COMMENT ON FUNCTION ledger.nack_outbox_events(text, text[], text) IS
    'Reports a failed delivery of the listed events lease_owner holds (55000 OUTBOX_NOT_LEASED for any other, and nothing changes): each is pending again after min(300, 2^(n-1)) seconds for its n-th attempt since its last replay, or failed after the 64th. error_message (8192 characters at most) is kept. Returns the events.';
COMMENT ON FUNCTION ledger.nack_outbox_events(text, text, text) IS
    'ledger.nack_outbox_events for one event.';
COMMENT ON FUNCTION ledger.replay_outbox_event(text) IS
    'Puts a failed outbox event back to pending, due now, with another 64 attempts (55000 OUTBOX_NOT_FAILED otherwise). attempt_count is kept; replay_count + 1. Notifies ledger_outbox.';
COMMENT ON FUNCTION ledger.replay_outbox_event(text, text, text) IS
    'ledger.replay_outbox_event by a person, who is named (actor; NULL or empty: 22023 ARGUMENT_REQUIRED), with its audit record in the same transaction: gateway_type outbox.replay, outcome replayed, for the event''s run (audit.recorded in its feed) or with no run if it has none; payload {outbox_event_id, event_type, replay_count, note}, redacted.';
COMMENT ON FUNCTION ledger.create_task(text, jsonb, text, text) IS
    'Creates a queued task of task_type with input (a JSON object, redacted), optionally for run_id (which must exist in scope). A caller task_id is idempotent: the same type and run return the task, anything else fails 23505 IDEMPOTENCY_MISMATCH. Writes task.created to ledger.task_events.';
COMMENT ON FUNCTION ledger.transition_task(text, text, text, jsonb, jsonb, text, text) IS
    'Moves a task to to_status under the run rules: a conditional update under the row lock (55000 TRANSITION_INVALID, 40001 TRANSITION_CONFLICT with expected_status; the current status returns the row unchanged). progress is merged by top-level key, output replaced (both JSON objects, redacted). Writes task.status.';
COMMENT ON FUNCTION ledger.add_task_checkpoint(text, jsonb) IS
    'Adds a checkpoint (payload: a JSON object, redacted) to a task that is not terminal (55000 TASK_TERMINAL), numbered 1, 2, 3, ... without gaps per task. Writes task.checkpoint.';
COMMENT ON FUNCTION ledger.record_task_event(text, text, jsonb) IS
    'Appends the caller''s event (payload: a JSON object, redacted) to a task''s history, in any status. The ledger''s own types task.created, task.status, task.checkpoint and task.snapshot are refused (22023 EVENT_TYPE_RESERVED).';
COMMENT ON FUNCTION ledger.set_task_snapshot(text, jsonb) IS
    'Stores the persisted execution snapshot (a JSON object, redacted) of a task that is not terminal (55000 TASK_TERMINAL); ledger.replay_task starts from it. Writes task.snapshot.';
COMMENT ON FUNCTION ledger.retry_task(text) IS
    'Retries a failed, canceled or expired task in place (55000 TRANSITION_INVALID otherwise; TASK_REPLAYED if it was replayed): retrying, then queued, as attempt_count + 1 with errors, output and times cleared and progress {"action": "requeued"}. Writes outbox task.retried.';
COMMENT ON FUNCTION ledger.replay_task(text) IS
    'Replays a task from its snapshot in one transaction and returns the NEW task: queued, same type and input, no run, replayed_from_task_id set, snapshot without task_id and run_id (top level and in payload). The old task goes to canceled (through retrying when terminal; succeeded fails 55000 TRANSITION_INVALID) with retried_as_task_id. No snapshot: 55000 TASK_RETRY_SNAPSHOT_MISSING, nothing changed. A task already replayed returns its replacement.';

-- Run leases, the operator role and scope grants (0.5.0).
COMMENT ON FUNCTION ledger.set_concurrency_limit(text, integer) IS
    'Lets at most max_in_flight (0 to 100000; 0 pauses the key; 22023 LIMIT_INVALID) runs of concurrency_key hold a live lease at once: ledger.claim_run skips the key''s runs while it is full, never waits, and no two claims can both take the last place. NULL max_in_flight removes the limit. Returns the limit in force.';
COMMENT ON FUNCTION ledger.set_rate_limit(text, integer, integer) IS
    'Lets at most max_claims (0 to 1000000; 0 pauses the key) claims of concurrency_key''s runs fall in one window of per_seconds (1 to 86400; 22023 LIMIT_INVALID): a window starts at the first claim after the last one ended, and while it is full ledger.claim_run skips the key''s runs (also by run_id) and never waits; no two claims can both take its last claim. It stands beside the key''s concurrency limit. NULL max_claims removes it. Returns the rate in force.';
COMMENT ON FUNCTION ledger.set_budget(text, numeric, text, text, text, numeric, text, text) IS
    'Sets a budget: at most max_amount (>= 0; 22023 AMOUNT_INVALID) of unit (a currency code such as USD, tokens, tool_calls or llm_steps; 22023 UNIT_INVALID) per period (total, day or month in UTC; 22023 PERIOD_UNKNOWN) for level workspace (the scope''s), tenant (every workspace of it; 42501 TENANT_NOT_GRANTED for a role bound to some of them) or run (run_id). NULL max_amount removes it. A decision to spend (claim_tool_call(s), create_step of an llm step, claim_run) is refused while a budget that applies is used up; record_cost never refuses. warn_ratio (0 to 1, default 0.8; NULL: no warning) writes budget.warning once per window. Audited (budget.set) with actor and note. Returns the budget as ledger.budget_usage shows it (no row once removed).';
COMMENT ON FUNCTION ledger.claim_run(text, text, text[], text[], integer, boolean) IS
    'Claims a run for lease_owner: run_id, or the claimable run of the scope (filtered by modes and kinds) with the highest priority, oldest first within it, FOR UPDATE SKIP LOCKED: never waits. Claimable: not terminal, no live lease, due (not_before NULL or passed), queued or retrying or claimed before (a run nobody ever claimed stays with its caller), and with room under its concurrency key''s limit (a full key''s runs are skipped, also by run_id); the oldest-first claim skips runs with a call in doubt or waiting for approval before its deadline (they wait for a person, whose decision makes them claimable). Each claim adds 1 to the run''s run_token, leases the run for lease_seconds (1 to 86400) and writes run.claimed to its feed; the status does not change. Returns no row when nothing is claimable, else a ledger.claimed_run (takeover: the lease of previous_owner had expired). any_scope => true: across scopes, for members of ledger_operator (42501 OPERATOR_REQUIRED); scopes take turns (the one served longest ago first, then its highest priority, oldest first).';
COMMENT ON FUNCTION ledger.heartbeat_run(text, bigint, integer) IS
    'Extends the owner''s lease by extend_seconds (default: the claim''s lease_seconds) from now and returns when it ends. Fenced by run_token (40001 LEASE_STALE), not by the clock: accepted after expiry until another worker takes the run over. A terminal run: 55000 RUN_TERMINAL.';
COMMENT ON FUNCTION ledger.release_run(text, bigint) IS
    'Gives up the owner''s run: claimable at once by anyone unless it is terminal, and run_token is over (40001 LEASE_STALE on any later write carrying it).';
COMMENT ON FUNCTION ledger.wait_run(text, bigint, timestamp with time zone) IS
    'Parks the owner''s run until wake_at (a durable wait): it moves to waiting_input (55000 TRANSITION_INVALID from a status that cannot), its lease is given up (run_token is over: 40001 LEASE_STALE on any later write carrying it), and claim_run hands it out again from wake_at on (not_before), so no worker holds or polls it meanwhile. Returns the run.';
COMMENT ON FUNCTION ledger.inbox(boolean) IS
    'What waits for people in the scope: calls in doubt, pending approvals (before their deadline), runs paused by a budget that is still used up (BUDGET_EXHAUSTED; raised, the run waits for a worker, not a person) and failed outbox events, each counted with the oldest one''s time (when it went in doubt, was asked, stopped, failed). One row for the scope, zeros when nothing waits. any_scope => true: one row per scope the session may state that has something waiting, for members of ledger_operator (42501 OPERATOR_REQUIRED).';
COMMENT ON FUNCTION ledger.next_wake(boolean) IS
    'When a run of the scope next becomes claimable by the clock alone: the nearest wake time ahead of a wait or backoff (not_before), deadline of a pending approval, or end of a full rate window; NULL when none is ahead. Anything else that makes a run claimable (a new run, a release, an input, a decision, a run ending) notifies channel ledger_runs at commit, so an idle worker listens there and sleeps until next_wake at most. any_scope => true: across every scope the session may state, for members of ledger_operator (42501 OPERATOR_REQUIRED).';
COMMENT ON FUNCTION ledger.send_input(text, text, jsonb, text) IS
    'Sends run run_id the input input_key (a label; keys starting with ledger: are the ledger''s own, 22023 INPUT_KEY_RESERVED): payload (any JSON, redacted before it is stored) from sender, kept in ledger.run_mailbox. The same key again with the same payload returns the input already there; another payload fails 23505 IDEMPOTENCY_MISMATCH; a terminal run takes none (55000 RUN_TERMINAL). A run parked waiting for the key (ledger.wait_for_input) becomes claimable at once. Writes input.received to the run''s feed and an audit row (input.send) with the sender. Returns the mailbox row.';
COMMENT ON FUNCTION ledger.wait_for_input(text, bigint, text, timestamp with time zone) IS
    'The owner''s run waits for input input_key: returns {status: received, input} when it was sent, {status: timed_out} when deadline has passed without it, else {status: waiting, input}: the run moves to waiting_input (55000 TRANSITION_INVALID from a status that cannot), its lease is given up (run_token is over: 40001 LEASE_STALE on any later write carrying it), and claim_run hands it out again when the input arrives or at the deadline (none: only the input wakes it). Call it again with the same key and deadline on resume.';
COMMENT ON FUNCTION ledger.wait_for_children(text, bigint, timestamp with time zone) IS
    'The owner''s run waits for its children (the runs created with parent_run_id => run_id): returns {status: done, children} when every one has ended, {status: timed_out, children} when deadline has passed first, else {status: waiting, children}: the run is parked as ledger.wait_for_input parks it and claimable again when its last child ends or at the deadline. children: [{run_id, status, output_summary, error_code, error_message}] oldest first. Each child''s end is also put in the parent''s mailbox (input_key ledger:child:<run_id>).';
COMMENT ON FUNCTION ledger.set_schedule(text, text, text, jsonb, text, text, text, integer, text, text) IS
    'Creates or replaces schedule schedule_id: at every time cron names (five fields, minute hour day-of-month month day-of-week, or @hourly, @daily, @weekly, @monthly, @yearly; 22023 CRON_INVALID) in time_zone (a name from pg_timezone_names; 22023 TIME_ZONE_UNKNOWN), ledger.fire_schedules creates a run of mode with kind, inputs (a JSON object, redacted when set), priority and concurrency_key, request_id schedule:<schedule_id>:<firing in UTC>. catch_up (latest or all; 22023 CATCH_UP_UNKNOWN): what a sweep does with firings it finds missed (one run for the most recent, or one per firing, at most 100 per sweep). The next firing counts from now; a paused schedule stays paused. Audited (schedule.set) with actor. Returns the schedule.';
COMMENT ON FUNCTION ledger.pause_schedule(text, boolean, text) IS
    'Pauses (paused true, the default) or resumes a schedule (P0002 SCHEDULE_NOT_FOUND): paused, it fires nothing; resumed, it fires from the next time its expression names, the firings while paused skipped. Audited (schedule.set, paused or resumed) with actor. Returns the schedule.';
COMMENT ON FUNCTION ledger.drop_schedule(text, text) IS
    'Removes a schedule (the runs it created stay); returns whether it existed. Audited (schedule.set, dropped) with actor.';
COMMENT ON FUNCTION ledger.fire_schedules(boolean) IS
    'Creates the runs of every due firing of the scope''s schedules (not paused, next_fire_at passed) and moves each to its next firing; returns how many firings it ran. A firing creates one run however many sweepers fire it (its request_id), and a schedule another sweeper holds is skipped, never waited for. Run it every minute (pg_cron, or a worker''s loop). With any_scope => true (members of ledger_operator only), every scope''s.';
COMMENT ON FUNCTION ledger.grant_scope(text, text, text) IS
    'Lets login role role_name state the tenant''s workspace (NULL: every workspace of the tenant) with ledger.set_scope. The first grant binds the role: set_scope refuses it any other scope (42501 SCOPE_NOT_GRANTED), and any_scope => true reaches only its granted scopes. Returns false when the grant existed. For the extension''s owner and superusers only.';
COMMENT ON FUNCTION ledger.revoke_scope(text, text, text) IS
    'Removes the grant of exactly this tenant and workspace (NULL: the every-workspace grant) from role_name; returns whether it existed. The role stays bound: with no grant left it may state no scope (ledger.unbind_scope unbinds it). For the extension''s owner and superusers only.';
COMMENT ON FUNCTION ledger.unbind_scope(text) IS
    'Unbinds login role role_name: removes its scope grants and its binding, so that it may state any scope again; returns whether it was bound. For the extension''s owner and superusers only.';

-- Grants decide who may state which scope: no application role may read or change them.
REVOKE SELECT ON ledger.scope_grants, ledger.scope_bindings FROM ledger_reader;
REVOKE EXECUTE ON FUNCTION ledger.grant_scope(text, text, text), ledger.revoke_scope(text, text, text),
    ledger.unbind_scope(text) FROM ledger_writer;

-- ledger_dispatcher: owns the functions that find work across scopes (see schema.sql).
ALTER FUNCTION ledger_dispatch.next_run(text[], text[]) OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.due_outbox_events(integer) OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.expired_tool_call_scopes() OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.due_schedule_scopes() OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.next_wake() OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.inbox(text, text) OWNER TO ledger_dispatcher;
ALTER FUNCTION ledger_dispatch.scope_granted(text, text) OWNER TO ledger_owner;
ALTER FUNCTION ledger_dispatch.tenant_granted(text) OWNER TO ledger_owner;
GRANT USAGE ON SCHEMA ledger TO ledger_dispatcher;
GRANT EXECUTE ON FUNCTION ledger.scope_tenant(), ledger.scope_workspace(),
    ledger.budget_window(text, timestamp with time zone),
    ledger.budget_spent(text, numeric, timestamp with time zone, timestamp with time zone) TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, id, mode, kind, status, queued_at, lease_expires_at, run_token, source_run_id,
              not_before, priority, concurrency_key, error_code, updated_at),
      UPDATE (lease_owner) ON ledger.runs TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, id, status, available_at, lease_expires_at, processed_at),
      UPDATE (lease_owner) ON ledger.outbox TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, run_id, status, lease_expires_at, completed_at, updated_at) ON ledger.run_step_tool_calls TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, run_id, status, expires_at, created_at) ON ledger.approval_requests TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, concurrency_key, max_in_flight, max_per_window, window_seconds,
              window_start, window_claims) ON ledger.concurrency_limits TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, served_at) ON ledger.dispatch_turns TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, run_id, period, max_amount, spent, window_start) ON ledger.budgets TO ledger_dispatcher;
GRANT SELECT (tenant_id, workspace_id, paused, next_fire_at) ON ledger.schedules TO ledger_dispatcher;
GRANT SELECT (grantee, tenant_id, workspace_id) ON ledger.scope_grants TO ledger_dispatcher;
GRANT SELECT (grantee) ON ledger.scope_bindings TO ledger_dispatcher;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA ledger_dispatch FROM PUBLIC;
GRANT USAGE ON SCHEMA ledger_dispatch TO ledger_owner, ledger_reader;
GRANT EXECUTE ON FUNCTION ledger_dispatch.next_run(text[], text[]),
    ledger_dispatch.due_outbox_events(integer),
    ledger_dispatch.expired_tool_call_scopes(),
    ledger_dispatch.due_schedule_scopes(),
    ledger_dispatch.next_wake(),
    ledger_dispatch.inbox(text, text),
    ledger_dispatch.scope_granted(text, text),
    ledger_dispatch.tenant_granted(text) TO ledger_owner;
-- set_scope runs as its caller.
GRANT EXECUTE ON FUNCTION ledger_dispatch.scope_granted(text, text) TO ledger_reader;

-- An operator is a writer that may also claim runs and outbox events, sweep leases and fire
-- schedules across scopes (any_scope => true).
GRANT ledger_writer TO ledger_operator;
