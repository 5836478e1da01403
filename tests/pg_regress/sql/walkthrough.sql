-- The ledger's main job, as a psql user sees it. `make demo` runs this file on a throwaway
-- cluster; the test suite runs it through pg_regress and compares every line.
\pset null '(null)'
-- Work as an application role: it may call the functions and SELECT the tables, never write
-- them directly, and row-level security shows it only its own scope.
SET ROLE ledger_writer;

-- 1. Everything happens in a scope: a tenant and a workspace. Without one, nothing runs.
SELECT ledger.create_run('agent');
SELECT ledger.set_scope('acme', 'support');

-- 2. A run, with its exact inputs, and an idempotent request id.
SELECT id, status, mode, attempt_no, root_run_id, input_summary
  FROM ledger.create_run('agent', inputs => '{"question": "Where is my order?", "order": 1042, "max_cost": 0.50}',
                         run_id => 'run-demo-1', request_id => 'req-1042', user_id => 'customer-7',
                         subject_id => 'support-agent', subject_version_id => 'support-agent@v3');
-- The same request again returns the same run instead of a second one.
SELECT id, status FROM ledger.create_run('agent', inputs => '{"question": "Where is my order?", "order": 1042, "max_cost": 0.50}',
                                         run_id => 'run-demo-1', request_id => 'req-1042', user_id => 'customer-7',
                                         subject_id => 'support-agent', subject_version_id => 'support-agent@v3');
-- The same request_id with anything else different is refused, naming what differs.
SELECT id FROM ledger.create_run('agent', inputs => '{"question": "Where is my refund?"}', request_id => 'req-1042');
SELECT ledger.run_inputs('run-demo-1');

-- 3. Steps, moved through the status machine.
SELECT (ledger.transition_run('run-demo-1', 'running')).status;
SELECT id, step_no, step_type, status FROM ledger.create_step('run-demo-1', 'llm', step_key => 'plan', step_id => 'step-plan');
SELECT id, status, metrics FROM ledger.transition_step('step-plan', 'running', metrics => '{"model": "small"}');
SELECT id, status, metrics, output_summary
  FROM ledger.transition_step('step-plan', 'succeeded', metrics => '{"prompt_tokens": 812}', output_summary => 'look up order 1042');
SELECT id, step_no, status FROM ledger.create_step('run-demo-1', 'tool', step_key => 'lookup', step_id => 'step-lookup');

-- 4. The rules hold: an illegal transition is refused, with a machine-readable DETAIL.
SELECT ledger.transition_step('step-plan', 'failed');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.transition_run('run-demo-1', 'queued');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- A writer that expected a status the run no longer has loses the race (and may retry).
SELECT ledger.transition_run('run-demo-1', 'paused', expected_status => 'queued');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- Asking for the status a run already has is idempotent.
SELECT id, status FROM ledger.transition_run('run-demo-1', 'running');

-- 5. Catch-up (replay #2): a client that saw events up to seq 3 asks for the rest.
SELECT seq, event_type, step_id, payload->>'to' AS "to" FROM ledger.events_since('run-demo-1') ORDER BY seq;
SELECT event_id AS cursor FROM ledger.events_since('run-demo-1') WHERE seq = 3 \gset
SELECT seq, event_type, step_id FROM ledger.events_since('run-demo-1', :'cursor');
-- Live clients LISTEN on the run's channel before reading (see the README's client contract).
SELECT ledger.run_channel('run-demo-1') LIKE 'ledger_run_%' AS channel_ok;
-- A cursor that is not an event of this run is an error, never a silent replay from the start.
SELECT * FROM ledger.events_since('run-demo-1', 'evt_unknown');
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- 6. Tool calls (replay #3). An executor claims a call; secrets in the arguments are redacted
--    before they are stored, and the request hash covers the exact arguments.
SELECT r->>'outcome' AS outcome, r->'tool_call'->>'attempt' AS attempt, r->'tool_call'->'arguments' AS stored_arguments
  FROM ledger.claim_tool_call('run-demo-1', 'crm.lookup_order', '{"order": 1042, "api_key": "sk-live-0123456789abcdefghij"}',
                              tool_call_id => 'call-lookup') AS r;
SELECT id AS call_lookup FROM ledger.run_step_tool_calls WHERE tool_call_id = 'call-lookup' \gset
-- Claims are not re-entrant: while the lease lives, the same call is busy for everyone.
SELECT ledger.claim_tool_call('run-demo-1', 'crm.lookup_order', '{"order": 1042, "api_key": "sk-live-0123456789abcdefghij"}',
                              tool_call_id => 'call-lookup')->>'outcome' AS outcome;
-- begin (COMMIT it before the request leaves), then complete with the answer. The attempt is the fencing token.
SELECT ledger.begin_tool_call(:'call_lookup', 1)->>'outcome' AS outcome;
SELECT ledger.complete_tool_call(:'call_lookup', 1, 'succeeded', '{"status": "shipped", "eta": "tomorrow"}')->>'outcome' AS outcome;
-- The same key again executes nothing: the last result comes back.
SELECT r->>'outcome' AS outcome, r->'response' AS response
  FROM ledger.claim_tool_call('run-demo-1', 'crm.lookup_order', '{"order": 1042, "api_key": "sk-live-0123456789abcdefghij"}',
                              tool_call_id => 'call-lookup') AS r;
-- The same key with other arguments is a conflict, never a silent re-execution.
SELECT ledger.claim_tool_call('run-demo-1', 'crm.lookup_order', '{"order": 9999}', tool_call_id => 'call-lookup');
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- 7. In doubt: an email was sent, then the executor died before recording the answer.
SELECT ledger.claim_tool_call('run-demo-1', 'email.send', '{"to": "customer@example.com"}', tool_call_id => 'call-email')->>'outcome' AS outcome;
SELECT id AS call_email FROM ledger.run_step_tool_calls WHERE tool_call_id = 'call-email' \gset
SELECT ledger.begin_tool_call(:'call_email', 1)->>'outcome' AS outcome;
-- (Time passes: we make the lease expire by hand, as a superuser.)
RESET ROLE;
UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 second' WHERE id = :'call_email';
SET ROLE ledger_writer;
-- The next claim does not send it again: the call is in doubt, and stays so.
SELECT ledger.claim_tool_call('run-demo-1', 'email.send', '{"to": "customer@example.com"}', tool_call_id => 'call-email')->>'outcome' AS outcome;
SELECT tool_call_id, tool_ref, attempt FROM ledger.tool_calls_in_doubt;
-- A human checks the mail log and decides.
SELECT ledger.resolve_tool_call(:'call_email', 'succeeded', '{"message_id": "<42@mail>"}',
                                note => 'found in the mail log', actor => 'ops@acme')->>'outcome' AS outcome;
-- The ledger audited the tool activity itself: claims, completions and the decision.
SELECT gateway_type, outcome, actor FROM ledger.audit_events ORDER BY created_at, id;
SELECT ledger.claim_tool_call('run-demo-1', 'email.send', '{"to": "customer@example.com"}', tool_call_id => 'call-email')->'response'->'result' AS result;

-- 8. The run ends; the terminal status goes to the outbox in the same transaction.
SELECT (ledger.transition_step('step-lookup', 'skipped')).status;
SELECT id, status, ended_at IS NOT NULL AS ended, duration_ms >= 0 AS timed
  FROM ledger.transition_run('run-demo-1', 'succeeded', output_summary => 'Order 1042 ships tomorrow.');
SELECT event_type, status, payload->>'to' AS "to" FROM ledger.outbox ORDER BY occurred_at, event_type;

-- 9. Re-running (replay #4) keeps lineage in the ledger: a new run from this one is attempt 2 of the
--    same root, and its tool calls with unchanged keys come back from the ledger.
SELECT id AS run_demo_2 FROM ledger.replay_run('run-demo-1') \gset
SELECT attempt_no, control_action, source_run_id, root_run_id, subject_version_id, ledger.run_inputs(id) AS inputs
  FROM ledger.runs WHERE id = :'run_demo_2';
SELECT r->>'outcome' AS outcome, r->'response'->'result' AS result
  FROM ledger.claim_tool_call(:'run_demo_2', 'crm.lookup_order', '{"order": 1042, "api_key": "sk-live-0123456789abcdefghij"}',
                              idempotency_key => 'tool:run-demo-1:call-lookup') AS r;
-- The whole chain, oldest first:
SELECT attempt_no, control_action, status FROM ledger.runs WHERE root_run_id = 'run-demo-1' ORDER BY attempt_no;
-- Its evidence names the result it reused and where it came from.
SELECT e->>'status' AS status, e->>'summary' AS summary,
       e->'evidence_refs'->>0 = 'run-demo-1:' || :'call_lookup' AS names_the_source_record
  FROM jsonb_array_elements(ledger.run_evidence(:'run_demo_2')) e WHERE e->>'key' = 'tool_call';

-- 10. Evidence (replay #1). Is run-demo-1 replayable from the ledger alone? Not yet:
SELECT ledger.replay_ready('run-demo-1');
-- Record what it is missing: the model's cost and what the user was shown (its tool calls were
-- audited as they ran); and, for run_evidence's egress item, the tool gateway's decision.
SELECT (ledger.record_cost('run-demo-1', 'tokens', 1200, 0.0125, 'USD', step_id => 'step-plan',
        usage => '{"prompt_tokens": 1000, "completion_tokens": 200, "latency_ms": 850}', model_ref => 'small')).amount;
SELECT (ledger.record_cost('run-demo-1', 'requests', 1, 0.01, 'EUR', usage => '{"request_count": 1}')).amount;
SELECT (ledger.record_response_event('run-demo-1', 'message', '{"text": "Order 1042 ships tomorrow."}')).event_type;
SELECT (ledger.record_audit('run-demo-1', 'gateway.request', 'allowed',
        '{"tool": "crm.lookup_order", "egress_decision": "allow", "authorization": "Bearer abc123def456"}',
        step_id => (SELECT step_id FROM ledger.run_step_tool_calls WHERE id = :'call_lookup'))).payload;
SELECT ledger.replay_ready('run-demo-1');
SELECT e->>'key' AS item, e->>'status' AS status, e->>'summary' AS summary
  FROM jsonb_array_elements(ledger.run_evidence('run-demo-1')) e;
-- The bundle: one read, every list complete and ordered, money as decimal strings per currency.
SELECT key, jsonb_typeof(value) AS type, CASE WHEN jsonb_typeof(value) = 'array' THEN jsonb_array_length(value) END AS items
  FROM jsonb_each(ledger.replay_bundle('run-demo-1')) ORDER BY key;
SELECT b->'trace_spec'->'charge_summary' AS charge_summary, b->'trace_spec'->'usage_summary' AS usage_summary
  FROM ledger.replay_bundle('run-demo-1') AS b;
SELECT id, status, steps, tool_calls, cost FROM ledger.run_overview WHERE id = 'run-demo-1';

-- 11. Controls around runs. A worker takes the most urgent due run first; a concurrency key caps
--     how many of a key's runs are in flight at once; a budget stops spending before it happens.
SELECT id FROM ledger.create_run('agent', kind => 'report', run_id => 'run-later', not_before => now() + interval '1 hour');
SELECT id FROM ledger.create_run('agent', kind => 'report', run_id => 'run-routine', concurrency_key => 'customer:42');
SELECT id FROM ledger.create_run('agent', kind => 'report', run_id => 'run-urgent', concurrency_key => 'customer:42', priority => 10);
SELECT ledger.set_concurrency_limit('customer:42', 1);
-- The urgent run first; then nothing: run-routine's key is full and run-later is not due.
SELECT run_id, run_token FROM ledger.claim_run('worker-1', kinds => '{report}');
SELECT count(*) AS claimed FROM ledger.claim_run('worker-2', kinds => '{report}');
-- A budget of one tool call for the urgent run: the first claim is handed out, the second is
-- refused (returned, not raised) and parks the run for a person.
SELECT level, unit, max_amount, remaining
  FROM ledger.set_budget('tool_calls', 1, 'run', run_id => 'run-urgent', actor => 'ops@acme');
SELECT (ledger.transition_run('run-urgent', 'running', run_token => 1)).status;
SELECT ledger.claim_tool_call('run-urgent', 'search.web', '{"q": "refund policy"}', tool_call_id => 'call-u1',
                              run_token => 1)->>'outcome' AS outcome;
SELECT r->>'outcome' AS outcome, r->'budget'->>'unit' AS unit, r->'budget'->>'spent' AS spent
  FROM ledger.claim_tool_call('run-urgent', 'search.web', '{"q": "chargebacks"}', tool_call_id => 'call-u2',
                              run_token => 1) AS r;
SELECT status, error_code FROM ledger.runs WHERE id = 'run-urgent';
SELECT event_type, payload->>'decision' AS decision FROM ledger.events_since('run-urgent') WHERE event_type LIKE 'budget.%';
-- Its worker lets it go; no worker gets it back until a person raises the budget (audited).
SELECT ledger.release_run('run-urgent', 1);
SELECT remaining, exhausted FROM ledger.set_budget('tool_calls', 2, 'run', run_id => 'run-urgent',
                                                   actor => 'ops@acme', note => 'one more search');
SELECT run_id, run_token, status FROM ledger.claim_run('worker-1', kinds => '{report}');

-- 12. Waiting without holding a worker. A run asks the customer and parks until the answer comes
--     (or its deadline); the answer, sent twice by a retrying web app, is one input.
SELECT id FROM ledger.create_run('agent', kind => 'refund', run_id => 'run-ask');
SELECT run_token FROM ledger.claim_run('worker-1', 'run-ask');
SELECT (ledger.transition_run('run-ask', 'running', run_token => 1)).status;
SELECT ledger.wait_for_input('run-ask', 1, 'refund-ok', now() + interval '2 days')->>'status' AS status;
SELECT count(*) AS claimed FROM ledger.claim_run('worker-2', 'run-ask');
-- An idle worker sleeps until the nearest wait ends (next_wake), or until a commit that may make
-- a run claimable notifies ledger_runs (as send_input below does).
SELECT ledger.next_wake() = (SELECT min(not_before) FROM ledger.runs
                              WHERE not_before > now() AND not_before < 'infinity') AS wakes_at_the_nearest_wait;
SELECT i->'payload' AS payload, i->>'sender' AS sender
  FROM ledger.send_input('run-ask', 'refund-ok', '{"answer": "yes"}', sender => 'customer') AS i;
SELECT count(*) AS inputs
  FROM ledger.send_input('run-ask', 'refund-ok', '{"answer": "yes"}', sender => 'customer') AS i
  JOIN ledger.run_mailbox m ON m.id = i->>'id';
SELECT run_token, status FROM ledger.claim_run('worker-2', 'run-ask');
SELECT (ledger.transition_run('run-ask', 'running', run_token => 2)).status;
SELECT ledger.wait_for_input('run-ask', 2, 'refund-ok', now() + interval '2 days')->'input'->'payload' AS answer;
-- It hands the shipping label to a child run and waits for it; the child's end wakes it.
SELECT id FROM ledger.create_run('agent', kind => 'label', run_id => 'run-label', parent_run_id => 'run-ask');
SELECT ledger.wait_for_children('run-ask', 2)->>'status' AS status;
SELECT (ledger.transition_run('run-label', 'running')).status;
SELECT (ledger.transition_run('run-label', 'succeeded', output_summary => 'label printed')).status;
SELECT run_token FROM ledger.claim_run('worker-1', 'run-ask');
SELECT c->>'run_id' AS child, c->>'status' AS status, c->>'output_summary' AS summary
  FROM jsonb_array_elements(ledger.wait_for_children('run-ask', 3)->'children') AS c;
-- A schedule creates a run at each firing, once whoever fires it (pg_cron calls
-- ledger.fire_schedules every minute); this one is not due yet.
SELECT to_char(next_fire_at AT TIME ZONE 'Europe/Berlin', 'HH24:MI') AS berlin, catch_up
  FROM ledger.set_schedule('nightly-digest', '30 2 * * *', 'agent', time_zone => 'Europe/Berlin',
                           actor => 'ops@acme');
SELECT ledger.fire_schedules() AS fired;
-- What waits for people in this workspace (an operator asks every scope with any_scope => true).
SELECT calls_in_doubt, pending_approvals, budget_stops, failed_outbox_events FROM ledger.inbox();

-- 13. Another workspace sees none of it.
SELECT ledger.set_scope('acme', 'billing');
SELECT count(*) AS runs_visible FROM ledger.runs;
SELECT ledger.transition_run('run-demo-1', 'failed');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.set_scope('acme', 'support');

-- The status machine itself, for reference (succeeded reaches nothing).
SELECT from_status, string_agg(to_status, ', ' ORDER BY n) AS to_statuses
  FROM ledger.status_transitions() WITH ORDINALITY AS t(resource, from_status, to_status, n)
 WHERE resource = 'run' GROUP BY from_status ORDER BY min(n);
RESET ROLE;
