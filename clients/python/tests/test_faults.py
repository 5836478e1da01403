"""Faults against the real extension: a worker's (or the outbox consumer's) connection terminated
by ``pg_terminate_backend`` at each point of a run, the encoding rule of tool results, and a
rejected approval's default."""

import base64
import dataclasses
import datetime
import enum
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import SCOPE, one, wait_for
from psycopg.rows import DictRow
from psycopg_pool import ConnectionPool, PoolTimeout
from test_tool_calls import running_run
from test_worker import running, status

from ledger_client import (
    InDoubt,
    Ledger,
    ModelReply,
    NotEncodable,
    OutboxConsumer,
    OutboxEvent,
    ResultNotEncodable,
    RunContext,
    ScopedLedger,
    ToolCallStatus,
    ToolRequest,
    Worker,
    encode,
    is_transient,
    tool_call,
    tool_calls,
)

APP = "ledger-worker"


@pytest.fixture
def fragile(dsn: str) -> Iterator[Ledger]:
    """A user's own pool that does not check its connections: a terminated one is handed out and
    the client's own writes meet the lost connection."""
    with ConnectionPool(dsn, min_size=1, max_size=4, open=True, kwargs={"application_name": APP}) as pool:
        yield Ledger(pool)


def cut(person: psycopg.Connection[DictRow]) -> int:
    """Terminates the worker's backends (as the superuser, from another connection); how many."""
    ended: int = one(person, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                             " WHERE datname = current_database() AND application_name = %s", (APP,))
    return ended


class Agent:
    """A plan, a lookup, an answer; ``at`` names the point where the worker's connection is cut."""

    def __init__(self, person: psycopg.Connection[DictRow], at: str) -> None:
        self.person = person
        self.at = at
        self.done: Counter[str] = Counter()  # each side effect and model call, as executed
        self.cuts = 0

    def _cut(self, point: str) -> None:
        if self.at == point and self.cuts == 0:
            self.cuts = cut(self.person)

    def _model(self, key: str, text: str) -> ModelReply:
        self.done[f"model-{key}"] += 1
        self._cut(f"model-{key}")  # its cost and the step's end meet the terminated connection
        return ModelReply(text, {"input_tokens": 10, "output_tokens": 2})

    def _lookup(self, arguments: dict[str, Any]) -> Any:
        self.done["lookup"] += 1
        self._cut("complete")
        return {"order": arguments["order"], "paid": Decimal("12.50")}

    def __call__(self, ctx: RunContext) -> str:
        ctx.llm_step("plan", lambda: self._model("plan", "look it up"))
        self._cut("begin")  # the tool call's claim and begin (one statement) meet it
        found = ctx.tool_call("lookup", "crm.lookup_order", {"order": 7}, self._lookup)
        answer = ctx.llm_step("answer", lambda: self._model("answer", f"Paid {found['paid']}."))
        self._cut("final")
        return answer


@pytest.mark.parametrize("at", ["before-claim", "model-plan", "begin", "complete", "final"])
def test_a_terminated_connection_is_not_the_agents_failure(
    at: str, fragile: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", {"order": 7}, run_id="r-cut")
    agent = Agent(person, at)
    if at == "before-claim":
        agent.cuts = cut(person)  # the pool's idle connection: the claim meets it
    with running(Worker(fragile, agent, scope=SCOPE, lease_owner="worker-1", idle_s=0.05)):
        wait_for("the run to end", lambda: status(person, "r-cut") in ("succeeded", "failed"))
    assert agent.cuts >= 1  # the point was reached and a backend of the worker's was terminated
    assert status(person, "r-cut") == "succeeded"
    assert agent.done == {"model-plan": 1, "lookup": 1, "model-answer": 1}
    said = scoped.execute("SELECT payload FROM ledger.response_events WHERE run_id = 'r-cut'")
    assert said == [{"payload": {"text": "Paid 12.50."}}]
    calls = scoped.execute("SELECT status, attempt, result FROM ledger.run_step_tool_calls")
    assert calls == [{"status": "succeeded", "attempt": 1, "result": {"order": 7, "paid": "12.50"}}]
    assert one(person, "SELECT count(*) FROM ledger.run_cost_entries WHERE run_id = 'r-cut'") == 2


def test_an_agent_ending_on_a_lost_connection_releases_the_run(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", run_id="r-lost")
    tries: list[int] = []

    def agent(ctx: RunContext) -> str:
        tries.append(ctx.run_token)
        if len(tries) == 1:  # what the agent's own query meets when the server goes away
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return "done"

    with running(Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1", idle_s=0.05)):
        wait_for("the run to end", lambda: status(person, "r-lost") in ("succeeded", "failed"))
    assert status(person, "r-lost") == "succeeded" and len(tries) == 2  # released, claimed again at once
    statuses = [r["to_status"] for r in person.execute(
        "SELECT payload->>'to_status' AS to_status FROM ledger.run_events"
        " WHERE run_id = 'r-lost' AND event_type = 'run.status_changed' ORDER BY id")]
    assert "failed" not in statuses


def test_a_terminated_ack_is_acked_again_on_a_fresh_connection(
    fragile: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", run_id="r-ack")
    delivered: list[str] = []

    def handler(event: OutboxEvent) -> None:
        delivered.append(event.id)
        cut(person)  # the ack that follows meets the terminated connection

    consumer = OutboxConsumer(fragile, handler, lease_owner="billing-sync", scope=SCOPE)
    assert consumer.run_once() == 1
    assert one(person, "SELECT status FROM ledger.outbox") == "done" and len(delivered) == 1


def test_which_errors_are_the_connections() -> None:
    assert is_transient(psycopg.OperationalError("server closed the connection unexpectedly"))
    assert is_transient(psycopg.errors.AdminShutdown())
    assert is_transient(psycopg.errors.CannotConnectNow())
    assert is_transient(psycopg.errors.ConnectionFailure())
    assert is_transient(PoolTimeout("couldn't get a connection after 30.00 sec"))
    assert not is_transient(psycopg.errors.SerializationFailure())
    assert not is_transient(psycopg.errors.QueryCanceled())
    assert not is_transient(ValueError("the agent's own"))


class Tier(enum.Enum):
    GOLD = "gold"


@dataclasses.dataclass
class Line:
    sku: str
    price: Decimal


class Model:
    """A pydantic model as the rule sees one: anything with ``model_dump(mode="json")``."""

    def model_dump(self, mode: str) -> dict[str, Any]:
        assert mode == "json"
        return {"kind": "pydantic"}


UUID = uuid.UUID("8a6e0804-2bd0-4672-b79d-d97027f9de0a")
ENCODED: list[tuple[Any, Any]] = [
    (Decimal("12.30"), "12.30"),
    (datetime.datetime(2026, 12, 5, 16, 30, tzinfo=datetime.UTC), "2026-12-05T16:30:00+00:00"),
    (datetime.date(2026, 12, 5), "2026-12-05"),
    (datetime.time(16, 30, 5), "16:30:05"),
    (b"\x00\xffpdf", base64.b64encode(b"\x00\xffpdf").decode()),
    (UUID, str(UUID)),
    (Tier.GOLD, "gold"),
    (Line("a-1", Decimal("3.10")), {"sku": "a-1", "price": "3.10"}),
    (Model(), {"kind": "pydantic"}),
    ((1, "two"), [1, "two"]),
    ({3, 1, 2}, [1, 2, 3]),
    ({"nested": [Decimal("1.5")]}, {"nested": ["1.5"]}),
]


@pytest.mark.parametrize(("value", "recorded"), ENCODED, ids=[type(v).__name__ for v, _ in ENCODED])
def test_results_and_arguments_are_encoded_by_one_rule(value: Any, recorded: Any, scoped: ScopedLedger) -> None:
    assert encode(value) == recorded
    running_run(scoped, "r-enc")
    returned = tool_call(scoped, "r-enc", "one", "t.one", {"value": value}, lambda a: {"value": a["value"]})
    assert returned == {"value": value}  # the caller gets the tool's own value
    [turn] = tool_calls(scoped, "r-enc", [ToolRequest("many", "t.many", {"value": value},
                                                      lambda a: {"value": a["value"]})])
    assert turn.get() == {"value": value}
    rows = scoped.execute("SELECT tool_call_id, arguments, result FROM ledger.run_step_tool_calls ORDER BY tool_call_id")
    assert rows == [{"tool_call_id": k, "arguments": {"value": recorded}, "result": {"value": recorded}}
                    for k in ("many", "one")]
    # on a resume the recorded (encoded) result is replayed, and the tool is not run again
    assert tool_call(scoped, "r-enc", "one", "t.one", {"value": value}, lambda a: pytest.fail("ran again")) \
        == {"value": recorded}


def test_a_result_the_rule_cannot_encode_is_recorded_in_doubt(scoped: ScopedLedger) -> None:
    running_run(scoped, "r-odd")

    class Receipt:
        def __repr__(self) -> str:
            return "Receipt(#991)"

    ran: list[str] = []

    def send(arguments: dict[str, Any]) -> Any:
        ran.append("sent")
        return {"receipt": Receipt()}

    with pytest.raises(ResultNotEncodable) as raised:
        tool_call(scoped, "r-odd", "mail", "mail.send", {"to": "a@b"}, send)
    assert "mail" in str(raised.value) and "Receipt" in str(raised.value)
    assert raised.value.tool_call is not None and raised.value.tool_call.status is ToolCallStatus.IN_DOUBT
    [row] = scoped.execute("SELECT status, error_message FROM ledger.run_step_tool_calls")
    assert row["status"] == "in_doubt" and "Receipt(#991)" in row["error_message"]
    assert "$.receipt" in row["error_message"]
    # never run again, whoever asks (a person resolves it)
    with pytest.raises(InDoubt):
        tool_call(scoped, "r-odd", "mail", "mail.send", {"to": "a@b"}, send, retry_failed=True)
    assert ran == ["sent"]
    # arguments outside the rule: refused before anything is written
    with pytest.raises(NotEncodable, match=r"\$\.n"):
        encode({"n": float("nan")})
    with pytest.raises(NotEncodable, match=r"\$\.to"):
        tool_call(scoped, "r-odd", "mail2", "mail.send", {"to": Receipt()}, send)
    assert len(scoped.execute("SELECT 1 FROM ledger.run_step_tool_calls")) == 1


def test_a_rejected_approval_ends_the_run_failed_with_its_code(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", run_id="r-reject")
    refunded: list[Any] = []

    def refund(arguments: dict[str, Any]) -> Any:
        refunded.append(arguments)
        return {"ok": True}

    def agent(ctx: RunContext) -> str:
        ctx.tool_call("refund-1", "payments.refund", {"amount": "9.00"}, refund,
                      approval={"title": "Refund 9.00"})
        return "refunded"

    stop = threading.Event()
    with running(Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1", idle_s=0.05, stopping=stop)):
        wait_for("the approval request", lambda: status(person, "r-reject") == "waiting_approval")
        [pending] = person.execute("SELECT id FROM ledger.pending_approvals").fetchall()
        scoped.resolve_approval(pending["id"], "rejected", actor="lead@acme", note="not refundable")
        wait_for("the run to end", lambda: status(person, "r-reject") in ("succeeded", "failed"))
    run = scoped.get_run("r-reject")
    assert run is not None and run.status == "failed" and refunded == []
    assert run.error_code == "TOOL_APPROVAL_REJECTED"
    assert run.error_message == "tool call refund-1: approval rejected: not refundable"


def test_an_approval_no_one_decided_in_time_ends_the_run_failed_with_its_code(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", run_id="r-expire")
    refunded: list[Any] = []

    def refund(arguments: dict[str, Any]) -> Any:
        refunded.append(arguments)
        return {"ok": True}

    def agent(ctx: RunContext) -> str:
        ctx.tool_call("refund-1", "payments.refund", {"amount": "9.00"}, refund,
                      approval={"title": "Refund 9.00", "expires_in_seconds": 3600})
        return "refunded"

    stop = threading.Event()
    with running(Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1", idle_s=0.05, stopping=stop)):
        wait_for("the approval request", lambda: status(person, "r-expire") == "waiting_approval")
        # The deadline passes with no decision and no sweep: the run is claimable again, and the
        # worker's claim of the call expires the approval.
        person.execute("UPDATE ledger.approval_requests SET expires_at = clock_timestamp() - interval '1 second'")
        wait_for("the run to end", lambda: status(person, "r-expire") in ("succeeded", "failed"))
    run = scoped.get_run("r-expire")
    assert run is not None and run.status == "failed" and refunded == []
    assert run.error_code == "TOOL_APPROVAL_EXPIRED"
    assert run.error_message == "tool call refund-1: approval expired"
    assert one(person, "SELECT status FROM ledger.approval_requests") == "expired"


