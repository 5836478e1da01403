"""Server-Sent Events over plain ASGI, with one LISTEN connection for many browser streams.

An `EventHub` holds the only connection that LISTENs: it LISTENs on a run's channel while at least
one stream follows that run (reference-counted LISTEN/UNLISTEN), wakes every stream of a channel
on a notification, and after a dropped connection reconnects, LISTENs again and wakes every stream
(notifications sent in between are lost, the rows are not). Streams read the rows through a small
connection pool, each read a short transaction with the scope set transaction-locally, and each
stream also reads again every `wait_s` without a notification (the README's backstop). `sse_app`
turns a hub into an ASGI endpoint; it needs no web framework, so it mounts in Starlette, FastAPI or
any ASGI server. Needs the `pool` extra (psycopg-pool).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import asdict
from types import FrameType
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.rows import BaseRowFactory, TupleRow, class_row, tuple_row
from psycopg_pool import AsyncConnectionPool, PoolClosed

from .errors import LedgerError, ScopeError, raise_translated
from .feed import (
    CURSOR_ENDS_RUN,
    EVENTS_SINCE,
    RUN_CHANNEL,
    SET_SCOPE_LOCAL,
    Reconnect,
    listen,
    retry_after,
)
from .types import RunEvent

__all__ = ["EventHub", "RunStream", "sse_app"]

log = logging.getLogger(__name__)
R = TypeVar("R")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
LedgerScope = tuple[str, str]
Pool = AsyncConnectionPool[psycopg.AsyncConnection[TupleRow]]
ScopeOf = Callable[[Scope], "LedgerScope | None | Awaitable[LedgerScope | None]"]


class EventHub:
    """One LISTEN connection and a small read pool shared by every stream of a process.

    Use it from one event loop. It opens on first use (or `await hub.open()`, or `async with
    hub`) and keeps reconnecting its LISTEN connection after a drop, forever, backing off per
    `reconnect`; a stream that cannot get its LISTEN in place within `listen_timeout_s` fails with
    TimeoutError. Pass `pool` to share an application's AsyncConnectionPool; otherwise the hub
    opens its own of `pool_size` connections on `conninfo` (and closes it in `close`, which is
    final).
    """

    def __init__(
        self,
        conninfo: str,
        *,
        pool: Pool | None = None,
        pool_size: int = 4,
        reconnect: Reconnect = Reconnect(),
        listen_timeout_s: float = 10.0,
    ) -> None:
        self._conninfo = conninfo
        self._own_pool = pool is None
        self._pool: Pool = pool if pool is not None else AsyncConnectionPool(
            conninfo,
            min_size=1,
            max_size=pool_size,
            open=False,
            check=AsyncConnectionPool.check_connection,  # a connection broken by a restart is replaced
        )
        self._reconnect = reconnect
        self._listen_timeout_s = listen_timeout_s
        self._streams: dict[str, set[asyncio.Event]] = {}  # channel -> the wake-up of each stream
        self._listening: set[str] = set()  # channels LISTENed on the current connection
        self._changed = asyncio.Event()  # _streams gained or lost a channel
        self._synced = asyncio.Condition()  # notified after each LISTEN/UNLISTEN round
        self._opening = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def channels(self) -> frozenset[str]:
        """The channels the hub's connection LISTENs on now."""
        return frozenset(self._listening)

    async def open(self) -> None:
        async with self._opening:
            if self._task is None:
                if self._own_pool:
                    await self._pool.open()
                self._task = asyncio.create_task(self._serve())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self._listening.clear()
        if self._own_pool:
            await self._pool.close()

    async def __aenter__(self) -> EventHub:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def follow(
        self,
        tenant: str,
        workspace: str,
        run_id: str,
        *,
        cursor: str | None = None,
        wait_s: float = 15.0,
        page: int = 1000,
    ) -> AsyncIterator[RunStream]:
        """Follow a run in the scope (tenant, workspace) after `cursor`: LISTEN first (through the
        hub), then the first read, so that an unknown run or cursor, a bad id or a refused scope
        raises here, before anything is sent. Iterate the stream for the events."""
        await self.open()
        stream = RunStream(self, (tenant, workspace), run_id, cursor, wait_s, page)
        channel = _first(await self._read(stream.scope, RUN_CHANNEL, (run_id,), tuple_row))
        self._streams.setdefault(channel, set()).add(stream._wake)
        self._changed.set()
        try:
            async with self._synced:
                await asyncio.wait_for(
                    self._synced.wait_for(lambda: channel in self._listening), self._listen_timeout_s
                )
            await stream._start()
            yield stream
        finally:
            wakes = self._streams[channel]
            wakes.discard(stream._wake)
            if not wakes:
                del self._streams[channel]
                self._changed.set()

    async def _read(
        self, scope: LedgerScope, query: str, params: tuple[Any, ...], rows: BaseRowFactory[R]
    ) -> list[R]:
        """One query in a short transaction of a pooled connection, with the scope set
        transaction-locally (the connection goes back to the pool with none), retried per
        `reconnect` after a lost connection or a restart."""
        failures = 0
        while True:
            try:
                async with self._pool.connection() as conn, conn.transaction():
                    await conn.execute(SET_SCOPE_LOCAL, scope)
                    return await (await conn.cursor(row_factory=rows).execute(query, params)).fetchall()
            except psycopg.Error as exc:
                failures += 1
                delay = None if isinstance(exc, PoolClosed) else retry_after(exc, self._reconnect, failures)
                if delay is None:  # a ledger error, the retries are used up, or the hub was closed
                    raise_translated(exc)
                await asyncio.sleep(delay)

    async def _serve(self) -> None:
        """The LISTEN connection's life: connect, LISTEN/UNLISTEN to match the streams, hand
        notifications out until the streams change, again; after a drop, back off and reconnect."""
        failures = 0
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True) as conn:
                    while True:
                        await self._sync(conn)
                        failures = 0
                        await self._dispatch_until_changed(conn)
            except psycopg.Error as exc:
                self._listening.clear()
                failures += 1
                log.warning("ledger event hub: LISTEN connection lost (%s); reconnecting", exc)
                await asyncio.sleep(self._reconnect.delay(failures))

    async def _sync(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._changed.clear()
        wanted = set(self._streams)
        for channel in sorted(wanted - self._listening):
            await conn.execute(listen(channel))
            self._listening.add(channel)
            # New LISTEN (or again after a drop): what was sent before it is read, not heard.
            for wake in self._streams.get(channel, ()):
                wake.set()
        for channel in sorted(self._listening - wanted):
            await conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))
            self._listening.discard(channel)
        async with self._synced:
            self._synced.notify_all()

    async def _dispatch_until_changed(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Wake the streams of each notification's channel until the set of channels changes (the
        connection can only LISTEN once its notifications generator is closed)."""

        async def dispatch() -> None:
            async for note in conn.notifies():
                for wake in self._streams.get(note.channel, ()):
                    wake.set()

        await _until(dispatch(), self._changed.wait())


class RunStream:
    """A run followed through an `EventHub` (see `EventHub.follow`).

    Iterating yields the events after the cursor, each once, in seq order, until the one that ended
    the run, and None each time `wait_s` passed with nothing new (time for a heartbeat; the stream
    has just read again). `ended` is true when the cursor already was the run's ending event:
    nothing will come.
    """

    def __init__(
        self, hub: EventHub, scope: LedgerScope, run_id: str, cursor: str | None, wait_s: float, page: int
    ) -> None:
        self._hub = hub
        self.scope = scope
        self.run_id = run_id
        self.cursor = cursor
        self._wait_s = wait_s
        self._page = page
        self._wake = asyncio.Event()
        self.ended = False
        self._pending: list[RunEvent] = []

    async def _start(self) -> None:
        if self.cursor is not None:
            ends = await self._hub._read(self.scope, CURSOR_ENDS_RUN, (self.run_id, self.cursor), tuple_row)
            self.ended = bool(_first(ends))
        await self._next_page()

    async def _next_page(self) -> None:
        self._wake.clear()  # before the read: a notification during it wakes the next wait
        params = (self.run_id, self.cursor, self._page)
        self._pending = await self._hub._read(self.scope, EVENTS_SINCE, params, class_row(RunEvent))

    async def __aiter__(self) -> AsyncIterator[RunEvent | None]:
        if self.ended:
            return
        while True:
            for event in self._pending:
                self.cursor = event.event_id
                yield event
                if event.ends_run:
                    return
            if len(self._pending) < self._page:
                try:
                    await asyncio.wait_for(self._wake.wait(), self._wait_s)
                except TimeoutError:
                    yield None
            await self._next_page()


def _first(rows: list[tuple[Any, ...]]) -> Any:
    return rows[0][0] if rows else None


# --- Errors: the one place that turns a ledger error into an HTTP status. ---

_STATUS = {
    "RUN_NOT_FOUND": 404,  # unknown, or not in the caller's scope: the same answer
    "EVENT_NOT_FOUND": 400,  # a Last-Event-ID that is not an event of this run
    "ID_INVALID": 400,
    "ARGUMENT_REQUIRED": 400,
}


def _http_status(exc: LedgerError) -> int | None:
    if exc.code in _STATUS:
        return _STATUS[exc.code]
    if isinstance(exc, ScopeError):  # the scope the application chose is refused
        return 403
    return None


def _last_segment(scope: Scope) -> str:
    return str(scope["path"]).rstrip("/").rsplit("/", 1)[-1]


def sse_app(
    hub: EventHub,
    scope_of: ScopeOf,
    *,
    run_id_of: Callable[[Scope], str] = _last_segment,
    wait_s: float = 15.0,
    page: int = 1000,
) -> ASGIApp:
    """An ASGI app streaming a run's events as `text/event-stream`.

    GET `.../<run_id>` (or what `run_id_of` reads from the ASGI scope). `scope_of(asgi_scope)`,
    plain or async, returns the ledger scope (tenant, workspace) of the request, or None to refuse
    it (403): authenticating the caller and choosing the scope it may read is the application's
    job. Each event is sent as `id: <event_id>`, `event: <event_type>`, `data: <the event as
    JSON>`; a `Last-Event-ID` header resumes after that event; a comment line every `wait_s`
    without events keeps proxies from closing the stream. The response ends after the event that
    ended the run, and a request resuming after that event gets 204 (which tells EventSource to
    stop reconnecting). An unknown run (or one in another scope) is 404, a bad run id or an unknown
    Last-Event-ID 400. Serving the app directly, its lifespan opens and closes the hub. SIGTERM or
    SIGINT ends the open streams (cleanly: the browser reconnects, with its Last-Event-ID), so that
    the server, which waits for open responses before it shuts down, can stop.
    """
    shutdown = asyncio.Event()
    signals_chained = False

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal signals_chained
        if not signals_chained:
            signals_chained = True
            _set_on_signals(shutdown)
        if scope["type"] == "lifespan":
            await _lifespan(hub, receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["method"] != "GET":
            await _plain(send, 405, "only GET", [(b"allow", b"GET")])
            return
        chosen = scope_of(scope)
        ledger_scope: LedgerScope | None = await chosen if inspect.isawaitable(chosen) else chosen
        if ledger_scope is None:
            await _plain(send, 403, "forbidden")
            return
        headers = dict(scope["headers"])
        cursor = headers.get(b"last-event-id", b"").decode("latin-1").strip() or None
        async with AsyncExitStack() as stack:
            try:
                stream = await stack.enter_async_context(
                    hub.follow(*ledger_scope, run_id_of(scope), cursor=cursor, wait_s=wait_s, page=page)
                )
            except LedgerError as exc:
                status = _http_status(exc)
                if status is None:
                    raise
                # The ledger's message says what was wrong with the request; a refused scope's
                # says nothing the caller needs.
                await _plain(send, status, "forbidden" if status == 403 else exc.message)
                return
            except TimeoutError:
                await _plain(send, 503, "no LISTEN connection")
                return
            if stream.ended:
                await _plain(send, 204, "")
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
                    ],
                }
            )
            if not await _until_disconnect(_write(stream, send), receive, shutdown):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def _set_on_signals(shutdown: asyncio.Event) -> None:
    """Chains a handler that sets `shutdown` in front of the server's SIGTERM and SIGINT handlers
    (uvicorn's, which stop it): the server waits for open responses to end before it shuts down,
    and a stream ends only with its run. Signals reach only the main thread's handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            loop.call_soon_threadsafe(shutdown.set)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:  # as if this handler were not there: the default action
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        signal.signal(sig, handler)


async def _write(stream: RunStream, send: Send) -> None:
    try:
        async for event in stream:
            await send({"type": "http.response.body", "body": _frame(event), "more_body": True})
    except (psycopg.Error, LedgerError) as exc:  # the reads kept failing: end; the browser resumes with Last-Event-ID
        log.warning("ledger SSE stream of run %s ended by %s", stream.run_id, exc)


def _frame(event: RunEvent | None) -> bytes:
    if event is None:
        return b": keepalive\n\n"
    data = json.dumps({**asdict(event), "created_at": event.created_at.isoformat()}, separators=(",", ":"))
    return f"id: {event.event_id}\nevent: {event.event_type}\ndata: {data}\n\n".encode()


async def _until_disconnect(writing: Awaitable[None], receive: Receive, shutdown: asyncio.Event) -> bool:
    """Run the stream until it ends, the server shuts down or the client goes away (True); the
    end cancels it, which ends the stream's interest in its channel (and the hub UNLISTENs when it
    was the last)."""
    left = asyncio.Event()

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        left.set()

    await _until(writing, disconnected(), shutdown.wait())
    return left.is_set()


async def _until(main: Awaitable[None], *stops: Awaitable[object]) -> None:
    """Run `main` until it ends or one of `stops` does, then cancel the others; an error of `main`
    is raised."""
    work, stopped = asyncio.ensure_future(main), [asyncio.ensure_future(stop) for stop in stops]
    try:
        await asyncio.wait({work, *stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, *stopped):
            task.cancel()
        await asyncio.gather(work, *stopped, return_exceptions=True)
    if not work.cancelled():
        work.result()


async def _plain(
    send: Send, status: int, text: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8"), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": text.encode()})


async def _lifespan(hub: EventHub, receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await hub.open()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await hub.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
