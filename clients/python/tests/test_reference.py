"""The manual's promises about the public API: every public parameter is in its reference (so
that no parameter is documented only by its signature), a ledger error chains the driver's error
it came from, and the retry loop of "Errors" retries a conflict and nothing else."""

import enum
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import SCOPE
from psycopg.rows import DictRow

import ledger_client
from ledger_client import ConflictError, LedgerError, RunStatus, ScopedLedger, ToolCallStopped, translated
from ledger_client import otel, sse
from ledger_client.otel import OTLPExportError

MANUAL = Path(__file__).resolve().parents[1] / "README.md"

# What the client returns (their fields are the SQL rows', in docs/reference.md) or hands out
# (ledger.scoped, scoped.transaction, the worker's RunContext, hub.follow's RunStream): users do
# not construct them.
NOT_CONSTRUCTED = {
    "Approval", "Budget", "BudgetUsage", "ClaimedRun", "CostEntry", "EvidenceItem", "OutboxEvent", "ReplayReady", "ResponseEvent", "Run",
    "RunEvent", "Step", "ToolCall", "ToolCallClaim", "ToolCallResult", "ToolCallTombstone", "ToolResponse",
    "LedgerCalls", "ScopedLedger", "Transaction", "Calls", "AsyncLedgerCalls", "AsyncScopedLedger",
    "AsyncTransaction", "PendingApproval", "ToolCallInDoubt", "RunContext", "RunStream",
    "MailboxInput", "InputWait", "ChildRun", "ChildrenWait", "Schedule", "Inbox",
}

# The "### " subsections of the manual's Reference, and the public callables whose parameters each
# documents.
REFERENCED: dict[str, list[Callable[..., Any]]] = {
    "Ledger": [ledger_client.Ledger, ledger_client.AsyncLedger],
    "Worker": [ledger_client.Worker, ledger_client.Worker.run],
    "RunContext": [ledger_client.RunContext.step, ledger_client.RunContext.llm_step,
                   ledger_client.RunContext.tool_calls, ledger_client.RunContext.wait_until,
                   ledger_client.WaitingUntil, ledger_client.RunContext.wait_for_input,
                   ledger_client.RunContext.wait_for_children, ledger_client.WaitingForInput,
                   ledger_client.InputTimedOut, ledger_client.WaitingForChildren, ledger_client.ChildrenTimedOut,
                   ledger_client.ModelReply],
    "tool_call, tool_calls, ToolRequest": [ledger_client.tool_call, ledger_client.tool_calls,
                                           ledger_client.ToolRequest, ledger_client.RunContext.tool_call,
                                           ledger_client.tool_call_async],
    "OutboxConsumer": [ledger_client.OutboxConsumer, ledger_client.OutboxConsumer.run],
    "follow, afollow, Reconnect": [ledger_client.follow, ledger_client.afollow, ledger_client.Reconnect],
    "translate, translated": [ledger_client.translate, ledger_client.translated],
    "EventHub, sse_app (ledger_client.sse)": [sse.EventHub, sse.EventHub.follow, sse.sse_app],
    "encode, NotEncodable, is_transient": [ledger_client.encode, ledger_client.NotEncodable,
                                           ledger_client.is_transient],
    "OpenTelemetry (ledger_client.otel)": [otel.export_trace, otel.send_trace, otel.to_protobuf,
                                           otel.traces_endpoint, OTLPExportError],
}
BY_NAME = {f.__qualname__: (f, heading) for heading, functions in REFERENCED.items() for f in functions}


def reference_sections() -> dict[str, str]:
    text = MANUAL.read_text(encoding="utf-8")
    reference = re.search(r"^## Reference\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert reference, "clients/python/README.md has no section \"Reference\""
    parts = re.split(r"^### (.*)\n", reference.group(1), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_exported_callable_is_referenced_or_a_result() -> None:
    exported = {
        name: getattr(module, name)
        for module in (ledger_client, sse, otel) for name in module.__all__
    }
    for name, value in exported.items():
        if not callable(value) or name in NOT_CONSTRUCTED or name in BY_NAME:
            continue
        if isinstance(value, type) and issubclass(value, (enum.Enum, LedgerError, ToolCallStopped)):
            continue  # enums, and exceptions the client raises
        pytest.fail(f"{name} is public: add it (and each of its parameters) to the manual's Reference"
                    " and to REFERENCED here, or to NOT_CONSTRUCTED if users never construct it")


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_every_public_parameter_is_in_the_reference(name: str) -> None:
    function, heading = BY_NAME[name]
    sections = reference_sections()
    assert heading in sections, f"the manual's Reference has no \"### {heading}\" (for {name})"
    missing = [p for p in inspect.signature(function).parameters if p != "self" and f"`{p}`" not in sections[heading]]
    assert not missing, f"{name}: parameters {missing} are not in the manual's Reference, \"### {heading}\""


def test_a_ledger_error_chains_the_drivers_error(scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    run = scoped.create_run("agent", run_id="r-chain")
    person.execute("SELECT ledger.transition_run('r-chain', 'running')")
    with pytest.raises(ConflictError) as conflict:
        scoped.transition_run(run.id, "canceled", expected_status="queued")
    error = conflict.value
    assert (error.sqlstate, error.code) == ("40001", "TRANSITION_CONFLICT")
    assert not isinstance(error, psycopg.Error), "except psycopg.Error must not catch a LedgerError"
    cause = error.__cause__
    assert isinstance(cause, psycopg.errors.SerializationFailure), repr(cause)
    assert cause.diag.sqlstate == "40001" and cause.diag.message_primary == error.message
    assert error.__suppress_context__  # raised `from` the cause: the traceback shows the driver's error

    # Code on psycopg directly gets the same chain from translated().
    with pytest.raises(ConflictError) as direct, translated():
        person.execute("SELECT ledger.transition_run('r-chain', 'canceled', expected_status => 'queued')")
    assert isinstance(direct.value.__cause__, psycopg.errors.SerializationFailure)
    # The driver's own errors stay psycopg's, unchained.
    with pytest.raises(psycopg.errors.UndefinedTable) as plain, translated():
        person.execute("SELECT * FROM no_such_table")
    assert plain.value.__cause__ is None


def errors_example() -> str:
    text = MANUAL.read_text(encoding="utf-8")
    section = re.search(r"^## Errors\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "clients/python/README.md has no section \"Errors\""
    blocks: list[str] = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    assert len(blocks) == 1, "the manual's Errors section has one python block"
    return blocks[0]


class Racing(ScopedLedger):
    """The scoped handle of a worker that loses a race: right after it reads the run the first
    time, another writer (the person's session) moves it."""

    def __init__(self, scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
        super().__init__(scoped.ledger, *SCOPE)
        self.person = person
        self.reads = 0

    def get_run(self, run_id: str) -> Any:
        run = super().get_run(run_id)
        self.reads += 1
        if self.reads == 1:
            self.person.execute("SELECT ledger.transition_run(%s, 'running')", (run_id,))
        return run


def test_the_manuals_retry_loop_retries_a_conflict(scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    namespace: dict[str, Any] = {}
    exec(errors_example(), namespace)  # noqa: S102 - the manual's own code is what is under test
    scoped.create_run("agent", run_id="r-retry")
    racing = Racing(scoped, person)
    namespace["cancel"](racing, "r-retry")
    run = scoped.get_run("r-retry")
    assert run is not None and run.status is RunStatus.CANCELED and racing.reads == 2

    # LEASE_STALE is not retried: the run is another worker's.
    scoped.create_run("agent", run_id="r-stale")
    person.execute("SELECT ledger.claim_run('w-1', run_id => 'r-stale')")
    with pytest.raises(ConflictError) as stale:
        namespace["cancel"](_Fenced(scoped), "r-stale")
    assert stale.value.code == "LEASE_STALE"


class _Fenced(ScopedLedger):
    """A worker that writes with a run token another claim has made stale."""

    def __init__(self, scoped: ScopedLedger) -> None:
        super().__init__(scoped.ledger, *SCOPE)

    def transition_run(self, run_id: str, to_status: str, **named: Any) -> Any:
        return super().transition_run(run_id, to_status, run_token=0, **named)
