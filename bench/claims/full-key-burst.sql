-- Claims past a burst of one key's queued runs (BENCHMARKS.md, "Claims past a full key"):
-- 10,000 queued runs of a key whose limit is full, and runs without a key behind them.
-- psql -d postgres -f bench/claims/full-key-burst.sql (a superuser; makes database ledger_burst).
DROP DATABASE IF EXISTS ledger_burst;
CREATE DATABASE ledger_burst;
\c ledger_burst
CREATE EXTENSION ledger;
SELECT ledger.set_scope('acme', 'w');
SELECT ledger.set_concurrency_limit('burst', 1);
SELECT count(ledger.create_run('agent', run_id => 'b' || lpad(i::text, 5, '0'), concurrency_key => 'burst'))
  FROM generate_series(1, 10000) i;
SELECT ledger.create_run('agent', run_id => 'z-other') IS NOT NULL;
ANALYZE;
SELECT run_id FROM ledger.claim_run('w0');                       -- b00001: the key is full now
\timing on
SELECT run_id FROM ledger.claim_run('w1');                       -- z-other, past 9,999 runs
SELECT count(*) FROM ledger.claim_run('w2');                     -- 0: only the full key's runs left
SELECT count(*) FROM ledger.claim_run('op', any_scope => true);  -- 0, across scopes
