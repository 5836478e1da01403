"""A server restart under a running worker and outbox consumer: both connect again by themselves,
and a run created after the restart is driven to its end and its outbox events delivered."""

import os
import subprocess
import threading

import psycopg
from conftest import SCOPE, wait_for
from psycopg.rows import dict_row

from ledger_client import Ledger, OutboxConsumer, OutboxEvent, RunContext, Worker, tool_call


def restart_server() -> None:
    """The project's way: pg_ctl restart keeps the server's options (the preload included); the
    server's output goes to its log, so that no pipe of ours stays open in it."""
    pg_ctl = os.path.join(os.environ["LEDGER_TEST_BINDIR"], "pg_ctl")
    data = os.environ["LEDGER_TEST_PGDATA"]
    command = [pg_ctl, "-D", data, "-l", os.path.join(data, "server.log"), "-w", "-m", "fast", "restart"]
    if os.geteuid() == 0:
        command = ["sudo", "-u", "postgres", *command]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


def listening(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN ledger_outbox'").fetchone()
    return row is not None and row[0] == 1


def test_the_worker_and_the_consumer_survive_a_server_restart(dsn: str, ledger: Ledger) -> None:
    delivered: list[tuple[str, str | None]] = []

    def agent(ctx: RunContext) -> str:
        return ctx.step("answer", "llm", lambda: "after the restart")

    def handler(event: OutboxEvent) -> None:
        delivered.append((event.event_type, event.run_id))

    stopping = threading.Event()  # one stop for both
    worker = Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1", idle_s=0.1, stopping=stopping)
    consumer = OutboxConsumer(ledger, handler, lease_owner="sync", scope=SCOPE, wait_s=2.0, stopping=stopping)
    threads = [threading.Thread(target=worker.run), threading.Thread(target=consumer.run)]
    for t in threads:
        t.start()
    try:
        wait_for("the consumer's LISTEN", lambda: listening(dsn))
        restart_server()
        ledger.scoped(*SCOPE).create_run("agent", run_id="r-after")
        wait_for("the run's end to be delivered", lambda: ("run.status.updated", "r-after") in delivered, 60)
    finally:
        stopping.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert delivered == [("run.created", "r-after"), ("run.status.updated", "r-after")]
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        conn.execute("SELECT ledger.set_scope(%s, %s)", SCOPE)
        row = conn.execute("SELECT status, output_summary FROM ledger.runs WHERE id = 'r-after'").fetchone()
    assert row == {"status": "succeeded", "output_summary": "after the restart"}


def test_a_completion_survives_a_restart_while_the_tool_runs(pooled: Ledger) -> None:
    ledger = pooled.scoped(*SCOPE)  # the pool's connections all break with the restart
    ledger.create_run("agent", run_id="r-restart")
    ledger.transition_run("r-restart", "running")

    def send(arguments: dict[str, object]) -> object:
        restart_server()  # the request went out; the connection the helper held is gone
        return {"message_id": "<7@mail>"}

    assert tool_call(ledger, "r-restart", "email", "email.send", {"to": "x@example.com"}, send) == {
        "message_id": "<7@mail>"}
    calls = ledger.execute("SELECT status, attempt FROM ledger.run_step_tool_calls")
    assert calls == [{"status": "succeeded", "attempt": 1}]
