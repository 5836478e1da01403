"""The tool-call helper against the real extension: every claim outcome, replays that execute
nothing, the in-doubt rule after a timeout, heartbeats, and one turn's calls in parallel."""

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from conftest import SCOPE, one, wait_for
from psycopg.rows import DictRow

from ledger_client import (
    BudgetExhausted,
    Busy,
    ClaimOutcome,
    InDoubt,
    InvalidArgumentError,
    Ledger,
    Purged,
    Rejected,
    ScopedLedger,
    ToolCallClaim,
    ToolCallStatus,
    ToolFailed,
    ToolRequest,
    WaitingApproval,
    Worker,
    tool_call,
    tool_calls,
)


class Tool:
    """A tool that counts its executions (thread-safe) and answers `result`."""

    def __init__(self, result: Any = None, action: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._result = result
        self._action = action

    def __call__(self, arguments: dict[str, Any]) -> Any:
        with self._lock:
            self.calls[str(arguments.get("key", ""))] += 1
        if self._action is not None:
            return self._action(arguments)
        return self._result

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def running_run(ledger: ScopedLedger, run_id: str) -> str:
    ledger.create_run("agent", run_id=run_id)
    ledger.transition_run(run_id, "running")
    return run_id


def test_every_claim_outcome_typed_and_raised(scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    run = running_run(scoped, "r-outcomes")
    tool = Tool({"status": "shipped"})

    def helper(call_id: str, **options: Any) -> Any:
        return tool_call(scoped, run, call_id, "crm.lookup", {"order": 1}, tool, **options)

    def claim(call_id: str, **options: Any) -> ToolCallClaim:
        return scoped.claim_tool_call(run, "crm.lookup", {"order": 1}, tool_call_id=call_id, **options)

    # claimed, then busy while its lease lives (claims are not re-entrant)
    first = claim("busy")
    assert first.outcome is ClaimOutcome.CLAIMED and first.tool_call is not None
    assert first.tool_call.attempt == 1 and first.tool_call.status is ToolCallStatus.CLAIMED
    assert claim("busy").outcome is ClaimOutcome.BUSY
    with pytest.raises(Busy) as busy:
        helper("busy")
    assert busy.value.outcome is ClaimOutcome.BUSY and busy.value.tool_call is not None
    assert busy.value.tool_call.lease_owner == first.tool_call.lease_owner

    # claimed and executed, then replayed: the recorded result, nothing executed
    assert helper("lookup") == {"status": "shipped"} and tool.total == 1
    replay = claim("lookup")
    assert replay.outcome is ClaimOutcome.REPLAYED and replay.response is not None
    assert replay.response.success and replay.response.result == {"status": "shipped"}
    assert helper("lookup") == {"status": "shipped"} and tool.total == 1

    # in doubt: begun, and completed unknown
    doubt = claim("doubt")
    assert doubt.tool_call is not None
    scoped.begin_tool_call(doubt.tool_call.id, doubt.tool_call.attempt)
    scoped.complete_tool_call(doubt.tool_call.id, doubt.tool_call.attempt, "unknown")
    assert claim("doubt").outcome is ClaimOutcome.IN_DOUBT
    with pytest.raises(InDoubt) as in_doubt:
        helper("doubt", retry_failed=True)
    assert in_doubt.value.tool_call is not None and in_doubt.value.tool_call.status is ToolCallStatus.IN_DOUBT

    # waiting for approval, then rejected
    with pytest.raises(WaitingApproval) as waiting:
        helper("refund", approval={"title": "Refund order 1", "policy_ref": "refunds/v1"})
    assert waiting.value.approval is not None and waiting.value.approval.title == "Refund order 1"
    assert claim("refund").outcome is ClaimOutcome.WAITING_APPROVAL
    decided = scoped.resolve_approval(waiting.value.approval.id, "rejected", actor="lead@acme", note="no")
    assert decided.status == "rejected" and decided.actor == "lead@acme"
    assert claim("refund").outcome is ClaimOutcome.REJECTED
    with pytest.raises(Rejected):
        helper("refund", approval={"title": "Refund order 1"})

    # purged: a finished run's key, claimed after the run was purged
    done = running_run(scoped, "r-purged")
    tool_call(scoped, done, "c1", "crm.lookup", {"order": 1}, tool)
    scoped.transition_run(done, "succeeded")
    assert scoped.execute("SELECT ledger.purge_runs('0 seconds') AS n") == [{"n": 1}]
    purged = scoped.claim_tool_call(run, "crm.lookup", {"order": 1}, tool_call_id="late",
                                    idempotency_key=f"tool:{done}:c1")
    assert purged.outcome is ClaimOutcome.PURGED and purged.tool_call is None
    assert purged.tombstone is not None and purged.tombstone.run_id == done
    with pytest.raises(Purged):
        tool_call(scoped, run, "late", "crm.lookup", {"order": 1}, tool, idempotency_key=f"tool:{done}:c1")
    assert tool.total == 2  # "lookup" and "c1", each once; nothing else ever executed
    assert one(person, "SELECT count(*) FROM ledger.tool_calls_in_doubt") == 1


def test_a_call_its_budget_refuses_is_never_executed(scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    run = running_run(scoped, "r-budget")
    scoped.set_budget("tool_calls", 2, level="run", run_id=run)
    tool = Tool({"status": "shipped"})
    turn = [ToolRequest(f"call-{n}", "crm.lookup", {"key": n}, tool) for n in range(3)]
    results = tool_calls(scoped, run, turn)
    assert [r.claim.outcome for r in results] == [ClaimOutcome.CLAIMED] * 2 + [ClaimOutcome.BUDGET_EXHAUSTED]
    refused = results[2].error
    assert isinstance(refused, BudgetExhausted) and refused.outcome is ClaimOutcome.BUDGET_EXHAUSTED
    assert refused.tool_call is None and refused.budget is not None
    assert (refused.budget.level, refused.budget.run_id, refused.budget.unit) == ("run", run, "tool_calls")
    with pytest.raises(BudgetExhausted) as alone:
        tool_call(scoped, run, "call-3", "crm.lookup", {"key": 3}, tool)
    assert alone.value.budget == refused.budget
    assert tool.total == 2 and one(person, "SELECT count(*) FROM ledger.run_step_tool_calls") == 2
    assert one(person, "SELECT error_code FROM ledger.runs WHERE id = %s", (run,)) == "BUDGET_EXHAUSTED"
    # A replay is no decision: the recorded result comes back while the budget is used up.
    assert tool_call(scoped, run, "call-0", "crm.lookup", {"key": 0}, tool) == {"status": "shipped"}
    scoped.set_budget("tool_calls", 3, level="run", run_id=run, actor="lead@acme")
    assert tool_call(scoped, run, "call-2", "crm.lookup", {"key": 2}, tool) == {"status": "shipped"}
    assert tool.total == 3


def test_a_failure_is_recorded_and_replayed_until_retried(scoped: ScopedLedger) -> None:
    run = running_run(scoped, "r-fail")

    def broken(arguments: dict[str, Any]) -> Any:
        raise ConnectionRefusedError("crm is down")

    with pytest.raises(ConnectionRefusedError):
        tool_call(scoped, run, "c1", "crm.lookup", {}, broken)
    with pytest.raises(ToolFailed) as replayed:
        tool_call(scoped, run, "c1", "crm.lookup", {}, broken)
    assert replayed.value.tool_call is not None and replayed.value.tool_call.status is ToolCallStatus.FAILED
    assert replayed.value.tool_call.error_message == "crm is down"
    assert tool_call(scoped, run, "c1", "crm.lookup", {}, Tool("up again"), retry_failed=True) == "up again"


def test_a_timeout_after_sending_leaves_the_call_in_doubt_for_good(
    scoped: ScopedLedger, pooled: Ledger, person: psycopg.Connection[DictRow]
) -> None:
    run = running_run(scoped, "r-timeout")

    def times_out(arguments: dict[str, Any]) -> Any:
        raise TimeoutError("no answer from the mail server")

    tool = Tool(action=times_out)
    with pytest.raises(InDoubt) as first:
        tool_call(scoped, run, "email", "email.send", {"to": "customer@example.com"}, tool, lease_owner="worker-1")
    assert isinstance(first.value.__cause__, TimeoutError)
    assert first.value.tool_call is not None and first.value.tool_call.status is ToolCallStatus.IN_DOUBT
    doubt = person.execute("SELECT tool_call_id, lease_owner FROM ledger.tool_calls_in_doubt").fetchall()
    assert doubt == [{"tool_call_id": "email", "lease_owner": "worker-1"}]
    # A second worker (another pool, its lease long over) never executes it again.
    second = pooled.scoped(*SCOPE)
    person.execute("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 hour'")
    for _ in range(2):
        with pytest.raises(InDoubt):
            tool_call(second, run, "email", "email.send", {"to": "customer@example.com"}, tool,
                      lease_owner="worker-2", retry_failed=True)
    assert tool.total == 1
    # Only a person's decision ends the doubt; then the key replays it.
    assert first.value.tool_call is not None
    scoped.resolve_tool_call(first.value.tool_call.id, "succeeded", {"message_id": "<42@mail>"},
                             actor="ops@acme", note="found in the mail log")
    assert tool_call(second, run, "email", "email.send", {"to": "customer@example.com"}, tool) == {
        "message_id": "<42@mail>"}
    assert tool.total == 1


def test_heartbeats_keep_a_slow_tools_lease_alive_past_its_timeout(
    scoped: ScopedLedger, pooled: Ledger, person: psycopg.Connection[DictRow]
) -> None:
    run = running_run(scoped, "r-slow")
    other = pooled.scoped(*SCOPE)
    seen: list[str] = []

    def slow(arguments: dict[str, Any]) -> Any:
        started = time.monotonic()
        # begin_tool_call was committed before the tool runs: another session sees it.
        assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE tool_call_id = 'slow'") == "running"
        # The lease runs out (as it would after `timeout_seconds` plus a tenth) ...
        person.execute("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 second'"
                       " WHERE tool_call_id = 'slow'")
        # ... and the helper's heartbeat extends it again while the tool still runs.
        wait_for("a heartbeat", lambda: bool(one(
            person, "SELECT lease_expires_at > now() FROM ledger.run_step_tool_calls WHERE tool_call_id = 'slow'")))
        try:
            tool_call(other, run, "slow", "report.build", {"pages": 40}, Tool(), lease_owner="worker-2")
        except Busy:
            seen.append("busy")  # alive: not in doubt, not taken over
        time.sleep(max(0.0, 1.2 - (time.monotonic() - started)))  # outlive timeout_seconds
        return {"pages": 40}

    result = tool_call(scoped, run, "slow", "report.build", {"pages": 40}, slow, timeout_seconds=1, heartbeat_s=0.1)
    assert result == {"pages": 40} and seen == ["busy"]
    assert one(person, "SELECT status FROM ledger.run_step_tool_calls WHERE tool_call_id = 'slow'") == "succeeded"
    assert one(person, "SELECT count(*) FROM ledger.run_events WHERE event_type = 'tool_call.in_doubt'") == 0


def test_one_turn_in_parallel_with_overlapping_workers_executes_each_call_once(
    scoped: ScopedLedger, pooled: Ledger, person: psycopg.Connection[DictRow]
) -> None:
    run = running_run(scoped, "r-turn")
    inside = threading.Barrier(4, timeout=30)  # the first worker's four calls run at the same time

    def fetch(arguments: dict[str, Any]) -> Any:
        inside.wait()
        return {"city": arguments["key"], "temp": len(str(arguments["key"]))}

    tool = Tool(action=fetch)
    requests = [ToolRequest(f"call-{city}", "weather.now", {"key": city}, tool, timeout_seconds=5)
                for city in ("Lyon", "Oslo", "Lima", "Pune")]
    start = threading.Barrier(2, timeout=30)
    turns: dict[str, list[Any]] = {}

    def worker(name: str, ledger: ScopedLedger) -> None:
        start.wait()
        turns[name] = tool_calls(ledger, run, requests, lease_owner=name, heartbeat_s=0.2)

    threads = [threading.Thread(target=worker, args=(name, ledger))
               for name, ledger in (("worker-1", scoped), ("worker-2", pooled.scoped(*SCOPE)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert dict(tool.calls) == {"Lyon": 1, "Oslo": 1, "Lima": 1, "Pune": 1}
    outcomes = sorted((r.claim.outcome, type(r.error).__name__) for turn in turns.values() for r in turn)
    # One worker's batch claimed all four (one statement, the run locked once); the other's found
    # them held or finished.
    assert outcomes.count((ClaimOutcome.CLAIMED, "NoneType")) == 4
    assert all(o in ((ClaimOutcome.BUSY, "Busy"), (ClaimOutcome.REPLAYED, "NoneType"), (ClaimOutcome.CLAIMED, "NoneType"))
               for o in outcomes)
    assert len(outcomes) == 8
    # The turn again, as after a resume: every result replayed, nothing executed.
    again = tool_calls(scoped, run, requests)
    assert [r.claim.outcome for r in again] == [ClaimOutcome.REPLAYED] * 4
    assert [r.get() for r in again] == [{"city": c, "temp": 4} for c in ("Lyon", "Oslo", "Lima", "Pune")]
    assert tool.total == 4
    assert one(person, "SELECT count(*) FROM ledger.run_step_tool_calls WHERE status = 'succeeded'") == 4


def test_a_refused_turn_executes_and_writes_nothing(scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    run = running_run(scoped, "r-refused")
    tool = Tool("never")
    events = one(person, "SELECT count(*) FROM ledger.run_events")
    twice = [ToolRequest("call-1", "weather.now", {"key": "Lyon"}, tool), ToolRequest("call-1", "weather.now", {}, tool)]
    with pytest.raises(InvalidArgumentError) as refused:
        tool_calls(scoped, run, twice)
    assert (refused.value.sqlstate, refused.value.code) == ("22023", "CALLS_DUPLICATE")
    assert (refused.value.detail["index"], refused.value.detail["same_as"]) == (1, 0)
    assert tool.total == 0 and one(person, "SELECT count(*) FROM ledger.run_events") == events
    assert one(person, "SELECT count(*) FROM ledger.run_step_tool_calls") == 0


@pytest.mark.parametrize("heartbeat_s", [0, -1.0, float("nan"), float("inf")])
def test_a_heartbeat_that_is_not_a_positive_number_is_refused_before_anything_is_claimed(
    heartbeat_s: float, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    run = running_run(scoped, "r-beat")
    tool = Tool("never")
    for attempt in (
        lambda: tool_call(scoped, run, "call-1", "weather.now", {}, tool, heartbeat_s=heartbeat_s),
        lambda: tool_calls(scoped, run, [ToolRequest("call-1", "weather.now", {}, tool)], heartbeat_s=heartbeat_s),
        lambda: Worker(scoped.ledger, lambda ctx: "", heartbeat_s=heartbeat_s),
    ):
        with pytest.raises(ValueError, match=r"ledger: heartbeat_s must be a positive number of seconds"):
            attempt()
    assert tool.total == 0 and one(person, "SELECT count(*) FROM ledger.run_step_tool_calls") == 0
