#!/usr/bin/env bash
# Upgrades, on the running test cluster with the current build installed.
#
# 1. Parity: every frozen install script in sql/install/ (one per released version) must become,
#    through `ALTER EXTENSION ledger UPDATE`, exactly what a fresh install of the current version
#    is (compared with tests/schema_snapshot.sql). The frozen script of the current version itself
#    must equal a fresh install: a schema change without a version bump fails here.
# 2. Rows: a database that the previous release filled through its own library (its walkthrough)
#    keeps every row through the update, and the current API reads and replays them.
#
# The current library no longer has every symbol an older version's functions name, so older
# versions run on a released library: each release's is built once from its commit and installed
# beside the current one as ledger-<version>.so.
# Usage (from test.sh, cluster running, current build installed): upgrade.sh MAJOR DATADIR PORT WORKDIR
# (LEDGER_UPGRADE_FROM=previous: see below).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
. pgrx-tests/lib.sh
major=$1 data=$2 port=$3 work=$4

# The released versions whose libraries the test builds, oldest first, each with the commit it
# was released from; the last is the release before the current version (its rows are test 2's).
# A release appends itself (and freezes its own install script in sql/install/).
RELEASES="0.2.0=f514a6dc0129ce6761d7f5038c2a38de6950ba2b 0.3.0=cf4f73f4528fb0c0024955c3329bfbf221476097 0.4.0=126578d5d2db545191b1df39c228ac1904527804 0.5.0=3ce2db75a1fef95271dc5238868bd2bdd026e5b6"
# LEDGER_UPGRADE_FROM=previous: only the previous release is updated and its library built.
# test.sh updates every release on its first PostgreSQL version only: the older update scripts
# are the same SQL on every version, and each release's library is a build per version.
if [ "${LEDGER_UPGRADE_FROM:-all}" = previous ]; then RELEASES=${RELEASES##* }; fi
PREVIOUS_VERSION=${RELEASES##* } PREVIOUS_VERSION=${PREVIOUS_VERSION%%=*}
PREVIOUS_COMMIT=${RELEASES##*=}

current=$(ledger_version)
pg_config="$(pg_bindir "$major")/pg_config"
extdir="$("$pg_config" --sharedir)/extension"
libdir="$("$pg_config" --pkglibdir)"
cp tests/schema_snapshot.sql "$work/snapshot.sql"
[ "$(id -u)" -eq 0 ] && chown postgres: "$work/snapshot.sql"

# Each release's library for this major, as $libdir/ledger-<version>.so. Its source lives outside
# the checkout (inside, cargo would take it for a member of this workspace). The releases share
# one target directory under target/: they pin the same pgrx, so cargo builds the dependencies
# they have in common (pgrx's bindings above all) once per major, not once per release. Their
# libraries have one file name there, so a release's build that cargo finds fresh could hold
# another release's library: each build is kept under its own name (version, commit, major) and
# reused, and when one is missing its source is touched, so that cargo builds it again.
for release in $RELEASES; do
  version=${release%%=*} commit=${release#*=}
  src=/tmp/ledger-release-$version
  kept=$repo/target/releases/ledger-$version-$commit-pg$major.so
  if [ ! -f "$kept" ]; then
    if [ "$(cat "$src/.commit" 2>/dev/null)" != "$commit" ]; then
      if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
        echo "upgrade: commit $commit of release $version is not in this clone (a shallow clone?)" >&2
        exit 1
      fi
      rm -rf "$src" && mkdir -p "$src"
      git archive "$commit" | tar -x -C "$src"
      echo "$commit" > "$src/.commit"
    fi
    echo "upgrade: building release $version's library for PostgreSQL $major"
    touch "$src/src/lib.rs"
    (cd "$src" && CARGO_TARGET_DIR="$repo/target/releases" cargo build --quiet --no-default-features --features "pg$major")
    cp "$repo/target/releases/debug/libledger.so" "$kept"
  fi
  cp "$kept" "$libdir/ledger-$version.so"
done
# The library a frozen version's functions are bound to: the oldest built release not older than
# it (an older version names no symbol that release lacks).
library_for() {
  local release version
  for release in $RELEASES; do
    version=${release%%=*}
    if [ "$(printf '%s\n%s\n' "$1" "$version" | sort -V | head -n 1)" = "$1" ]; then
      echo "ledger-$version"
      return
    fi
  done
  echo "upgrade: no built release for version $1" >&2
  exit 1
}
# Older versions' install scripts are in the extension directory only while a test uses them.
cleanup() {
  for release in $RELEASES; do rm -f "$libdir/ledger-${release%%=*}.so"; done
  for f in sql/install/ledger--*.sql; do
    [ "$f" = "sql/install/ledger--$current.sql" ] || rm -f "$extdir/${f#sql/install/}"
  done
}
trap cleanup EXIT

snapshot() {  # snapshot DB > file
  cluster_psql "$major" "$data" "$port" -d "$1" -q -f "$work/snapshot.sql"
}
fresh_db() {  # fresh_db NAME [VERSION]
  cluster_psql "$major" "$data" "$port" -q -c "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1"
  cluster_psql "$major" "$data" "$port" -d "$1" -q -c "CREATE EXTENSION ledger${2:+ VERSION '$2'}"
}
# install_frozen VERSION: the frozen script as that version's install script, its functions
# bound to a released library that has their symbols.
install_frozen() {
  sed "s|'MODULE_PATHNAME'|'\$libdir/$(library_for "$1")'|" "sql/install/ledger--$1.sql" > "$extdir/ledger--$1.sql"
}
# rows DB [TABLE,...]: every table of schema ledger, or only the ones named, with its row count
# (a superuser sees every scope).
rows() {
  cluster_psql "$major" "$data" "$port" -d "$1" -qAt -c "
    SELECT string_agg(c.relname || '=' || (xpath('/row/n/text()',
             query_to_xml(format('SELECT count(*) AS n FROM ledger.%I', c.relname), false, true, '')))[1]::text,
           ' ' ORDER BY c.relname)
      FROM pg_class c WHERE c.relnamespace = 'ledger'::regnamespace AND c.relkind = 'r'
       AND ('${2:-}' = '' OR c.relname = ANY (string_to_array('${2:-}', ',')))"
}

fresh_db ledger_fresh
snapshot ledger_fresh > "$work/fresh.txt"
status=0
compare() {  # compare LABEL DB
  snapshot "$2" > "$work/frozen.txt"
  if diff -u "$work/fresh.txt" "$work/frozen.txt" > "$work/upgrade.diff"; then
    echo "upgrade parity: $1 matches a fresh install ($(wc -l < "$work/fresh.txt") catalog lines)"
  else
    cat "$work/upgrade.diff"
    echo "upgrade parity: $1 differs from a fresh install of $current."
    status=1
  fi
}

for frozen in sql/install/ledger--*.sql; do
  version=${frozen#sql/install/ledger--}
  version=${version%.sql}
  generated="$extdir/ledger--$version.sql"
  if [ "$version" = "$current" ]; then
    # Install the frozen script in place of the generated one, then put that back.
    cp "$generated" "$work/generated.sql"
    cp "$frozen" "$generated"
    fresh_db ledger_frozen || { cp "$work/generated.sql" "$generated"; exit 1; }
    cp "$work/generated.sql" "$generated"
    compare "frozen $version" ledger_frozen
    if [ $status -ne 0 ]; then
      echo "  The schema changed: bump the version in Cargo.toml and add sql/ledger--$current--<new>.sql."
    fi
    continue
  fi
  if [ "${LEDGER_UPGRADE_FROM:-all}" = previous ] \
     && [ "$(printf '%s\n%s\n' "$version" "$PREVIOUS_VERSION" | sort -V | head -n 1)" != "$PREVIOUS_VERSION" ]; then
    echo "upgrade parity: $version skipped (LEDGER_UPGRADE_FROM=previous)"
    continue
  fi
  install_frozen "$version"
  fresh_db ledger_frozen "$version"
  cluster_psql "$major" "$data" "$port" -d ledger_frozen -q -c "ALTER EXTENSION ledger UPDATE"
  rm -f "$generated"
  compare "$version updated to $current" ledger_frozen
done

# Rows written by the previous release survive the update, and the current API works on them.
git show "$PREVIOUS_COMMIT:tests/pg_regress/sql/walkthrough.sql" > "$work/previous-walkthrough.sql"
[ "$(id -u)" -eq 0 ] && chown postgres: "$work/previous-walkthrough.sql"
install_frozen "$PREVIOUS_VERSION"
fresh_db ledger_rows "$PREVIOUS_VERSION"
# The walkthrough shows refused calls on purpose: run it to the end.
cluster_psql "$major" "$data" "$port" -d ledger_rows -q -v ON_ERROR_STOP=0 \
  -f "$work/previous-walkthrough.sql" > /dev/null 2>&1
# The walkthrough stores no blob: one, so that the update meets the blob store too.
cluster_psql "$major" "$data" "$port" -d ledger_rows -q -c "SELECT ledger.set_scope('acme', 'support')" \
  -c "SELECT ledger.create_run('chat', run_id => 'run-blob')" \
  -c "SELECT ledger.put_artifact('run-blob', '\\x01'::bytea)" > /dev/null
before=$(rows ledger_rows)
cluster_psql "$major" "$data" "$port" -d ledger_rows -q -c "ALTER EXTENSION ledger UPDATE"
# A real update replaces the library in place, under the same name. Here the functions the update
# did not re-create are still bound to ledger-<previous>.so, and a session that loads both
# libraries fails (both define the same GUCs): bind them to the current one, as the replacement
# would.
cluster_psql "$major" "$data" "$port" -d ledger_rows -q -c "UPDATE pg_catalog.pg_proc SET probin = '\$libdir/ledger' WHERE pronamespace = 'ledger'::regnamespace AND probin LIKE '\$libdir/ledger-%'"
rm -f "$extdir/ledger--$PREVIOUS_VERSION.sql"
# The previous release's tables: an update may add tables, never change those tables' rows.
after=$(rows ledger_rows "$(printf '%s\n' $before | sed 's/=.*//' | paste -sd, -)")
if [ "$before" != "$after" ]; then
  printf 'upgrade rows: before %s\nupgrade rows: after  %s\n' "$before" "$after"
  echo "upgrade rows: ALTER EXTENSION UPDATE from $PREVIOUS_VERSION lost or added rows."
  status=1
fi
checks=$(cluster_psql "$major" "$data" "$port" -d ledger_rows -qAt -c "
  SELECT ledger.set_scope('acme', 'support');
  SELECT concat_ws(' ',
    (SELECT count(*) FROM ledger.events_since('run-demo-1', max_events => 10000))
      = (SELECT last_seq FROM ledger.runs WHERE id = 'run-demo-1'),
    (SELECT bool_and(event_type IS NOT NULL) FROM ledger.events_since('run-demo-1', max_events => 10000)),
    ledger.claim_tool_call('run-demo-1', 'crm.lookup_order',
                           '{\"order\": 1042, \"api_key\": \"sk-live-0123456789abcdefghij\"}',
                           tool_call_id => 'call-lookup')->>'outcome' = 'replayed',
    (ledger.replay_bundle('run-demo-1')->'run'->>'id') = 'run-demo-1',
    NOT EXISTS (SELECT 1 FROM ledger.outbox WHERE event_type = 'run.status.updated' AND status <> 'done'
                   AND NOT (payload ? 'from' AND payload ? 'to' AND NOT payload ? 'old_status')),
    (SELECT count(*) FILTER (WHERE metadata ? 'actor' AND metadata ? 'decision') >= 1
            AND count(*) FILTER (WHERE metadata ? 'resolved_by' OR metadata ? 'resolution') = 0
       FROM ledger.run_step_tool_calls),
    (SELECT count(*) FILTER (WHERE event_type = 'run.status.updated' AND payload ? 'from') >= 1
            AND count(*) = (SELECT count(*) FROM ledger.outbox WHERE status = 'pending')
       FROM ledger.claim_outbox_events('upgrade-check', 1000)),
    (SELECT count(*) FROM ledger.blob_locks) = 1,
    (SELECT size_bytes FROM ledger.put_artifact('run-blob', '\\x0102'::bytea)) = 2,
    (SELECT string_agg(step_no::text, ',' ORDER BY step_no) FROM ledger.run_steps
      WHERE run_id = 'run-demo-1') = '1,2,3,4'
      AND (SELECT bool_and(priority = 0 AND not_before IS NULL) FROM ledger.runs)
      AND (SELECT run_id FROM ledger.claim_run('upgrade-worker', 'run-blob')) = 'run-blob')" | tail -n 1)
if [ "$checks" = "t t t t t t t t t t" ]; then
  echo "upgrade rows: $PREVIOUS_VERSION's rows kept through the update ($after); the current API reads and replays them"
else
  echo "upgrade rows: checks after the update failed: $checks (expected: t t t t t t t t t t)"
  status=1
fi
compare "$PREVIOUS_VERSION with rows updated to $current" ledger_rows
exit $status
