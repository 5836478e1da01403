#!/usr/bin/env bash
# Release packages, one archive per supported PostgreSQL (default 15 16 17 18; narrow it with
# LEDGER_PG_VERSIONS="15"): dist/ledger-<version>-pg<NN>-<arch>.tar.gz and dist/SHA256SUMS.
# `cargo pgrx package` makes the release build and lays out the install tree under
# target/release/ledger-pgNN/<that server's own paths>; this repackages it as two directories a
# user copies: lib/ (the library) and extension/ (control file, the install script and the
# upgrade scripts). Older versions' install scripts are not shipped: their functions name
# symbols this library no longer has; a database on an older version updates with the scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
. pgrx-tests/lib.sh

VERSIONS=${LEDGER_PG_VERSIONS:-15 16 17 18}
version=$(ledger_version)
arch=$(uname -m)
dist=$repo/dist
# A fixed timestamp and owner make the tar itself reproducible from the same files.
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
mkdir -p "$dist"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

for v in $VERSIONS; do
  started=$(date +%s)
  pg_config="$(pg_bindir "$v")/pg_config"
  name=ledger-$version-pg$v-$arch
  out=$repo/target/release/ledger-pg$v
  echo "==> PostgreSQL $v: cargo pgrx package (release build)"
  rm -rf "$out"   # nothing left over from an older build may ride along
  cargo pgrx package --no-default-features --features "pg$v" --pg-config "$pg_config" --out-dir "$out" >/dev/null

  # pgrx keeps the server's absolute paths under $out.
  lib="$out$("$pg_config" --pkglibdir)"
  ext="$out$("$pg_config" --sharedir)/extension"
  pkg=$stage/$name
  mkdir -p "$pkg/lib" "$pkg/extension"
  cp "$lib/ledger.so" "$pkg/lib/"
  cp "$ext/ledger.control" "$ext/ledger--$version.sql" "$pkg/extension/"
  # pgrx copies sql/ledger--A--B.sql itself (with @CARGO_VERSION@ filled in); take its copies,
  # and fail if one is missing rather than ship an archive that cannot update.
  for up in sql/ledger--*--*.sql; do
    [ -e "$up" ] || continue
    cp "$ext/$(basename "$up")" "$pkg/extension/"
  done
  grep -q "^default_version = '$version'\$" "$pkg/extension/ledger.control"
  cat > "$pkg/INSTALL" <<EOF
ledger $version for PostgreSQL $v (Linux $arch)

Install with pg_config of your PostgreSQL $v first in PATH (on Debian and Ubuntu:
PATH=/usr/lib/postgresql/$v/bin:\$PATH), as the user that owns that installation (usually root),
from this directory:

    cp --remove-destination lib/* "\$(pg_config --pkglibdir)/"
    cp extension/* "\$(pg_config --sharedir)/extension/"

(--remove-destination writes a new file instead of overwriting a library that running servers
have loaded.) No restart is needed. Then, as a superuser, in each database that should have it:

    CREATE EXTENSION ledger;

An older ledger is updated with the same two copies and ALTER EXTENSION ledger UPDATE.

Contents:
  lib/ledger.so                  the extension's library
  extension/ledger.control       control file (default_version = '$version')
  extension/ledger--$version.sql    install script of $version
  extension/ledger--A--B.sql     upgrade scripts, for ALTER EXTENSION ledger UPDATE
  extension/ledger--X.sql        install scripts of older versions (CREATE EXTENSION ledger VERSION 'X')
EOF
  chmod 755 "$pkg" "$pkg/lib" "$pkg/extension" "$pkg/lib/ledger.so"
  chmod 644 "$pkg/INSTALL" "$pkg"/extension/*
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$epoch" -C "$stage" -cf - "$name" \
    | gzip -n -9 > "$dist/$name.tar.gz.tmp"
  mv "$dist/$name.tar.gz.tmp" "$dist/$name.tar.gz"
  rm -rf "$pkg"
  echo "    dist/$name.tar.gz ($(tar -tzf "$dist/$name.tar.gz" | grep -vc '/$') files, $(du -k "$dist/$name.tar.gz" | cut -f1) KB) in $(( $(date +%s) - started ))s"
done

# Checksums of this version's archives, whichever versions of PostgreSQL were packaged so far.
(cd "$dist" && sha256sum ledger-"$version"-pg*-"$arch".tar.gz > SHA256SUMS)
echo "==> dist/SHA256SUMS:"
sed 's/^/    /' "$dist/SHA256SUMS"
