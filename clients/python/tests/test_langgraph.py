"""The LangGraph tool guard against the real extension, driven by a scripted tool-calling model:
executed once and replayed (both faces), an approval round trip through interrupt and
Command(resume=...) (approved, and rejected through LangChain's create_agent middleware), a call
in doubt after a timeout resolved failed, and a process SIGKILLed while its tool ran, resumed by
another from PostgreSQL checkpoints; each run passes replay_ready. The manual
(docs/langgraph.md) shows examples/langgraph_agent.py verbatim, and the example runs."""

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import assert_shows_verbatim, SCOPE, one, wait_for
from langchain_core.messages import ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.types import Command
from langgraph_support import ScriptedModel, ask, build, count, make_tools
from psycopg.rows import DictRow, dict_row

from ledger_client import AsyncLedger, Busy, ScopedLedger
from ledger_client.integrations.langgraph import LedgerToolGuard, finish_run, start_run

REFUND = ("refund", "call-refund-1042", {"order": 1042, "amount": "12.50"})
CLIENT = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).with_name("langgraph_support.py")
EXAMPLE = CLIENT / "examples" / "langgraph_agent.py"
MANUAL = CLIENT / "docs" / "langgraph.md"


@pytest.fixture
def saver(dsn: str) -> Iterator[PostgresSaver]:
    """LangGraph's own PostgreSQL checkpoints, in the test database."""
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
        checkpointer = PostgresSaver(conn)
        checkpointer.setup()
        yield checkpointer


def tool_messages(state: dict[str, Any]) -> list[ToolMessage]:
    return [m for m in state["messages"] if isinstance(m, ToolMessage)]


def answer(state: dict[str, Any]) -> str:
    return str(state["messages"][-1].text)


def finished(scoped: ScopedLedger, config: Any, state: dict[str, Any]) -> None:
    """Ends the run with the graph's answer; it must pass replay_ready."""
    finish_run(scoped, config, answer(state))
    run_id = config["configurable"]["ledger_run_id"]
    ready = scoped.replay_ready(run_id)
    assert (ready.status, ready.missing) == ("pass", ()), ready


def test_executed_once_then_replayed_with_costs_and_the_answer(
        scoped: ScopedLedger, person: psycopg.Connection[DictRow], saver: PostgresSaver, tmp_path: Path) -> None:
    graph = build(LedgerToolGuard(scoped), make_tools(tmp_path), saver)
    config = start_run(scoped, "t-1", "req-1", inputs={"question": "refund 1042"}, user_id="customer-7")
    state = graph.invoke(ask(REFUND, ("lookup", "call-lookup", {"order": 1042})), config)
    assert answer(state) == "Done: Refund rf-1042 of 12.50 sent; Order 1042 paid 12.50"
    assert (count(tmp_path, "refund"), count(tmp_path, "lookup")) == (1, 1)
    finished(scoped, config, state)
    run_id = config["configurable"]["ledger_run_id"]
    calls = person.execute("SELECT tool_call_id, status, result FROM ledger.run_step_tool_calls ORDER BY tool_call_id").fetchall()
    assert [(c["tool_call_id"], c["status"], c["result"]) for c in calls] == [
        ("call-lookup", "succeeded", "Order 1042 paid 12.50"), ("call-refund-1042", "succeeded", "Refund rf-1042 of 12.50 sent")]
    costs = person.execute("SELECT billed_quantity, model_ref, provider FROM ledger.run_cost_entries").fetchall()
    assert [(int(c["billed_quantity"]), c["model_ref"], c["provider"]) for c in costs] == [(120, "scripted-1", "test")] * 2
    assert one(person, "SELECT count(*) FROM ledger.run_steps WHERE step_type = 'llm' AND status = 'succeeded'") == 2
    assert one(person, "SELECT payload->>'text' FROM ledger.response_events WHERE run_id = %s", (run_id,)) == answer(state)

    # A re-run of the run (a new ledger run whose source is this one, on a new thread) repeats the
    # framework's steps with the same tool-call ids: the recorded results, nothing executed.
    rerun = start_run(scoped, "t-2", "req-2", source_run_id=run_id)
    again = graph.invoke(ask(REFUND), rerun)
    [replayed] = tool_messages(again)
    assert (replayed.text, replayed.tool_call_id, replayed.status) == ("Refund rf-1042 of 12.50 sent", "call-refund-1042", "success")
    assert count(tmp_path, "refund") == 1
    finished(scoped, rerun, again)


def test_the_async_face_executes_once_and_replays(dsn: str, person: psycopg.Connection[DictRow], tmp_path: Path) -> None:
    async def body() -> None:
        aledger = AsyncLedger(dsn).scoped(*SCOPE)
        await aledger.create_run("agent", run_id="r-async")
        await aledger.transition_run("r-async", "running")
        graph = build(LedgerToolGuard(aledger=aledger), make_tools(tmp_path), InMemorySaver())
        for thread in ("a-1", "a-2"):
            state = await graph.ainvoke(ask(REFUND), {"configurable": {"thread_id": thread, "ledger_run_id": "r-async"}})
            assert answer(state) == "Done: Refund rf-1042 of 12.50 sent"
        assert count(tmp_path, "refund") == 1

    asyncio.run(body())
    assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE tool_call_id = 'call-refund-1042'") == "succeeded"


def test_an_approval_round_trip_through_interrupt_and_resume(
        scoped: ScopedLedger, person: psycopg.Connection[DictRow], saver: PostgresSaver, tmp_path: Path) -> None:
    guard = LedgerToolGuard(scoped, approvals={"refund": {"title": "Refund order 1042", "policy_ref": "refunds/v1"}})
    graph = build(guard, make_tools(tmp_path), saver)
    config = start_run(scoped, "t-approve", "req-approve")
    run_id = config["configurable"]["ledger_run_id"]
    state = graph.invoke(ask(REFUND), config)
    [pause] = state["__interrupt__"]
    assert {k: pause.value[k] for k in ("ledger", "run_id", "tool", "tool_call_id", "title", "policy_ref", "arguments")} == {
        "ledger": "waiting_approval", "run_id": run_id, "tool": "refund", "tool_call_id": "call-refund-1042",
        "title": "Refund order 1042", "policy_ref": "refunds/v1", "arguments": {"order": 1042, "amount": "12.50"}}
    assert count(tmp_path, "refund") == 0
    assert one(person, "SELECT status FROM ledger.runs WHERE id = %s", (run_id,)) == "waiting_approval"

    # Resumed before anyone decided: it asks again.
    state = graph.invoke(Command(resume="go"), start_run(scoped, "t-approve", "req-approve"))
    assert state["__interrupt__"][0].value["approval_id"] == pause.value["approval_id"]
    assert count(tmp_path, "refund") == 0

    person.execute("SELECT ledger.resolve_approval(%s, 'approved', actor => 'lead@acme')", (pause.value["approval_id"],))
    config = start_run(scoped, "t-approve", "req-approve")
    state = graph.invoke(Command(resume="approved"), config)
    assert "__interrupt__" not in state
    assert answer(state) == "Done: Refund rf-1042 of 12.50 sent"
    assert count(tmp_path, "refund") == 1
    finished(scoped, config, state)


def test_a_rejection_reaches_the_model_through_the_agent_middleware(
        scoped: ScopedLedger, person: psycopg.Connection[DictRow], tmp_path: Path) -> None:
    from langchain.agents import create_agent

    guard = LedgerToolGuard(scoped, approvals=lambda call: {"title": f"Refund {call['args']['order']}"}
                            if call["name"] == "refund" else None)
    agent = create_agent(ScriptedModel(), make_tools(tmp_path), middleware=[guard.middleware()], checkpointer=InMemorySaver())
    config = start_run(scoped, "t-reject", "req-reject")
    # ask() builds the input as a plain dict, not create_agent's input TypedDict
    state = agent.invoke(ask(REFUND, ("lookup", "call-lookup", {"order": 1042})), config)  # type: ignore[call-overload]
    [pause] = state["__interrupt__"]
    assert (pause.value["ledger"], pause.value["title"]) == ("waiting_approval", "Refund 1042")
    person.execute("SELECT ledger.resolve_approval(%s, 'rejected', actor => 'lead@acme', note => 'over 10.00: needs a return')",
                   (pause.value["approval_id"],))
    state = agent.invoke(Command(resume="decided"), start_run(scoped, "t-reject", "req-reject"))
    rejected = next(m for m in tool_messages(state) if m.tool_call_id == "call-refund-1042")
    assert rejected.status == "error"
    assert rejected.text == "The call was rejected by lead@acme: over 10.00: needs a return. It was not executed."
    assert answer(state).startswith("Sorry: ")
    assert (count(tmp_path, "refund"), count(tmp_path, "lookup")) == (0, 1)
    finished(scoped, config, state)


def test_a_call_in_doubt_interrupts_and_a_persons_failed_resolution_reaches_the_model(
        scoped: ScopedLedger, person: psycopg.Connection[DictRow], saver: PostgresSaver, tmp_path: Path) -> None:
    graph = build(LedgerToolGuard(scoped), make_tools(tmp_path, timeout=True), saver)
    config = start_run(scoped, "t-doubt", "req-doubt")
    state = graph.invoke(ask(REFUND), config)
    [pause] = state["__interrupt__"]
    assert (pause.value["ledger"], pause.value["tool_call_id"]) == ("in_doubt", "call-refund-1042")
    assert one(person, "SELECT status FROM ledger.runs WHERE id = %s", (config["configurable"]["ledger_run_id"],)) == "paused"
    person.execute("SELECT ledger.resolve_tool_call(%s, 'failed', actor => 'ops@acme', note => 'the bank has no such refund')",
                   (pause.value["tool_call_record_id"],))
    state = graph.invoke(Command(resume="resolved"), config)
    [failed] = tool_messages(state)
    assert failed.status == "error" and failed.text.startswith("The call failed: ")
    assert count(tmp_path, "refund") == 1
    finished(scoped, config, state)


def test_a_killed_process_resumed_by_another_runs_the_side_effect_once(
        dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], saver: PostgresSaver, tmp_path: Path) -> None:
    src = str(CLIENT / "src")
    first = subprocess.Popen([sys.executable, str(SUPPORT), dsn, str(tmp_path), "t-kill", "req-kill", "1042"],
                             env={**os.environ, "BLOCK": "1", "PYTHONPATH": src})
    try:
        wait_for("the refund to start", lambda: count(tmp_path, "refund") == 1)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE tool_call_id = 'call-refund-1042'") == "running"

    graph = build(LedgerToolGuard(scoped), make_tools(tmp_path), saver)
    config = start_run(scoped, "t-kill", "req-kill")
    with pytest.raises(Busy):  # the killed attempt's lease is still live
        graph.invoke(None, config)
    person.execute("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 hour'")
    state = graph.invoke(None, config)
    [pause] = state["__interrupt__"]
    assert {k: pause.value[k] for k in ("ledger", "tool_call_id", "arguments")} == {
        "ledger": "in_doubt", "tool_call_id": "call-refund-1042", "arguments": {"order": 1042, "amount": "12.50"}}
    person.execute("SELECT ledger.resolve_tool_call(%s, 'succeeded', result => '\"Refund rf-1042 sent (the bank confirmed)\"',"
                   " actor => 'ops@acme')", (pause.value["tool_call_record_id"],))

    config = start_run(scoped, "t-kill", "req-kill")
    state = graph.invoke(Command(resume="resolved"), config)
    assert answer(state) == "Done: Refund rf-1042 sent (the bank confirmed)"
    assert count(tmp_path, "refund") == 1
    finished(scoped, config, state)


def test_the_manual_shows_the_example_verbatim() -> None:
    assert_shows_verbatim(MANUAL, EXAMPLE)


def test_the_example_runs_and_leaves_its_run_in_the_ledger(dsn: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LEDGER_DSN": dsn, "PYTHONPATH": str(CLIENT / "src")})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["paused: waiting_approval 'Refund order 1042': {'order': 1042, 'amount': '12.50'}",
                         "person: approved 'Refund order 1042'"]
    assert lines[2].endswith(": Your refund is on its way: refund rf-1042 of 12.50.") and lines[3] == "replay_ready: pass"
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SELECT ledger.set_scope('acme', 'examples-langgraph')")
        [run] = conn.execute("SELECT id, status, request_id, user_id FROM ledger.runs").fetchall()
        assert (run["status"], run["request_id"], run["user_id"]) == ("succeeded", "support-req-1042", "customer-7")
        calls = conn.execute("SELECT tool_call_id, status, attempt, result FROM ledger.run_step_tool_calls").fetchall()
        assert calls == [{"tool_call_id": "call-refund-1042", "status": "succeeded", "attempt": 1,
                          "result": "refund rf-1042 of 12.50"}]
        approval = conn.execute("SELECT status, actor, note FROM ledger.approval_requests").fetchall()
        assert approval == [{"status": "approved", "actor": "lead@acme", "note": "broken on arrival"}]
        costs = conn.execute("SELECT count(*) AS n, sum(amount) AS usd FROM ledger.run_cost_entries").fetchone()
        assert costs is not None and (costs["n"], str(costs["usd"])) == (2, "0.001200")


def test_tools_left_out_run_unguarded_and_a_config_without_the_run_is_refused(
        scoped: ScopedLedger, person: psycopg.Connection[DictRow], tmp_path: Path) -> None:
    graph = build(LedgerToolGuard(scoped, tools={"refund"}), make_tools(tmp_path), InMemorySaver())
    config = start_run(scoped, "t-some", "req-some")
    for thread in ("t-some", "t-some-again"):
        graph.invoke(ask(REFUND, ("lookup", "call-lookup", {"order": 1042})),
                     {**config, "configurable": {**config["configurable"], "thread_id": thread}})
    assert (count(tmp_path, "refund"), count(tmp_path, "lookup")) == (1, 2)
    assert one(person, "SELECT array_agg(tool_call_id) FROM ledger.run_step_tool_calls") == ["call-refund-1042"]
    with pytest.raises(LookupError, match="no configurable\\['ledger_run_id'\\]"):
        graph.invoke(ask(REFUND), {"configurable": {"thread_id": "t-none"}})
