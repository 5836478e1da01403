#!/usr/bin/env bash
# The client benchmark: one durable no-op tool call through each client's helper against the same
# SQL in its raw driver, 1 client, p50 latency and calls/s side by side with the helper/raw ratio.
# Uses the running server of LEDGER_TEST_HOST / LEDGER_TEST_PORT (user postgres, as the client
# tests) and a database of its own (ledger_bench_clients, made afresh); starts no server.
#   bench/clients/run.sh [--smoke] [python] [typescript]    (default: both)
# BENCH_CALLS calls per block (default 500; smoke 50), BENCH_BLOCKS alternating blocks (default 5; smoke 1).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
: "${LEDGER_TEST_HOST:?}" "${LEDGER_TEST_PORT:?}"
calls=${BENCH_CALLS:-500} blocks=${BENCH_BLOCKS:-5}
if [ "${1:-}" = --smoke ]; then calls=${BENCH_CALLS:-50} blocks=${BENCH_BLOCKS:-1}; shift; fi
clients=${*:-python typescript}
py=${LEDGER_PYTHON:-/opt/ledger-venv/bin/python}
db=ledger_bench_clients
admin="host=$LEDGER_TEST_HOST port=$LEDGER_TEST_PORT user=postgres dbname=postgres"
"$py" - "$admin" "$db" <<'PY'
import sys, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as c:
    c.execute(f'DROP DATABASE IF EXISTS "{sys.argv[2]}" WITH (FORCE)')
    c.execute(f'CREATE DATABASE "{sys.argv[2]}"')
with psycopg.connect(sys.argv[1].replace("dbname=postgres", f"dbname={sys.argv[2]}"), autocommit=True) as c:
    c.execute("CREATE EXTENSION ledger")
PY
dsn="host=$LEDGER_TEST_HOST port=$LEDGER_TEST_PORT user=postgres dbname=$db"
url="postgresql://postgres@/$db?host=$LEDGER_TEST_HOST&port=$LEDGER_TEST_PORT"
rows=()
for c in $clients; do
  case $c in
    python) mapfile -t -O "${#rows[@]}" rows < <(PYTHONPATH="$root/clients/python/src" "$py" "$here/bench_py.py" "$dsn" "$calls" "$blocks") ;;
    typescript)
      (cd "$root/clients/typescript" && { [ -d node_modules ] || npm ci --no-audit --no-fund --loglevel=error; } && npx tsc -p .)
      mapfile -t -O "${#rows[@]}" rows < <(node "$here/bench_ts.mjs" "$url" "$calls" "$blocks") ;;
    *) echo "unknown client $c" >&2; exit 2 ;;
  esac
done
echo "1 client, $calls calls x $blocks blocks each way; one call = claim + begin + complete of a no-op tool"
echo "(python: the tool_call helper; python-handle: the three calls through the scoped handle;"
echo " raw-3: claim, begin, complete in the raw driver; raw-2: the helper's two statements in it)"
printf '%-14s %9s %9s %9s %9s %9s %9s %12s %12s\n' client "p50 ms" "raw-3" "raw-2" "calls/s" "raw-3" "raw-2" "/ raw-3 p50" "/ raw-2 p50"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f x", a/b}'; }
for r in "${rows[@]}"; do
  [[ $r == repeatable$'\t'* ]] && continue
  IFS=$'\t' read -r name hp hc rp rc p2 c2 <<<"$r"
  printf '%-14s %9s %9s %9s %9s %9s %9s %12s %12s\n' "$name" "$hp" "$rp" "$p2" "$hc" "$rc" "$c2" "$(ratio "$hp" "$rp")" "$(ratio "$hp" "$p2")"
done
echo
echo "The repeatable path (a tool safe to repeat): rep = the helper with repeatable (find_tool_call, the tool,"
echo " record_tool_call: 2 round trips, 1 commit); raw = those two statements in the raw driver; side = the"
echo " side-effecting helper above (claim and begin, the tool, complete: 2 round trips, 2 commits)"
printf '%-14s %9s %9s %9s %9s %9s %9s %8s %8s %8s %11s %11s\n' client "rep p50" "raw" "side" "rep /s" "raw /s" "side /s" "rep KB" "raw KB" "side KB" "rep / raw" "side / rep"
for r in "${rows[@]}"; do
  [[ $r == repeatable$'\t'* ]] || continue
  IFS=$'\t' read -r _ name ep ec rp rc sp sc ek rk sk <<<"$r"
  printf '%-14s %9s %9s %9s %9s %9s %9s %8s %8s %8s %11s %11s\n' "$name" "$ep" "$rp" "$sp" "$ec" "$rc" "$sc" "$ek" "$rk" "$sk" "$(ratio "$ep" "$rp")" "$(ratio "$sp" "$ep")"
done
echo "(p50 in ms; KB: WAL per call)"
