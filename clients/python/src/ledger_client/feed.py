"""Following a run's feed: every event exactly once, in order, across reconnects and restarts.

This is the README's catch-up contract ("Catching up"), kept in one place: (1) LISTEN on
`ledger.run_channel(run_id)` first, (2) read `ledger.events_since(run_id, cursor)` with the last
event id as an exclusive cursor, again while pages come back full, (3) on a notification, or after
`wait_s` without one (the backstop for a notification lost in a crash), read again. After a lost
connection or a server restart the follower starts again at (1) with its cursor, so nothing is
lost (LISTEN comes before the read) and nothing is repeated (the cursor is exclusive). It returns
after the event with `ends_run = true`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from psycopg import sql
from psycopg.rows import class_row

from .errors import LedgerError, raise_translated, translate
from .types import RunEvent

__all__ = ["Reconnect", "afollow", "follow"]


class Scoped(Protocol):
    """A scoped handle (sync or async): where the follower connects, and the scope it states."""

    tenant_id: str
    workspace_id: str

    @property
    def conninfo(self) -> str: ...


@dataclass(frozen=True)
class Reconnect:
    """How to retry after a lost connection or a server that is restarting.

    The delay doubles from `initial_s` up to `max_s`, with jitter so that many followers cut off
    together do not come back in step. `retries` bounds the reconnections tried in a row without
    reading anything (None: keep trying); past it the last error is raised.
    """

    initial_s: float = 0.1
    max_s: float = 5.0
    retries: int | None = None

    def delay(self, failures: int) -> float:
        """Seconds to wait after `failures` consecutive failures (1 or more)."""
        return random.uniform(0.5, 1.0) * min(self.max_s, self.initial_s * 2.0 ** min(failures - 1, 30))


# --- Errors: the one place that decides which server errors a reader retries. ---


def retry_after(exc: psycopg.Error, policy: Reconnect, failures: int) -> float | None:
    """Seconds to wait before reconnecting after `exc`, or None when it must be raised.

    Only a lost connection or a server shutting down or starting up is worth a retry; an error the
    ledger raised (an unknown run or cursor, a bad id, a missing scope) stays the caller's.
    """
    if not isinstance(exc, psycopg.OperationalError) or isinstance(translate(exc), LedgerError):
        return None
    if policy.retries is not None and failures > policy.retries:
        return None
    return policy.delay(failures)


# --- The statements of the contract, shared with the SSE hub. ---

SET_SCOPE = "SELECT ledger.set_scope(%s, %s)"
SET_SCOPE_LOCAL = "SELECT ledger.set_scope(%s, %s, is_local => true)"
RUN_CHANNEL = "SELECT ledger.run_channel(%s)"
EVENTS_SINCE = (
    "SELECT event_id, seq, event_type, step_id, payload, created_at, ends_run"
    "  FROM ledger.events_since(%s, %s, %s)"
)
# Whether the cursor itself is the event that ended the run (a follower resumed after the end
# returns at once instead of waiting): the extension's own ends_run of that row, read by asking
# for the one event after its predecessor. No row: the cursor is not an event of the run (the
# read that follows fails EVENT_NOT_FOUND). The scope is explicit because a role with BYPASSRLS
# sees every scope's rows.
CURSOR_ENDS_RUN = """
SELECT e.ends_run
  FROM ledger.run_events c
 CROSS JOIN LATERAL ledger.events_since(
         c.run_id,
         (SELECT p.id FROM ledger.run_events p
           WHERE (p.tenant_id, p.workspace_id, p.run_id, p.seq)
               = (c.tenant_id, c.workspace_id, c.run_id, c.seq - 1)),
         1) e
 WHERE (c.tenant_id, c.workspace_id) = (ledger.scope_tenant(), ledger.scope_workspace())
   AND c.run_id = %s AND c.id = %s
"""


def listen(channel: str) -> sql.Composed:
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))


def _first(row: tuple[Any, ...] | None) -> Any:
    return None if row is None else row[0]


class _Contract:
    """What `follow` and `afollow` decide, kept apart from their I/O (blocking or asyncio): the
    cursor, which events of a page to hand out, and when to reconnect."""

    def __init__(self, run_id: str, cursor: str | None, page: int, reconnect: Reconnect) -> None:
        self.run_id = run_id
        self.cursor = cursor
        self.page = page
        self.reconnect = reconnect
        self.failures = 0

    def cursor_check(self) -> tuple[str, str] | None:
        """The parameters of CURSOR_ENDS_RUN, or None when following from the start."""
        return None if self.cursor is None else (self.run_id, self.cursor)

    def read(self) -> tuple[str, str | None, int]:
        """The parameters of the next EVENTS_SINCE."""
        return (self.run_id, self.cursor, self.page)

    def take(self, rows: list[RunEvent]) -> tuple[list[RunEvent], bool]:
        """The events of a page to hand out (up to the one that ended the run, if any) and
        whether the follower returns after them; the cursor moves past them."""
        self.failures = 0
        ended = next((i for i, event in enumerate(rows) if event.ends_run), None)
        if ended is not None:
            rows = rows[: ended + 1]
        if rows:
            self.cursor = rows[-1].event_id
        return rows, ended is not None

    def caught_up(self, rows: list[RunEvent]) -> bool:
        """A page that came back short: wait for "something new" or the backstop."""
        return len(rows) < self.page

    def failed(self, exc: psycopg.Error) -> float:
        """Seconds to wait before reconnecting after `exc`; raises it (translated) when it is not
        worth a retry."""
        self.failures += 1
        delay = retry_after(exc, self.reconnect, self.failures)
        if delay is None:
            raise_translated(exc)
        return delay


def follow(
    ledger: Scoped,
    run_id: str,
    *,
    cursor: str | None = None,
    wait_s: float = 5.0,
    page: int = 1000,
    reconnect: Reconnect = Reconnect(),
) -> Iterator[RunEvent]:
    """Yield the run's events after `cursor` (from the start when None), each once, in seq order,
    and return after the event that ended the run (at once if `cursor` is that event).

    `ledger` is the scoped handle (``ScopedLedger``; ``afollow`` takes either face's). The
    follower holds a connection of its own, not the pool's, to its ``conninfo`` (autocommit,
    session scope: LISTEN needs a session), reconnecting per
    `reconnect` after a lost connection or a restart; `wait_s` is the backstop read interval (and
    the poll interval when `ledger.notify` is off). Ledger errors (RUN_NOT_FOUND, EVENT_NOT_FOUND,
    ID_INVALID, a scope refused) are raised. To resume later, keep the last `event_id` you handled
    and pass it as `cursor`.
    """
    contract = _Contract(run_id, cursor, page, reconnect)
    while True:
        try:
            # autocommit: LISTEN takes effect at once and notifications arrive between statements
            with psycopg.connect(ledger.conninfo, autocommit=True) as conn:
                conn.execute(SET_SCOPE, (ledger.tenant_id, ledger.workspace_id))
                conn.execute(listen(_first(conn.execute(RUN_CHANNEL, (run_id,)).fetchone())))
                check = contract.cursor_check()
                if check is not None and _first(conn.execute(CURSOR_ENDS_RUN, check).fetchone()):
                    return
                events = conn.cursor(row_factory=class_row(RunEvent))
                while True:
                    rows = events.execute(EVENTS_SINCE, contract.read()).fetchall()
                    taken, ended = contract.take(rows)
                    yield from taken
                    if ended:
                        return
                    if contract.caught_up(rows):
                        for _ in conn.notifies(timeout=wait_s, stop_after=1):
                            pass
        except psycopg.Error as exc:
            time.sleep(contract.failed(exc))


async def afollow(
    ledger: Scoped,
    run_id: str,
    *,
    cursor: str | None = None,
    wait_s: float = 5.0,
    page: int = 1000,
    reconnect: Reconnect = Reconnect(),
) -> AsyncIterator[RunEvent]:
    """`follow` for asyncio, on a psycopg AsyncConnection: the same contract, step for step.

    Leaving the loop early leaves the connection open until the generator is collected; wrap it
    in `contextlib.aclosing` to close it at once."""
    contract = _Contract(run_id, cursor, page, reconnect)
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(ledger.conninfo, autocommit=True) as conn:
                await conn.execute(SET_SCOPE, (ledger.tenant_id, ledger.workspace_id))
                await conn.execute(listen(_first(await (await conn.execute(RUN_CHANNEL, (run_id,))).fetchone())))
                check = contract.cursor_check()
                if check is not None and _first(await (await conn.execute(CURSOR_ENDS_RUN, check)).fetchone()):
                    return
                events = conn.cursor(row_factory=class_row(RunEvent))
                while True:
                    rows = await (await events.execute(EVENTS_SINCE, contract.read())).fetchall()
                    taken, ended = contract.take(rows)
                    for event in taken:
                        yield event
                    if ended:
                        return
                    if contract.caught_up(rows):
                        async for _ in conn.notifies(timeout=wait_s, stop_after=1):
                            pass
        except psycopg.Error as exc:
            await asyncio.sleep(contract.failed(exc))
