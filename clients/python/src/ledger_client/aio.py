"""The async face: :class:`AsyncLedger` over psycopg_pool's ``AsyncConnectionPool`` (or a
conninfo string) and :meth:`AsyncLedger.scoped`, with the methods, arguments and result types of
the sync handle (the same declarations, :class:`~ledger_client.client.Calls`), each awaited; and
:func:`tool_call_async`, the tool-call helper on it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.abc import QueryNoTemplate as Query
from psycopg.rows import dict_row

from ._faults import again_async
from .client import Calls, OperatorCalls, _InfinityLoader, conninfo_of
from .errors import LedgerError, translated
from .feed import afollow
from .statement import AsyncRunner, Row, Scope, Statement, scoped
from .tool_calls import ToolRequest, _ending, _recorded, _Repeat, _to_execute, positive_seconds
from .types import ClaimOutcome, ToolCall

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

T = TypeVar("T")


class AsyncLedgerCalls(Calls, AsyncRunner):
    """The async face of :class:`~ledger_client.client.Calls`: each method returns an awaitable
    of what the sync one returns."""


async def _fetch(cur: psycopg.AsyncCursor[Row], query: Query, params: Sequence[Any]) -> list[Row]:
    cur.adapters.register_loader("timestamptz", _InfinityLoader)  # as the sync face's
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


AsyncExecute = Callable[[dict[str, Any]], Awaitable[Any]]
"""An async tool: awaited with the call's arguments, returns its JSON result."""


async def _beat(ledger: AsyncScopedLedger, record: ToolCall, interval: float) -> None:
    """The attempt's heartbeats while the tool runs (cancelled when it ends)."""
    while True:
        await asyncio.sleep(interval)
        try:
            await ledger.heartbeat_tool_call(record.id, record.attempt)
        except LedgerError:
            return  # the attempt is over (released, resolved): its completion will say so
        except psycopg.OperationalError:
            continue  # the server is unreachable now: try again at the next beat


async def tool_call_async(
    ledger: AsyncScopedLedger,
    run_id: str,
    tool_call_id: str,
    tool_ref: str,
    arguments: Mapping[str, Any],
    execute: AsyncExecute,
    *,
    idempotency_key: str | None = None,
    lease_owner: str | None = None,
    timeout_seconds: int = 30,
    approval: Mapping[str, Any] | None = None,
    retry_failed: bool = False,
    run_token: int | None = None,
    heartbeat_s: float | None = None,
    in_doubt_on: tuple[type[BaseException], ...] = (TimeoutError,),
    repeatable: bool = False,
) -> Any:
    """:func:`~ledger_client.tool_call` on the async face: the same arguments, outcomes,
    exceptions, encoding and retries across a lost connection; ``execute`` is awaited, its
    heartbeats are a task of the event loop."""
    positive_seconds("heartbeat_s", heartbeat_s)
    request = ToolRequest(tool_call_id, tool_ref, arguments, execute, idempotency_key=idempotency_key,
                          timeout_seconds=timeout_seconds, approval=approval, retry_failed=retry_failed)
    if repeatable:
        repeat = _Repeat(request, run_token)
        found = await again_async(f"tool call {tool_call_id}: find", lambda: ledger.find_tool_call(run_id, **repeat.find))
        if found.outcome is not ClaimOutcome.UNRECORDED:
            return _recorded(found, tool_ref)
        try:
            result = await execute(dict(arguments))
        except Exception as e:
            failed = repeat.failed(e)
            answer = await again_async(f"tool call {tool_call_id}: record",
                                       lambda: ledger.record_tool_call(run_id, **failed))
            if answer.outcome is ClaimOutcome.RECORDED:
                raise
            return _recorded(answer, tool_ref)
        succeeded = repeat.succeeded(result)
        answer = await again_async(f"tool call {tool_call_id}: record",
                                   lambda: ledger.record_tool_call(run_id, **succeeded))
        return result if answer.outcome is ClaimOutcome.RECORDED else _recorded(answer, tool_ref)
    spec = request.spec()  # encoded before anything is written
    [claim] = await again_async(f"tool call {tool_call_id}: claim", lambda: ledger.claim_tool_calls(
        run_id, [spec], lease_owner=lease_owner, begin=True, run_token=run_token))
    record = _to_execute(claim, tool_ref)
    if record is None:
        assert claim.response is not None
        return claim.response.result
    error: Exception | None = None
    result = None
    beats = asyncio.create_task(_beat(ledger, record, heartbeat_s if heartbeat_s is not None else record.lease_seconds / 3))
    try:
        result = await execute(dict(arguments))
    except Exception as e:
        error = e
    finally:
        beats.cancel()
    ending = _ending(record, tool_ref, error, result, in_doubt_on)
    done = await again_async(f"tool call {record.id}: complete", lambda: ledger.complete_tool_call(
        record.id, record.attempt, ending.outcome, ending.result, error_message=ending.error_message))
    if ending.raised is not None:
        raise ending.raised(done) from ending.cause or error
    if error is not None:
        raise error
    return result
