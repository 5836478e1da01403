"""The READMEs' Python workers, run as written: the client's manual (clients/python/README.md)
shows examples/worker.py verbatim, and that example runs against a test database and leaves what
it says in the ledger; its Budgets example runs as written; the top README's short worker ("A worker")
works its run to the end."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from datetime import datetime
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
from psycopg.rows import dict_row

from conftest import assert_shows_verbatim, wait_for
from ledger_client import ScopedLedger

CLIENT = Path(__file__).resolve().parents[1]
MANUAL = CLIENT / "README.md"
TOP_README = CLIENT.parents[1] / "README.md"
EXAMPLE = CLIENT / "examples" / "worker.py"


def test_the_readme_shows_the_example_verbatim() -> None:
    assert_shows_verbatim(MANUAL, EXAMPLE)


def test_the_example_runs_and_leaves_its_runs_in_the_ledger(dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "LEDGER_DSN": dsn, "PYTHONPATH": str(CLIENT / "src")},
    )
    assert done.returncode == 0, done.stderr
    assert "person: approved 'Refund order 1042'" in done.stdout
    assert "person: rejected 'Refund order 1043'" in done.stdout
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SELECT ledger.set_scope('acme', 'examples-py')")
        runs = conn.execute("SELECT id, status, output_summary FROM ledger.runs ORDER BY queued_at, id").fetchall()
        assert [(r["status"], r["output_summary"]) for r in runs] == [
            ("succeeded", "Order 1042 is delivered."), ("succeeded", "Order 1042 was refunded: 12.50."),
            ("succeeded", "A colleague will call you about a return.")]
        for run in runs:
            assert f"{run['id']}: succeeded" in done.stdout
            ready = conn.execute("SELECT ledger.replay_ready(%s) AS r", (run["id"],)).fetchone()
            assert ready is not None and ready["r"] == {"status": "pass", "missing": []}
        calls = conn.execute("SELECT tool_ref, status, attempt, result FROM ledger.run_step_tool_calls"
                             " ORDER BY tool_ref, status, arguments->>'order'").fetchall()
        assert [(c["tool_ref"], c["status"], c["attempt"], c["result"]) for c in calls] == [
            ("crm.lookup_order", "succeeded", 1, {"order": 1042, "paid": "12.50"}),
            ("crm.lookup_order", "succeeded", 1, {"order": 1042, "paid": "12.50"}),
            ("crm.lookup_order", "succeeded", 1, {"order": 1043, "paid": "480.00"}),
            # The rejected refund was never executed: no result.
            ("payments.refund", "rejected", 0, None),
            ("payments.refund", "succeeded", 1, {"refund_id": "rf-1042", "amount": "12.50"}),
            ("shipping.track", "succeeded", 1, {"order": 1042, "status": "delivered"}),
            ("shipping.track", "succeeded", 1, {"order": 1042, "status": "delivered"}),
            ("shipping.track", "succeeded", 1, {"order": 1043, "status": "delivered"})]
        approvals = conn.execute("SELECT status, actor, note FROM ledger.approval_requests ORDER BY status").fetchall()
        assert approvals == [{"status": "approved", "actor": "lead@acme", "note": "broken on arrival"},
                             {"status": "rejected", "actor": "lead@acme", "note": "over 50.00: needs a return"}]
        costs = conn.execute("SELECT count(*) AS n, sum(amount) AS usd FROM ledger.run_cost_entries").fetchone()
        assert costs is not None and (costs["n"], str(costs["usd"])) == (5, "0.0030")


def test_the_manuals_budgets_example_runs(scoped: ScopedLedger, capsys: pytest.CaptureFixture[str]) -> None:
    section = re.search(r"^### Budgets\n(.*?)(?=^##)", MANUAL.read_text(encoding="utf-8"), re.S | re.M)
    assert section, "clients/python/README.md has no section \"Budgets\""
    (block,) = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    namespace: dict[str, Any] = {"support": scoped}
    exec(block, namespace)  # noqa: S102 - the manual's own code is what is under test
    assert "run tool_calls 1 of 1 True" in capsys.readouterr().out  # the loop's line of the run's budget
    run_id = namespace["run"].id
    calls = scoped.execute("SELECT tool_ref FROM ledger.run_step_tool_calls WHERE run_id = %s", (run_id,))
    assert calls == [{"tool_ref": "crm.lookup_order"}]  # the refund was never claimed nor executed
    run = scoped.get_run(run_id)
    assert run is not None and (run.status, run.error_code) == ("paused", "BUDGET_EXHAUSTED")
    assert [(b.unit, b.max_amount, b.exhausted) for b in scoped.budgets(run_id)] == [
        ("USD", Decimal(50), False), ("tool_calls", Decimal(2), False)]


def test_the_manuals_schedules_example_runs(scoped: ScopedLedger, capsys: pytest.CaptureFixture[str]) -> None:
    section = re.search(r"^### Schedules\n(.*?)(?=^##)", MANUAL.read_text(encoding="utf-8"), re.S | re.M)
    assert section, "clients/python/README.md has no section \"Schedules\""
    (block,) = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    exec(block, {"support": scoped})  # noqa: S102 - the manual's own code is what is under test
    next_fire, fired = capsys.readouterr().out.splitlines()
    local = datetime.fromisoformat(next_fire).astimezone(ZoneInfo("Europe/Berlin"))
    assert (local.strftime("%H:%M"), local.weekday() < 5, fired) == ("09:00", True, "0")
    assert scoped.execute("SELECT id FROM ledger.schedules") == []  # dropped at the end
    changes = scoped.execute("SELECT outcome, actor FROM ledger.audit_events WHERE gateway_type = 'schedule.set'"
                             " ORDER BY created_at, id")
    assert [(c["outcome"], c["actor"]) for c in changes] == [
        ("set", "ops@acme"), ("paused", "ops@acme"), ("resumed", "ops@acme"), ("dropped", "ops@acme")]


def test_the_top_readme_worker_works_its_run_to_the_end(dsn: str) -> None:
    text = TOP_README.read_text(encoding="utf-8")
    section = re.search(r"^## A worker\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "README.md has no section \"A worker\""
    (block,) = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    worker = subprocess.Popen(
        [sys.executable, "-c", block], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LEDGER_DSN": dsn, "PYTHONPATH": str(CLIENT / "src")},
    )
    try:
        with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
            conn.execute("SELECT ledger.set_scope('acme', 'orders')")

            def finished() -> bool:
                assert worker.poll() is None, worker.communicate()
                row = conn.execute("SELECT status FROM ledger.runs").fetchone()
                return row is not None and row["status"] in ("succeeded", "failed")

            wait_for("the README's run to finish", finished, timeout_s=60)
            worker.send_signal(signal.SIGTERM)  # the block's worker stops on SIGTERM, as it says
            _, err = worker.communicate(timeout=30)
            assert worker.returncode == 0, err
            run = conn.execute("SELECT id, status, output_summary, user_id FROM ledger.runs").fetchone()
            assert run is not None
            assert (run["status"], run["output_summary"], run["user_id"]) == (
                "succeeded", "Order 1042 is shipped.", "customer-7")
            steps = conn.execute("SELECT step_key, step_type, status FROM ledger.run_steps ORDER BY step_no").fetchall()
            assert [(s["step_key"], s["step_type"], s["status"]) for s in steps] == [
                ("plan", "llm", "succeeded"), ("lookup", "tool", "succeeded")]
            calls = conn.execute("SELECT tool_ref, status, attempt FROM ledger.run_step_tool_calls").fetchall()
            assert [(c["tool_ref"], c["status"], c["attempt"]) for c in calls] == [("crm.lookup_order", "succeeded", 1)]
            shown = conn.execute("SELECT event_type, payload FROM ledger.response_events").fetchall()
            assert shown == [{"event_type": "message", "payload": {"text": "Order 1042 is shipped."}}]
            costs = conn.execute("SELECT billed_quantity FROM ledger.run_cost_entries").fetchall()
            assert [str(c["billed_quantity"]) for c in costs] == ["102"]
            ready = conn.execute("SELECT ledger.replay_ready(%s) AS r", (run["id"],)).fetchone()
            assert ready is not None and ready["r"] == {"status": "pass", "missing": []}
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
