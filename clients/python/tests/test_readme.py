"""The README's "Python client" section: its worker example is examples/worker.py verbatim, and
that example runs against a test database and leaves what it says in the ledger."""

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

CLIENT = Path(__file__).resolve().parents[1]
README = CLIENT.parents[1] / "README.md"
EXAMPLE = CLIENT / "examples" / "worker.py"


def section_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Python client\n")
    section = text[start:text.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_shows_the_example_verbatim() -> None:
    blocks = section_blocks()
    examples = [b for b in blocks if 'if __name__ == "__main__":' in b]
    assert len(examples) == 1, "the section must show examples/worker.py once, in a ```python block"
    assert examples[0] == EXAMPLE.read_text(encoding="utf-8"), "README.md and examples/worker.py differ"
    for n, block in enumerate(blocks):
        compile(block, f"README.md python block {n}", "exec")


def test_the_example_runs_and_leaves_its_runs_in_the_ledger(dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "LEDGER_DSN": dsn, "PYTHONPATH": str(CLIENT / "src")},
    )
    assert done.returncode == 0, done.stderr
    assert "person: approved 'Refund order 1042'" in done.stdout
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SELECT ledger.set_scope('acme', 'examples-py')")
        runs = conn.execute("SELECT id, status, output_summary FROM ledger.runs ORDER BY queued_at, id").fetchall()
        assert [(r["status"], r["output_summary"]) for r in runs] == [
            ("succeeded", "Order 1042 is delivered."), ("succeeded", "Order 1042 was refunded: 12.50.")]
        for run in runs:
            assert f"{run['id']}: succeeded" in done.stdout
            ready = conn.execute("SELECT ledger.replay_ready(%s) AS r", (run["id"],)).fetchone()
            assert ready is not None and ready["r"] == {"status": "pass", "missing": []}
        calls = conn.execute("SELECT tool_ref, status, attempt FROM ledger.run_step_tool_calls"
                             " ORDER BY tool_ref").fetchall()
        assert [(c["tool_ref"], c["status"], c["attempt"]) for c in calls] == [
            ("crm.lookup_order", "succeeded", 1), ("crm.lookup_order", "succeeded", 1),
            ("payments.refund", "succeeded", 1), ("shipping.track", "succeeded", 1), ("shipping.track", "succeeded", 1)]
        approval = conn.execute("SELECT status, actor FROM ledger.approval_requests").fetchall()
        assert approval == [{"status": "approved", "actor": "lead@acme"}]
        costs = conn.execute("SELECT count(*) AS n, sum(amount) AS usd FROM ledger.run_cost_entries").fetchone()
        assert costs is not None and (costs["n"], str(costs["usd"])) == (3, "0.0018")
