"""A support agent on the ledger: a worker drives three runs, a person approves one refund and
rejects another.

Run it against `make demo` (`export LEDGER_DSN=...` as the demo prints it):
    PYTHONPATH=clients/python/src python3 clients/python/examples/worker.py
"""

import os
import threading
import time
from decimal import Decimal
from typing import Any

from psycopg_pool import ConnectionPool

from ledger_client import Ledger, ModelReply, Rejected, RunContext, ToolRequest, Worker

SCOPE = ("acme", "examples-py")


def call_model(prompt: str, reply: str) -> ModelReply:
    """Stands in for your model client: the reply, its usage as the SDK reports it, its price."""
    return ModelReply(reply, {"input_tokens": 120, "output_tokens": 30}, model_ref="small",
                      provider="example", amount=Decimal("0.0006"), currency="USD")


def lookup_order(arguments: dict[str, Any]) -> Any:
    """A read-only tool (your CRM client; raise TimeoutError when a sent request gets no answer)."""
    return {"order": arguments["order"], "paid": "12.50" if arguments["order"] == 1042 else "480.00"}


def track_parcel(arguments: dict[str, Any]) -> Any:
    return {"order": arguments["order"], "status": "delivered"}


def refund(arguments: dict[str, Any]) -> Any:
    """A tool with a side effect: it runs only once a person approved exactly these arguments."""
    return {"refund_id": f"rf-{arguments['order']}", "amount": arguments["amount"]}


def support_agent(ctx: RunContext) -> str:
    """Written as if it ran from the start every time: on a resume, finished steps and calls
    return what they recorded instead of running again."""
    order = ctx.inputs["order"]
    ctx.llm_step("plan", lambda: call_model(f"plan: {ctx.inputs['question']}", "Let me look the order up."))
    # The model asked for two tools at once: claimed and begun in one statement, run in parallel.
    found, parcel = (result.get() for result in ctx.tool_calls([
        ToolRequest("lookup", "crm.lookup_order", {"order": order}, lookup_order, timeout_seconds=10),
        ToolRequest("track", "shipping.track", {"order": order}, track_parcel, timeout_seconds=10),
    ]))
    if ctx.inputs.get("refund"):
        try:
            ctx.tool_call("refund", "payments.refund", {"order": order, "amount": found["paid"]}, refund,
                          approval={"title": f"Refund order {order}", "policy_ref": "refunds/v1"})
        except Rejected as rejected:  # uncaught, the run ends failed with TOOL_APPROVAL_REJECTED
            apology = "A colleague will call you about a return."
            return ctx.llm_step("apology", lambda: call_model(f"answer: {rejected}", apology))
        refunded = f"Order {order} was refunded: {found['paid']}."
        return ctx.llm_step("answer", lambda: call_model("answer: refunded", refunded))
    return f"Order {order} is {parcel['status']}."


def main() -> None:
    # A pool, its connections checked when taken: a connection per transaction costs a connect
    # (tens of milliseconds) on every call.
    with ConnectionPool(os.environ["LEDGER_DSN"], check=ConnectionPool.check_connection) as pool:
        work(Ledger(pool))


def work(ledger: Ledger) -> None:
    support = ledger.scoped(*SCOPE)
    runs = [
        support.create_run("agent", {"order": 1042, "question": "Where is my order?"},
                           user_id="customer-7", subject_id="support-agent", subject_version_id="support-agent@v1"),
        support.create_run("agent", {"order": 1042, "question": "Refund me, it came broken.", "refund": True},
                           user_id="customer-7", subject_id="support-agent", subject_version_id="support-agent@v1"),
        support.create_run("agent", {"order": 1043, "question": "Refund me, it came broken.", "refund": True},
                           user_id="customer-8", subject_id="support-agent", subject_version_id="support-agent@v1"),
    ]
    worker = Worker(ledger, support_agent, scope=SCOPE, lease_owner="example-worker", idle_s=0.2)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not all(r.status.terminal for r in (support.get_run(run.id) or run for run in runs)):
            assert time.monotonic() < deadline, "the runs did not finish within a minute"
            # A person at the approval queue (the console, or psql: SELECT * FROM ledger.pending_approvals)
            # refunds up to 50.00 without a return.
            for approval in support.pending_approvals():
                if Decimal((approval.arguments or {})["amount"]) <= 50:
                    decision, note = "approved", "broken on arrival"
                else:
                    decision, note = "rejected", "over 50.00: needs a return"
                support.resolve_approval(approval.id, decision, actor="lead@acme", note=note)
                print(f"person: {decision} {approval.title!r}")
            time.sleep(0.2)
    finally:
        worker.stop()
        thread.join()

    for run in runs:
        done = support.get_run(run.id)
        assert done is not None
        print(f"\n{done.id}: {done.status}, answered {done.output_summary!r}")
        for event in support.events_since(run.id):
            print(f"  {event.seq:3} {event.event_type:24} {event.payload.get('to', '')}")
        costs = support.replay_bundle(run.id)["trace_spec"]["charge_summary"]["amounts"]
        print(f"  cost {costs}, replay_ready {support.replay_ready(run.id).status}")


if __name__ == "__main__":
    main()
