"""A LangGraph graph whose checkpoints live in the ledger: it pauses for a person (interrupt),
and the invocation, found again by its request id, resumes from the ledger's checkpoint, in
this process or any other. The run holds the graph's checkpoints next to its evidence.

Run it against `make demo` (`export LEDGER_DSN=...` as the demo prints it):
    PYTHONPATH=clients/python/src python3 clients/python/examples/langgraph_checkpointer.py
"""

import operator
import os
from typing import Annotated, Any, TypedDict

from langgraph.graph import START, StateGraph
from langgraph.types import Command, interrupt

from ledger_client import Ledger
from ledger_client.integrations.langgraph import finish_run, start_run
from ledger_client.integrations.langgraph_checkpoint import LedgerSaver


class Refund(TypedDict):
    order: int
    notes: Annotated[list[str], operator.add]


def check(state: Refund) -> dict[str, Any]:
    return {"notes": [f"order {state['order']} paid 12.50"]}


def confirm(state: Refund) -> dict[str, Any]:
    decision = interrupt(f"Refund order {state['order']}?")  # the graph pauses here, its state saved
    return {"notes": [f"a person said {decision}"]}


ledger = Ledger(os.environ["LEDGER_DSN"]).scoped("acme", "examples-checkpointer")
saver = LedgerSaver(ledger)
graph = (StateGraph(Refund).add_node(check).add_node(confirm)
         .add_edge(START, "check").add_edge("check", "confirm").compile(checkpointer=saver))

# One invocation of thread "refund-1042" is one ledger run, named by the request id.
config = start_run(ledger, "refund-1042", "refund-request-1042")
state = graph.invoke({"order": 1042, "notes": []}, config)
print("paused:", state["__interrupt__"][0].value)

# Later, here or in another process: the same request id finds the same run, and the graph
# resumes from the checkpoint the ledger holds.
config = start_run(ledger, "refund-1042", "refund-request-1042")
state = graph.invoke(Command(resume="yes"), config)
finish_run(ledger, config, "; ".join(state["notes"]))
print("notes:", state["notes"])
runs = {t.metadata.get("ledger_run_id") for t in saver.list({"configurable": {"thread_id": "refund-1042"}})}
print("checkpoints of run:", runs == {config["configurable"]["ledger_run_id"]})
