"""A LangGraph support agent on the ledger: its refund tool runs at most once and only after a
person approved it in SQL; the graph pauses (interrupt) meanwhile and resumes from its PostgreSQL
checkpoints.

Run it against `make demo` (`export LEDGER_DSN=...` as the demo prints it):
    PYTHONPATH=clients/python/src python3 clients/python/examples/langgraph_agent.py
"""

import os
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import psycopg
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command
from psycopg.rows import dict_row

from ledger_client import Ledger
from ledger_client.integrations.langgraph import LedgerToolGuard, finish_run, start_run


class SupportModel(BaseChatModel):
    """Stands in for your chat model (ChatOpenAI, ChatAnthropic, ...): asks for the refund, then answers."""

    @property
    def _llm_type(self) -> str:
        return "support-example"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        usage = {"input_tokens": 120, "output_tokens": 30, "total_tokens": 150}
        meta = {"model_name": "small", "model_provider": "example"}
        if isinstance(messages[-1], ToolMessage):
            reply = AIMessage(f"Your refund is on its way: {messages[-1].text}.", usage_metadata=usage, response_metadata=meta)
        else:
            call = {"name": "refund", "args": {"order": 1042, "amount": "12.50"}, "id": "call-refund-1042"}
            reply = AIMessage("", tool_calls=[call], usage_metadata=usage, response_metadata=meta)
        return ChatResult(generations=[ChatGeneration(message=reply)])


@tool
def refund(order: int, amount: str) -> str:
    """Refunds an order: a side effect (your payment provider's client)."""
    return f"refund rf-{order} of {amount}"


def price(model: str | None, usage: Mapping[str, Any]) -> Decimal:
    """Your price list: what a model call cost."""
    return Decimal("0.000004") * int(usage["total_tokens"])


def main() -> None:
    dsn = os.environ["LEDGER_DSN"]
    support = Ledger(dsn).scoped("acme", "examples-langgraph")
    model = SupportModel()
    guard = LedgerToolGuard(support, approvals={"refund": {"title": "Refund order 1042", "policy_ref": "refunds/v1"}})

    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", ToolNode([refund], wrap_tool_call=guard, awrap_tool_call=guard.awrap_tool_call))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")

    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0, row_factory=dict_row) as conn:
        checkpointer = PostgresSaver(conn)
        checkpointer.setup()
        graph = builder.compile(checkpointer=checkpointer)

        def run_config() -> RunnableConfig:
            """One ledger run per invocation of the thread: created by the first call, found again
            by its request id (and the same arguments) on a resume, in this process or another."""
            return start_run(support, "customer-7", "support-req-1042", inputs={"question": "Refund order 1042"},
                             user_id="customer-7", price=price)

        state = graph.invoke({"messages": [HumanMessage("It came broken, refund me.")]}, run_config())
        for pause in state["__interrupt__"]:
            print(f"paused: {pause.value['ledger']} {pause.value['title']!r}: {pause.value['arguments']}")
            # A person decides in the console, or in SQL:
            support.resolve_approval(pause.value["approval_id"], "approved", actor="lead@acme", note="broken on arrival")
            print(f"person: approved {pause.value['title']!r}")

        # The resume value is not read: the ledger's answer (approved: the refund runs) decides.
        config = run_config()
        state = graph.invoke(Command(resume="decided"), config)
        answer = state["messages"][-1].text
        finish_run(support, config, answer)
        run_id = config["configurable"]["ledger_run_id"]
        print(f"{run_id}: {answer}")
        print(f"replay_ready: {support.replay_ready(run_id).status}")


if __name__ == "__main__":
    main()
