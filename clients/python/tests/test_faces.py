"""The sync and the async face: one test body each, run through both (`face`), against the same
declarations; the people's queues; and the scope stated inside each call's statement, for a login
role that row-level security binds."""

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

import psycopg
import pytest
from conftest import SCOPE, one
from psycopg.rows import DictRow
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from ledger_client import (
    ApprovalStatus,
    AsyncLedger,
    AsyncScopedLedger,
    AsyncTransaction,
    ChildRun,
    ClaimedRun,
    ClaimOutcome,
    ConflictError,
    IdempotencyMismatchError,
    Inbox,
    InvalidArgumentError,
    Ledger,
    MailboxInput,
    NotFoundError,
    OutboxStatus,
    PendingApproval,
    Run,
    RunStatus,
    Schedule,
    ScopedLedger,
    ScopeError,
    ToolCallInDoubt,
    ToolCallStatus,
    Transaction,
    WaitStatus,
    WrongStateError,
)

T = TypeVar("T")
Handle = ScopedLedger | AsyncScopedLedger
Body = Callable[[Handle, psycopg.Connection[DictRow]], Coroutine[Any, Any, None]]


async def got(result: T | Awaitable[T]) -> T:
    """What a call returned: awaited on the async face, as it is on the sync one."""
    if isinstance(result, Awaitable):
        awaited: T = await result
        return awaited
    return result


@asynccontextmanager
async def transaction(handle: Handle) -> AsyncIterator[Transaction | AsyncTransaction]:
    if isinstance(handle, ScopedLedger):
        with handle.transaction() as tx:
            yield tx
    else:
        async with handle.transaction() as atx:
            yield atx


def through(face: str, dsn: str, person: psycopg.Connection[DictRow], body: Body) -> None:
    """Runs the body with the scoped handle of the face, each over a pool of its own kind."""
    if face == "sync":
        with ConnectionPool(dsn, min_size=1, max_size=4, open=True) as pool:
            asyncio.run(body(Ledger(pool).scoped(*SCOPE), person))
        return

    async def run() -> None:
        async with AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False) as pool:
            await body(AsyncLedger(pool).scoped(*SCOPE), person)

    asyncio.run(run())


FACES = pytest.mark.parametrize("face", ["sync", "async"])


async def typed_results(h: Handle, person: psycopg.Connection[DictRow]) -> None:
    run = await got(h.create_run("agent", {"order": 1042}, run_id="r-typed"))
    assert isinstance(run, Run) and run.status is RunStatus.QUEUED and run.inputs == {"order": 1042}
    assert await got(h.create_run("agent", {"order": 1042}, run_id="r-typed")) == run  # idempotent
    claimed = await got(h.claim_run("worker-1", modes=["agent"], lease_seconds=30))
    assert isinstance(claimed, ClaimedRun) and (claimed.run_id, claimed.run_token) == ("r-typed", 1)
    assert await got(h.claim_run("worker-2")) is None
    await got(h.transition_run("r-typed", RunStatus.RUNNING, run_token=1))
    step = await got(h.create_step("r-typed", "tool", step_key="send", run_token=1))
    assert (await got(h.get_run("r-typed"))) is not None
    cost = await got(h.record_cost("r-typed", "tokens", 1200, Decimal("0.0125"), "usd", step_id=step.id))
    assert cost.amount == Decimal("0.0125") and cost.currency == "USD"
    assert await got(h.heartbeat_run("r-typed", 1, extend_seconds=60)) > claimed.lease_expires_at

    claim = await got(h.claim_tool_call("r-typed", "email.send", {"to": "a@example.com"}, tool_call_id="c-1",
                                        lease_owner="worker-1", run_token=1))
    assert claim.tool_call is not None
    call = claim.tool_call
    begun = await got(h.begin_tool_call(call.id, call.attempt))
    assert begun.status is ToolCallStatus.RUNNING
    done = await got(h.complete_tool_call(call.id, call.attempt, "succeeded", {"sent": True}))
    assert done.status is ToolCallStatus.SUCCEEDED
    said = await got(h.record_response_event("r-typed", "message", {"text": "sent"}))
    assert said.payload == {"text": "sent"}
    await got(h.transition_run("r-typed", RunStatus.SUCCEEDED, run_token=1))
    events = await got(h.events_since("r-typed"))
    assert [e.seq for e in events] == list(range(1, len(events) + 1)) and events[-1].ends_run
    assert (await got(h.replay_ready("r-typed"))).ready
    assert set(await got(h.replay_bundle("r-typed"))) >= {"run", "steps", "costs"}
    assert await got(h.execute("SELECT ledger.scope_tenant() AS t")) == [{"t": "acme"}]


async def transactions_and_errors(h: Handle, person: psycopg.Connection[DictRow]) -> None:
    async with transaction(h) as tx:
        await got(tx.create_run("agent", run_id="r-tx"))
        await got(tx.transition_run("r-tx", "running"))
    with pytest.raises(WrongStateError):
        async with transaction(h) as tx:
            await got(tx.create_step("r-tx", "llm", step_key="rolled-back"))
            await got(tx.transition_run("r-tx", "queued"))
    assert await got(h.execute("SELECT step_key FROM ledger.run_steps")) == []

    with pytest.raises(InvalidArgumentError) as bad_id:
        await got(h.create_run("agent", run_id="has a space"))
    assert (bad_id.value.sqlstate, bad_id.value.code) == ("22023", "ID_INVALID")
    assert isinstance(bad_id.value.__cause__, psycopg.Error)
    with pytest.raises(NotFoundError) as missing:
        await got(h.transition_run("r-none", "running"))
    assert (missing.value.code, missing.value.detail["id"]) == ("RUN_NOT_FOUND", "r-none")
    await got(h.create_run("agent", run_id="r-stale"))
    first = await got(h.claim_run("worker-1", run_id="r-stale"))
    assert first is not None
    await got(h.release_run("r-stale", first.run_token))
    assert await got(h.claim_run("worker-2", run_id="r-stale")) is not None
    with pytest.raises(ConflictError) as stale:
        await got(h.heartbeat_run("r-stale", first.run_token))
    assert (stale.value.sqlstate, stale.value.code) == ("40001", "LEASE_STALE")
    assert one(person, "SELECT count(*) FROM ledger.runs") == 2  # nothing of the refused calls


async def the_peoples_queues(h: Handle, person: psycopg.Connection[DictRow]) -> None:
    assert await got(h.tool_calls_in_doubt()) == [] and await got(h.pending_approvals()) == []
    await got(h.create_run("agent", run_id="r-q"))
    claim = await got(h.claim_tool_call("r-q", "billing.charge", {"amount": "12.00", "api_key": "sk-live-1"},
                                        tool_call_id="c-doubt"))
    assert claim.tool_call is not None
    await got(h.begin_tool_call(claim.tool_call.id, claim.tool_call.attempt))
    await got(h.complete_tool_call(claim.tool_call.id, claim.tool_call.attempt, "unknown", error_message="timeout"))
    [doubt] = await got(h.tool_calls_in_doubt())
    assert isinstance(doubt, ToolCallInDoubt) and (doubt.tool_call_id, doubt.tool_ref) == ("c-doubt", "billing.charge")
    assert doubt.arguments["amount"] == "12.00" and doubt.arguments["api_key"] != "sk-live-1"  # as stored: redacted
    assert await got(h.tool_calls_in_doubt("r-q", limit=1)) == [doubt]
    assert await got(h.tool_calls_in_doubt("r-other")) == [] and await got(h.tool_calls_in_doubt(limit=0)) == []

    asked = await got(h.request_tool_approval("r-q", "email.send", {"to": "a@example.com", "password": "hunter2"},
                                              tool_call_id="c-ask", title="Send it?"))
    [pending] = await got(h.pending_approvals())
    assert isinstance(pending, PendingApproval) and pending.title == "Send it?" and pending.tool_ref == "email.send"
    assert pending.tool_call_id == "c-ask"
    assert await got(h.pending_approvals("r-q")) == [pending] and await got(h.pending_approvals("r-other")) == []
    assert pending.arguments is not None and pending.arguments["to"] == "a@example.com"
    assert pending.arguments["password"] != "hunter2"  # as stored: redacted
    assert asked.approval is not None and pending.id == asked.approval.id

    assert await got(h.failed_outbox_events()) == []
    person.execute("UPDATE ledger.outbox SET status = 'failed', attempt_count = 64 WHERE event_type = 'run.created'")
    [failed] = await got(h.failed_outbox_events())
    assert failed.status is OutboxStatus.FAILED and failed.event_type == "run.created"
    assert await got(h.failed_outbox_events("r-q", limit=5)) == [failed]
    assert await got(h.failed_outbox_events("r-other")) == [] and await got(h.failed_outbox_events(limit=0)) == []
    replayed = await got(h.replay_outbox_event(failed.id, actor="ops@acme", note="back up"))
    assert replayed.status is OutboxStatus.PENDING and replayed.replay_count == 1
    assert await got(h.failed_outbox_events()) == []


async def budgets(h: Handle, person: psycopg.Connection[DictRow]) -> None:
    await got(h.create_run("agent", run_id="r-b"))
    budget = await got(h.set_budget("tool_calls", 0, level="run", run_id="r-b", actor="ops@acme"))
    assert budget is not None and (budget.level, budget.max_amount, budget.exhausted) == ("run", Decimal(0), True)
    claim = await got(h.claim_tool_call("r-b", "crm.lookup", {}, tool_call_id="c-1"))
    assert claim.outcome is ClaimOutcome.BUDGET_EXHAUSTED and claim.budget is not None
    assert claim.budget.run_id == "r-b" and claim.budget.remaining == 0
    assert [b.run_id for b in await got(h.budgets("r-b"))] == ["r-b"] and await got(h.budgets("r-other")) == []
    with pytest.raises(InvalidArgumentError) as bad:
        await got(h.set_budget("not a unit", 1))
    assert (bad.value.sqlstate, bad.value.code) == ("22023", "UNIT_INVALID")
    assert await got(h.set_budget("tool_calls", None, level="run", run_id="r-b")) is None
    assert await got(h.budgets()) == []


async def durable_waits(h: Handle, person: psycopg.Connection[DictRow]) -> None:
    assert await got(h.next_wake()) is None  # nothing waits
    await got(h.create_run("agent", run_id="r-wait"))
    first = await got(h.claim_run("worker-1", run_id="r-wait"))
    assert first is not None and first.run_token == 1
    await got(h.transition_run("r-wait", RunStatus.RUNNING, run_token=1))
    wake_at = datetime.now(timezone.utc) + timedelta(seconds=1)
    parked = await got(h.wait_run("r-wait", 1, wake_at))
    assert isinstance(parked, Run) and parked.status is RunStatus.WAITING_INPUT
    assert (parked.lease_owner, parked.lease_expires_at, parked.not_before, parked.run_token) == (None, None, wake_at, 1)
    assert await got(h.claim_run("worker-2")) is None and await got(h.claim_run("worker-2", run_id="r-wait")) is None
    assert await got(h.next_wake()) == wake_at  # what an idle worker sleeps until
    with pytest.raises(ConflictError) as over:
        await got(h.heartbeat_run("r-wait", 1))  # the lease was given up with the wait
    assert (over.value.sqlstate, over.value.code, over.value.detail["lease_released"]) == ("40001", "LEASE_STALE", True)

    deadline = time.monotonic() + 30  # only stops a hung test: the claim must come once wake_at passed
    while (woken := await got(h.claim_run("worker-2", run_id="r-wait"))) is None:
        assert time.monotonic() < deadline, "the run was not handed out after its wake time"
        await asyncio.sleep(0.05)
    assert datetime.now(timezone.utc) >= wake_at
    assert (woken.run_token, woken.status, woken.takeover) == (2, RunStatus.WAITING_INPUT, False)
    with pytest.raises(ConflictError) as stale_wait:
        await got(h.wait_run("r-wait", 1, wake_at))  # the parking owner's token is over
    with pytest.raises(ConflictError) as stale_move:
        await got(h.transition_run("r-wait", "running", run_token=1))
    for stale in (stale_wait.value, stale_move.value):
        assert (stale.code, stale.detail["current_run_token"]) == ("LEASE_STALE", 2)
    assert (await got(h.transition_run("r-wait", RunStatus.RUNNING, run_token=2))).status is RunStatus.RUNNING

    # In a transaction, and a wake time already past: claimable at once.
    async with transaction(h) as tx:
        again = await got(tx.wait_run("r-wait", 2, datetime.now(timezone.utc) - timedelta(minutes=1)))
    assert again.status is RunStatus.WAITING_INPUT
    third = await got(h.claim_run("worker-3"))
    assert third is not None and (third.run_id, third.run_token) == ("r-wait", 3)

    # Only a preparing or running run waits (a claimed queued run does not); a NULL argument is
    # refused; neither writes anything.
    await got(h.create_run("agent", run_id="r-queued"))
    queued = await got(h.claim_run("worker-4", run_id="r-queued"))
    assert queued is not None and queued.status is RunStatus.QUEUED
    events = one(person, "SELECT count(*) FROM ledger.run_events")
    with pytest.raises(WrongStateError) as invalid:
        await got(h.wait_run("r-queued", queued.run_token, wake_at))
    assert (invalid.value.sqlstate, invalid.value.code) == ("55000", "TRANSITION_INVALID")
    with pytest.raises(InvalidArgumentError) as required:
        await got(h.wait_run("r-wait", 3, None))  # type: ignore[arg-type]
    assert (required.value.sqlstate, required.value.code) == ("22023", "ARGUMENT_REQUIRED")
    assert one(person, "SELECT count(*) FROM ledger.run_events") == events
    assert one(person, "SELECT status FROM ledger.runs WHERE id = 'r-queued'") == "queued"


async def approval_deadlines(h: Handle, person: psycopg.Connection[DictRow]) -> None:
    await got(h.create_run("agent", run_id="r-late"))
    asked = await got(h.request_tool_approval("r-late", "payments.wire", {"amount": 100}, tool_call_id="c-wire",
                                              title="Wire 100?", expires_in_seconds=3600))
    assert asked.outcome is ClaimOutcome.WAITING_APPROVAL and asked.approval is not None
    approval = asked.approval
    assert approval.expires_at is not None and approval.expires_at - approval.created_at == timedelta(hours=1)
    # The claim's approval takes a deadline too.
    claimed = await got(h.claim_tool_call("r-late", "payments.refund", {"amount": 5}, tool_call_id="c-refund",
                                          approval={"title": "Refund 5?", "expires_in_seconds": 60}))
    assert claimed.outcome is ClaimOutcome.WAITING_APPROVAL and claimed.approval is not None
    assert claimed.approval.expires_at is not None
    assert claimed.approval.expires_at - claimed.approval.created_at == timedelta(minutes=1)
    queue = await got(h.pending_approvals("r-late"))
    assert [(p.id, p.expires_at) for p in queue] == [(approval.id, approval.expires_at),
                                                     (claimed.approval.id, claimed.approval.expires_at)]
    with pytest.raises(InvalidArgumentError) as too_long:
        await got(h.request_tool_approval("r-late", "payments.wire", {"amount": 1}, tool_call_id="c-year",
                                          expires_in_seconds=31622401))
    assert (too_long.value.code, too_long.value.detail["expires_in_seconds"]) == ("TIMEOUT_INVALID", 31622401)
    with pytest.raises(InvalidArgumentError) as not_whole:
        await got(h.claim_tool_call("r-late", "payments.wire", {"amount": 1}, tool_call_id="c-hour",
                                    approval={"expires_in_seconds": "1h"}))
    assert (not_whole.value.code, not_whole.value.detail["key"]) == ("APPROVAL_INVALID", "expires_in_seconds")
    assert await got(h.sweep_tool_calls()) == 0  # no deadline has passed

    # No one decided the wire in time.
    person.execute("UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second'"
                   " WHERE id = %s", (approval.id,))
    assert [p.id for p in await got(h.pending_approvals("r-late"))] == [claimed.approval.id]
    with pytest.raises(WrongStateError) as late:
        await got(h.resolve_approval(approval.id, "approved", actor="cfo@acme"))
    assert (late.value.sqlstate, late.value.code, late.value.detail["approval_id"]) == (
        "55000", "APPROVAL_EXPIRED", approval.id)
    assert await got(h.sweep_tool_calls()) == 1
    with pytest.raises(WrongStateError) as still_late:
        await got(h.resolve_approval(approval.id, "rejected"))
    assert still_late.value.code == "APPROVAL_EXPIRED"
    wire = await got(h.claim_tool_call("r-late", "payments.wire", {"amount": 100}, tool_call_id="c-wire"))
    assert wire.outcome is ClaimOutcome.REJECTED and wire.tool_call is not None and wire.approval is not None
    assert (wire.tool_call.status, wire.tool_call.error_code) == (ToolCallStatus.REJECTED, "TOOL_APPROVAL_EXPIRED")
    assert (wire.approval.status, wire.approval.actor) == (ApprovalStatus.EXPIRED, None)
    assert wire.approval.decided_at is not None
    events = [e for e in await got(h.events_since("r-late")) if e.step_id == wire.tool_call.step_id]
    assert [e.event_type for e in events][-3:] == ["step.status", "approval.expired", "tool_call.rejected"]
    assert events[-2].payload["approval_id"] == approval.id and events[-2].payload["tool_call_id"] == "c-wire"

    # Nor the refund, and no sweep ran: its next claim expires it and answers rejected.
    person.execute("UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second'"
                   " WHERE id = %s", (claimed.approval.id,))
    refund = await got(h.claim_tool_call("r-late", "payments.refund", {"amount": 5}, tool_call_id="c-refund",
                                         approval={"title": "Refund 5?", "expires_in_seconds": 60}))
    assert refund.outcome is ClaimOutcome.REJECTED and refund.approval is not None
    assert refund.approval.status is ApprovalStatus.EXPIRED
    assert await got(h.sweep_tool_calls()) == 0 and await got(h.pending_approvals()) == []


async def mailbox_and_children(h: Handle, person: psycopg.Connection[DictRow]) -> None:
    await got(h.create_run("agent", run_id="r-mail"))
    form = {"iban": "DE89370400440532013000", "api_key": "sk-live-0123456789abcdefghij"}
    sent = await got(h.send_input("r-mail", "form", form, sender="ana"))
    assert isinstance(sent, MailboxInput) and (sent.run_id, sent.input_key, sent.sender) == ("r-mail", "form", "ana")
    assert sent.payload == {"iban": "DE89370400440532013000", "api_key": "[REDACTED]"}  # as stored
    assert sent.received_at is not None and (sent.waited_at, sent.wait_deadline) == (None, None)
    assert await got(h.send_input("r-mail", "form", dict(reversed(form.items())), sender="ana")) == sent  # the same input
    with pytest.raises(IdempotencyMismatchError) as other:
        await got(h.send_input("r-mail", "form", {"iban": "another"}))
    assert (other.value.sqlstate, other.value.code, other.value.detail["input_key"]) == ("23505", "IDEMPOTENCY_MISMATCH", "form")
    with pytest.raises(InvalidArgumentError) as reserved:
        await got(h.send_input("r-mail", "ledger:child:r-x", {}))
    assert (reserved.value.sqlstate, reserved.value.code) == ("22023", "INPUT_KEY_RESERVED")
    assert (await got(h.send_input("r-mail", "ping"))).payload == {}  # the SQL default
    assert (await got(h.send_input("r-mail", "note", "call me back"))).payload == "call me back"  # any JSON value

    claimed = await got(h.claim_run("worker-1", run_id="r-mail"))
    assert claimed is not None and claimed.run_token == 1
    await got(h.transition_run("r-mail", RunStatus.RUNNING, run_token=1))
    early = await got(h.wait_for_input("r-mail", 1, "form"))  # sent before the wait: at once
    assert (early.status, early.input_key, early.input) == (WaitStatus.RECEIVED, "form", sent)
    late = await got(h.wait_for_input("r-mail", 1, "missing", datetime.now(timezone.utc) - timedelta(minutes=1)))
    assert (late.status, late.input_key, late.input) == (WaitStatus.TIMED_OUT, "missing", None)
    deadline = datetime.now(timezone.utc) + timedelta(hours=1)
    parked = await got(h.wait_for_input("r-mail", 1, "answer", deadline))
    assert parked.status is WaitStatus.WAITING and parked.input is not None
    assert (parked.input.payload, parked.input.received_at, parked.input.wait_deadline) == (None, None, deadline)
    with pytest.raises(ConflictError) as over:
        await got(h.heartbeat_run("r-mail", 1))  # the lease was given up with the wait
    assert (over.value.code, over.value.detail["lease_released"]) == ("LEASE_STALE", True)
    assert await got(h.claim_run("worker-2", run_id="r-mail")) is None
    await got(h.send_input("r-mail", "answer", {"refund": True}, sender="lead@acme"))
    woken = await got(h.claim_run("worker-2", run_id="r-mail"))
    assert woken is not None and (woken.run_token, woken.status) == (2, RunStatus.WAITING_INPUT)
    await got(h.transition_run("r-mail", RunStatus.RUNNING, run_token=2))
    answer = await got(h.wait_for_input("r-mail", 2, "answer", deadline))
    assert answer.status is WaitStatus.RECEIVED and answer.input is not None
    assert (answer.input.payload, answer.input.sender, answer.input.wait_deadline) == ({"refund": True}, "lead@acme", deadline)

    none = await got(h.wait_for_children("r-mail", 2))
    assert (none.status, none.children) == (WaitStatus.DONE, ())
    await got(h.create_run("agent", run_id="r-kid", parent_run_id="r-mail"))
    waiting = await got(h.wait_for_children("r-mail", 2))
    assert waiting.status is WaitStatus.WAITING
    assert waiting.children == (ChildRun("r-kid", RunStatus.QUEUED, None, None, None),)
    await got(h.transition_run("r-kid", RunStatus.RUNNING))
    await got(h.transition_run("r-kid", RunStatus.FAILED, error_code="CARRIER_DOWN", error_message="no pickup"))
    parent = await got(h.claim_run("worker-3", run_id="r-mail"))  # the last child's end woke it
    assert parent is not None and parent.run_token == 3
    await got(h.transition_run("r-mail", RunStatus.RUNNING, run_token=3))
    done = await got(h.wait_for_children("r-mail", 3))
    assert done.status is WaitStatus.DONE
    assert done.children == (ChildRun("r-kid", RunStatus.FAILED, None, "CARRIER_DOWN", "no pickup"),)

    await got(h.transition_run("r-mail", RunStatus.SUCCEEDED, run_token=3))
    with pytest.raises(WrongStateError) as ended:
        await got(h.send_input("r-mail", "too-late", {}))
    assert (ended.value.sqlstate, ended.value.code) == ("55000", "RUN_TERMINAL")


async def a_wait_without_a_deadline(h: Handle, person: psycopg.Connection[DictRow]) -> None:
    """A run waiting for an input without a deadline has not_before 'infinity', read as the
    latest datetime, in UTC, also after it ended."""
    latest = datetime.max.replace(tzinfo=timezone.utc)
    await got(h.create_run("agent", run_id="r-forever"))
    await got(h.claim_run("worker-1", run_id="r-forever"))
    await got(h.transition_run("r-forever", RunStatus.RUNNING, run_token=1))
    assert (await got(h.wait_for_input("r-forever", 1, "answer"))).status is WaitStatus.WAITING
    assert one(person, "SELECT not_before::text FROM ledger.runs WHERE id = 'r-forever'") == "infinity"
    waiting = await got(h.get_run("r-forever"))
    assert waiting is not None and (waiting.status, waiting.not_before) == (RunStatus.WAITING_INPUT, latest)
    async with transaction(h) as tx:
        assert await got(tx.get_run("r-forever")) == waiting
    ended = await got(h.transition_run("r-forever", RunStatus.CANCELED))
    assert ended.not_before == latest
    person.execute("UPDATE ledger.runs SET not_before = '-infinity' WHERE id = 'r-forever'")
    earliest = await got(h.get_run("r-forever"))
    assert earliest is not None and earliest.not_before == datetime.min.replace(tzinfo=timezone.utc)


async def schedules_and_rates(h: Handle, person: psycopg.Connection[DictRow]) -> None:
    weekday = await got(h.set_schedule("weekday", "0 9 * * MON-FRI", "report", {"team": "support"},
                                       time_zone="Europe/Berlin", actor="ana"))
    assert isinstance(weekday, Schedule)
    assert (weekday.id, weekday.cron, weekday.time_zone, weekday.mode, weekday.inputs, weekday.catch_up,
            weekday.paused, weekday.updated_by) == ("weekday", "0 9 * * MON-FRI", "Europe/Berlin", "report",
                                                    {"team": "support"}, "latest", False, "ana")
    assert weekday.next_fire_at is not None and weekday.next_fire_at > datetime.now(timezone.utc)
    assert weekday.next_fire_at.astimezone(ZoneInfo("Europe/Berlin")).strftime("%H:%M") == "09:00"
    assert (await got(h.pause_schedule("weekday", actor="ana"))).paused
    assert not (await got(h.pause_schedule("weekday", False))).paused
    with pytest.raises(NotFoundError) as unknown:
        await got(h.pause_schedule("no-such"))
    assert (unknown.value.sqlstate, unknown.value.code) == ("P0002", "SCHEDULE_NOT_FOUND")
    with pytest.raises(InvalidArgumentError) as bad:
        await got(h.set_schedule("bad", "61 * * * *", "report"))
    assert (bad.value.sqlstate, bad.value.code) == ("22023", "CRON_INVALID")

    every = await got(h.set_schedule("every-10", "*/10 * * * *", "report", catch_up="all", priority=5,
                                     concurrency_key="reports", kind="digest"))
    assert (every.catch_up, every.priority, every.concurrency_key, every.kind) == ("all", 5, "reports", "digest")
    assert await got(h.fire_schedules()) == 0  # nothing is due yet
    # As if no sweeper had run for half an hour: three firings missed, each gets its run.
    person.execute("UPDATE ledger.schedules SET next_fire_at = next_fire_at - interval '30 minutes' WHERE id = 'every-10'")
    assert await got(h.fire_schedules()) == 3 and await got(h.fire_schedules()) == 0
    runs = person.execute("SELECT mode, kind, priority, concurrency_key, status FROM ledger.runs"
                          " WHERE request_id LIKE 'schedule:every-10:%'").fetchall()
    assert runs == [{"mode": "report", "kind": "digest", "priority": 5, "concurrency_key": "reports",
                     "status": "queued"}] * 3
    assert await got(h.execute("SELECT id FROM ledger.schedules WHERE last_run_id IS NOT NULL")) == [{"id": "every-10"}]
    # Paused, a due firing is skipped.
    await got(h.pause_schedule("every-10"))
    person.execute("UPDATE ledger.schedules SET next_fire_at = now() - interval '1 minute' WHERE id = 'every-10'")
    assert await got(h.fire_schedules()) == 0
    assert await got(h.drop_schedule("every-10", actor="ana")) is True
    assert await got(h.drop_schedule("every-10")) is False

    assert await got(h.set_concurrency_limit("supplier-api", 4)) == 4
    assert await got(h.set_rate_limit("supplier-api", 1, 3600)) == 1
    assert await got(h.set_rate_limit("plan-free", 10)) == 10  # per minute, the SQL's default window
    limits = "SELECT concurrency_key, max_in_flight, max_per_window, window_seconds FROM ledger.concurrency_limits"
    assert person.execute(limits + " ORDER BY concurrency_key").fetchall() == [
        {"concurrency_key": "plan-free", "max_in_flight": None, "max_per_window": 10, "window_seconds": 60},
        {"concurrency_key": "supplier-api", "max_in_flight": 4, "max_per_window": 1, "window_seconds": 3600}]
    for n in (1, 2):
        await got(h.create_run("agent", run_id=f"r-rate-{n}", concurrency_key="supplier-api"))
    assert await got(h.claim_run("worker-1", run_id="r-rate-1")) is not None
    assert await got(h.claim_run("worker-1", run_id="r-rate-2")) is None  # one claim an hour, in flight or not
    with pytest.raises(InvalidArgumentError) as too_many:
        await got(h.set_rate_limit("supplier-api", -1))
    assert (too_many.value.code, too_many.value.detail["argument"]) == ("LIMIT_INVALID", "max_claims")
    assert await got(h.set_rate_limit("supplier-api", None)) is None and await got(h.set_rate_limit("plan-free", None)) is None
    # The key's concurrency limit stays; a key with only a rate is gone.
    assert person.execute(limits).fetchall() == [
        {"concurrency_key": "supplier-api", "max_in_flight": 4, "max_per_window": None, "window_seconds": None}]


@FACES
@pytest.mark.parametrize("body", [typed_results, transactions_and_errors, the_peoples_queues, budgets, durable_waits,
                                  approval_deadlines, mailbox_and_children, a_wait_without_a_deadline,
                                  schedules_and_rates])
def test_both_faces(face: str, body: Body, dsn: str, person: psycopg.Connection[DictRow]) -> None:
    through(face, dsn, person, body)


@FACES
def test_operator_claims_and_a_conninfo_source(face: str, dsn: str, person: psycopg.Connection[DictRow]) -> None:
    async def body() -> None:
        if face == "sync":
            ledger = Ledger(dsn)
            ledger.scoped(*SCOPE).create_run("agent", run_id="r-op")
            claimed = ledger.claim_run("op-1")
        else:
            aledger = AsyncLedger(dsn)
            await aledger.scoped(*SCOPE).create_run("agent", run_id="r-op")
            claimed = await aledger.claim_run("op-1")
        assert claimed is not None and (claimed.run_id, claimed.tenant_id, claimed.workspace_id) == ("r-op", *SCOPE)

    asyncio.run(body())


@FACES
def test_next_wake_across_scopes_is_an_operators(face: str, dsn: str, person: psycopg.Connection[DictRow]) -> None:
    person.execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_py_app') THEN"
                   " CREATE ROLE ledger_py_app LOGIN IN ROLE ledger_writer; END IF; END $$")
    app = dsn.replace("user=postgres", "user=ledger_py_app")
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    person.execute("SELECT ledger.set_scope('globex', 'billing')")
    person.execute("SELECT ledger.create_run('agent', run_id => 'r-later', not_before => %s)", (later,))

    async def body() -> None:
        if face == "sync":
            # Another scope's backoff: none in the tests' scope, the operator sees it.
            assert Ledger(dsn).scoped(*SCOPE).next_wake() is None and Ledger(dsn).next_wake() == later
            with pytest.raises(ScopeError) as refused:
                Ledger(app).next_wake()
        else:
            assert await AsyncLedger(dsn).scoped(*SCOPE).next_wake() is None and await AsyncLedger(dsn).next_wake() == later
            with pytest.raises(ScopeError) as refused:
                await AsyncLedger(app).next_wake()
        assert (refused.value.sqlstate, refused.value.code) == ("42501", "OPERATOR_REQUIRED")

    asyncio.run(body())


@FACES
def test_the_inbox_counts_what_waits_per_scope_and_across_scopes_for_an_operator(
    face: str, dsn: str, person: psycopg.Connection[DictRow]
) -> None:
    person.execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_py_app') THEN"
                   " CREATE ROLE ledger_py_app LOGIN IN ROLE ledger_writer; END IF; END $$")
    app = dsn.replace("user=postgres", "user=ledger_py_app")
    at = {n: datetime(2026, 1, 1, tzinfo=timezone.utc) + timedelta(hours=n) for n in range(5)}
    # In the tests' scope two calls in doubt, an approval and a run stopped by a budget used up;
    # in another one failed outbox event.
    person.execute("SELECT ledger.create_run('agent', run_id => 'r-1')")
    for n, call in ((1, "c-1"), (2, "c-2")):
        person.execute("SELECT ledger.claim_tool_call('r-1', 'crm.lookup', jsonb_build_object('n', %s),"
                       " tool_call_id => %s)", (n, call))
        person.execute("UPDATE ledger.run_step_tool_calls SET status = 'in_doubt', updated_at = %s"
                       " WHERE tool_call_id = %s", (at[n], call))
    person.execute("SELECT ledger.request_tool_approval('r-1', 'payments.wire', '{}', tool_call_id => 'pay')")
    person.execute("UPDATE ledger.approval_requests SET created_at = %s", (at[3],))
    person.execute("SELECT ledger.create_run('agent', run_id => 'r-2')")
    person.execute("SELECT ledger.set_budget('tool_calls', 0, 'run', run_id => 'r-2')")
    person.execute("UPDATE ledger.runs SET status = 'paused', error_code = 'BUDGET_EXHAUSTED', updated_at = %s"
                   " WHERE id = 'r-2'", (at[4],))
    person.execute("SELECT ledger.set_scope('globex', 'billing')")
    person.execute("SELECT ledger.create_run('agent', run_id => 'r-3')")
    person.execute("UPDATE ledger.outbox SET status = 'failed', processed_at = %s WHERE run_id = 'r-3'", (at[0],))
    here = Inbox(*SCOPE, 2, at[1], 1, at[3], 1, at[4], 0, None)
    there = Inbox("globex", "billing", 0, None, 0, None, 0, None, 1, at[0])
    quiet = Inbox("acme", "quiet", 0, None, 0, None, 0, None, 0, None)  # one row, zeros

    async def body() -> None:
        if face == "sync":
            assert Ledger(dsn).scoped(*SCOPE).inbox() == here and Ledger(dsn).scoped("acme", "quiet").inbox() == quiet
            with Ledger(dsn).scoped(*SCOPE).transaction() as tx:
                assert tx.inbox() == here
            assert Ledger(dsn).inbox() == [here, there]  # only the scopes with something waiting
            with pytest.raises(ScopeError) as refused:
                Ledger(app).inbox()
        else:
            assert await AsyncLedger(dsn).scoped(*SCOPE).inbox() == here
            assert await AsyncLedger(dsn).scoped("acme", "quiet").inbox() == quiet
            async with AsyncLedger(dsn).scoped(*SCOPE).transaction() as atx:
                assert await atx.inbox() == here
            assert await AsyncLedger(dsn).inbox() == [here, there]
            with pytest.raises(ScopeError) as refused:
                await AsyncLedger(app).inbox()
        assert (refused.value.sqlstate, refused.value.code) == ("42501", "OPERATOR_REQUIRED")

    asyncio.run(body())


def test_the_scope_inside_the_statement_binds_a_login_role(dsn: str, person: psycopg.Connection[DictRow]) -> None:
    """A login role that row-level security binds (not a superuser) sees its scope in each call's
    single statement: in volatile functions, in STABLE ones (events_since, replay_ready) and in the
    policies of a plain read, and never another scope's rows."""
    person.execute("DROP ROLE IF EXISTS agent_app")  # roles outlive the test's database
    person.execute("CREATE ROLE agent_app LOGIN")
    person.execute("GRANT ledger_writer TO agent_app")
    person.execute("SELECT ledger.grant_scope('agent_app', 'acme', 'tests')")
    person.execute("SELECT ledger.set_scope('other', 'ws')")
    person.execute("SELECT ledger.create_run('agent', run_id => 'r-other')")
    ledger = Ledger(dsn.replace("user=postgres", "user=agent_app")).scoped(*SCOPE)
    ledger.create_run("agent", run_id="r-app")
    assert ledger.get_run("r-app") is not None and ledger.get_run("r-other") is None
    assert [e.event_type for e in ledger.events_since("r-app")][:1] == ["run.created"]
    assert ledger.replay_ready("r-app").status in ("pass", "fail")
    assert [r["id"] for r in ledger.execute("SELECT id FROM ledger.runs")] == ["r-app"]
    with pytest.raises(ScopeError) as refused:
        Ledger(dsn.replace("user=postgres", "user=agent_app")).scoped("other", "ws").get_run("r-other")
    assert refused.value.code == "SCOPE_NOT_GRANTED"
