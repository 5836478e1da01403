"""The LangGraph tests' scripted model, tools and graph, and a process driving that graph.

Usage: python langgraph_support.py DSN EFFECTS_DIR THREAD REQUEST ORDER

The process invokes the graph on the thread with PostgreSQL checkpoints; its refund tool blocks
after its side effect (BLOCK=1), so that the test can kill the process while the call is begun.
Every execution of a tool appends a line to a file in EFFECTS_DIR, so that the executions of a
killed process count too.
"""

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from ledger_client.integrations.langgraph import LedgerToolGuard

USAGE = {"input_tokens": 100, "output_tokens": 20, "total_tokens": 120}


class ScriptedModel(BaseChatModel):
    """A tool-calling chat model whose reply depends only on the conversation, so that a resumed
    process gets the same one: the user's message is JSON naming the calls to make
    (``[{"name", "args", "id"}]``); after the tools it answers with what they said."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool], *,
                   tool_choice: str | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        meta = {"model_name": "scripted-1", "model_provider": "test"}
        last = messages[-1]
        if isinstance(last, ToolMessage):
            results = [m for m in messages if isinstance(m, ToolMessage)]
            failed = any(m.status == "error" for m in results)
            reply = AIMessage(content=f"{'Sorry' if failed else 'Done'}: {'; '.join(m.text for m in results)}",
                              usage_metadata=USAGE, response_metadata=meta)
        else:
            calls = json.loads(last.text)
            reply = AIMessage(content="", tool_calls=[{**c, "type": "tool_call"} for c in calls],
                              usage_metadata=USAGE, response_metadata=meta)
        return ChatResult(generations=[ChatGeneration(message=reply)])


def ask(*calls: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    """The graph's input: a user message asking for these calls (name, id, arguments)."""
    return {"messages": [HumanMessage(json.dumps([{"name": n, "id": i, "args": a} for n, i, a in calls]))]}


def effect(effects: Path, name: str) -> None:
    with open(effects / name, "a") as f:
        f.write("x\n")


def count(effects: Path, name: str) -> int:
    path = effects / name
    return len(path.read_text().splitlines()) if path.exists() else 0


def make_tools(effects: Path, *, block: bool = False, timeout: bool = False) -> list[BaseTool]:
    @tool
    def refund(order: int, amount: str) -> str:
        """Refunds an order (a side effect)."""
        effect(effects, "refund")
        if block:
            time.sleep(3600)  # the test kills the process here, the call begun
        if timeout:
            raise TimeoutError("the bank did not answer in 5 s")
        return f"Refund rf-{order} of {amount} sent"

    @tool
    def lookup(order: int) -> str:
        """Reads an order (no side effect)."""
        effect(effects, "lookup")
        return f"Order {order} paid 12.50"

    return [refund, lookup]


def build(guard: LedgerToolGuard, tools: list[BaseTool], checkpointer: BaseCheckpointSaver[Any]) -> CompiledStateGraph[Any]:
    """The classic agent loop: the model, then the guarded tools while it asks for some."""
    model = ScriptedModel()

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    async def aagent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", RunnableLambda(agent, afunc=aagent))
    builder.add_node("tools", ToolNode(tools, wrap_tool_call=guard, awrap_tool_call=guard.awrap_tool_call))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)


def main() -> None:
    import psycopg
    from langgraph.checkpoint.postgres import PostgresSaver
    from psycopg.rows import dict_row

    from ledger_client import Ledger
    from ledger_client.integrations.langgraph import start_run

    dsn, effects, thread, request, order = sys.argv[1:6]
    scoped = Ledger(dsn).scoped("acme", "tests")
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
        graph = build(LedgerToolGuard(scoped), make_tools(Path(effects), block=os.environ.get("BLOCK") == "1"),
                      PostgresSaver(conn))
        graph.invoke(ask(("refund", f"call-refund-{order}", {"order": int(order), "amount": "12.50"})),
                     start_run(scoped, thread, request))


if __name__ == "__main__":
    main()
