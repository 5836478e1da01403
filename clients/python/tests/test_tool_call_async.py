"""The tool-call helper on the async face, against the real extension: executed once and replayed,
the in-doubt rule after a timeout, a failure recorded and raised, a result outside the encoding
rule recorded in doubt, and heartbeats while a slow tool runs."""

import asyncio
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from conftest import SCOPE, one
from psycopg.rows import DictRow

from ledger_client import (
    AsyncLedger,
    AsyncScopedLedger,
    BudgetExhausted,
    InDoubt,
    ResultNotEncodable,
    ToolFailed,
    tool_call_async,
)


def test_the_async_helper_keeps_the_sync_ones_rules(dsn: str, person: psycopg.Connection[DictRow]) -> None:
    executed: list[str] = []
    leases: list[Any] = []

    def lease() -> Any:
        return one(person, "SELECT lease_expires_at FROM ledger.run_step_tool_calls WHERE tool_call_id = 'c5'")

    async def lookup(arguments: dict[str, Any]) -> Any:
        executed.append(arguments["what"])
        if arguments["what"] == "timeout":
            raise TimeoutError("no answer in 5 s")
        if arguments["what"] == "broken":
            raise ValueError("the CRM refused")
        if arguments["what"] == "object":
            return {"handle": object()}
        if arguments["what"] == "slow":
            leases.append(lease())
            await asyncio.sleep(1.5)
            leases.append(lease())
        return {"price": Decimal("10.50")}

    async def body() -> None:
        scoped: AsyncScopedLedger = AsyncLedger(dsn).scoped(*SCOPE)
        await scoped.create_run("agent", run_id="r-async")
        await scoped.transition_run("r-async", "running")

        async def call(call_id: str, what: str, **options: Any) -> Any:
            return await tool_call_async(scoped, "r-async", call_id, "crm.lookup", {"what": what}, lookup, **options)

        assert await call("c1", "price") == {"price": Decimal("10.50")}
        assert await call("c1", "price") == {"price": "10.50"}, "replayed as recorded (encoded), not executed"
        with pytest.raises(InDoubt) as in_doubt:
            await call("c2", "timeout")
        assert in_doubt.value.tool_call is not None and in_doubt.value.tool_call.status == "in_doubt"
        with pytest.raises(InDoubt):
            await call("c2", "timeout")
        with pytest.raises(ValueError, match="the CRM refused"):
            await call("c3", "broken")
        with pytest.raises(ToolFailed):
            await call("c3", "broken")
        with pytest.raises(ResultNotEncodable) as not_encodable:
            await call("c4", "object")
        assert isinstance(not_encodable.value.__cause__, TypeError)
        await call("c5", "slow", timeout_seconds=1, heartbeat_s=0.3)

    asyncio.run(body())
    assert executed == ["price", "timeout", "broken", "object", "slow"], "each call executed once"
    assert one(person, "SELECT string_agg(tool_call_id || ':' || status, ' ' ORDER BY tool_call_id)"
                       " FROM ledger.run_step_tool_calls WHERE run_id = 'r-async'") == (
        "c1:succeeded c2:in_doubt c3:failed c4:in_doubt c5:succeeded")
    assert "not encodable" in one(person, "SELECT error_message FROM ledger.run_step_tool_calls"
                                          " WHERE tool_call_id = 'c4'")
    assert leases[1] > leases[0], "the heartbeats extended the slow tool's lease while it ran"


def test_the_async_helper_never_executes_a_call_its_budget_refuses(dsn: str, person: psycopg.Connection[DictRow]) -> None:
    executed: list[str] = []

    async def lookup(arguments: dict[str, Any]) -> Any:
        executed.append(arguments["what"])
        return {"found": arguments["what"]}

    async def body() -> None:
        scoped: AsyncScopedLedger = AsyncLedger(dsn).scoped(*SCOPE)
        await scoped.create_run("agent", run_id="r-async-budget")
        await scoped.transition_run("r-async-budget", "running")
        budget = await scoped.set_budget("tool_calls", 1, level="run", run_id="r-async-budget")
        assert budget is not None and budget.max_amount == 1
        assert await tool_call_async(scoped, "r-async-budget", "c1", "crm.lookup", {"what": "a"}, lookup) == {"found": "a"}
        with pytest.raises(BudgetExhausted) as refused:
            await tool_call_async(scoped, "r-async-budget", "c2", "crm.lookup", {"what": "b"}, lookup)
        assert refused.value.budget is not None and refused.value.budget.remaining == 0
        [used_up] = await scoped.budgets("r-async-budget")
        assert used_up.exhausted and used_up.run_id == "r-async-budget"

    asyncio.run(body())
    assert executed == ["a"]
    assert one(person, "SELECT status || ' ' || error_code FROM ledger.runs") == "paused BUDGET_EXHAUSTED"
