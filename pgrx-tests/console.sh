#!/usr/bin/env bash
# `make console`: the operator console (clients/console) on the demo cluster of `make demo`
# (started first when it is not running), as the login role `ledger_console` (ledger_writer, bound
# to the scope acme/support), with one person, `demo`, whose new password it prints. Serves on
# 127.0.0.1 only (LEDGER_CONSOLE_PORT, default 8765); Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
. pgrx-tests/lib.sh

MAJOR=15
PORT=${LEDGER_DEMO_PORT:-28915}
running() { [ -S "$1/.s.PGSQL.$PORT" ]; }
# demo.sh's data directory: the repository's .demo, or /tmp when the postgres user cannot reach it.
DATA=${LEDGER_DEMO_DIR:-$repo/.demo/pgdata}
running "$DATA" || ! running /tmp/ledger-demo/pgdata || DATA=/tmp/ledger-demo/pgdata
if ! running "$DATA"; then
  echo "console: the demo cluster is not running; starting it (make demo)"
  bash pgrx-tests/demo.sh
  running "$DATA" || DATA=/tmp/ledger-demo/pgdata
fi
bash pgrx-tests/bootstrap.sh >/dev/null

cluster_psql "$MAJOR" "$DATA" "$PORT" -d ledger_demo -q <<'SQL'
DO $$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'ledger_console') THEN
    CREATE ROLE ledger_console LOGIN;
  END IF;
  IF NOT pg_has_role('ledger_console', 'ledger_writer', 'MEMBER') THEN
    GRANT ledger_writer TO ledger_console;
  END IF;
END $$;
SELECT ledger.grant_scope('ledger_console', 'acme', 'support') \g /dev/null
SQL

py=${LEDGER_PYTHON:-/opt/ledger-venv/bin/python}
export PYTHONPATH=$repo/clients/python/src:$repo/clients/console/src
users=${LEDGER_CONSOLE_USERS:-$(dirname "$DATA")/console-users.json}
password=$("$py" -c 'import secrets; print(secrets.token_urlsafe(12))')
printf '%s\n' "$password" | "$py" -m ledger_console --users-file "$users" users add demo --password-stdin >/dev/null
cat <<MSG
console: sign in as demo with the password $password
console: (more people: PYTHONPATH=$PYTHONPATH $py -m ledger_console --users-file $users users add NAME)
MSG
export LEDGER_CONSOLE_DSN="host=$DATA port=$PORT user=ledger_console dbname=ledger_demo"
export LEDGER_CONSOLE_SCOPES=acme/support
exec "$py" -m ledger_console --users-file "$users" serve --port "${LEDGER_CONSOLE_PORT:-8765}"
