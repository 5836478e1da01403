#!/usr/bin/env bash
# The release archive works without cargo: it is installed into a clean private copy of
# PostgreSQL MAJOR with the two `cp` commands of its INSTALL file (cargo kept off PATH), then
# CREATE EXTENSION, the walkthrough through pg_regress, and an update path from every released
# version (the update itself, with rows, is upgrade.sh's test: it needs the older library). The copy and its cluster live in /tmp/ledger-pkgtest-NN
# (port 287NN) and are removed at the end, also on failure.
# Usage: package-test.sh MAJOR [ARCHIVE]. Without ARCHIVE it tests this tree's archive, which
# package.sh brings up to date first (about a second when the release build is current).
set -euo pipefail
archive_arg=${2:+$(realpath "$2")}   # relative to the caller's directory
cd "$(dirname "$0")/.."
repo=$(pwd)
. pgrx-tests/lib.sh

major=$1
version=$(ledger_version)
if [ -n "$archive_arg" ]; then
  archive=$archive_arg
else
  LEDGER_PG_VERSIONS=$major bash pgrx-tests/package.sh
  archive=$repo/dist/ledger-$version-pg$major-$(uname -m).tar.gz
fi
work=/tmp/ledger-pkgtest-$major
root=$work/root          # the copy of PostgreSQL, at its original paths below this
data=$work/pgdata
port=$((28700 + major))
sys_bindir=$(pg_bindir "$major")
bindir=$root$sys_bindir
# From here on lib.sh's cluster helpers run the copy's binaries, never the system's.
pg_bindir() { echo "$bindir"; }

started=$(date +%s)
step="start"
say() { echo "package test, PostgreSQL $major: $*"; }
fail() { say "$*"; exit 1; }
finish() {
  local status=$?
  cluster_stop "$major" "$data" 2>/dev/null || true
  rm -rf "$work"
  if [ $status -ne 0 ]; then say "FAILED at step: $step"; fi
}
[ -f "$archive" ] || fail "no archive $archive"
# What a previous, interrupted run left behind.
if [ -x "$bindir/pg_ctl" ]; then cluster_stop "$major" "$data" 2>/dev/null || true; fi
rm -rf "$work"
trap finish EXIT

step="copy PostgreSQL $major"
# The installation's own directory, plus its share dir where that lies elsewhere (Debian:
# /usr/lib/postgresql/15 and /usr/share/postgresql/15), kept at the same relative layout so
# that the copied binaries find the copied share and lib dirs. `make test` installs ledger into
# the system trees; its files are left out of the copy.
mkdir -p "$root"
chmod 755 "$work"
inst=$(dirname "$sys_bindir")
for d in "$inst" "$("$sys_bindir/pg_config" --sharedir)" "$("$sys_bindir/pg_config" --pkglibdir)"; do
  case "$d" in "$inst"/*) continue ;; esac
  # ledger.so, ledger.control, ledger--*.sql and a versioned ledger-X.so; not /opt/ledger-pg.
  tar -C / --exclude='ledger.*' --exclude='ledger--*' --exclude='ledger-[0-9]*' -cf - "${d#/}" \
    | tar -C "$root" -xf -
done
config=$bindir/pg_config
pkglibdir=$("$config" --pkglibdir)
extdir="$("$config" --sharedir)/extension"
for d in "$pkglibdir" "$extdir" "$("$config" --bindir)"; do
  case "$d" in "$root"/*) ;; *) fail "the copy's pg_config points outside the copy: $d" ;; esac
done
leftover=$(find "$root" -type f \( -name 'ledger.*' -o -name 'ledger--*' -o -name 'ledger-[0-9]*' \))
[ -z "$leftover" ] || fail "the copy already holds ledger files: $leftover"
say "clean copy at $root (pkglibdir and sharedir inside it, no ledger files)"

step="install $(basename "$archive") with tar and cp"
# PATH without any directory holding cargo, cargo-pgrx or rustc (~/.cargo/bin), and the copy's
# bin first, as the INSTALL file asks.
clean_path=$bindir
IFS=: read -ra path_dirs <<< "$PATH"
for d in "${path_dirs[@]}"; do
  if [ -n "$d" ] && [ ! -e "$d/cargo" ] && [ ! -e "$d/cargo-pgrx" ] && [ ! -e "$d/rustc" ]; then
    clean_path+=":$d"
  fi
done
mkdir "$work/unpack"
env -i PATH="$clean_path" HOME="$work/unpack" LC_ALL=C bash -c '
  set -euo pipefail
  if command -v cargo || command -v cargo-pgrx || command -v rustc; then echo "a Rust tool is on PATH"; exit 1; fi
  [ "$(command -v pg_config)" = "$2/pg_config" ] || { echo "pg_config is not the copy'"'"'s"; exit 1; }
  cd "$1" && tar -xzf "$3" && cd ledger-*/
  commands=$(sed -n "s/^    \(cp .*\)/\1/p" INSTALL)
  [ "$(grep -c "^cp " <<< "$commands")" -eq 2 ] || { echo "INSTALL does not give the two cp commands"; exit 1; }
  eval "$commands"
' install "$work/unpack" "$bindir" "$archive"
shipped=$(cd "$work/unpack"/ledger-*/ && find lib extension -type f | sort)
for f in $shipped; do
  case "$f" in lib/*) dest=$pkglibdir/${f#lib/} ;; *) dest=$extdir/${f#extension/} ;; esac
  cmp -s "$work/unpack"/ledger-*/"$f" "$dest" || fail "$f was not installed as $dest"
done
say "installed $(wc -w <<< "$shipped") files with the INSTALL file's cp commands, cargo not on PATH"

step="start a cluster of the copy"
cluster_start "$major" "$data" "$port"
psql_() { cluster_psql "$major" "$data" "$port" "$@"; }
say "cluster running on port $port ($(psql_ -qAt -c 'SHOW server_version'))"

step="CREATE EXTENSION ledger"
psql_ -q -c "CREATE DATABASE ledger_pkg"
got=$(psql_ -d ledger_pkg -qAt -c "CREATE EXTENSION ledger" \
  -c "SELECT extversion FROM pg_extension WHERE extname = 'ledger'")
[ "$got" = "$version" ] || fail "CREATE EXTENSION gave version '$got', expected $version"
# The library the backend actually mapped: the copy's, not the one `make test` installs.
mapped=$(psql_ -d ledger_pkg -qAt -c "SELECT ledger.canonical_json('{}') IS NOT NULL" \
  -c "SELECT DISTINCT substring(l from '(/\S*ledger\.so)') FROM regexp_split_to_table(pg_read_file('/proc/self/maps'), E'\n') l WHERE l LIKE '%ledger.so'" | tail -n 1)
[ "$mapped" = "$pkglibdir/ledger.so" ] || fail "the backend loaded '$mapped', not $pkglibdir/ledger.so"
say "CREATE EXTENSION ledger: version $got, library $mapped"

step="walkthrough through pg_regress"
regress_dir=$work/regress
mkdir -p "$regress_dir/in/sql" "$regress_dir/in/expected"
for t in setup walkthrough; do
  cp "tests/pg_regress/sql/$t.sql" "$regress_dir/in/sql/"
  cp "tests/pg_regress/expected/$t.out" "$regress_dir/in/expected/"
done
[ "$(id -u)" -eq 0 ] && chown -R postgres: "$regress_dir"
# run_regress DB TESTS...: pg_regress of the copy, with the diff on failure.
run_regress() {
  local db=$1 out=$regress_dir/out-$1
  shift
  if ! as_pg "$pkglibdir/pgxs/src/test/regress/pg_regress" --use-existing --dbname="$db" \
      --host="$data" --port="$port" --user=postgres --bindir="$bindir" \
      --inputdir="$regress_dir/in" --outputdir="$out" "$@" > "$regress_dir/pg_regress.log" 2>&1; then
    cat "$regress_dir/pg_regress.log"
    cat "$out/regression.diffs" 2>/dev/null || true
    fail "pg_regress $* differs from tests/pg_regress/expected (diff above)"
  fi
}
psql_ -q -c "CREATE DATABASE ledger_pkg_regress"
run_regress ledger_pkg_regress setup walkthrough
say "pg_regress setup walkthrough: as expected"

step="update paths"
for frozen in sql/install/ledger--*.sql; do
  from=${frozen#sql/install/ledger--}
  from=${from%.sql}
  [ "$from" = "$version" ] && continue
  path=$(psql_ -d ledger_pkg_regress -qAt -c "SELECT path FROM pg_extension_update_paths('ledger')
    WHERE source = '$from' AND target = '$version'")
  [ -n "$path" ] || fail "the archive has no update path from $from to $version"
  say "ALTER EXTENSION ledger UPDATE from $from: path $path"
done

step="stop and clean up"
cluster_stop "$major" "$data"
rm -rf "$work"
say "passed in $(( $(date +%s) - started ))s (cluster stopped, copy removed)"
