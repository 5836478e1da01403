"""The async face: :class:`AsyncLedger` over psycopg_pool's ``AsyncConnectionPool`` (or a
conninfo string) and :meth:`AsyncLedger.scoped`, with the methods, arguments and result types of
the sync handle (the same declarations, :class:`~ledger_client.client.Calls`), each awaited."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.abc import QueryNoTemplate as Query
from psycopg.rows import dict_row

from .client import Calls, OperatorCalls, conninfo_of
from .errors import translated
from .feed import afollow
from .statement import AsyncRunner, Row, Scope, Statement, scoped

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

T = TypeVar("T")


class AsyncLedgerCalls(Calls, AsyncRunner):
    """The async face of :class:`~ledger_client.client.Calls`: each method returns an awaitable
    of what the sync one returns."""


async def _fetch(cur: psycopg.AsyncCursor[Row], query: Query, params: Sequence[Any]) -> list[Row]:
    await cur.execute(query, params)
    return await cur.fetchall() if cur.description else []


class AsyncTransaction(AsyncLedgerCalls):
    """The calls on one connection inside an open transaction (``connection``: the psycopg
    ``AsyncConnection``); everything commits or rolls back together."""

    def __init__(self, connection: psycopg.AsyncConnection[Any]) -> None:
        self.connection = connection

    async def _run(self, statement: Statement[T]) -> T:
        with translated():
            async with self.connection.cursor(row_factory=dict_row) as cur:
                return statement.decode(await _fetch(cur, statement.query, statement.params))


class AsyncLedger(OperatorCalls, AsyncRunner):
    """The ledger behind a psycopg_pool ``AsyncConnectionPool`` or a conninfo string (a new
    connection per call: fine for scripts, a pool for services)."""

    def __init__(self, source: str | AsyncConnectionPool[Any]) -> None:
        self._source = source

    @asynccontextmanager
    async def connection(self, *, autocommit: bool = False) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection of the pool (or a new one), given back (closed) at the end."""
        if isinstance(self._source, str):
            async with await psycopg.AsyncConnection.connect(self._source, autocommit=autocommit) as conn:
                yield conn
            return
        async with self._source.connection() as conn:
            before = conn.autocommit
            await conn.set_autocommit(autocommit)
            try:
                yield conn
            finally:
                if not conn.closed and not conn.broken:  # a broken one the pool discards
                    await conn.rollback()
                    await conn.set_autocommit(before)

    @property
    def conninfo(self) -> str:
        """Where the ledger is: the conninfo string, or the pool's."""
        return conninfo_of(self._source)

    def scoped(self, tenant_id: str, workspace_id: str) -> AsyncScopedLedger:
        """The handle of one scope."""
        return AsyncScopedLedger(self, tenant_id, workspace_id)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncTransaction]:
        """A transaction without a scope: the operator calls, or ``set_scope`` yourself."""
        async with self.connection() as conn:
            with translated():
                async with conn.transaction():
                    yield AsyncTransaction(conn)

    async def _run(self, statement: Statement[T]) -> T:
        async with self.connection(autocommit=True) as conn:
            with translated():
                async with conn.cursor(row_factory=dict_row) as cur:
                    return statement.decode(await _fetch(cur, statement.query, statement.params))


class AsyncScopedLedger(Scope["AsyncLedger"], AsyncLedgerCalls):
    """The async handle of one scope: each call is one statement that states the scope for
    itself only, as :class:`~ledger_client.ScopedLedger`'s."""

    feed = afollow
    """The run's events, each once, in order, to the end of the run: :func:`~ledger_client.afollow`."""

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncTransaction]:
        """Several calls (or any SQL) in one transaction of this scope, committed at the end and
        rolled back on an exception."""
        async with self.ledger.transaction() as tx:
            await tx.connection.execute("SELECT ledger.set_scope(%s, %s, is_local => true)",
                                        (self.tenant_id, self.workspace_id))
            yield tx

    async def _run(self, statement: Statement[T]) -> T:
        if not statement.relation:
            async with self.transaction() as tx:
                return await tx._run(statement)
        query, params = scoped(statement, self.tenant_id, self.workspace_id)
        async with self.ledger.connection(autocommit=True) as conn:
            with translated():
                async with conn.cursor(row_factory=dict_row) as cur:
                    return statement.decode(await _fetch(cur, query, params))
