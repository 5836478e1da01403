"""The follower against the real server: a concurrent writer, real LISTEN/NOTIFY, a terminated
backend and a restarted server. Helpers here are shared by the SSE tests."""

import asyncio
import faulthandler
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql

from ledger_client import AsyncLedger, InvalidArgumentError, Ledger, NotFoundError, RunEvent
from ledger_client.feed import Reconnect, afollow

SCOPE = ("acme", "stream")
FAST = Reconnect(initial_s=0.05, max_s=0.5)


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    """A follower that is never woken hangs: dump the stacks and exit instead of stalling CI."""
    faulthandler.dump_traceback_later(90, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def scoped(dsn: str, scope: tuple[str, str] = SCOPE) -> psycopg.Connection[tuple[Any, ...]]:
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SELECT ledger.set_scope(%s, %s)", scope)
    return conn


def start_run(dsn: str, run_id: str, scope: tuple[str, str] = SCOPE) -> None:
    """A run moved to running: two events (run.created, run.status)."""
    with scoped(dsn, scope) as conn:
        conn.execute("SELECT ledger.create_run('agent', run_id => %s)", (run_id,))
        conn.execute("SELECT ledger.transition_run(%s, 'running')", (run_id,))


def write_steps(
    dsn: str, run_id: str, steps: range, *, finish: bool = False, scope: tuple[str, str] = SCOPE
) -> None:
    """One event per step, each its own commit (and notification); `finish` ends the run."""
    with scoped(dsn, scope) as conn:
        for n in steps:
            conn.execute("SELECT ledger.create_step(%s, 'llm', step_key => %s)", (run_id, f"s{n}"))
        if finish:
            conn.execute("SELECT ledger.transition_run(%s, 'succeeded')", (run_id,))


def feed(dsn: str, run_id: str, scope: tuple[str, str] = SCOPE) -> list[str]:
    """The run's event ids as the ledger has them."""
    with scoped(dsn, scope) as conn:
        rows = conn.execute("SELECT event_id FROM ledger.events_since(%s, NULL, 10000)", (run_id,))
        return [r[0] for r in rows]


def collect(
    flavour: str,
    conninfo: str,
    run_id: str,
    on_event: Callable[[list[RunEvent]], None] = lambda seen: None,
    *,
    cursor: str | None = None,
    wait_s: float = 600,
    page: int = 1000,
    reconnect: Reconnect = FAST,
) -> list[RunEvent]:
    """Follow with the scoped handle's `feed` or `afollow` to the end; `on_event` sees the list after each event.
    wait_s is far beyond a test's length: only notifications wake the follower in time."""
    seen: list[RunEvent] = []
    kw: dict[str, Any] = {"cursor": cursor, "wait_s": wait_s, "page": page, "reconnect": reconnect}
    if flavour == "sync":
        for event in Ledger(conninfo).scoped(*SCOPE).feed(run_id, **kw):
            seen.append(event)
            on_event(seen)
    else:

        async def run() -> None:
            async for event in afollow(AsyncLedger(conninfo).scoped(*SCOPE), run_id, **kw):
                seen.append(event)
                on_event(seen)

        asyncio.run(run())
    return seen


def assert_whole_feed(seen: list[RunEvent], dsn: str, run_id: str) -> None:
    """Every event once, in seq order, and the follower stopped at the one that ended the run."""
    assert [e.event_id for e in seen] == feed(dsn, run_id)
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    assert [e.ends_run for e in seen] == [False] * (len(seen) - 1) + [True]
    assert (seen[-1].event_type, seen[-1].payload["to"]) == ("run.status", "succeeded")


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_follower_gets_a_concurrent_writers_events_once_and_stops_at_the_end(dsn: str, flavour: str) -> None:
    start_run(dsn, "r")
    writer = threading.Thread(target=write_steps, args=(dsn, "r", range(12)), kwargs={"finish": True})
    writer.start()
    # A page of 5: the follower reads again while pages come back full.
    seen = collect(flavour, dsn, "r", page=5)
    writer.join()
    assert len(seen) == 2 + 12 + 1
    assert_whole_feed(seen, dsn, "r")


def restart_server() -> None:
    bindir, pgdata = os.environ.get("LEDGER_TEST_BINDIR"), os.environ.get("LEDGER_TEST_PGDATA")
    if not bindir or not pgdata:
        pytest.skip("LEDGER_TEST_BINDIR and LEDGER_TEST_PGDATA are needed to restart the server")
    subprocess.run(
        ["sudo", "-u", "postgres", f"{bindir}/pg_ctl", "-D", pgdata, "-w", "-m", "fast", "restart"],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def terminate(dsn: str, application_name: str) -> int:
    """pg_terminate_backend on the backends of `application_name`; how many there were."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))"
            "  FROM pg_stat_activity WHERE application_name = %s",
            (application_name,),
        ).fetchone()
        assert row is not None
        return int(row[0])


@pytest.mark.parametrize("disruption", ["terminate", "restart"])
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_follower_loses_and_repeats_nothing_across(dsn: str, flavour: str, disruption: str) -> None:
    start_run(dsn, "r")
    write_steps(dsn, "r", range(3))
    caught_up = threading.Event()
    terminated: list[int] = []

    def disrupt_then_write() -> None:
        # The follower has handled every event so far and waits for the next notification.
        assert caught_up.wait(60)
        if disruption == "terminate":
            terminated.append(terminate(dsn, "ledger_follower_test"))
        else:
            restart_server()
        # Written while the follower reconnects (or after): it must read them from its cursor.
        write_steps(dsn, "r", range(3, 8), finish=True)

    disruptor = threading.Thread(target=disrupt_then_write)
    disruptor.start()
    try:
        seen = collect(
            flavour,
            dsn + " application_name=ledger_follower_test",
            "r",
            lambda seen: caught_up.set() if len(seen) == 5 else None,
        )
    finally:  # a failed follower still lets the restart finish before the next test
        caught_up.set()
        disruptor.join()
    assert terminated == ([1] if disruption == "terminate" else [])  # the follower's own connection
    assert len(seen) == 2 + 8 + 1
    assert_whole_feed(seen, dsn, "r")


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_follower_resumes_after_its_cursor_and_returns_at_once_after_the_end(dsn: str, flavour: str) -> None:
    for scope in (("acme", "twin"), SCOPE):  # the same run id in another scope changes nothing
        start_run(dsn, "r", scope=scope)
        write_steps(dsn, "r", range(3), finish=True, scope=scope)
    ids = feed(dsn, "r")
    # Written before the follower came: no notification is coming, every full page is read again.
    assert [e.event_id for e in collect(flavour, dsn, "r", page=2)] == ids
    rest = collect(flavour, dsn, "r", cursor=ids[1])
    assert [e.event_id for e in rest] == ids[2:]
    assert [e.event_id for e in collect(flavour, dsn, "r", cursor=ids[-2])] == ids[-1:]
    # Resumed from the event that ended the run: nothing more, and no waiting for it.
    assert collect(flavour, dsn, "r", cursor=ids[-1]) == []


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_follower_raises_ledger_errors_without_retrying(dsn: str, flavour: str) -> None:
    start_run(dsn, "r")
    start_run(dsn, "elsewhere", scope=("acme", "other"))
    cases = [
        ("nope", None, NotFoundError, "RUN_NOT_FOUND"),
        ("elsewhere", None, NotFoundError, "RUN_NOT_FOUND"),  # another scope's run
        ("r", "evt_00000000000000000000000000", NotFoundError, "EVENT_NOT_FOUND"),
        ("bad id", None, InvalidArgumentError, "ID_INVALID"),
    ]
    for run_id, cursor, error, code in cases:
        # retries=None: an error that were retried would hang here (and the watchdog would fire).
        with pytest.raises(error) as raised:
            collect(flavour, dsn, run_id, cursor=cursor, reconnect=Reconnect(retries=None))
        assert raised.value.code == code


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_follower_gives_up_after_its_retries(dsn: str, flavour: str) -> None:
    attempts: list[float] = []

    class Counting(Reconnect):
        def delay(self, failures: int) -> float:
            attempts.append(failures)
            return 0.01

    nobody = dsn.replace(f"port={os.environ['LEDGER_TEST_PORT']}", "port=1")
    with pytest.raises(psycopg.OperationalError):
        collect(flavour, nobody, "r", reconnect=Counting(retries=3))
    assert attempts == [1, 2, 3]


@contextmanager
def reader_role(dsn: str, name: str) -> Iterator[str]:
    """A login role with ledger_reader and nothing more; the conninfo to connect as it."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE ledger_reader").format(sql.Identifier(name)))
    try:
        yield dsn.replace("user=postgres", f"user={name}")
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_follower_needs_no_more_than_ledger_reader(dsn: str) -> None:
    """The tests connect as a superuser (BYPASSRLS); an application's reader role is not one."""
    start_run(dsn, "r")
    write_steps(dsn, "r", range(2), finish=True)
    ids = feed(dsn, "r")
    with reader_role(dsn, "ledger_py_follow_reader") as reader:
        assert [e.event_id for e in collect("sync", reader, "r")] == ids
        assert [e.event_id for e in collect("async", reader, "r", cursor=ids[-2])] == ids[-1:]
        assert collect("sync", reader, "r", cursor=ids[-1]) == []
