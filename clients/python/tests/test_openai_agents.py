"""The OpenAI Agents SDK adapter against the real extension, offline with the SDK's own scripted
model (agents.testing.ScriptedModel; tests/openai_agents_support.py is the agent): a guarded call
executed once and replayed, an approval decided in SQL (or left to expire) between two processes, a process killed
while its tool runs and the run finished by others after a person's decision, the tracing
processor's steps and costs, and replay_ready."""

import asyncio
import inspect
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from agents import RunConfig, Runner, UserError, handoff_span, set_trace_processors, trace
from conftest import assert_shows_verbatim, SCOPE, one, wait_for
from openai_agents_support import agent, drive
from psycopg.rows import DictRow

from ledger_client import AsyncLedger, Ledger, ScopedLedger
from ledger_client.integrations import openai_agents
from ledger_client.integrations.openai_agents import LedgerRun, LedgerTracingProcessor, flush_processors

HERE = Path(__file__).parent


@pytest.fixture
def effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EFFECTS_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def processor(ledger: Ledger) -> Iterator[LedgerTracingProcessor]:
    """The ledger's processor as the only one: no trace leaves the machine."""
    processor = LedgerTracingProcessor(ledger)
    set_trace_processors([processor])
    yield processor
    set_trace_processors([])
    processor.shutdown()


def ledger_run(dsn: str, run_id: str) -> LedgerRun:
    return LedgerRun(AsyncLedger(dsn).scoped(*SCOPE), run_id)


def executions(effects: Path) -> list[str]:
    path = effects / "refund"
    return path.read_text().split() if path.exists() else []


def spawn(dsn: str, run_id: str, input: str, approval: bool, effects: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "openai_agents_support.py"), dsn, SCOPE[1], run_id, input, "1" if approval else "0"],
        env={**os.environ, "EFFECTS_DIR": str(effects), "PYTHONPATH": f"{HERE.parent / 'src'}:{HERE}"},
        stdout=subprocess.PIPE, text=True)


def drive_elsewhere(dsn: str, run_id: str, input: str, approval: bool, effects: Path) -> dict[str, Any]:
    """run_agent in another process, to its end."""
    process = spawn(dsn, run_id, input, approval, effects)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, out
    outcome: dict[str, Any] = json.loads(out)
    return outcome


def tool_call(person: psycopg.Connection[DictRow], call_id: str) -> dict[str, Any]:
    row = person.execute("SELECT id, status, attempt, approval_id, result FROM ledger.run_step_tool_calls"
                         " WHERE tool_call_id = %s", (call_id,)).fetchone()
    assert row is not None
    return dict(row)


def test_a_guarded_call_is_executed_once_then_replayed_and_the_run_is_replay_ready(
    dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path,
    processor: LedgerTracingProcessor,
) -> None:
    scoped.create_run("agent", {"ask": "refund:7,track:7"}, run_id="r-once")
    outcome = asyncio.run(drive(dsn, SCOPE[1], "r-once", "refund:7,track:7", False))
    assert outcome == {"status": "succeeded", "final_output": "done: {'refund_id': 'rf-7'} | order 7: delivered",
                       "waiting": []}
    assert executions(effects) == ["7"]
    assert tool_call(person, "call-refund-7")["result"] == {"refund_id": "rf-7"}

    async def again() -> Any:  # the same turn again, the same call ids: nothing is executed
        run = ledger_run(dsn, "r-once")
        result = await Runner.run(agent(approval=False), "refund:7", context=run)
        await flush_processors()
        return result.final_output
    assert asyncio.run(again()) == "done: {'refund_id': 'rf-7'}"
    assert executions(effects) == ["7"]
    assert tool_call(person, "call-refund-7")["attempt"] == 1

    # The processor: each model call an llm step with its cost; the guardrail; the unguarded
    # `track` as a function step; the guarded `refund` only as its tool call's step.
    steps = person.execute("SELECT step_type, status, input_summary, output_summary FROM ledger.run_steps"
                           " WHERE run_id = 'r-once' ORDER BY step_no").fetchall()
    assert sorted((s["step_type"], s["input_summary"], s["output_summary"]) for s in steps) == [
        ("function", "tool=track", "order 7: delivered"), ("guardrail", "polite", "passed"),
        ("llm", "scripted-1", None), ("llm", "scripted-1", None), ("tool", "tool=refund", '{"refund_id":"rf-7"}')]
    assert all(s["status"] == "succeeded" for s in steps)
    costs = person.execute("SELECT billed_quantity, usage, model_ref, provider, step_id IS NOT NULL AS of_step"
                           " FROM ledger.run_cost_entries WHERE run_id = 'r-once'").fetchall()
    assert [(int(c["billed_quantity"]), c["usage"], c["model_ref"], c["provider"], c["of_step"]) for c in costs] == 2 * [
        (150, {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150, "request_count": 1},
         "scripted-1", "openai", True)]
    shown = person.execute("SELECT payload FROM ledger.response_events WHERE run_id = 'r-once'").fetchall()
    assert [s["payload"] for s in shown] == [{"text": "done: {'refund_id': 'rf-7'} | order 7: delivered"}]
    assert one(person, "SELECT ledger.replay_ready('r-once')") == {"status": "pass", "missing": []}


def test_the_processor_records_handoffs_and_guardrails_of_a_ledger_trace_only(
    dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], processor: LedgerTracingProcessor
) -> None:
    run = ledger_run(dsn, scoped.create_run("agent", run_id="r-spans").id)
    with trace("triage", metadata=run.trace_metadata()):
        with handoff_span(from_agent="triage", to_agent="refunds"):
            pass
    with trace("no ledger run"):
        with handoff_span(from_agent="a", to_agent="b"):
            pass
    processor.force_flush()
    steps = person.execute("SELECT run_id, step_type, input_summary, output_summary FROM ledger.run_steps").fetchall()
    assert [tuple(s.values()) for s in steps] == [("r-spans", "handoff", "triage -> refunds", "refunds")]


@pytest.mark.parametrize("decision", ["approved", "rejected", "expired"])
def test_an_approval_is_asked_in_the_ledger_decided_in_sql_and_applied_by_another_process(
    dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path,
    processor: LedgerTracingProcessor, decision: str,
) -> None:
    scoped.create_run("agent", run_id="r-approve")
    first = asyncio.run(drive(dsn, SCOPE[1], "r-approve", "refund:8", True))
    record = tool_call(person, "call-refund-8")
    assert first == {"status": "waiting_approval", "final_output": None,
                     "waiting": [["call-refund-8", "waiting_approval", record["id"]]]}
    assert one(person, "SELECT status FROM ledger.runs WHERE id = 'r-approve'") == "waiting_approval"
    assert one(person, "SELECT count(*) FROM ledger.run_artifacts WHERE meta->>'kind' = 'openai_agents.run_state'") == 1
    assert executions(effects) == []
    assert one(person, "SELECT expires_at - created_at FROM ledger.approval_requests") == timedelta(hours=1)
    # Nothing decided yet: a resume finds the call still waiting and executes nothing.
    assert asyncio.run(drive(dsn, SCOPE[1], "r-approve", "refund:8", True))["status"] == "waiting_approval"

    if decision == "expired":  # no one decides before the deadline, and no sweep has run yet
        person.execute("UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second'")
    else:
        person.execute("SELECT ledger.resolve_approval(id, %s, actor => 'ops@acme', note => 'checked')"
                       " FROM ledger.pending_approvals", (decision,))
    last = drive_elsewhere(dsn, "r-approve", "refund:8", True, effects)
    assert last["status"] == "succeeded"
    if decision == "approved":
        assert last["final_output"] == "done: {'refund_id': 'rf-8'}"
        assert executions(effects) == ["8"]
    elif decision == "rejected":  # the SDK's rejection path: the model is told, the tool never ran
        assert last["final_output"] == (f"done: ledger: a person rejected tool call call-refund-8 ({record['id']}):"
                                        " checked; it was not executed")
        assert executions(effects) == []
    else:  # the same path, told why; the run's end then settles the ledger's record
        assert last["final_output"] == (f"done: ledger: the approval of tool call call-refund-8 ({record['id']})"
                                        " expired before anyone decided it; it was not executed")
        assert executions(effects) == []
        assert one(person, "SELECT ledger.sweep_tool_calls()") == 0
        assert one(person, "SELECT status FROM ledger.approval_requests") == "canceled"
        assert tool_call(person, "call-refund-8")["status"] == "rejected"
    # The pause and the run are the guarded call's only trace: no function step besides its tool step.
    assert one(person, "SELECT count(*) FROM ledger.run_steps WHERE step_type = 'function'") == 0
    assert one(person, "SELECT ledger.replay_ready('r-approve')") == {"status": "pass", "missing": []}
    # The run is over: driving it again runs nothing and answers what it answered.
    assert asyncio.run(drive(dsn, SCOPE[1], "r-approve", "refund:8", True)) == {**last, "waiting": []}
    assert len(executions(effects)) == (1 if decision == "approved" else 0)


@pytest.mark.parametrize("approval", [False, True])
def test_a_process_killed_while_its_tool_runs_leaves_the_call_in_doubt_for_a_person_then_the_run_finishes(
    dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path,
    processor: LedgerTracingProcessor, approval: bool,
) -> None:
    def resume() -> dict[str, Any]:  # this process, not the killed one
        return asyncio.run(drive(dsn, SCOPE[1], "r-killed", "refund:9", approval))

    scoped.create_run("agent", run_id="r-killed")
    if approval:  # the run pauses before the tool: its RunState is saved, the approval asked
        assert resume()["status"] == "waiting_approval"
        person.execute("SELECT ledger.resolve_approval(id, 'approved') FROM ledger.pending_approvals")
    (effects / "block").touch()
    killed = spawn(dsn, "r-killed", "refund:9", approval, effects)
    wait_for("the refund to start", lambda: executions(effects) == ["9"])
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    (effects / "block").unlink()
    record = tool_call(person, "call-refund-9")
    assert record["status"] == "running"

    # This process resumes the run (from its saved RunState, or the same turn again with the
    # same call ids): the call is still held, then in doubt; either way the run parks on the
    # SDK's interruption naming the record, and nothing is executed.
    held = resume()
    assert held == {"status": "paused", "final_output": None, "waiting": [["call-refund-9", "running", record["id"]]]}
    person.execute("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 hour'")
    assert one(person, "SELECT ledger.sweep_tool_calls()") == 1
    in_doubt = resume()
    assert in_doubt == {"status": "paused", "final_output": None,
                        "waiting": [["call-refund-9", "in_doubt", record["id"]]]}
    assert executions(effects) == ["9"]

    # A person finds the refund at the payment provider and says so; the run finishes on it.
    person.execute("SELECT ledger.resolve_tool_call(%s, 'succeeded', '{\"refund_id\": \"rf-9\"}', actor => 'ops@acme')",
                   (record["id"],))
    done = resume()
    assert done == {"status": "succeeded", "final_output": "done: {'refund_id': 'rf-9'}", "waiting": []}
    assert executions(effects) == ["9"]
    assert one(person, "SELECT status FROM ledger.runs WHERE id = 'r-killed'") == "succeeded"
    assert one(person, "SELECT ledger.replay_ready('r-killed')") == {"status": "pass", "missing": []}


def test_an_approval_given_in_the_sdk_alone_runs_nothing_the_ledger_holds_waiting(
    dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path,
    processor: LedgerTracingProcessor,
) -> None:
    scoped.create_run("agent", run_id="r-bypass")

    async def body() -> Any:
        run = ledger_run(dsn, "r-bypass")
        support = agent(approval=True)
        paused = await Runner.run(support, "refund:5", context=run)
        [item] = paused.interruptions
        state = paused.to_state()
        state.approve(item)  # nobody asked the ledger
        return (await Runner.run(support, state)).final_output
    output = json.loads(asyncio.run(body()).removeprefix("done: "))
    assert output == {"error": "ledger: the call waits for a person's approval (ledger.resolve_approval)",
                      "outcome": "waiting_approval", "tool_call_id": "call-refund-5",
                      "tool_call_record_id": tool_call(person, "call-refund-5")["id"]}
    assert executions(effects) == []


EXAMPLE = HERE.parent / "examples" / "openai_agents_agent.py"
MANUAL = HERE.parent / "docs" / "openai-agents.md"


def test_the_manual_shows_the_example_verbatim() -> None:
    assert_shows_verbatim(MANUAL, EXAMPLE)


def test_the_manual_documents_every_public_parameter() -> None:
    text = MANUAL.read_text(encoding="utf-8")
    section = re.search(r"^## Parameters\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, "docs/openai-agents.md has no section \"Parameters\""
    for name in openai_agents.__all__:
        value = getattr(openai_agents, name)
        assert f"`{name}" in text, f"{name} is public and not in docs/openai-agents.md"
        if not callable(value) or name in ("AgentOutcome", "Waiting", "Approval"):  # results, a type
            continue
        missing = [p for p in inspect.signature(value).parameters if f"`{p}`" not in section.group(1)]
        assert not missing, f"{name}: parameters {missing} are not in docs/openai-agents.md's \"Parameters\""


def test_the_example_runs_and_leaves_its_run_in_the_ledger(dsn: str, person: psycopg.Connection[DictRow]) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LEDGER_DSN": dsn, "PYTHONPATH": str(HERE.parent / "src")})
    assert done.returncode == 0, done.stderr
    assert "person: approved 'Refund order 1042'" in done.stdout
    assert "replay_ready pass" in done.stdout
    person.execute("SELECT ledger.set_scope('acme', 'examples-openai-agents')")
    [run] = person.execute("SELECT id, status, output_summary FROM ledger.runs").fetchall()
    assert (run["status"], run["output_summary"]) == (
        "succeeded", "Order 1042 was refunded: {'refund_id': 'rf-1042', 'amount': '12.50'}")
    calls = person.execute("SELECT tool_call_id, status, attempt, result FROM ledger.run_step_tool_calls").fetchall()
    assert [tuple(c.values()) for c in calls] == [("call-refund", "succeeded", 1, {"refund_id": "rf-1042", "amount": "12.50"})]
    steps = person.execute("SELECT step_type FROM ledger.run_steps ORDER BY step_no").fetchall()
    assert sorted(s["step_type"] for s in steps) == ["function", "llm", "llm", "llm", "tool"]
    assert one(person, "SELECT sum(billed_quantity)::int FROM ledger.run_cost_entries") == 450
    assert one(person, "SELECT count(*) FROM ledger.run_artifacts WHERE meta->>'kind' = 'openai_agents.run_state'") == 1


def test_a_tool_that_fails_fails_the_run_and_one_that_times_out_leaves_its_call_in_doubt(
    dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path,
    processor: LedgerTracingProcessor,
) -> None:
    scoped.create_run("agent", run_id="r-fails")
    with pytest.raises(UserError, match="the payment provider refused"):  # the SDK's wrapping of it
        asyncio.run(drive(dsn, SCOPE[1], "r-fails", "refund:0", False))
    run = person.execute("SELECT status, error_code, error_message FROM ledger.runs WHERE id = 'r-fails'").fetchone()
    assert run is not None and tuple(run.values()) == (
        "failed", "UserError", "Error running tool refund: the payment provider refused")
    assert tool_call(person, "call-refund-0")["status"] == "failed"

    async def again() -> Any:  # the same turn again: the recorded failure, told to the model
        run = ledger_run(dsn, "r-fails")
        return (await Runner.run(agent(approval=False), "refund:0", context=run)).final_output
    told = json.loads(asyncio.run(again()).removeprefix("done: "))
    assert (told["outcome"], told["recorded_error"]) == ("replayed", "the payment provider refused")
    assert executions(effects) == ["0"]

    # A timeout after sending: the call is in doubt, and the model is told so with the record's id.
    scoped.create_run("agent", run_id="r-timeout")
    outcome = asyncio.run(drive(dsn, SCOPE[1], "r-timeout", "refund:-1", False))
    record = tool_call(person, "call-refund--1")
    assert record["status"] == "in_doubt"
    told = json.loads(outcome["final_output"].removeprefix("done: "))
    assert (told["outcome"], told["tool_call_record_id"]) == ("in_doubt", record["id"])
    assert executions(effects) == ["0", "-1"]


def test_a_streamed_run_is_guarded_and_traced_alike(
    dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path,
    processor: LedgerTracingProcessor,
) -> None:
    run = ledger_run(dsn, scoped.create_run("agent", run_id="r-stream").id)

    async def body() -> Any:
        outputs = []
        for _ in range(2):  # the second time, the same call id: replayed
            streamed = Runner.run_streamed(agent(approval=False), "refund:3", context=run,
                                           run_config=RunConfig(trace_metadata=run.trace_metadata()))
            async for _event in streamed.stream_events():
                pass
            outputs.append(streamed.final_output)
        await flush_processors()
        return outputs
    assert asyncio.run(body()) == 2 * ["done: {'refund_id': 'rf-3'}"]
    assert executions(effects) == ["3"]
    steps = person.execute("SELECT step_type, count(*) AS n FROM ledger.run_steps WHERE run_id = 'r-stream'"
                           " GROUP BY step_type ORDER BY step_type").fetchall()
    assert [(s["step_type"], s["n"]) for s in steps] == [("guardrail", 2), ("llm", 4), ("tool", 1)]
    assert one(person, "SELECT count(*) FROM ledger.run_cost_entries WHERE run_id = 'r-stream'") == 4
