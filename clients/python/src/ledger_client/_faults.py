"""Which errors are the connection's and not the caller's, and writing again across them.

A connection error (SQLSTATE class 08, an administrator's or a crash's shutdown 57P01/57P02,
57P03/57P05 cannot connect now, a dropped socket psycopg reports without a SQLSTATE, a pool that
found no connection in time) says nothing about the write: it may not have reached the server, or
it committed and the answer was lost. A write is repeated only where a repeat is harmless.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg

log = logging.getLogger("ledger_client")

T = TypeVar("T")

_SHUTDOWN = frozenset({"57P01", "57P02", "57P03", "57P05"})

PAUSES = (0.1, 0.3, 0.6, 1.2, 2.4)
"""Between the tries of :func:`again`: about 5 s in all, a server restart's worth."""


def is_transient(error: BaseException) -> bool:
    """True for a connection's failure (see the module's docstring), False for anything else."""
    if not isinstance(error, psycopg.OperationalError):
        return False
    sqlstate = error.sqlstate
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in _SHUTDOWN


def again(what: str, write: Callable[[], T]) -> T:
    """``write()``, tried again on a connection error (each try takes a fresh connection: a pool
    discards a broken one); the last connection error propagates. For idempotent or fenced writes
    only."""
    for pause in PAUSES:
        try:
            return write()
        except psycopg.OperationalError as e:
            if not is_transient(e):
                raise
            log.warning("%s: connection lost (%s); again in %s s", what, e, pause)
            time.sleep(pause)
    return write()


async def again_async(what: str, write: Callable[[], Awaitable[T]]) -> T:
    """:func:`again` for the async face."""
    for pause in PAUSES:
        try:
            return await write()
        except psycopg.OperationalError as e:
            if not is_transient(e):
                raise
            log.warning("%s: connection lost (%s); again in %s s", what, e, pause)
            await asyncio.sleep(pause)
    return await write()
