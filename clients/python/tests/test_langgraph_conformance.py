"""LangGraph's own checkpointer conformance suite (langgraph-checkpoint-conformance) against
LedgerSaver on the real extension: every base test and every extended one (copy_thread,
delete_for_runs, prune). The counts are the manual's ("Checkpointer", conformance)."""

import asyncio
from collections.abc import AsyncGenerator

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import BASE_CAPABILITIES, EXTENDED_CAPABILITIES

from ledger_client.aio import AsyncLedger
from ledger_client.integrations.langgraph_checkpoint import LedgerSaver

from conftest import SCOPE


def test_the_conformance_suite_passes_base_and_extended(dsn: str) -> None:
    @checkpointer_test(name="LedgerSaver")
    async def saver() -> AsyncGenerator[LedgerSaver, None]:
        yield LedgerSaver(aledger=AsyncLedger(dsn).scoped(*SCOPE))

    report = asyncio.run(validate(saver))
    failures = [f for r in report.results.values() for f in r.failures]
    assert not failures, "\n".join(failures)

    def count(capabilities: frozenset[object]) -> tuple[int, int]:
        results = [report.results[c.value] for c in capabilities]  # type: ignore[attr-defined]
        passed = sum(r.tests_passed for r in results)
        return passed, passed + sum(r.tests_failed for r in results)

    assert count(BASE_CAPABILITIES) == (58, 58)
    assert count(EXTENDED_CAPABILITIES) == (23, 23)
    assert report.conformance_level() == "FULL"
