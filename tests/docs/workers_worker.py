"""The plain-SQL worker of docs/workers.md (its two ```python blocks under "A worker"), run as
written against the test cluster, through a crash and two decisions by a person.

Usage: python3 tests/docs/workers_worker.py docs/workers.md "host=... port=... dbname=... user=postgres"

A first worker process is killed (SIGKILL) while the lookup's request is out. A second worker,
in this process, takes the run over, does not redo the model step, finds the lookup in doubt and
parks the run; a person resolves the call, the worker resumes, asks for the refund's approval and
parks again; the person approves and the worker finishes (each decision's notification of
ledger_runs wakes it: its idle bound is longer than the test waits), its refund taking three times
its 1 s lease while a third worker claims: the heartbeat must keep the run with the second worker. The
model, the lookup and the refund must each have run exactly once, the run must have been taken
over only once (after the kill), and it must pass replay_ready.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psycopg

document, dsn = sys.argv[1], sys.argv[2]
text = open(document, encoding="utf-8").read()
section = text[text.index("\n## A worker\n"):]
section = section[:section.index("\n## ", 1)]
blocks = re.findall(r"```python\n(.*?)```", section, re.S)
assert len(blocks) == 2, f"the worker section has {len(blocks)} python blocks"
CODE = "\n".join(blocks)

SCOPE = ("acme", "readme-worker")
RUN = "readme-worker-run"
effects = tempfile.mkdtemp(prefix="ledger-readme-worker-")
os.chmod(effects, 0o777)

# The tools and the model the document's agent calls, as a worker process defines them: each
# execution is a line in a file, so that a killed process's executions are counted too.
TOOLS = f"""
import os, time
EFFECTS = {effects!r}
def effect(name):
    with open(os.path.join(EFFECTS, name), "a") as f:
        f.write("x\\n")
def lookup_order(arguments):
    effect("lookup")
    time.sleep(float(os.environ.get("LOOKUP_SECONDS", "0")))
    return {{"order": arguments["order"], "paid": "12.50"}}
def refund(arguments):
    effect("refund")
    time.sleep(float(os.environ.get("REFUND_SECONDS", "0")))
    return {{"refunded": arguments["amount"]}}
_llm_step = llm_step
def llm_step(conn, run, key, call_model):
    def counted():
        effect("model-" + key)
        return call_model()
    return _llm_step(conn, run, key, counted)
"""


def count(name):
    try:
        return len(open(os.path.join(effects, name)).read().splitlines())
    except FileNotFoundError:
        return 0


def wait_for(what, check, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


person = psycopg.connect(dsn, autocommit=True)
person.execute("SELECT ledger.set_scope(%s, %s)", SCOPE)
person.execute("SELECT ledger.create_run('agent', '{\"order\": 7}', run_id => %s)", (RUN,))


def status():
    return person.execute("SELECT status FROM ledger.runs WHERE id = %s", (RUN,)).fetchone()[0]


# 1. A worker process, killed while the lookup's request is out.
first = subprocess.Popen(
    [sys.executable, "-c", CODE + TOOLS + f"\nwork(connect({dsn!r}), support_agent, lease_owner='worker-1', idle_s=0.1)\n"],
    env={**os.environ, "LOOKUP_SECONDS": "600"},
)
wait_for("the lookup's request", lambda: count("lookup") == 1)
first.send_signal(signal.SIGKILL)
first.wait()
# Its leases would run out in a minute; the test ends them now instead of waiting.
person.execute("UPDATE ledger.runs SET lease_expires_at = now() WHERE id = %s", (RUN,))
person.execute("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() WHERE run_id = %s", (RUN,))

# 2. A second worker takes over, finds the lookup in doubt and parks the run.
namespace = {}
exec(CODE + TOOLS, namespace)  # noqa: S102 - the document's own code is what is under test
done = threading.Event()
pool = namespace["connect"](dsn)


def worker(name, idle_s):
    return threading.Thread(target=namespace["work"], args=(pool, namespace["support_agent"]),
                            kwargs={"lease_owner": name, "lease_s": 1, "idle_s": idle_s, "stop": done.is_set})


# Idle for longer than the test waits for each stage (60 s): only a notification of ledger_runs (a
# person's decision) wakes it in time.
second = worker("worker-2", idle_s=120)
second.start()
third = None
try:
    wait_for("the run parked in doubt", lambda: status() == "paused")
    doubt = person.execute("SELECT id, lease_owner FROM ledger.tool_calls_in_doubt").fetchall()
    assert [owner for _, owner in doubt] == ["worker-1"], doubt
    # 3. A person checks the CRM and resolves the call; the worker resumes, asks for the refund's
    # approval and parks the run again.
    person.execute("SELECT ledger.resolve_tool_call(%s, 'succeeded', '{\"order\": 7, \"paid\": \"12.50\"}',"
                   " actor => 'ops@acme', note => 'seen in the CRM')", (doubt[0][0],))
    wait_for("the run parked for approval", lambda: status() == "waiting_approval")
    # 4. The person approves; the worker executes the refund, slower than its 1 s lease, while a
    # third worker claims: the heartbeat keeps the run with the second, which finishes it.
    os.environ["REFUND_SECONDS"] = "3"
    person.execute("SELECT ledger.resolve_approval(id, 'approved', actor => 'lead@acme') FROM ledger.pending_approvals")
    wait_for("the refund's request", lambda: count("refund") == 1)
    third = worker("worker-3", idle_s=0.05)
    third.start()
    wait_for("the run to finish", lambda: status() not in ("queued", "running", "waiting_approval"))
finally:
    done.set()
    person.execute("NOTIFY ledger_runs")  # wakes the second worker to see the stop
    second.join()
    if third is not None:
        third.join()
    pool.close()

assert status() == "succeeded", status()
executed = {name: count(name) for name in ("model-plan", "lookup", "refund", "model-answer")}
assert executed == {"model-plan": 1, "lookup": 1, "refund": 1, "model-answer": 1}, executed
ready = person.execute("SELECT ledger.replay_ready(%s)", (RUN,)).fetchone()[0]
assert ready["status"] == "pass", ready
replayed = person.execute("SELECT count(*) FROM ledger.run_events WHERE run_id = %s"
                          " AND event_type = 'tool_call.replayed'", (RUN,)).fetchone()[0]
assert replayed == 0, replayed
takeovers = person.execute("SELECT count(*) FROM ledger.run_events WHERE run_id = %s AND event_type = 'run.claimed'"
                           " AND (payload->>'takeover')::boolean", (RUN,)).fetchone()[0]
assert takeovers == 1, f"{takeovers} takeovers: only the killed worker's run may be taken over"
print(f"docs/workers.md worker: {executed}, replay_ready pass, across a killed worker and two decisions")
