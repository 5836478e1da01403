"""The Python catch-up example of docs/workers.md ("Following a run"), run as written against the
test cluster.

Usage: python3 tests/docs/workers_follower.py docs/workers.md "host=... port=... dbname=... user=postgres"

It takes the section's ```python block, defines its `events` function, and follows a run while
another connection writes to it in pauses (so the follower really waits for notifications); half
way the follower stops and starts again from its last event id, as after a dropped connection.
Every event must arrive exactly once, in seq order, and the follower must stop by itself at the
event that ended the run.
"""

import re
import signal
import sys
import threading
import time

import psycopg

document, dsn = sys.argv[1], sys.argv[2]
text = open(document, encoding="utf-8").read()
section = text[text.index("\n## Following a run\n"):]
code = re.search(r"```python\n(.*?)```", section, re.S)
assert code, f"{document} has no python example under \"Following a run\""
example = {}
exec(code.group(1), example)  # noqa: S102 - the document's own code is what is under test
events = example["events"]

SCOPE = ("acme", "readme")
RUN = "readme-follower"
STEPS = 6

with psycopg.connect(dsn, autocommit=True) as setup:
    setup.execute("SELECT ledger.set_scope(%s, %s)", SCOPE)
    setup.execute("SELECT ledger.create_run('agent', run_id => %s)", (RUN,))


def write():
    with psycopg.connect(dsn, autocommit=True) as w:
        w.execute("SELECT ledger.set_scope(%s, %s)", SCOPE)
        w.execute("SELECT ledger.transition_run(%s, 'running')", (RUN,))
        for n in range(STEPS):
            time.sleep(0.2)
            w.execute("SELECT ledger.create_step(%s, 'llm', step_key => %s)", (RUN, f"s{n}"))
        time.sleep(0.2)
        w.execute("SELECT ledger.transition_run(%s, 'succeeded')", (RUN,))


writer = threading.Thread(target=write)
writer.start()

# The follower waits up to 10 minutes per notification: only notifications can wake it in time.
# The alarm turns a follower that is never woken (or hangs) into a failure instead of a stuck test.
signal.alarm(120)
seen, cursor = [], None
for part in (1, 2):
    for event_id, seq, event_type, payload in events(dsn, *SCOPE, RUN, cursor=cursor, wait_s=600):
        seen.append(seq)
        cursor = event_id
        if part == 1 and len(seen) == 3:
            break  # a dropped connection: start again from the cursor
# The generator ended by itself: at the event that ended the run, the last one written.
writer.join()
assert event_type == "run.status" and payload.get("to") == "succeeded", (event_type, payload)

expected = list(range(1, STEPS + 4))  # run.created, running, the steps, succeeded
assert seen == expected, f"events {seen}, expected {expected}"
print(f"docs/workers.md follower: {len(seen)} events, each once, in seq order, across a reconnect")
