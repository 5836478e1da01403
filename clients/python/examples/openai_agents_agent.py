"""A support agent of the OpenAI Agents SDK on the ledger: its refund tool runs at most once,
after a person approved it in the ledger; the run pauses in between and is resumed from the
RunState the ledger keeps.

Run it against `make demo` (`export LEDGER_DSN=...` as the demo prints it), with the extra
installed (`pip install 'ledger-client[openai-agents]'`):
    PYTHONPATH=clients/python/src python3 clients/python/examples/openai_agents_agent.py
"""

import asyncio
import os
from typing import Any

from agents import Agent, Usage, function_tool, get_current_span, set_trace_processors
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

from ledger_client import AsyncLedger, Ledger
from ledger_client.integrations.openai_agents import LedgerRun, LedgerTracingProcessor, guard, run_agent

SCOPE = ("acme", "examples-openai-agents")


def model(call: ModelCall) -> ModelStep:
    """Stands in for your model (``model="gpt-..."`` in the Agent): it looks the order up and
    refunds it, then answers. Provider models report their usage on the span as this one does."""
    span = get_current_span()
    if span is not None:
        span.span_data.model = "example-model"
        span.span_data.usage = {"requests": 1, "input_tokens": 120, "output_tokens": 30, "total_tokens": 150}
    items = call.input if isinstance(call.input, list) else []
    outputs = [i["output"] for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
    usage = Usage(requests=1, input_tokens=120, output_tokens=30, total_tokens=150)
    if len(outputs) == 0:
        return ModelStep(output=[function_call("lookup_order", {"order": 1042}, call_id="call-lookup")], usage=usage)
    if len(outputs) == 1:
        return ModelStep(output=[function_call("refund", {"order": 1042, "amount": "12.50"}, call_id="call-refund")],
                         usage=usage)
    return ModelStep(output=[assistant_message(f"Order 1042 was refunded: {outputs[-1]}")], usage=usage)


@function_tool
def lookup_order(order: int) -> dict[str, Any]:
    """A read-only tool: unguarded, the tracing processor records it as a step."""
    return {"order": order, "paid": "12.50"}


@function_tool(failure_error_function=None)
def refund(order: int, amount: str) -> dict[str, Any]:
    """A tool with a side effect (your payment provider's client; raise TimeoutError when a sent
    request gets no answer): guarded, it runs once, and only once a person approved it."""
    return {"refund_id": f"rf-{order}", "amount": amount}


support = Agent(
    name="support",
    instructions="Help the customer with their order.",
    tools=[lookup_order, guard(refund, approval={"title": "Refund order 1042", "policy_ref": "refunds/v1"})],
    model=ScriptedModel([ModelStep.respond(model) for _ in range(3)], emit_traces=True),
)


async def main() -> None:
    dsn = os.environ["LEDGER_DSN"]
    # The runs' model calls, handoffs and guardrails go to the ledger (and nowhere else).
    processor = LedgerTracingProcessor(Ledger(dsn))
    set_trace_processors([processor])
    ledger = AsyncLedger(dsn).scoped(*SCOPE)
    # One ledger run per customer request: the request id finds the same run on a resume.
    created = await ledger.create_run("agent", {"question": "Refund order 1042, it came broken."},
                                      request_id="ticket-4711", user_id="customer-7")
    run = LedgerRun(ledger, created.id)

    outcome = await run_agent(support, "Refund order 1042, it came broken.", run)
    print(f"{run.run_id}: {outcome.status}")
    # A person at the approval queue (the console, or psql: SELECT * FROM ledger.pending_approvals);
    # the agent's process may be gone by now: the paused RunState is an artifact of the run.
    for approval in await ledger.pending_approvals(run.run_id):
        await ledger.resolve_approval(approval.id, "approved", actor="lead@acme", note="broken on arrival")
        print(f"person: approved {approval.title!r}")

    outcome = await run_agent(support, "Refund order 1042, it came broken.", run)
    print(f"{run.run_id}: {outcome.status}, answered {outcome.final_output!r}")
    for step in (await ledger.replay_bundle(run.run_id))["steps"]:
        print(f"  {step['step_type']:9} {step['status']:9} {step['input_summary']}")
    print(f"  replay_ready {(await ledger.replay_ready(run.run_id)).status}")
    processor.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
