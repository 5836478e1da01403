# Shared shell helpers for the demo and the test runner (sourced, not executed).
# Postgres refuses to run as root, so every server command runs as the `postgres` user when
# the caller is root; every directory that user writes lives under /tmp unless it can reach
# the checkout.

PG_ROOT=${LEDGER_PG_ROOT:-/opt/ledger-pg}

pg_bindir() {
  case "$1" in
    15) echo /usr/lib/postgresql/15/bin ;;
    *) echo "$PG_ROOT/$1/bin" ;;
  esac
}

as_pg() {
  if [ "$(id -u)" -eq 0 ]; then sudo -u postgres -- "$@"; else "$@"; fi
}

# cluster_start MAJOR DATADIR PORT [SERVER OPTIONS]: a private cluster, socket in DATADIR, no TCP
# listener. The options (e.g. "$PRELOAD") go to the server's command line, which pg_ctl restart keeps.
cluster_start() {
  local major=$1 data=$2 port=$3 options=${4:-} bin
  bin=$(pg_bindir "$major")
  if [ ! -f "$data/PG_VERSION" ]; then
    mkdir -p "$data"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$data"
    chmod 700 "$data"
    as_pg "$bin/initdb" -D "$data" -U postgres --auth=trust --encoding=UTF8 --no-locale >/dev/null
  fi
  as_pg "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w -o "-p $port -k $data -c listen_addresses='' $options" start >/dev/null
}

cluster_stop() {
  local major=$1 data=$2
  [ -f "$data/postmaster.pid" ] || return 0
  as_pg "$(pg_bindir "$major")/pg_ctl" -D "$data" -m fast -w stop >/dev/null
}

# The library preloaded, so that the notifier worker sends the notifications (ledger.notify = worker),
# and prepared transactions allowed (the notifier tests prepare some).
PRELOAD="-c shared_preload_libraries=ledger -c max_prepared_transactions=8"

# cluster_psql MAJOR DATADIR PORT [psql args...]
cluster_psql() {
  local major=$1 data=$2 port=$3
  shift 3
  as_pg "$(pg_bindir "$major")/psql" -h "$data" -p "$port" -U postgres -X -v ON_ERROR_STOP=1 "$@"
}

# install_ledger MAJOR [--release]: builds and installs the extension into that server.
install_ledger() {
  local major=$1 pg_config
  pg_config="$(pg_bindir "$major")/pg_config"
  cargo pgrx install ${2:-} --no-default-features --features "pg$major" --pg-config "$pg_config" >/dev/null
}

# ledger_version: the extension's version, from Cargo.toml (run from the checkout).
ledger_version() {
  sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1
}
