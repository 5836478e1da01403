-- Every bad input gets a `ledger: ...` error with its SQLSTATE and a JSON DETAIL code, and
-- writes nothing.
\set VERBOSITY default
SET ROLE ledger_writer;
SELECT ledger.set_scope('acme', 'errors');
SELECT (ledger.create_run('chat', run_id => 'r')).id;

SELECT ledger.create_run(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.create_run('chat', inputs => '["not", "an", "object"]');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.create_run('chat', run_id => repeat('x', 129));
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.create_run('chat', run_id => 'two words');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.create_run('chat', attempt_no => 0);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.create_run('chat', source_run_id => 'missing');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.create_run('workflow', run_id => 'r');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.transition_run('r', 'finished');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.transition_run('r', 'succeeded');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.transition_run('r', 'running', expected_status => 'paused');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.transition_run('missing', 'running');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.create_step('r', NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT ledger.transition_step('missing', 'running');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT * FROM ledger.events_since('r', max_events => 0);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- Nothing of the above was written: one run, one event.
SELECT count(*) AS runs, (SELECT count(*) FROM ledger.run_events) AS events FROM ledger.runs;
SELECT (ledger.transition_run('r', 'canceled')).status;
SELECT ledger.create_step('r', 'llm');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- A read-only transaction (as on a hot standby) refuses writes with a ledger error and still reads.
BEGIN READ ONLY;
SELECT (ledger.create_run('chat', run_id => 'read-only')).id;
\echo SQLSTATE :LAST_ERROR_SQLSTATE
ROLLBACK;
BEGIN READ ONLY;
SELECT ledger.transition_run('r', 'running');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
ROLLBACK;
BEGIN READ ONLY;
SELECT count(*) AS events FROM ledger.events_since('r');
COMMIT;
-- Without scope nothing runs.
RESET ledger.tenant_id;
SELECT * FROM ledger.events_since('r');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
RESET ROLE;
