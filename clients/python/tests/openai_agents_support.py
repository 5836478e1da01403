"""An agent of the OpenAI Agents SDK on the ledger, for tests/test_openai_agents.py: a scripted
model (the SDK's agents.testing.ScriptedModel) that asks for the tools the user names
("refund:7,track:7") in one turn and then answers with what they returned; a guarded `refund`
(a side effect, counted in EFFECTS_DIR/refund; it blocks when EFFECTS_DIR/block exists, fails
for order 0 and times out for a negative one) and an unguarded `track`.

Run as a script, it drives one ledger run with run_agent and prints the outcome as JSON:
    openai_agents_support.py DSN WORKSPACE RUN_ID INPUT APPROVAL(0|1)
"""

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    GuardrailFunctionOutput,
    InputGuardrail,
    RunContextWrapper,
    Usage,
    function_tool,
    get_current_span,
    set_trace_processors,
)
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

from ledger_client import AsyncLedger, Ledger
from ledger_client.integrations.openai_agents import LedgerRun, LedgerTracingProcessor, guard, run_agent

USAGE = Usage(requests=1, input_tokens=120, output_tokens=30, total_tokens=150)


def respond(call: ModelCall) -> ModelStep:
    """The model: the tools the user named, then an answer quoting their outputs. It reports its
    usage on its generation span, as the SDK's provider models do."""
    span = get_current_span()
    if span is not None:
        span.span_data.model = "scripted-1"
        span.span_data.usage = {"requests": 1, "input_tokens": 120, "output_tokens": 30, "total_tokens": 150}
    items = call.input if isinstance(call.input, list) else [{"role": "user", "content": call.input}]
    outputs = [str(i["output"]) for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
    if outputs:
        return ModelStep(output=[assistant_message("done: " + " | ".join(outputs))], usage=USAGE)
    asked = str(next(i["content"] for i in items if isinstance(i, dict) and i.get("role") == "user"))
    calls = []
    for part in asked.split(","):
        tool, order = part.split(":")
        calls.append(function_call(tool, {"order": int(order)}, call_id=f"call-{tool}-{order}"))
    return ModelStep(output=calls, usage=USAGE)


def effects_dir() -> Path:
    return Path(os.environ["EFFECTS_DIR"])


@function_tool(failure_error_function=None)
def refund(order: int) -> dict[str, Any]:
    """Refunds an order (the side effect)."""
    with (effects_dir() / "refund").open("a") as f:
        f.write(f"{order}\n")
    if order == 0:
        raise ValueError("the payment provider refused")
    if order < 0:
        raise TimeoutError("no answer from the payment provider in 5 s")
    while (effects_dir() / "block").exists():
        time.sleep(0.05)  # the payment provider hangs: the test kills the process here
    return {"refund_id": f"rf-{order}"}


@function_tool
def track(order: int) -> str:
    """Where the parcel is (read-only: not guarded)."""
    return f"order {order}: delivered"


async def polite(ctx: RunContextWrapper[Any], agent: Agent[Any], input: Any) -> GuardrailFunctionOutput:
    return GuardrailFunctionOutput(output_info=None, tripwire_triggered=False)


def agent(*, approval: bool) -> Agent[Any]:
    tool = guard(refund, approval={"title": "Refund", "policy_ref": "refunds/v1", "expires_in_seconds": 3600}
                 if approval else None,
                 timeout_seconds=5)
    return Agent(name="support", instructions="Help the customer.", tools=[tool, track],
                 input_guardrails=[InputGuardrail(polite, name="polite")],
                 model=ScriptedModel([ModelStep.respond(respond) for _ in range(4)], emit_traces=True))


async def drive(dsn: str, workspace: str, run_id: str, input: str, approval: bool) -> dict[str, Any]:
    run = LedgerRun(AsyncLedger(dsn).scoped("acme", workspace), run_id)
    outcome = await run_agent(agent(approval=approval), input, run)
    return {"status": str(outcome.status), "final_output": outcome.final_output,
            "waiting": [[w.item.call_id, w.status, w.tool_call_record_id] for w in outcome.waiting]}


if __name__ == "__main__":
    dsn, workspace, run_id, input, approval = sys.argv[1:6]
    processor = LedgerTracingProcessor(Ledger(dsn))
    set_trace_processors([processor])  # no exporter: nothing leaves the machine
    print(json.dumps(asyncio.run(drive(dsn, workspace, run_id, input, approval == "1"))), flush=True)
    processor.shutdown()
