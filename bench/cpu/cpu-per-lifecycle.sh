#!/usr/bin/env bash
# Backend CPU per tool-call lifecycle (BENCHMARKS.md, "Side by side"): one pgbench client runs
# N lifecycles (the same statements as bench/src/designs.rs) on a fresh run, and
# `perf stat -e task-clock` counts its backend's CPU time. The script's first lifecycle sleeps
# 3 s, so perf attaches before any lifecycle has run.
#
#   PGHOST=<socket dir> PGPORT=<port> PGUSER=postgres PGDATABASE=<db with ledger> \
#     bash bench/cpu/cpu-per-lifecycle.sh [N] [label]
#
# Needs psql, pgbench and perf in PATH and the rights to attach perf to the backend (root).
# ANALYZE the database once it holds a few thousand lifecycles, as the benchmark does.
set -euo pipefail
n=${1:-1500}
label=${2:-lifecycle}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run="cpu-$(date +%s)-$$"
psql -qAt -c "SELECT ledger.set_scope('bench', 'cpu')" -c "SELECT ledger.create_run('agent', run_id => '$run')" \
  -c "SELECT ledger.transition_run('$run', 'running')" >/dev/null
pgbench -n -M prepared -c 1 -t "$n" -D started=0 -D run="$run" -f "$here/lifecycle.pgbench" \
  >"$out/pgbench" 2>&1 &
bench=$!
sleep 1.5
pid=$(psql -qAt -c "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgbench'")
perf stat -e task-clock -x, -p "$pid" -o "$out/perf" &
perf=$!
wait "$bench"
wait "$perf" || true
ms=$(grep task-clock "$out/perf" | cut -d, -f1)
echo "$label: $(awk -v ms="$ms" -v n="$n" 'BEGIN {printf "%.3f", ms / n}') ms backend CPU per lifecycle ($n lifecycles)"
