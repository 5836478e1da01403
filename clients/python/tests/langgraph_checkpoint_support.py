"""A process driving the LangGraph tests' agent (langgraph_support.py) with the ledger as its
checkpointer; its refund tool blocks after its side effect, so that the test can kill it.

Usage: python langgraph_checkpoint_support.py DSN EFFECTS_DIR THREAD REQUEST ORDER
"""

import sys
from pathlib import Path

from langgraph_support import ask, build, make_tools

from ledger_client import Ledger
from ledger_client.integrations.langgraph import LedgerToolGuard, start_run
from ledger_client.integrations.langgraph_checkpoint import LedgerSaver

if __name__ == "__main__":
    dsn, effects, thread, request, order = sys.argv[1:6]
    scoped = Ledger(dsn).scoped("acme", "tests")
    graph = build(LedgerToolGuard(scoped), make_tools(Path(effects), block=True), LedgerSaver(scoped))
    graph.invoke(ask(("refund", f"call-refund-{order}", {"order": int(order), "amount": "12.50"})),
                 start_run(scoped, thread, request))
