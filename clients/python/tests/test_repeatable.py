"""The helper's repeatable path against the real extension: a tool run once then replayed without
running, a failure recorded and replayed, concurrent callers each running it at most once and
all returning the first record, a side-effecting call under the key keeping its protocol, a lost
connection at the record retried safely, and the async face."""

import asyncio
import threading
from typing import Any

import psycopg
import pytest
from conftest import SCOPE, one
from psycopg.rows import DictRow
from test_faults import cut, fragile  # noqa: F401 (a fixture)
from test_tool_calls import Tool, running_run

from ledger_client import (
    AsyncLedger,
    Busy,
    ClaimOutcome,
    InDoubt,
    Ledger,
    NotEncodable,
    ScopedLedger,
    ToolFailed,
    tool_call,
    tool_call_async,
)


def records(person: psycopg.Connection[DictRow], run: str) -> list[dict[str, Any]]:
    return person.execute(
        "SELECT tool_call_id, status, attempt, lease_owner, outbound_started_at, result, error_message"
        " FROM ledger.run_step_tool_calls WHERE run_id = %s ORDER BY tool_call_id", (run,)).fetchall()


def test_a_repeatable_tool_runs_once_and_is_replayed_without_running(
    scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    run = running_run(scoped, "r-rep-once")
    tool = Tool({"temp_c": 21})
    for _ in range(3):
        assert tool_call(scoped, run, "c1", "weather.now", {"city": "Lyon"}, tool, repeatable=True) == {"temp_c": 21}
    assert tool.total == 1
    [record] = records(person, run)
    assert (record["status"], record["attempt"], record["lease_owner"], record["outbound_started_at"]) == (
        "succeeded", 1, None, None)
    # One step, created finished; its feed holds the creation and the completion only.
    events = person.execute("SELECT event_type FROM ledger.run_events WHERE run_id = %s AND seq > 2 ORDER BY seq",
                            (run,)).fetchall()
    assert [e["event_type"] for e in events] == ["step.created", "tool_call.completed"]
    # The side-effecting helper on the same key replays it too: one key, one record.
    assert tool_call(scoped, run, "c1", "weather.now", {"city": "Lyon"}, tool) == {"temp_c": 21}
    assert tool.total == 1
    # The lookup and the record, as the handle's methods.
    found = scoped.find_tool_call(run, "weather.now", {"city": "Lyon"}, tool_call_id="c1")
    assert found.outcome is ClaimOutcome.REPLAYED and found.response is not None
    assert found.response.result == {"temp_c": 21}
    assert scoped.find_tool_call(run, "weather.now", {"city": "Paris"}, tool_call_id="c2").outcome is ClaimOutcome.UNRECORDED


def test_a_failure_is_recorded_raised_and_replayed_until_retried(
    scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    run = running_run(scoped, "r-rep-failed")
    attempts: list[int] = []

    def flaky(arguments: dict[str, Any]) -> Any:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("HTTP 503")
        return {"ok": True}

    with pytest.raises(ConnectionError, match="HTTP 503"):
        tool_call(scoped, run, "c1", "search", {}, flaky, repeatable=True)
    with pytest.raises(ToolFailed) as replayed:
        tool_call(scoped, run, "c1", "search", {}, flaky, repeatable=True)
    assert replayed.value.error == "HTTP 503" and len(attempts) == 1
    assert tool_call(scoped, run, "c1", "search", {}, flaky, repeatable=True, retry_failed=True) == {"ok": True}
    [record] = records(person, run)
    assert (record["status"], record["attempt"], record["error_message"]) == ("succeeded", 2, None)
    # A result the encoding rule cannot encode records nothing: the tool may simply run again.
    with pytest.raises(NotEncodable):
        tool_call(scoped, run, "c2", "search", {}, lambda _: {"handle": object()}, repeatable=True)
    assert len(records(person, run)) == 1
    # An approval needs the side-effecting protocol.
    with pytest.raises(ValueError, match="not repeatable"):
        tool_call(scoped, run, "c3", "search", {}, flaky, repeatable=True, approval={"title": "ok?"})
    assert len(records(person, run)) == 1


def test_concurrent_callers_each_run_it_at_most_once_and_return_the_first_record(
    pooled: Ledger, person: psycopg.Connection[DictRow]
) -> None:
    scoped = pooled.scoped(*SCOPE)
    run = running_run(scoped, "r-rep-race")
    both_running = threading.Barrier(2, timeout=10)
    lock = threading.Lock()
    order: list[str] = []

    def lookup(arguments: dict[str, Any]) -> Any:
        name = threading.current_thread().name
        both_running.wait()  # both looked the call up and found it unrecorded
        with lock:
            order.append(name)
        return {"by": name}

    answers: dict[str, Any] = {}

    def caller() -> None:
        answers[threading.current_thread().name] = tool_call(
            scoped, run, "c1", "fx.rate", {"pair": "EURUSD"}, lookup, repeatable=True)

    threads = [threading.Thread(target=caller, name=name) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(order) == ["a", "b"], "each ran the tool once"
    [record] = records(person, run)
    assert answers == {"a": record["result"], "b": record["result"]}, "both return the one record"
    assert one(person, "SELECT count(*) FROM ledger.audit_events WHERE gateway_type = 'tool_call.record'"
                       " AND run_id = %s", (run,)) == 1


def test_a_side_effecting_call_under_the_key_keeps_its_protocol(
    scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    run = running_run(scoped, "r-rep-side")
    tool = Tool({"sent": True})
    claim = scoped.claim_tool_call(run, "email.send", {"to": "a"}, tool_call_id="c1")
    assert claim.outcome is ClaimOutcome.CLAIMED and claim.tool_call is not None
    with pytest.raises(Busy):
        tool_call(scoped, run, "c1", "email.send", {"to": "a"}, tool, repeatable=True)
    scoped.begin_tool_call(claim.tool_call.id, 1)
    scoped.complete_tool_call(claim.tool_call.id, 1, "unknown")
    with pytest.raises(InDoubt):
        tool_call(scoped, run, "c1", "email.send", {"to": "a"}, tool, repeatable=True)
    assert tool.total == 0
    [record] = records(person, run)
    assert record["status"] == "in_doubt"


def test_a_connection_lost_at_the_record_is_written_again_once(
    fragile: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]  # noqa: F811
) -> None:
    run = running_run(scoped, "r-rep-lost")
    worker = fragile.scoped(*SCOPE)

    def cutting(arguments: dict[str, Any]) -> Any:
        assert cut(person) >= 1  # the record that follows meets the terminated connection
        return {"rate": "1.08"}

    tool = Tool(action=cutting)
    assert tool_call(worker, run, "c1", "fx.rate", {"pair": "EURUSD"}, tool, repeatable=True) == {"rate": "1.08"}
    assert tool.total == 1
    [record] = records(person, run)
    assert (record["status"], record["result"]) == ("succeeded", {"rate": "1.08"})
    # A record that committed and whose answer was lost is answered again, unchanged.
    again = scoped.record_tool_call(run, "fx.rate", {"pair": "EURUSD"}, "succeeded", {"rate": "9"}, tool_call_id="c1")
    assert again.outcome is ClaimOutcome.REPLAYED and again.response is not None
    assert again.response.result == {"rate": "1.08"}
    assert len(records(person, run)) == 1


def test_the_async_face_runs_it_once_and_replays_it(dsn: str, person: psycopg.Connection[DictRow]) -> None:
    ran: list[dict[str, Any]] = []

    async def lookup(arguments: dict[str, Any]) -> Any:
        ran.append(arguments)
        if arguments.get("broken"):
            raise ValueError("the CRM refused")
        return {"order": arguments["order"], "status": "shipped"}

    async def body() -> None:
        scoped = AsyncLedger(dsn).scoped(*SCOPE)
        await scoped.create_run("agent", run_id="r-rep-async")
        await scoped.transition_run("r-rep-async", "running")
        for _ in range(2):
            assert await tool_call_async(scoped, "r-rep-async", "c1", "crm.lookup", {"order": 7}, lookup,
                                         repeatable=True) == {"order": 7, "status": "shipped"}
        with pytest.raises(ValueError, match="refused"):
            await tool_call_async(scoped, "r-rep-async", "c2", "crm.lookup", {"order": 8, "broken": True}, lookup,
                                  repeatable=True)
        with pytest.raises(ToolFailed):
            await tool_call_async(scoped, "r-rep-async", "c2", "crm.lookup", {"order": 8, "broken": True}, lookup,
                                  repeatable=True)

    asyncio.run(body())
    assert len(ran) == 2
    assert [(r["tool_call_id"], r["status"]) for r in records(person, "r-rep-async")] == [
        ("c1", "succeeded"), ("c2", "failed")]
