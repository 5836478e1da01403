"""Fixtures: a fresh database with the extension for each test, on the server of
LEDGER_TEST_HOST / LEDGER_TEST_PORT (a socket directory and port; user postgres)."""

import os
import re
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql


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
