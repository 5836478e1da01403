#!/usr/bin/env bash
# WAL and backend CPU per tool-call lifecycle, with the WAL broken down by record type
# (BENCHMARKS.md, "Fewer bytes per call"): one pgbench client runs N lifecycles
# (bench/cpu/lifecycle.pgbench, the statements of bench/src/designs.rs) on a fresh run after
# a warm-up of the same size; the WAL insert position is read before and after, `perf stat`
# counts the backend's CPU and `pg_waldump` splits the WAL between the two positions by record
# type and by relation. Run it on a quiet cluster (nothing else writing, autovacuum off for
# stable figures) with the extension created:
#
#   PGHOST=<socket dir> PGPORT=<port> PGUSER=postgres PGDATABASE=<db> PGDATA=<data dir> \
#     bash bench/cpu/wal-per-lifecycle.sh [N] [label]
#
# Needs psql, pgbench, pg_waldump (of the server's version, in PATH), perf and the rights to read
# the data directory and attach perf to the backend (root).
set -euo pipefail
n=${1:-1000}
label=${2:-lifecycle}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
q() { psql -qAtX "$@"; }
lifecycles() { # RUN COUNT
  pgbench -n -M prepared -c 1 -t "$2" -D started=0 -D run="$1" -f "$here/lifecycle.pgbench" \
    >"$out/pgbench" 2>&1 || { cat "$out/pgbench" >&2; exit 1; }
}
new_run() {
  q -c "SELECT ledger.set_scope('bench', 'cpu')" -c "SELECT ledger.create_run('agent', run_id => '$1')" \
    -c "SELECT ledger.transition_run('$1', 'running')" >/dev/null
}
tag="wal-$(date +%s)-$$"
new_run "$tag-warm"
lifecycles "$tag-warm" "$n"
# No CHECKPOINT: the warm-up has already written the full-page images of the pages both touch.
q -c "ANALYZE"
new_run "$tag"
start=$(q -c "SELECT pg_current_wal_insert_lsn()")
lifecycles "$tag" "$n" &
bench=$!
sleep 1.5
pid=$(q -c "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgbench'")
perf stat -e task-clock -x, -p "$pid" -o "$out/perf" &
perf=$!
wait "$bench"
wait "$perf" || true
end=$(q -c "SELECT pg_current_wal_insert_lsn()")
bytes=$(q -c "SELECT pg_wal_lsn_diff('$end', '$start')")
ms=$(grep task-clock "$out/perf" | cut -d, -f1)
echo "$label: $(awk -v b="$bytes" -v n="$n" 'BEGIN {printf "%.0f", b / n}') WAL bytes and" \
  "$(awk -v ms="$ms" -v n="$n" 'BEGIN {printf "%.3f", ms / n}') ms backend CPU per lifecycle ($n lifecycles)"
# Per record type, per lifecycle: records, bytes (record + full-page images), largest first;
# then the total without full-page images (they depend on when the last checkpoint was).
pg_waldump --path="${PGDATA:?}/pg_wal" --start="$start" --end="$end" --stats=record 2>/dev/null |
  awk -v n="$n" '{ gsub(/\([^)]*\)/, "") } $1 ~ /\// && $2 ~ /^[0-9]+$/ {
      printf "  %-28s %6.1f records %6.0f bytes (%.0f of them full-page images)\n", $1, $2 / n, $5 / n, $4 / n
      rec += $3 } END { printf "  %-28s %6s         %6.0f bytes\n", "(all, without full pages)", "", rec / n }' |
  sort -k4 -n -r | head -n 30
# Per relation (a table or an index; records of no relation, such as commits, under "-"), per
# lifecycle, largest first.
q -c "SELECT relfilenode, relname FROM pg_class WHERE relnamespace = 'ledger'::regnamespace AND relfilenode <> 0" \
  -F ' ' >"$out/rels"
pg_waldump --path="$PGDATA/pg_wal" --start="$start" --end="$end" 2>/dev/null |
  awk -v n="$n" 'NR == FNR { name[$1] = $2; next }
    { split($0, a, "len \\(rec/tot\\): *"); split(a[2], b, "[/,]"); bytes = b[2] + 0
      rel = "-"; if (match($0, /rel [0-9]+\/[0-9]+\/[0-9]+/)) {
        split(substr($0, RSTART + 4, RLENGTH - 4), r, "/"); rel = (r[3] in name) ? name[r[3]] : r[3] }
      sum[rel] += bytes }
    END { for (k in sum) printf "  %-40s %6.0f bytes\n", k, sum[k] / n }' "$out/rels" - |
  sort -k2 -n -r
