"""Fixtures: a fresh database with the extension for each test, on the server of
LEDGER_TEST_HOST / LEDGER_TEST_PORT (a socket directory and port; user postgres)."""

import os
import re
import time
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence
from typing import Any, LiteralString

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool

from ledger_client import Ledger, ScopedLedger


def server_dsn(dbname: str) -> str:
    host = os.environ["LEDGER_TEST_HOST"]
    port = os.environ["LEDGER_TEST_PORT"]
    return f"host={host} port={port} user=postgres dbname={dbname}"


@pytest.fixture
def dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """A connection string to a new database with `CREATE EXTENSION ledger` done, dropped after."""
    name = "ledger_py_" + re.sub(r"\W", "_", request.node.name).lower()[:40]
    with psycopg.connect(server_dsn("postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with psycopg.connect(server_dsn(name), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION ledger")
    yield server_dsn(name)
    with psycopg.connect(server_dsn("postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


SCOPE = ("acme", "tests")


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Polls `check` until it holds; the timeout only stops a hung test (no timing is asserted)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def ledger(dsn: str) -> Ledger:
    """The client over a conninfo string (a connection per transaction)."""
    return Ledger(dsn)


@pytest.fixture
def pooled(dsn: str) -> Iterator[Ledger]:
    """The client over a psycopg_pool ConnectionPool that checks a connection before handing it out
    (as the manual says a service's pool should)."""
    with ConnectionPool(dsn, min_size=1, max_size=8, open=True, check=ConnectionPool.check_connection) as pool:
        yield Ledger(pool)


@pytest.fixture
def scoped(ledger: Ledger) -> ScopedLedger:
    return ledger.scoped(*SCOPE)


@pytest.fixture
def person(dsn: str) -> Iterator[psycopg.Connection[DictRow]]:
    """Someone at a psql prompt: an autocommit session in the tests' scope (the superuser, so it
    may also end leases early instead of waiting for them)."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SELECT ledger.set_scope(%s, %s)", SCOPE)
        yield conn


def one(conn: psycopg.Connection[DictRow], query: LiteralString, params: Sequence[Any] = ()) -> Any:
    """The single value of a one-row, one-column query."""
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return next(iter(row.values()))


def assert_shows_verbatim(manual: Path, example: Path) -> None:
    """The manual shows the example program once, as it is in the file, and every Python block of
    the manual compiles."""
    blocks = re.findall(r"```python\n(.*?)```", manual.read_text(encoding="utf-8"), re.S)
    assert blocks.count(example.read_text(encoding="utf-8")) == 1, f"{manual.name} must show {example.name} once, verbatim"
    for n, block in enumerate(blocks):
        compile(block, f"{manual.name} python block {n}", "exec")
