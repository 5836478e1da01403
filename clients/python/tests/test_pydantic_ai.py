"""The pydantic-ai adapter (ledger_client.integrations.pydantic_ai) against the real extension,
driven by pydantic-ai's own FunctionModel through the example agent (examples/pydantic_ai_agent.py,
whose scripted model calls its tools with fixed ids): a call executed once and replayed on a
repeat, the approval round trip (approved, rejected and expired) through ApprovalRequired and
DeferredToolRequests, a process killed while its tool runs and the turn resumed by another
process through CallDeferred (busy while the lease lasts, then in doubt) and a person's
resolve_tool_call, the calls of one response resumed together, the runs replay-ready; the manual
shows the example verbatim and the example runs."""

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import assert_shows_verbatim, SCOPE, one, wait_for
from psycopg.rows import DictRow
from pydantic_ai import Agent, messages
from pydantic_ai.messages import ModelMessagesTypeAdapter, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.tools import DeferredToolRequests
from pydantic_ai.usage import RequestUsage

from ledger_client import AsyncLedger, InDoubt
from ledger_client.integrations.pydantic_ai import LedgerCapability

CLIENT = Path(__file__).resolve().parents[1]
EXAMPLE = CLIENT / "examples" / "pydantic_ai_agent.py"
MANUAL = CLIENT / "docs" / "pydantic-ai.md"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("pydantic_ai_agent", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()


def capability(dsn: str, **options: Any) -> LedgerCapability:
    return LedgerCapability(AsyncLedger(dsn).scoped(*SCOPE), **options)


def turn(dsn: str, state: Path, prompt: str | None = None, **options: Any) -> Any:
    """One agent run of the example (a new turn with ``prompt``, else the stored one resumed)."""
    return asyncio.run(example.turn(capability(dsn, **options), state, prompt))


def refunds(state: Path) -> list[str]:
    log = state.parent / "refunds.log"
    return log.read_text().splitlines() if log.exists() else []


def ledger_run(person: psycopg.Connection[DictRow]) -> dict[str, Any]:
    row = person.execute("SELECT id, status, output_summary FROM ledger.runs").fetchone()
    assert row is not None
    return dict(row)


def replay_ready(person: psycopg.Connection[DictRow], run_id: str) -> Any:
    return one(person, "SELECT ledger.replay_ready(%s)", (run_id,))


def test_a_call_runs_once_and_a_repeat_is_replayed(dsn: str, tmp_path: Path,
                                                   person: psycopg.Connection[DictRow]) -> None:
    state = tmp_path / "state.json"
    assert turn(dsn, state, "Refund order 1042") == "Order 1042: refunded 120"
    assert refunds(state) == ["1042 120"]
    # The process that ran the refund died before it saved the history past the model's call:
    # the turn is resumed from the history that ends with the call, and the ledger answers it.
    stored = json.loads(state.read_text())
    history = ModelMessagesTypeAdapter.validate_python(stored["messages"])
    assert [m.kind for m in history] == ["request", "response", "request", "response", "request", "response"]
    stored["messages"] = stored["messages"][:4]
    state.write_text(json.dumps(stored))
    assert turn(dsn, state) == "Order 1042: refunded 120"
    assert refunds(state) == ["1042 120"], "replayed (SkipToolExecution), not sent again"
    run = ledger_run(person)
    assert run["status"] == "succeeded" and replay_ready(person, run["id"]) == {"status": "pass", "missing": []}
    calls = person.execute("SELECT tool_call_id, tool_ref, status, attempt FROM ledger.run_step_tool_calls"
                           " ORDER BY created_at").fetchall()
    assert [tuple(c.values()) for c in calls] == [("call-lookup", "lookup_order", "succeeded", 1),
                                                  ("call-refund", "refund", "succeeded", 1)]
    steps = person.execute("SELECT step_type, status FROM ledger.run_steps WHERE step_type = 'llm'").fetchall()
    assert len(steps) == 3 and {s["status"] for s in steps} == {"succeeded"}, "each model response an llm step"
    assert one(person, "SELECT count(*) FROM ledger.run_cost_entries") == 3, "the repeat, after the end, adds none"
    shown = person.execute("SELECT payload FROM ledger.response_events").fetchall()
    assert shown == [{"payload": {"text": "Order 1042: refunded 120"}}], "the answer shown once"


def test_an_approval_is_decided_in_the_ledger_and_the_run_resumes(dsn: str, tmp_path: Path,
                                                                  person: psycopg.Connection[DictRow]) -> None:
    state = tmp_path / "state.json"
    waiting = turn(dsn, state, "Refund order 1042", approval=example.large_refunds)
    assert isinstance(waiting, DeferredToolRequests) and [c.tool_call_id for c in waiting.approvals] == ["call-refund"]
    approval_id = waiting.metadata["call-refund"]["ledger"]["approval_id"]
    assert ledger_run(person)["status"] == "waiting_approval"
    again = turn(dsn, state, approval=example.large_refunds)
    assert isinstance(again, DeferredToolRequests), "still pending: ApprovalRequired again, nothing sent"
    assert refunds(state) == []
    person.execute("SELECT ledger.resolve_approval(%s, 'approved', 'lead@acme', 'broken on arrival')", (approval_id,))
    assert turn(dsn, state, approval=example.large_refunds) == "Order 1042: refunded 120"
    assert refunds(state) == ["1042 120"]
    run = ledger_run(person)
    assert run["status"] == "succeeded" and replay_ready(person, run["id"]) == {"status": "pass", "missing": []}


def test_a_rejected_approval_is_denied_to_the_model(dsn: str, tmp_path: Path,
                                                   person: psycopg.Connection[DictRow]) -> None:
    state = tmp_path / "state.json"
    waiting = turn(dsn, state, "Refund order 1042", approval=example.large_refunds)
    person.execute("SELECT ledger.resolve_approval(%s, 'rejected', 'lead@acme', 'needs a return')",
                   (waiting.metadata["call-refund"]["ledger"]["approval_id"],))
    answer = turn(dsn, state, approval=example.large_refunds)
    assert answer == "Order 1042: A person rejected the call: needs a return"
    history = ModelMessagesTypeAdapter.validate_python(json.loads(state.read_text())["messages"])
    [denied] = [p for m in history for p in m.parts if isinstance(p, ToolReturnPart) and p.tool_name == "refund"]
    assert denied.outcome == "denied", "pydantic-ai's own denial (ToolDenied)"
    assert refunds(state) == []
    assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE tool_call_id = 'call-refund'") == "rejected"
    assert ledger_run(person)["status"] == "succeeded"


def test_an_approval_no_one_decided_in_time_is_denied_to_the_model(dsn: str, tmp_path: Path,
                                                                   person: psycopg.Connection[DictRow]) -> None:
    state = tmp_path / "state.json"
    turn(dsn, state, "Refund order 1042", approval=example.large_refunds)
    # Its deadline passes with no decision and no sweep: the resumed call's claim expires it.
    person.execute("UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second'")
    answer = turn(dsn, state, approval=example.large_refunds)
    assert answer == "Order 1042: No one approved the call before its approval expired."
    assert refunds(state) == []
    call = person.execute("SELECT status, error_code FROM ledger.run_step_tool_calls"
                          " WHERE tool_call_id = 'call-refund'").fetchone()
    assert call == {"status": "rejected", "error_code": "TOOL_APPROVAL_EXPIRED"}
    assert ledger_run(person)["status"] == "succeeded"


# Process A: the example's turn, its refund sent and then stuck (as a provider that never answers),
# until the test kills the process.
STUCK = """
import asyncio, sys, time
from decimal import Decimal
from pathlib import Path
from ledger_client import AsyncLedger
from ledger_client.integrations.pydantic_ai import LedgerCapability
sys.path.insert(0, sys.argv[1])
import pydantic_ai_agent as example
sent = example.send_refund
def stuck(refunds, order, amount):
    sent(refunds, order, amount)
    time.sleep(600)
example.send_refund = stuck
ledger = AsyncLedger(sys.argv[2]).scoped("acme", "tests")
asyncio.run(example.turn(LedgerCapability(ledger), Path(sys.argv[3]), "Refund order 1042"))
"""


def test_a_turn_killed_after_begin_is_resumed_by_another_process(dsn: str, tmp_path: Path,
                                                                 person: psycopg.Connection[DictRow]) -> None:
    state = tmp_path / "state.json"
    a = subprocess.Popen([sys.executable, "-c", STUCK, str(EXAMPLE.parent), dsn, str(state)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(CLIENT / "src")})
    try:
        def sent() -> bool:
            assert a.poll() is None, a.communicate()
            return refunds(state) == ["1042 120"]
        wait_for("process A to send the refund", sent)
    finally:
        os.kill(a.pid, signal.SIGKILL)
        a.communicate()
    assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE tool_call_id = 'call-refund'") == "running"
    early = tmp_path / "early" / "state.json"
    early.parent.mkdir()
    early.write_text(state.read_text())
    busy = turn(dsn, early)  # while A's lease lasts, the call is A's: deferred busy, not sent
    assert isinstance(busy, DeferredToolRequests) and busy.metadata["call-refund"]["ledger"]["outcome"] == "busy"
    assert refunds(early) == []
    # A's lease is 33 s; the person ends it now rather than wait.
    person.execute("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() WHERE tool_call_id = 'call-refund'")

    deferred = turn(dsn, state)  # process B (this one), from the history A saved before the tool ran
    assert isinstance(deferred, DeferredToolRequests) and [c.tool_call_id for c in deferred.calls] == ["call-refund"]
    record = deferred.metadata["call-refund"]["ledger"]
    assert record["outcome"] == "in_doubt" and ledger_run(person)["status"] == "paused"
    with pytest.raises(InDoubt):
        turn(dsn, state)  # nobody has resolved it yet: deferred_results says so
    assert refunds(state) == ["1042 120"]
    person.execute("SELECT ledger.resolve_tool_call(%s, 'succeeded', '\"refunded 120\"', 'ops@acme',"
                   " 'the provider shows the refund')", (record["tool_call_record_id"],))
    assert turn(dsn, state) == "Order 1042: refunded 120"
    assert refunds(state) == ["1042 120"], "the side effect ran once"
    run = ledger_run(person)
    assert run["status"] == "succeeded" and replay_ready(person, run["id"]) == {"status": "pass", "missing": []}


def test_the_manual_shows_the_example_verbatim() -> None:
    assert_shows_verbatim(MANUAL, EXAMPLE)


def test_the_example_runs_and_leaves_its_turn_in_the_ledger(dsn: str, tmp_path: Path) -> None:
    def example_run(*prompt: str) -> str:
        done = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path / "state.json"), *prompt],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "LEDGER_DSN": dsn, "PYTHONPATH": str(CLIENT / "src")})
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert example_run("Refund order 1042").startswith("waiting: refund call-refund {'run_id': 'run_")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT ledger.set_scope('acme', 'support')")
        conn.execute("SELECT ledger.resolve_approval(id, 'approved', 'lead@acme') FROM ledger.approval_requests")
        assert example_run() == "Order 1042: refunded 120\n"
        assert (tmp_path / "refunds.log").read_text() == "1042 120\n"
        row = conn.execute("SELECT id, status, output_summary, request_id FROM ledger.runs").fetchone()
        assert row is not None and row[1:3] == ("succeeded", "Order 1042: refunded 120")
        assert row[3].startswith("pydantic-ai:")
        assert conn.execute("SELECT ledger.replay_ready(%s)", (row[0],)).fetchone() == ({"status": "pass", "missing": []},)
        calls = conn.execute("SELECT tool_call_id, status, result FROM ledger.run_step_tool_calls ORDER BY created_at").fetchall()
        assert calls == [("call-lookup", "succeeded", {"order": "1042", "paid": 120}),
                         ("call-refund", "succeeded", "refunded 120")]
        costs = conn.execute("SELECT count(*), sum(billed_quantity) > 0 FROM ledger.run_cost_entries").fetchone()
        assert costs == (3, True), "three model responses, each with its tokens"


def test_the_calls_of_one_response_resume_together(dsn: str, person: psycopg.Connection[DictRow]) -> None:
    """Two approved calls of one model response, resumed: they run concurrently and both are the
    first use of the ledger run in the resumed agent run (no model request before them)."""
    noted: list[str] = []

    def model(history: list[messages.ModelMessage], info: AgentInfo) -> messages.ModelResponse:
        if isinstance(history[-1].parts[-1], ToolReturnPart):
            return messages.ModelResponse(parts=[messages.TextPart("noted")])
        calls = [messages.ToolCallPart("note", {"text": t}, tool_call_id=f"call-{t}") for t in ("a", "b")]
        return messages.ModelResponse(parts=calls)

    async def body() -> None:
        ledger = LedgerCapability(AsyncLedger(dsn).scoped(*SCOPE), run_id=lambda ctx: "r-notes",
                                  approval=lambda call: {"title": "note"})
        agent = Agent(FunctionModel(model), output_type=[str, DeferredToolRequests], capabilities=[ledger])

        @agent.tool_plain
        async def note(text: str) -> str:
            await asyncio.sleep(0.05)
            noted.append(text)
            return text

        first = await agent.run("Note a and b")
        assert isinstance(first.output, DeferredToolRequests) and len(first.output.approvals) == 2
        person.execute("SELECT ledger.resolve_approval(id, 'approved', 'lead@acme') FROM ledger.approval_requests")
        results = await ledger.deferred_results(first.output)
        done = await agent.run(message_history=first.all_messages(), deferred_tool_results=results)
        assert done.output == "noted"

    asyncio.run(body())
    assert sorted(noted) == ["a", "b"]
    assert ledger_run(person)["status"] == "succeeded"
    assert replay_ready(person, "r-notes") == {"status": "pass", "missing": []}


def test_each_model_response_is_an_llm_step_with_its_cost(dsn: str, person: psycopg.Connection[DictRow]) -> None:
    def model(history: list[messages.ModelMessage], info: AgentInfo) -> messages.ModelResponse:
        usage = RequestUsage(input_tokens=1000, output_tokens=100)
        return messages.ModelResponse(parts=[messages.TextPart("Shipped.")], usage=usage, provider_name="openai")

    agent = Agent(FunctionModel(model, model_name="gpt-4o"), capabilities=[capability(dsn, run_id=lambda ctx: "r-cost")])
    assert agent.run_sync("Where is order 1042?").output == "Shipped."
    cost = person.execute("SELECT billed_quantity, amount, currency, usage, provider, model_ref FROM ledger.run_cost_entries"
                          ).fetchall()
    assert [tuple(c.values()) for c in cost] == [(1100, Decimal("0.0035"), "USD",
                                                 {"prompt_tokens": 1000, "completion_tokens": 100}, "openai", "gpt-4o")]
    step = person.execute("SELECT step_type, status, output_summary FROM ledger.run_steps").fetchall()
    assert step == [{"step_type": "llm", "status": "succeeded", "output_summary": "Shipped."}]
    assert one(person, "SELECT ledger.run_inputs('r-cost')->>'prompt'") == "Where is order 1042?"
    assert replay_ready(person, "r-cost") == {"status": "pass", "missing": []}
