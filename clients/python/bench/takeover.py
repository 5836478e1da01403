"""What a SIGKILL costs: a worker (Worker's defaults, idle_s 1) is killed with ``kill -9``
mid-step, another is started at once, and the time from the kill until it holds the run is printed.

    PYTHONPATH=clients/python/src python clients/python/bench/takeover.py DSN [TRIALS] [KILL_AFTER_S]

DSN: a database with the extension (the runs are made in scope acme/bench-takeover);
KILL_AFTER_S: how long after the step began the first worker is killed (the heartbeat is every
5 s: 4.7 kills just before one, 5.3 just after).
"""

import os
import signal
import subprocess
import sys
import time

import psycopg

from ledger_client import Ledger, RunContext, Worker

SCOPE = ("acme", "bench-takeover")


def slow_agent(ctx: RunContext) -> str:
    def work() -> str:
        time.sleep(float(os.environ.get("WORK_S", "60")))
        return "done"
    return ctx.step("work", "tool", work)


def until(conn: psycopg.Connection[tuple[object, ...]], query: str, run_id: str, value: str) -> None:
    while conn.execute(query, (run_id,)).fetchone() != (value,):
        time.sleep(0.02)


def main(dsn: str, trials: int, kill_after_s: float) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT ledger.set_scope(%s, %s)", SCOPE)
        for trial in range(trials):
            run_id = f"r-kill-{time.time_ns()}"
            conn.execute("SELECT ledger.create_run('agent', run_id => %s)", (run_id,))
            first = subprocess.Popen([sys.executable, __file__, "worker", dsn, "worker-a"])
            until(conn, "SELECT status FROM ledger.run_steps WHERE run_id = %s", run_id, "running")
            time.sleep(kill_after_s)
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            killed = time.monotonic()
            second = subprocess.Popen([sys.executable, __file__, "worker", dsn, "worker-b"],
                                      env={**os.environ, "WORK_S": "0"})
            until(conn, "SELECT lease_owner FROM ledger.runs WHERE id = %s", run_id, "worker-b")
            took = time.monotonic() - killed
            until(conn, "SELECT status FROM ledger.runs WHERE id = %s", run_id, "succeeded")
            second.send_signal(signal.SIGTERM)
            second.wait()
            print(f"trial {trial}: killed {kill_after_s} s into the step, taken over {took:.1f} s after the kill",
                  flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        # idle_s 1: the lease's part of a takeover, not an idle worker's longest sleep (nothing
        # notifies a lease's end).
        Worker(Ledger(sys.argv[2]), slow_agent, scope=SCOPE, lease_owner=sys.argv[3], idle_s=1).run(handle_signals=True)
    else:
        main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3,
             float(sys.argv[3]) if len(sys.argv) > 3 else 2.0)
