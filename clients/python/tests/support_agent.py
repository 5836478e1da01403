"""The tests' agent, and a worker process running it.

Usage: python support_agent.py DSN WORKSPACE LEASE_OWNER EFFECTS_DIR

Every execution of the model or a tool appends a line to a file in EFFECTS_DIR, so that the
executions of a killed process count too. LOOKUP_SECONDS makes the lookup slow; a run whose
inputs ask for a refund needs a person's approval for it.
"""

import os
import sys
import time
from pathlib import Path
from typing import Any

from ledger_client import Ledger, ModelReply, RunContext, Worker


def effect(name: str) -> None:
    with open(Path(os.environ["EFFECTS_DIR"]) / name, "a") as f:
        f.write("x\n")


def count(effects: Path, name: str) -> int:
    path = effects / name
    return len(path.read_text().splitlines()) if path.exists() else 0


def model(key: str, text: str) -> ModelReply:
    effect(f"model-{key}")
    return ModelReply(text, {"input_tokens": 100, "output_tokens": 20}, model_ref="small")


def lookup_order(arguments: dict[str, Any]) -> Any:
    effect("lookup")
    time.sleep(float(os.environ.get("LOOKUP_SECONDS", "0")))
    return {"order": arguments["order"], "paid": "12.50"}


def refund(arguments: dict[str, Any]) -> Any:
    effect("refund")
    return {"refunded": arguments["amount"]}


def support_agent(ctx: RunContext) -> str:
    order = ctx.inputs["order"]
    ctx.llm_step("plan", lambda: model("plan", "look the order up"))
    found = ctx.tool_call("lookup", "crm.lookup_order", {"order": order}, lookup_order, timeout_seconds=5)
    if ctx.inputs.get("refund"):
        ctx.tool_call("refund", "payments.refund", {"order": order, "amount": found["paid"]}, refund,
                      approval={"title": f"Refund order {order}"})
        return ctx.llm_step("answer", lambda: model("answer", f"Refunded {found['paid']}."))
    return ctx.llm_step("answer", lambda: model("answer", f"Order {order} was paid {found['paid']}."))


if __name__ == "__main__":
    dsn, workspace, owner, effects = sys.argv[1:5]
    os.environ["EFFECTS_DIR"] = effects
    Worker(Ledger(dsn), support_agent, scope=("acme", workspace), lease_owner=owner, idle_s=0.05,
           heartbeat_s=0.5).run(handle_signals=True)
