#!/usr/bin/env bash
# The TypeScript client's tests: a strict build (tsc), then node's test runner over the compiled
# tests against a running server with the extension installed (LEDGER_TEST_HOST, LEDGER_TEST_PORT;
# user postgres; each test makes its own database ledger_ts_*). The follower's restart test
# (LEDGER_TEST_PGDATA, LEDGER_TEST_BINDIR) restarts that server, so it runs alone, after the rest.
# pgrx-tests/test.sh calls it; extra arguments go to `node --test`.
set -euo pipefail
cd "$(dirname "$0")"
: "${LEDGER_TEST_HOST:?}" "${LEDGER_TEST_PORT:?}"
[ -d node_modules ] || npm ci --no-audit --no-fund --loglevel=error
rm -rf dist
npx tsc -p .
node --test --test-concurrency=3 "$@" $(ls dist/test/*.test.js | grep -v restart)
node --test "$@" dist/test/*restart*.test.js
