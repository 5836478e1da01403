#!/usr/bin/env python3
"""Reassembles the current upgrade script's generated part from a fresh install script.

An upgrade script (sql/ledger--<previous>--<current>.sql) is a hand-written head (new tables,
columns, indexes, policies, dispatch functions, and DROP FUNCTION of changed signatures), then
every C function of the generated install script as CREATE OR REPLACE (which binds each to the new
library), then sql/finalize.sql (ownership, privileges, comments). This keeps the head up to its
marker line and regenerates the rest. pgrx-tests/upgrade.sh checks the result against a fresh
install.

Usage: assemble-upgrade.py <sharedir>/extension/ledger--<current>.sql  (a build without pg_test)
"""
import pathlib
import re
import sys

MARKER = "-- each is bound again to this version's library)."

repo = pathlib.Path(__file__).resolve().parent.parent
install = pathlib.Path(sys.argv[1]).read_text()
current = re.search(r"ledger--([0-9.]+)\.sql$", sys.argv[1]).group(1)
[script] = [p for p in (repo / "sql").glob(f"ledger--*--{current}.sql")]
text = script.read_text()
head = text[: text.index(MARKER) + len(MARKER)] + "\n"
functions = re.findall(
    r"^CREATE  FUNCTION .*?AS 'MODULE_PATHNAME', '[^']+';$", install, flags=re.S | re.M
)
if not functions:
    sys.exit(f"no C functions found in {sys.argv[1]}")
body = "\n".join("CREATE OR REPLACE FUNCTION" + f[len("CREATE  FUNCTION"):] + "\n" for f in functions)
finalize = (repo / "sql" / "finalize.sql").read_text().split("\n", 1)[1]
script.write_text(
    head + body + "\n-- Ownership, privileges and comments, as sql/finalize.sql gives a fresh install.\n" + finalize
)
print(f"{script.name}: {len(functions)} functions")
