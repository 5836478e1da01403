#!/usr/bin/env bash
# Upgrade parity: every frozen install script in sql/install/ (one per released version) must
# become, through `ALTER EXTENSION ledger UPDATE`, exactly what a fresh install of the current
# version is (compared with tests/schema_snapshot.sql). The frozen script of the current version
# itself must equal a fresh install: a schema change without a version bump fails here.
# Usage (from test.sh, cluster running, current build installed): upgrade.sh MAJOR DATADIR PORT WORKDIR
set -euo pipefail
cd "$(dirname "$0")/.."
. pgrx-tests/lib.sh
major=$1 data=$2 port=$3 work=$4
current=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
extdir="$("$(pg_bindir "$major")/pg_config" --sharedir)/extension"
cp tests/schema_snapshot.sql "$work/snapshot.sql"
[ "$(id -u)" -eq 0 ] && chown postgres: "$work/snapshot.sql"

snapshot() {  # snapshot DB > file
  cluster_psql "$major" "$data" "$port" -d "$1" -q -f "$work/snapshot.sql"
}
fresh_db() {  # fresh_db NAME [VERSION]
  cluster_psql "$major" "$data" "$port" -q -c "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1"
  cluster_psql "$major" "$data" "$port" -d "$1" -q -c "CREATE EXTENSION ledger${2:+ VERSION '$2'}"
}

fresh_db ledger_fresh
snapshot ledger_fresh > "$work/fresh.txt"
status=0
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
    label="frozen $version"
  else
    cp "$frozen" "$generated"
    fresh_db ledger_frozen "$version"
    cluster_psql "$major" "$data" "$port" -d ledger_frozen -q -c "ALTER EXTENSION ledger UPDATE"
    rm -f "$generated"
    label="$version updated to $current"
  fi
  snapshot ledger_frozen > "$work/frozen.txt"
  if diff -u "$work/fresh.txt" "$work/frozen.txt" > "$work/upgrade.diff"; then
    echo "upgrade parity: $label matches a fresh install ($(wc -l < "$work/fresh.txt") catalog lines)"
  else
    cat "$work/upgrade.diff"
    echo "upgrade parity: $label differs from a fresh install of $current."
    [ "$version" = "$current" ] && echo "  The schema changed: bump the version in Cargo.toml and add sql/ledger--$current--<new>.sql."
    status=1
  fi
done
exit $status
