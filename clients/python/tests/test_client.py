"""The scoped handle: typed results, the escape hatch, transactions, and typed errors (with their
SQLSTATE and DETAIL code, and nothing written by a refused call)."""

from datetime import datetime, timedelta, timezone
from decimal import Decimal

import psycopg
import pytest
from conftest import SCOPE, one
from psycopg.rows import DictRow

from ledger_client import (
    BudgetUsage,
    ClaimedRun,
    ClaimOutcome,
    ConflictError,
    CostEntry,
    IdempotencyMismatchError,
    InvalidArgumentError,
    Ledger,
    LedgerError,
    NotFoundError,
    ReadOnlyError,
    ResponseEvent,
    Run,
    RunEvent,
    RunStatus,
    ScopedLedger,
    ScopeError,
    Step,
    StepStatus,
    WrongStateError,
    translate,
)


def test_typed_results_through_a_pool(pooled: Ledger) -> None:
    ledger = pooled.scoped(*SCOPE)
    run = ledger.create_run("agent", {"order": 1042}, run_id="r-typed", user_id="customer-7")
    assert isinstance(run, Run) and run.id == "r-typed" and run.status is RunStatus.QUEUED
    assert run.inputs == {"order": 1042} and isinstance(run.queued_at, datetime) and run.run_token == 0
    assert ledger.create_run("agent", {"order": 1042}, run_id="r-typed", user_id="customer-7") == run  # idempotent

    assert ledger.claim_run("worker-1", modes=["chat"], kinds=["agent"]) is None  # filtered out
    claimed = ledger.claim_run("worker-1", modes=["agent"], lease_seconds=30)
    assert isinstance(claimed, ClaimedRun)
    assert (claimed.run_id, claimed.run_token, claimed.takeover, claimed.status) == ("r-typed", 1, False, RunStatus.QUEUED)
    assert (claimed.tenant_id, claimed.workspace_id) == SCOPE and claimed.last_event_id is not None
    assert ledger.claim_run("worker-2") is None  # held: nothing else claimable

    running = ledger.transition_run("r-typed", RunStatus.RUNNING, run_token=1)
    assert running.status is RunStatus.RUNNING and running.started_at is not None
    step = ledger.create_step("r-typed", "llm", step_key="plan", run_token=1)
    assert isinstance(step, Step) and step.status is StepStatus.QUEUED and step.step_no == 1
    assert ledger.create_step("r-typed", "llm", step_key="plan").id == step.id  # found again by key
    ledger.transition_step(step.id, StepStatus.RUNNING)
    done = ledger.transition_step(step.id, StepStatus.SUCCEEDED, metrics={"model": "small"}, output_summary="plan")
    assert done.status is StepStatus.SUCCEEDED and done.metrics == {"model": "small"}

    cost = ledger.record_cost("r-typed", "tokens", 1200, Decimal("0.0125"), "usd", step_id=step.id,
                              usage={"input_tokens": 1000, "output_tokens": 200})
    assert isinstance(cost, CostEntry) and cost.amount == Decimal("0.0125") and cost.currency == "USD"
    assert cost.usage == {"prompt_tokens": 1000, "completion_tokens": 200}  # the ledger's names
    assert ledger.record_cost("r-typed", "requests", 1, 0.1, "USD").amount == Decimal("0.1")  # a float's text

    said = ledger.record_response_event("r-typed", "message", {"text": "shipped"})
    assert isinstance(said, ResponseEvent) and said.payload == {"text": "shipped"}
    assert ledger.heartbeat_run("r-typed", 1, extend_seconds=60) > claimed.lease_expires_at
    ended = ledger.transition_run("r-typed", RunStatus.SUCCEEDED, output_summary="shipped", run_token=1)
    assert ended.status.terminal and ended.lease_expires_at is None

    events = ledger.events_since("r-typed")
    assert all(isinstance(e, RunEvent) for e in events)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.event_type for e in events if e.ends_run] == ["run.status"] and events[-1].ends_run
    assert ledger.events_since("r-typed", events[2].event_id, max_events=2) == events[3:5]

    assert ledger.replay_ready("r-typed").ready
    evidence = ledger.run_evidence("r-typed")
    assert [e.key for e in evidence][:2] == ["actor_scope", "subject_version"] and len(evidence) == 13
    assert set(ledger.replay_bundle("r-typed")) >= {"run", "steps", "costs", "trace_spec"}


def test_scoped_transaction_commits_together_or_not_at_all(scoped: ScopedLedger) -> None:
    with scoped.transaction() as tx:
        tx.create_run("agent", run_id="r-tx")
        tx.transition_run("r-tx", "running")
    assert scoped.get_run("r-tx") is not None
    with pytest.raises(WrongStateError):
        with scoped.transaction() as tx:
            tx.create_step("r-tx", "llm", step_key="written-then-rolled-back")
            tx.transition_run("r-tx", "queued")  # running -> queued is not allowed
    assert scoped.execute("SELECT step_key FROM ledger.run_steps") == []
    # The escape hatch: any SQL in the scoped transaction, rows as dicts.
    assert scoped.execute("SELECT ledger.scope_tenant() AS t, ledger.scope_workspace() AS w") == [
        {"t": "acme", "w": "tests"}]
    assert scoped.ledger.scoped("acme", "elsewhere").get_run("r-tx") is None  # another scope's run


def count(person: psycopg.Connection[DictRow], table: str) -> int:
    value: int = one(person, f"SELECT count(*) FROM ledger.{table}")
    return value


def test_bad_input_is_a_typed_error_and_writes_nothing(scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    with pytest.raises(InvalidArgumentError) as bad_id:
        scoped.create_run("agent", {"order": 1}, run_id="has a space")
    assert (bad_id.value.sqlstate, bad_id.value.code) == ("22023", "ID_INVALID")
    assert bad_id.value.message.startswith("ledger: ") and isinstance(bad_id.value.__cause__, psycopg.Error)
    assert count(person, "runs") == 0 and count(person, "outbox") == 0

    scoped.create_run("agent", run_id="r-bad")
    before = count(person, "run_events")
    with pytest.raises(InvalidArgumentError) as quantity:
        scoped.record_cost("r-bad", "tokens", Decimal(-1))
    assert quantity.value.code == "QUANTITY_INVALID"
    with pytest.raises(InvalidArgumentError) as status:
        scoped.transition_run("r-bad", "finished")
    assert status.value.code == "STATUS_UNKNOWN" and status.value.detail["status"] == "finished"
    with pytest.raises(NotFoundError) as missing:
        scoped.transition_run("r-none", "running")
    assert (missing.value.sqlstate, missing.value.code, missing.value.detail["id"]) == ("P0002", "RUN_NOT_FOUND", "r-none")
    with pytest.raises(WrongStateError) as invalid:
        scoped.transition_run("r-bad", "succeeded")  # queued -> succeeded is not in the table
    assert (invalid.value.sqlstate, invalid.value.code) == ("55000", "TRANSITION_INVALID")
    assert invalid.value.detail == {"code": "TRANSITION_INVALID", "resource": "run", "from": "queued", "to": "succeeded"}
    scoped.create_step("r-bad", "llm", step_key="plan")
    with pytest.raises(IdempotencyMismatchError) as mismatch:
        scoped.create_step("r-bad", "retrieval", step_key="plan")
    assert (mismatch.value.sqlstate, mismatch.value.detail["fields"]) == ("23505", ["step_type"])
    assert count(person, "run_events") == before + 1  # only the step that was created
    assert count(person, "run_cost_entries") == 0
    assert one(person, "SELECT status FROM ledger.runs WHERE id = 'r-bad'") == "queued"


def test_scope_errors_and_errors_that_are_not_the_ledgers(ledger: Ledger, scoped: ScopedLedger) -> None:
    with pytest.raises(ScopeError) as no_scope:
        with ledger.transaction() as tx:
            tx.create_run("agent")
    assert (no_scope.value.sqlstate, no_scope.value.code) == ("42501", "SCOPE_MISSING")
    with pytest.raises(psycopg.errors.UndefinedFunction) as other:
        scoped.execute("SELECT ledger.no_such_function()")
    assert not isinstance(other.value, LedgerError) and translate(other.value) is other.value
    with pytest.raises(ReadOnlyError) as read_only:
        with scoped.transaction() as tx:
            tx.execute("SET TRANSACTION READ ONLY")  # as on a hot standby
            tx.create_run("agent")
    assert (read_only.value.sqlstate, read_only.value.code) == ("25006", "READ_ONLY")
    plain = ValueError("not a database error")
    assert translate(plain) is plain


def test_a_stale_run_token_is_the_conflict_error(scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    scoped.create_run("agent", run_id="r-stale")
    first = scoped.claim_run("worker-1", run_id="r-stale")
    assert first is not None
    scoped.release_run("r-stale", first.run_token)
    second = scoped.claim_run("worker-2", run_id="r-stale")
    assert second is not None and second.run_token == first.run_token + 1
    events = count(person, "run_events")
    for write in (
        lambda: scoped.transition_run("r-stale", "running", run_token=first.run_token),
        lambda: scoped.create_step("r-stale", "llm", step_key="late", run_token=first.run_token),
        lambda: scoped.heartbeat_run("r-stale", first.run_token),
    ):
        with pytest.raises(ConflictError) as stale:
            write()
        assert (stale.value.sqlstate, stale.value.code) == ("40001", "LEASE_STALE")
        assert stale.value.detail["current_run_token"] == second.run_token
    assert count(person, "run_events") == events and count(person, "run_steps") == 0
    assert scoped.transition_run("r-stale", "running", run_token=second.run_token).status is RunStatus.RUNNING
    with pytest.raises(ConflictError) as conflict:
        scoped.transition_run("r-stale", "paused", expected_status="queued")
    assert conflict.value.code == "TRANSITION_CONFLICT"


def test_the_status_enums_are_the_extensions_status_machine(person: psycopg.Connection[DictRow]) -> None:
    statuses = {r["resource"]: set(r["statuses"]) for r in person.execute(
        "SELECT resource, array_agg(DISTINCT s) AS statuses FROM ledger.status_transitions(),"
        " unnest(ARRAY[from_status, to_status]) s GROUP BY resource")}
    assert {s.value for s in RunStatus} == statuses["run"] == statuses["task"]
    assert {s.value for s in StepStatus} == statuses["step"]


def test_when_a_run_may_start_and_which_first(scoped: ScopedLedger) -> None:
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    low = scoped.create_run("agent", run_id="r-low", priority=-1)
    assert (low.priority, low.not_before) == (-1, None)
    waiting = scoped.create_run("agent", run_id="r-later", priority=9, not_before=later)
    assert waiting.not_before == later
    scoped.create_run("agent", run_id="r-urgent", priority=5)
    first, second = scoped.claim_run("w-1"), scoped.claim_run("w-2")
    assert first is not None and second is not None
    assert (first.run_id, second.run_id) == ("r-urgent", "r-low")  # the highest priority that is due
    assert scoped.claim_run("w-3") is None  # r-later is not due

    scoped.transition_run("r-low", "failed")
    retry = scoped.retry_run("r-low", not_before=later)
    assert (retry.priority, retry.not_before) == (-1, later)  # the source's priority, the backoff
    assert scoped.claim_run("w-4") is None

    with pytest.raises(InvalidArgumentError) as bad:
        scoped.create_run("agent", run_id="r-bad", priority=1001)
    assert (bad.value.sqlstate, bad.value.code) == ("22023", "PRIORITY_INVALID")
    assert scoped.get_run("r-bad") is None


def test_a_concurrency_limit_lets_so_many_runs_of_a_key_be_claimed(scoped: ScopedLedger) -> None:
    assert scoped.set_concurrency_limit("customer-7", 1) == 1
    first = scoped.create_run("agent", run_id="k-1", concurrency_key="customer-7")
    assert first.concurrency_key == "customer-7"
    scoped.create_run("agent", run_id="k-2", concurrency_key="customer-7")
    scoped.create_run("agent", run_id="other")
    claims = [scoped.claim_run(f"w-{i}") for i in range(3)]
    assert [c.run_id if c else None for c in claims] == ["k-1", "other", None]  # k-2 waits for k-1
    assert scoped.set_concurrency_limit("customer-7", None) is None
    again = scoped.claim_run("w-3")
    assert again is not None and again.run_id == "k-2"
    with pytest.raises(InvalidArgumentError) as bad:
        scoped.set_concurrency_limit("customer-7", -1)
    assert bad.value.code == "LIMIT_INVALID"


def test_a_budget_refuses_tool_calls_once_used_up_until_a_person_raises_it(
    scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    budget = scoped.set_budget("tool_calls", 1, actor="ops@acme", note="one call")
    assert isinstance(budget, BudgetUsage)
    assert (budget.level, budget.unit, budget.period, budget.tenant_id, budget.workspace_id) == (
        "workspace", "tool_calls", "total", *SCOPE)
    assert (budget.max_amount, budget.spent, budget.remaining, budget.warn_ratio) == (
        Decimal(1), Decimal(0), Decimal(1), Decimal("0.8"))
    assert not budget.exhausted and budget.updated_by == "ops@acme" and budget.window_start is None
    scoped.create_run("agent", run_id="r-budget")
    claimed = scoped.claim_run("w-1", run_id="r-budget")
    assert claimed is not None
    scoped.transition_run("r-budget", "running", run_token=claimed.run_token)

    first = scoped.claim_tool_call("r-budget", "crm.lookup", {"order": 1}, tool_call_id="c-1", run_token=claimed.run_token)
    assert first.outcome is ClaimOutcome.CLAIMED and first.budget is None
    refused = scoped.claim_tool_call("r-budget", "crm.lookup", {"order": 2}, tool_call_id="c-2",
                                     run_token=claimed.run_token)
    assert refused.outcome is ClaimOutcome.BUDGET_EXHAUSTED and refused.tool_call is None  # nothing created
    assert refused.budget is not None
    assert (refused.budget.level, refused.budget.unit, refused.budget.run_id) == ("workspace", "tool_calls", None)
    assert (refused.budget.max_amount, refused.budget.spent, refused.budget.remaining) == (
        Decimal(1), Decimal(1), Decimal(0))
    parked = scoped.get_run("r-budget")
    assert parked is not None and (parked.status, parked.error_code) == (RunStatus.PAUSED, "BUDGET_EXHAUSTED")
    assert one(person, "SELECT count(*) FROM ledger.run_step_tool_calls WHERE tool_call_id = 'c-2'") == 0

    [used_up] = scoped.budgets()
    assert used_up.exhausted and (used_up.spent, used_up.remaining) == (Decimal(1), Decimal(0))
    assert scoped.budgets("r-budget") == [used_up]  # the workspace's budgets apply to each of its runs
    raised = scoped.set_budget("tool_calls", 2, actor="lead@acme", note="one more")
    assert raised is not None and not raised.exhausted and raised.updated_by == "lead@acme"
    again = scoped.claim_tool_call("r-budget", "crm.lookup", {"order": 2}, tool_call_id="c-2")
    assert again.outcome is ClaimOutcome.CLAIMED and again.tool_call is not None


def test_budgets_of_each_level_unit_and_period(scoped: ScopedLedger) -> None:
    scoped.create_run("agent", run_id="r-1")
    scoped.create_run("agent", run_id="r-2")
    daily = scoped.set_budget("usd", 0.1, level="tenant", period="day", warn_ratio=None)  # a float: its decimal text
    assert daily is not None and (daily.unit, daily.level, daily.workspace_id) == ("USD", "tenant", None)
    assert daily.max_amount == Decimal("0.1") and daily.warn_ratio is None
    assert daily.window_start is not None and daily.window_end is not None and daily.window_start < daily.window_end
    scoped.set_budget("tokens", Decimal("5000"), level="run", run_id="r-1")
    scoped.set_budget("llm_steps", 10)
    assert [(b.level, b.unit) for b in scoped.budgets()] == [
        ("tenant", "USD"), ("workspace", "llm_steps"), ("run", "tokens")]
    assert [b.unit for b in scoped.budgets("r-2")] == ["USD", "llm_steps"]  # r-1's is not r-2's
    scoped.record_cost("r-1", "tokens", 1200, Decimal("0.04"), "USD", usage={"total_tokens": 1200})
    spent = {b.unit: b.spent for b in scoped.budgets("r-1")}
    assert spent == {"USD": Decimal("0.04"), "llm_steps": 0, "tokens": 1200}
    assert scoped.set_budget("usd", None, level="tenant", period="day") is None  # removed
    assert [b.unit for b in scoped.budgets()] == ["llm_steps", "tokens"]

    with pytest.raises(InvalidArgumentError) as bad:
        scoped.set_budget("dollars!", 10)
    assert (bad.value.sqlstate, bad.value.code) == ("22023", "UNIT_INVALID")
    with pytest.raises(InvalidArgumentError) as level:
        scoped.set_budget("tokens", 10, level="run")
    assert level.value.code == "ARGUMENT_REQUIRED"
    with pytest.raises(NotFoundError) as missing:
        scoped.set_budget("tokens", 10, level="run", run_id="r-none")
    assert missing.value.code == "RUN_NOT_FOUND"
    assert len(scoped.budgets()) == 2  # nothing written by the refused calls
