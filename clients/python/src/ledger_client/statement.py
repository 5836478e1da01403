"""One declaration per ledger function for both faces: a method decorated with :class:`call`
builds a :class:`Statement` (the SQL, its parameters and how to decode the rows) and does no I/O;
the handle it is read from runs it, synchronously (a :class:`SyncRunner`) or awaited (an
:class:`AsyncRunner`). ``mypy --strict`` sees the method with its own arguments and returns ``T``
on a sync handle and ``Awaitable[T]`` on an async one (the overloads of ``call.__get__``).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from psycopg import sql
from psycopg.abc import QueryNoTemplate as Query
from psycopg.types.json import Jsonb

Row = dict[str, Any]
P = ParamSpec("P")
T = TypeVar("T")


class Located(Protocol):
    @property
    def conninfo(self) -> str: ...


L = TypeVar("L", bound=Located)


class Scope(Generic[L]):
    """A scoped handle's state: its ledger (sync or async) and the scope it states."""

    def __init__(self, ledger: L, tenant_id: str, workspace_id: str) -> None:
        self.ledger = ledger
        self.tenant_id = tenant_id
        self.workspace_id = workspace_id

    @property
    def conninfo(self) -> str:
        """The ledger's conninfo (where the feed's follower connects)."""
        return self.ledger.conninfo


@dataclass(frozen=True)
class Statement(Generic[T]):
    """One statement: ``query`` with ``params``, and ``decode`` turning its rows (dicts) into the
    result. ``relation``: the query is a SELECT that can stand as a FROM item, so a scoped handle
    states the scope in the same statement (:func:`scoped`); any other runs after ``set_scope``
    in a transaction."""

    query: Query
    params: Sequence[Any]
    decode: Callable[[list[Row]], T]
    relation: bool = True


def _json(value: Any) -> Any:
    """Dicts as jsonb parameters (lists stay arrays: ``text[]``); anything else as it is."""
    return Jsonb(value) if isinstance(value, dict) else value


def function(
    decode: Callable[[list[Row]], T], name: str, *args: Any, **named: Any
) -> Statement[T]:
    """``SELECT * FROM ledger.<name>(%s, ..., arg => %s, ...)``; named arguments that are None are
    left out, so the SQL default applies."""
    given = {k: v for k, v in named.items() if v is not None}
    parts = [sql.SQL("%s")] * len(args) + [sql.SQL("{} => %s").format(sql.Identifier(k)) for k in given]
    query = sql.SQL("SELECT * FROM ledger.{}({})").format(sql.Identifier(name), sql.SQL(", ").join(parts))
    return Statement(query, [_json(a) for a in args] + [_json(v) for v in given.values()], decode)


def first(rows: list[Row]) -> Row:
    return rows[0]


def value(rows: list[Row]) -> Any:
    """The single value of a scalar function's one row."""
    return next(iter(rows[0].values()))


def scoped(statement: Statement[Any], tenant_id: str, workspace_id: str) -> tuple[Query, list[Any]]:
    """The statement with the scope stated inside it, for the statement's implicit transaction
    only. ``set_scope`` is the outer side of a lateral join whose inner side tests its result
    (``s.done``) inside a subquery the planner may not flatten (``OFFSET 0``: the test, and so the
    order, stays inside), so the query runs after it, and every function in it (volatile or
    STABLE) and every row-level security policy sees the scope (EXPLAIN: a one-time filter on
    ``set_scope`` gates the query's scan)."""
    inner = statement.query if isinstance(statement.query, sql.Composable) else sql.SQL(statement.query)  # type: ignore[arg-type]
    query = sql.SQL(
        "SELECT r.* FROM (SELECT ledger.set_scope(%s, %s, is_local => true)::text AS done OFFSET 0) s,"
        " LATERAL (SELECT q.* FROM ({}) q WHERE s.done IS NOT NULL OFFSET 0) r"
    ).format(inner)
    return query, [tenant_id, workspace_id, *statement.params]


class SyncRunner(ABC):
    """Runs statements and returns their results."""

    @abstractmethod
    def _run(self, statement: Statement[T]) -> T: ...


class AsyncRunner(ABC):
    """Runs statements and returns awaitables of their results."""

    @abstractmethod
    async def _run(self, statement: Statement[T]) -> T: ...


class call(Generic[P, T]):
    """Makes a statement builder a method of every runner that inherits it: read from a
    :class:`SyncRunner` it runs the statement, from an :class:`AsyncRunner` it returns the
    coroutine; read from the class it is the builder itself (``Calls.get_run(None, id)``)."""

    def __init__(self, build: Callable[Concatenate[Any, P], Statement[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, obj: None, owner: type) -> call[P, T]: ...
    @overload
    def __get__(self, obj: AsyncRunner, owner: type) -> Callable[P, Awaitable[T]]: ...
    @overload
    def __get__(self, obj: SyncRunner, owner: type) -> Callable[P, T]: ...
    def __get__(self, obj: SyncRunner | AsyncRunner | None, owner: type) -> Any:
        if obj is None:
            return self
        build, run = self.build, obj._run

        @functools.wraps(build)
        def bound(*args: P.args, **kwargs: P.kwargs) -> Any:
            return run(build(obj, *args, **kwargs))

        return bound

