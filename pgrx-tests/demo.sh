#!/usr/bin/env bash
# The demo: a private, throwaway PostgreSQL 15 cluster with `ledger` installed, and a
# walkthrough of the ledger's main job through psql. `make demo-stop` removes it.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
. pgrx-tests/lib.sh

MAJOR=15
PORT=${LEDGER_DEMO_PORT:-28915}
DATA=${LEDGER_DEMO_DIR:-$repo/.demo/pgdata}

if [ "${1:-}" = stop ]; then
  cluster_stop "$MAJOR" "$DATA" && rm -rf "$DATA" && echo "demo cluster stopped and removed ($DATA)"
  exit 0
fi

bash pgrx-tests/bootstrap.sh
# The postgres user must be able to reach the data directory; a checkout under /root is not
# reachable, so fall back to /tmp there.
mkdir -p "$(dirname "$DATA")"
if ! as_pg test -x "$(dirname "$DATA")"; then
  DATA=/tmp/ledger-demo/pgdata
  echo "demo: $repo is not reachable by the postgres user; using $DATA"
  mkdir -p "$(dirname "$DATA")"
fi
echo "demo: building and installing the extension into PostgreSQL $MAJOR"
install_ledger "$MAJOR"
cluster_stop "$MAJOR" "$DATA" || true
cluster_start "$MAJOR" "$DATA" "$PORT" "$PRELOAD"
cluster_psql "$MAJOR" "$DATA" "$PORT" -q -c "DROP DATABASE IF EXISTS ledger_demo" -c "CREATE DATABASE ledger_demo"
cluster_psql "$MAJOR" "$DATA" "$PORT" -d ledger_demo -q -c "CREATE EXTENSION ledger"
echo "demo: walkthrough (tests/pg_regress/sql/walkthrough.sql; its errors are on purpose)"
cluster_psql "$MAJOR" "$DATA" "$PORT" -d ledger_demo -v ON_ERROR_STOP=0 -a < tests/pg_regress/sql/walkthrough.sql
echo "demo: the whole replay bundle of run-demo-1"
cluster_psql "$MAJOR" "$DATA" "$PORT" -d ledger_demo -q -c "SELECT ledger.set_scope('acme', 'support')" \
  -c "SELECT jsonb_pretty(ledger.replay_bundle('run-demo-1')) AS replay_bundle"
psql_cmd="$(pg_bindir $MAJOR)/psql -h $DATA -p $PORT -U postgres ledger_demo"
[ "$(id -u)" -eq 0 ] && psql_cmd="sudo -u postgres $psql_cmd"
cat <<MSG

The demo cluster is still running. Explore it with:
    $psql_cmd
then, for example:
    SELECT ledger.set_scope('acme', 'support');
    SELECT id, status, attempt_no FROM ledger.runs;
The clients (clients/python, clients/typescript) and their examples connect with:
    export LEDGER_DSN='host=$DATA port=$PORT user=postgres dbname=ledger_demo'
Stop and remove it with:
    make demo-stop
MSG
