"""A pydantic-ai support agent whose tools, costs and answers go through the ledger.

Usage: LEDGER_DSN=... python pydantic_ai_agent.py STATE_FILE [PROMPT]

With a PROMPT it starts a turn; without one it resumes the turn STATE_FILE holds (after a crash,
or once a person decided in the ledger). STATE_FILE keeps the message history (pydantic-ai's JSON)
and the calls the last run deferred; the refunds "sent" are lines of ``refunds.log`` beside it. A
refund above 100 waits for a person's approval. The scripted model stands in for a real one
(``Agent("openai:gpt-5", ...)``): it looks the order up, refunds what was paid, then answers.
"""

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.tools import DeferredToolRequests

from ledger_client import AsyncLedger
from ledger_client.integrations.pydantic_ai import LedgerCapability

Output = str | DeferredToolRequests
PENDING = TypeAdapter(DeferredToolRequests | None)


def scripted_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Look the order up, refund what it paid, answer (tool-call ids as a real model gives them)."""
    returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
    if not returns:
        return ModelResponse(parts=[ToolCallPart("lookup_order", {"order": "1042"}, tool_call_id="call-lookup")])
    if len(returns) == 1:
        found: Any = returns[0].content
        refund = {"order": "1042", "amount": found["paid"]}
        return ModelResponse(parts=[ToolCallPart("refund", refund, tool_call_id="call-refund")])
    return ModelResponse(parts=[TextPart(f"Order 1042: {returns[-1].model_response_str()}")])


def send_refund(refunds: Path, order: str, amount: int) -> str:
    """The side effect: the payment provider's request (here a line in a file)."""
    with refunds.open("a") as f:
        f.write(f"{order} {amount}\n")
    return f"refunded {amount}"


def build_agent(capability: LedgerCapability, refunds: Path) -> Agent[None, Output]:
    agent = Agent(FunctionModel(scripted_model), output_type=[str, DeferredToolRequests], capabilities=[capability])

    @agent.tool_plain
    def lookup_order(order: str) -> dict[str, Any]:
        return {"order": order, "paid": 120}

    @agent.tool_plain
    def refund(order: str, amount: int) -> str:
        return send_refund(refunds, order, amount)

    return agent


def large_refunds(call: ToolCallPart) -> dict[str, Any] | None:
    """A refund above 100 waits for a person."""
    amount = call.args_as_dict().get("amount", 0)
    return {"title": f"Refund {amount}"} if call.tool_name == "refund" and amount > 100 else None


async def turn(capability: LedgerCapability, state: Path, prompt: str | None) -> Output:
    """One agent run: a new turn with ``prompt``, else the stored one resumed. The history is
    saved after every step, so that a crash leaves what another process resumes from."""
    agent = build_agent(capability, state.parent / "refunds.log")
    history, pending = None, None
    if prompt is None:
        stored = json.loads(state.read_text())
        history = ModelMessagesTypeAdapter.validate_python(stored["messages"])
        pending = PENDING.validate_python(stored["pending"])
    results = await capability.deferred_results(pending) if pending is not None else None

    def save(messages: list[ModelMessage], pending: DeferredToolRequests | None) -> None:
        state.write_text(json.dumps({"messages": ModelMessagesTypeAdapter.dump_python(messages, mode="json"),
                                     "pending": PENDING.dump_python(pending, mode="json")}))

    async with agent.iter(prompt, message_history=history, deferred_tool_results=results) as run:
        async for _ in run:
            save(run.all_messages(), None)
        assert run.result is not None
        output = run.result.output
    save(run.all_messages(), output if isinstance(output, DeferredToolRequests) else None)
    return output


async def main(state: Path, prompt: str | None) -> None:
    ledger = AsyncLedger(os.environ["LEDGER_DSN"]).scoped("acme", "support")
    output = await turn(LedgerCapability(ledger, approval=large_refunds), state, prompt)
    if isinstance(output, DeferredToolRequests):
        for call in output.approvals + output.calls:
            print(f"waiting: {call.tool_name} {call.tool_call_id} {output.metadata[call.tool_call_id]['ledger']}")
    else:
        print(output)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None))
