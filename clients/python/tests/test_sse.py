"""The SSE endpoint through real HTTP: uvicorn on a free localhost port in the test, streams read
with http.client like a browser's EventSource, real LISTEN/NOTIFY behind one hub connection."""

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any

import psycopg
import pytest
import uvicorn

from ledger_client.feed import Reconnect
from ledger_client.sse import EventHub, Scope, sse_app
from test_feed import FAST, SCOPE, feed, reader_role, restart_server, scoped, start_run, write_steps
from test_feed import watchdog  # noqa: F401 - the autouse fixture, for this module too


def scope_from_header(scope: Scope) -> tuple[str, str] | None:
    """The test's stand-in for authentication: `x-scope: tenant/workspace`."""
    value = dict(scope["headers"]).get(b"x-scope")
    if value is None:
        return None
    tenant, workspace = value.decode().split("/")
    return tenant, workspace


@contextmanager
def sse_server(
    dsn: str, *, wait_s: float = 600.0, reconnect: Reconnect = FAST
) -> Iterator[tuple[int, EventHub]]:
    """uvicorn serving `sse_app` on a free port in a thread; its lifespan opens and closes the hub.
    wait_s (the backstop) defaults to far beyond a test's length: notifications must do it."""
    hub = EventHub(dsn, pool_size=2, reconnect=reconnect)
    app = sse_app(hub, scope_from_header, wait_s=wait_s)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    eventually(lambda: server.started)
    try:
        yield sock.getsockname()[1], hub
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


def eventually(check: Callable[[], object], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


class Stream:
    """A browser stream: GET with the headers EventSource would send, parsed frame by frame."""

    def __init__(
        self,
        port: int,
        run_id: str,
        *,
        scope: tuple[str, str] | None = SCOPE,
        last_event_id: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        headers = {"accept": "text/event-stream", **(headers or {})}
        if scope is not None:
            headers["x-scope"] = "/".join(scope)
        if last_event_id is not None:
            headers["last-event-id"] = last_event_id
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.conn.request("GET", f"/runs/{run_id}", headers=headers)
        self.response = self.conn.getresponse()

    def frame(self) -> dict[str, str] | None:
        """The next frame's fields (a comment line as "comment"), None when the response ended."""
        fields: dict[str, str] = {}
        while line := self.response.readline().decode():
            if line == "\n":
                return fields
            name, _, value = line.rstrip("\n").partition(":")
            fields[name or "comment"] = value.removeprefix(" ")
        assert not fields, f"the stream ended in the middle of a frame: {fields}"
        return None

    def events(self, limit: int | None = None) -> list[dict[str, str]]:
        """Events (no comments) up to `limit` or the end of the response."""
        got: list[dict[str, str]] = []
        while (limit is None or len(got) < limit) and (frame := self.frame()) is not None:
            if "comment" not in frame:
                got.append(frame)
        return got

    def close(self) -> None:
        self.conn.close()


def listeners(dsn: str) -> list[tuple[int, str]]:
    """(pid, last statement) of the database's backends whose last statement was a (UN)LISTEN."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT pid, query FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid() AND query ~ '^(UN)?LISTEN '"
        ).fetchall()


def backends(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchone()
        assert row is not None
        return int(row[0])


def channel(dsn: str, run_id: str) -> str:
    with scoped(dsn) as conn:
        row = conn.execute("SELECT ledger.run_channel(%s)", (run_id,)).fetchone()
        assert row is not None
        return str(row[0])


def assert_stream_of(events: list[dict[str, str]], dsn: str, run_id: str, after: int = 0) -> None:
    """`id:` is each event id of the run's feed after the first `after`, once, in order, and the
    stream stopped at the event that ended the run."""
    ids = feed(dsn, run_id)[after:]
    assert [e["id"] for e in events] == ids
    data = [json.loads(e["data"]) for e in events]
    assert [d["event_id"] for d in data] == ids
    assert [e["event"] for e in events] == [d["event_type"] for d in data]
    assert [d["ends_run"] for d in data] == [False] * (len(ids) - 1) + [True]


def test_one_listen_connection_serves_many_streams_of_two_runs(dsn: str) -> None:
    start_run(dsn, "a")
    start_run(dsn, "b")
    with sse_server(dsn) as (port, hub):
        streams = {run: [Stream(port, run) for _ in range(n)] for run, n in (("a", 3), ("b", 2))}
        assert {s.response.status for ss in streams.values() for s in ss} == {200}
        assert streams["a"][0].response.getheader("content-type") == "text/event-stream; charset=utf-8"
        # Every stream is past its LISTEN and first read: one connection LISTENs for all five,
        # and the others are the hub's pool of two, not one per stream.
        assert hub.channels == {channel(dsn, "a"), channel(dsn, "b")}
        assert len(listeners(dsn)) == 1
        assert backends(dsn) <= 3

        got: dict[Stream, list[dict[str, str]]] = {}
        readers = [
            threading.Thread(target=lambda s=s: got.__setitem__(s, s.events()))
            for ss in streams.values()
            for s in ss
        ]
        writers = [
            threading.Thread(target=write_steps, args=(dsn, run, range(n)), kwargs={"finish": True})
            for run, n in (("a", 6), ("b", 4))
        ]
        for thread in readers + writers:
            thread.start()
        for thread in readers + writers:
            thread.join()
        for run, ss in streams.items():
            for s in ss:
                assert_stream_of(got[s], dsn, run)  # and the response ended there
                s.close()
        # The streams ended: the hub UNLISTENs, on the same single connection.
        eventually(lambda: hub.channels == frozenset())
        eventually(lambda: [q.split()[0] for _, q in listeners(dsn)] == ["UNLISTEN"])


def test_last_event_id_resumes_after_it_and_204_after_the_end(dsn: str) -> None:
    start_run(dsn, "r")
    write_steps(dsn, "r", range(5), finish=True)
    with sse_server(dsn) as (port, hub):
        first = Stream(port, "r")
        head = first.events(limit=3)
        first.close()  # the browser lost the connection after three events
        again = Stream(port, "r", last_event_id=head[-1]["id"])
        assert again.response.status == 200
        rest = again.events()
        assert_stream_of(head + rest, dsn, "r")
        assert_stream_of(rest, dsn, "r", after=3)
        again.close()
        # EventSource reconnects after the response ends: after the run's end it is told to stop.
        done = Stream(port, "r", last_event_id=rest[-1]["id"])
        assert (done.response.status, done.response.read()) == (204, b"")
        done.close()


def test_errors_are_plain_http_responses(dsn: str) -> None:
    start_run(dsn, "r")
    start_run(dsn, "theirs", scope=("acme", "other"))
    with sse_server(dsn) as (port, hub):
        cases: list[tuple[dict[str, Any], int, str]] = [
            ({"run_id": "theirs"}, 404, "ledger: run theirs not found"),  # another scope's run
            ({"run_id": "nope"}, 404, "ledger: run nope not found"),
            ({"run_id": "bad%20id"}, 400, "ledger: run_id contains whitespace"),
            ({"run_id": "r", "last_event_id": "evt_00000000000000000000000000"}, 400, "ledger: event"),
            ({"run_id": "r", "scope": None}, 403, "forbidden"),  # scope_of refused the request
        ]
        for request, status, text in cases:
            s = Stream(port, **request)
            assert s.response.status == status, request
            assert s.response.getheader("content-type") == "text/plain; charset=utf-8"
            assert s.response.read().decode().startswith(text), request
            s.close()
        with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=30)) as conn:
            conn.request("POST", "/runs/r")
            response = conn.getresponse()
            assert (response.status, response.getheader("allow")) == (405, "GET")
        # Refused requests leave no LISTEN behind (the unknown run's channel was LISTENed first).
        eventually(lambda: hub.channels == frozenset())


def test_a_scope_the_database_refuses_is_403(dsn: str) -> None:
    """The hub's role is bound to one scope by ledger.grant_scope; an application that hands it
    another (a bug in scope_of, say) is refused by the ledger, not served."""
    start_run(dsn, "r")
    start_run(dsn, "r", scope=("acme", "other"))
    with reader_role(dsn, "ledger_py_sse_bound") as bound:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT ledger.grant_scope('ledger_py_sse_bound', %s, %s)", SCOPE)
        with sse_server(bound) as (port, hub):
            refused = Stream(port, "r", scope=("acme", "other"))
            assert (refused.response.status, refused.response.read()) == (403, b"forbidden")
            refused.close()
            allowed = Stream(port, "r")
            assert allowed.response.status == 200
            assert [e["event"] for e in allowed.events(limit=1)] == ["run.created"]
            allowed.close()


def test_heartbeats_then_a_client_disconnect_unlistens(dsn: str) -> None:
    start_run(dsn, "r")
    with sse_server(dsn, wait_s=0.2) as (port, hub):
        s = Stream(port, "r")
        assert [e["event"] for e in s.events(limit=2)] == ["run.created", "run.status"]
        # Nothing new for wait_s: a comment keeps proxies from closing the idle stream.
        assert s.frame() == {"comment": "keepalive"}
        assert hub.channels == {channel(dsn, "r")}
        [(pid, query)] = listeners(dsn)
        assert query.startswith("LISTEN ")
        s.close()  # the browser tab goes away
        eventually(lambda: hub.channels == frozenset())
        eventually(lambda: listeners(dsn) == [(pid, f'UNLISTEN "{channel(dsn, "r")}"')])


@pytest.mark.parametrize("disruption", ["terminate", "restart"])
def test_the_hub_listens_again_after_its_connection_is_dropped(dsn: str, disruption: str) -> None:
    start_run(dsn, "r")
    # The hub waits half a second or more before it reconnects: the writes below are done by then.
    with sse_server(dsn, reconnect=Reconnect(initial_s=1.0, max_s=1.0)) as (port, hub):
        s = Stream(port, "r")
        head = s.events(limit=2)
        [(pid, _)] = listeners(dsn)
        if disruption == "terminate":
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        else:  # the pool's connections are gone too
            restart_server()
        # Written while the hub is away: the stream is woken when the hub LISTENs again (the
        # backstop is far away), and reads them from its cursor.
        write_steps(dsn, "r", range(4), finish=True)
        assert_stream_of(head + s.events(), dsn, "r")
        s.close()
        eventually(lambda: [p for p, _ in listeners(dsn)] not in ([], [pid]))
