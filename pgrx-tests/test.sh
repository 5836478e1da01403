#!/usr/bin/env bash
# Every test: first, once, formatting, lints and the plain #[test]s of the pure core
# (crates/ledger-model, no PostgreSQL); then on every supported PostgreSQL (default 15 16 17 18;
# narrow it with LEDGER_PG_VERSIONS="15") the extension's #[pg_test]s through `cargo pgrx test`,
# pg_regress, the upgrade tests, the multi-session tests and the clients' tests (clients/*/test.sh;
# the console's on the first version only)
# against a private cluster of the shipping build, then the release package (package.sh) installed
# without cargo into a clean copy of that server.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
. pgrx-tests/lib.sh

bash pgrx-tests/bootstrap.sh
VERSIONS=${LEDGER_PG_VERSIONS:-15 16 17 18}
summary=()
# Each step's heading says when it began (seconds since the start), so a log shows where the
# time goes.
t0=$(date +%s)
step() { echo "==> [$(( $(date +%s) - t0 )) s] $*"; }

step "formatting and lints"
cargo fmt --check
first=${VERSIONS%% *}
# The whole workspace; the features are the extension's (ledger-model has none).
cargo clippy --quiet --workspace --all-targets --no-default-features \
  --features "ledger/pg$first ledger/pg_test" -- -D warnings

step "the pure core's unit and property tests"
cargo test --quiet -p ledger-model

for v in $VERSIONS; do
  started=$(date +%s)
  step "PostgreSQL $v: #[pg_test]s"
  pgtest=/tmp/ledger-pgtest-$v
  rm -rf "$pgtest"
  if [ "$(id -u)" -eq 0 ]; then export CARGO_PGRX_TEST_RUNAS=postgres; fi
  CARGO_PGRX_TEST_PGDATA=$pgtest cargo pgrx test "pg$v"
  rm -rf "$pgtest"

  step "PostgreSQL $v: the upgrade tests"
  # The release build, as shipped: the package step below reuses it instead of building again.
  install_ledger "$v" --release
  work=/tmp/ledger-regress-$v
  data=$work/pgdata
  port=$((28800 + v))
  cluster_stop "$v" "$data" 2>/dev/null || true
  rm -rf "$work"
  mkdir -p "$work"
  cp -r tests/pg_regress "$work/in"
  [ "$(id -u)" -eq 0 ] && chown -R postgres: "$work"
  # The upgrade tests first, without the preload: they load older releases' libraries, which
  # define the same parameters as this one.
  cluster_start "$v" "$data" "$port"
  trap 'cluster_stop "$v" "$data" || true' EXIT
  if [ "$v" = "$first" ]; then from=all; else from=previous; fi
  LEDGER_UPGRADE_FROM=$from bash pgrx-tests/upgrade.sh "$v" "$data" "$port" "$work"
  # Then everything else with the library preloaded (the notifier worker sends notifications);
  # tests that need a server without it restart it so (tests/common/mod.rs).
  cluster_stop "$v" "$data"
  cluster_start "$v" "$data" "$port" "$PRELOAD"
  step "PostgreSQL $v: pg_regress"
  cluster_psql "$v" "$data" "$port" -q -c "CREATE DATABASE ledger_regress"
  bindir=$(pg_bindir "$v")
  regress="$($bindir/pg_config --pkglibdir)/pgxs/src/test/regress/pg_regress"
  tests=$(cd tests/pg_regress/sql && ls *.sql | sed 's/\.sql$//' | grep -v '^setup$' | sort)
  if ! as_pg "$regress" --use-existing --dbname=ledger_regress --host="$data" --port="$port" \
      --user=postgres --bindir="$bindir" --inputdir="$work/in" --outputdir="$work/out" \
      setup $tests; then
    cat "$work/out/regression.diffs" 2>/dev/null || true
    exit 1
  fi
  step "PostgreSQL $v: the multi-session tests (tests/*.rs)"
  LEDGER_TEST_HOST=$data LEDGER_TEST_PORT=$port LEDGER_TEST_PGDATA=$data LEDGER_TEST_BINDIR=$bindir \
    LEDGER_TEST_SERVER_OPTIONS="$PRELOAD" cargo test --no-default-features --features "pg$v pg_test" --test '*' -- --include-ignored --test-threads=1
  step "PostgreSQL $v: the clients (clients/*/test.sh)"
  for client in clients/*/test.sh; do
    # The console is a browser over the Python client, whose suite runs on every version: its
    # Chromium suite runs on the first version only.
    if [ "$client" = clients/console/test.sh ] && [ "$v" != "$first" ]; then continue; fi
    LEDGER_TEST_HOST=$data LEDGER_TEST_PORT=$port LEDGER_TEST_PGDATA=$data LEDGER_TEST_BINDIR=$bindir \
      LEDGER_PYTHON="${LEDGER_VENV:-/opt/ledger-venv}/bin/python" bash "$client"
  done
  cluster_stop "$v" "$data"
  trap - EXIT
  rm -rf "$work"

  step "PostgreSQL $v: the release package, installed without cargo"
  bash pgrx-tests/package-test.sh "$v"
  summary+=("PostgreSQL $v: passed in $(( $(date +%s) - started ))s")
done

printf '%s\n' "==> all tests passed" "${summary[@]}"
