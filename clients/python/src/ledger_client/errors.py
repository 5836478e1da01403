"""The ledger's errors as Python exceptions.

Every error the extension raises has a message starting with ``ledger:``, one SQLSTATE per class
and a DETAIL that is a JSON object with a stable ``code``. :func:`translate` turns such a psycopg
error into the :class:`LedgerError` subclass of its SQLSTATE; any other error (a syntax error, a
lost connection) stays the driver's own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import psycopg


class LedgerError(Exception):
    """An error raised by the ledger: ``sqlstate``, ``code`` (from the DETAIL), ``detail`` (the
    parsed DETAIL object) and ``message`` (the ``ledger: ...`` text)."""

    def __init__(self, message: str, sqlstate: str, detail: dict[str, Any]) -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate
        self.detail = detail
        self.code: str = str(detail.get("code", ""))

    def __str__(self) -> str:
        return f"{self.message} [{self.sqlstate} {self.code}]"


class ScopeError(LedgerError):
    """42501: no scope, a scope not granted, or an operator-only call."""


class NotFoundError(LedgerError):
    """P0002: an id unknown in this scope."""


class InvalidArgumentError(LedgerError):
    """22023: a bad argument."""


class WrongStateError(LedgerError):
    """55000: not allowed in the row's current state (a refused transition, a terminal run)."""


class ConflictError(LedgerError):
    """40001: a concurrent writer got there first (``TRANSITION_CONFLICT``), or an old tool-call
    attempt or run token wrote (``LEASE_STALE``)."""


class IdempotencyMismatchError(LedgerError):
    """23505: a key reused with different input."""


class CorruptedError(LedgerError):
    """XX001: stored bytes do not match their sha256."""


class ReadOnlyError(LedgerError):
    """25006: a writer called in a read-only transaction (a hot standby)."""


class InternalError(LedgerError):
    """XX000: a defect in the ledger."""


_BY_SQLSTATE: dict[str, type[LedgerError]] = {
    "42501": ScopeError,
    "P0002": NotFoundError,
    "22023": InvalidArgumentError,
    "55000": WrongStateError,
    "40001": ConflictError,
    "23505": IdempotencyMismatchError,
    "XX001": CorruptedError,
    "25006": ReadOnlyError,
    "XX000": InternalError,
}


def translate(exc: BaseException) -> BaseException:
    """The :class:`LedgerError` for a psycopg error the ledger raised, else ``exc`` itself."""
    if not isinstance(exc, psycopg.Error) or exc.diag.message_primary is None:
        return exc
    message = exc.diag.message_primary
    if not message.startswith("ledger:"):
        return exc
    sqlstate = exc.diag.sqlstate or ""
    try:
        parsed = json.loads(exc.diag.message_detail or "{}")
    except ValueError:
        parsed = None
    detail: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
    error = _BY_SQLSTATE.get(sqlstate, LedgerError)(message, sqlstate, detail)
    error.__cause__ = exc
    return error


def raise_translated(exc: psycopg.Error) -> NoReturn:
    """Raises ``exc`` as its :class:`LedgerError` (chained to it), or as it is."""
    error = translate(exc)
    if error is exc:
        raise exc
    raise error from exc


@contextmanager
def translated() -> Iterator[None]:
    """Raises the ledger's errors of the block as :class:`LedgerError` (others unchanged)."""
    try:
        yield
    except psycopg.Error as exc:
        raise_translated(exc)
