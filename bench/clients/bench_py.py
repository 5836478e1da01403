"""One durable no-op tool call through the Python helper's tool_call on a pooled scoped handle,
against raw psycopg on one autocommit connection that stated its scope once: the three statements
(claim, begin, complete: three commits) and the two the helper sends (claim_tool_calls with
begin, complete: two commits). Alternating blocks, so drift hits every way alike; and the three
calls through the scoped handle's methods (no helper around them). Prints a line per way
(python: the helper, python-handle: the methods), each with its p50 ms and calls/s, then raw's
three-statement and two-statement figures. Then the repeatable path (a tool safe to repeat):
the helper's tool_call(..., repeatable=True) and its raw statements (find_tool_call, then
record_tool_call: two round trips, one commit), beside the side-effecting helper, with the WAL
each way writes per call."""

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from ledger_client import Ledger, tool_call

SCOPE = ("bench", "clients")


def noop(arguments: dict[str, Any]) -> dict[str, Any]:
    return {"ok": True}


def raw_tool_call(raw: psycopg.Connection[Any], run_id: str, n: int) -> None:
    """Call n of the run as the three statements claim, begin, complete (three commits) on an
    autocommit connection that stated its scope (bench/peers' raw design too)."""
    claim = raw.execute("SELECT ledger.claim_tool_call(%s, %s, %s, tool_call_id => %s)",
                        (run_id, "bench.noop", Jsonb({"n": n}), f"c-{n}")).fetchone()
    assert claim is not None
    record = claim[0]["tool_call"]
    raw.execute("SELECT ledger.begin_tool_call(%s, %s)", (record["id"], record["attempt"]))
    raw.execute("SELECT ledger.complete_tool_call(%s, %s, 'succeeded', result => %s)",
                (record["id"], record["attempt"], Jsonb(noop({"n": n}))))


def main(dsn: str, calls: int, blocks: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as raw, ConnectionPool(dsn, min_size=1, max_size=1, open=True) as pool:
        raw.execute("SELECT ledger.set_scope(%s, %s)", SCOPE)
        stamp = time.time_ns()
        helper_run, raw_run = f"h-{stamp}", f"r-{stamp}"
        raw.execute("SELECT ledger.create_run('agent', run_id => %s)", (helper_run,))
        raw.execute("SELECT ledger.create_run('agent', run_id => %s)", (raw_run,))
        scoped = Ledger(pool).scoped(*SCOPE)
        n = 0

        def helper() -> None:
            tool_call(scoped, helper_run, f"c-{n}", "bench.noop", {"n": n}, noop)

        def handle() -> None:
            claim = scoped.claim_tool_call(helper_run, "bench.noop", {"n": n}, tool_call_id=f"c-{n}")
            assert claim.tool_call is not None
            record = claim.tool_call
            scoped.begin_tool_call(record.id, record.attempt)
            scoped.complete_tool_call(record.id, record.attempt, "succeeded", noop({"n": n}))

        def plain() -> None:
            raw_tool_call(raw, raw_run, n)

        def plain2() -> None:
            claim = raw.execute("SELECT claim FROM ledger.claim_tool_calls(%s, %s, begin => true)",
                                (raw_run, Jsonb([{"tool_ref": "bench.noop", "arguments": {"n": n},
                                                  "tool_call_id": f"c-{n}"}]))).fetchone()
            assert claim is not None
            record = claim[0]["tool_call"]
            raw.execute("SELECT ledger.complete_tool_call(%s, %s, 'succeeded', result => %s)",
                        (record["id"], record["attempt"], Jsonb(noop({"n": n}))))

        def repeatable() -> None:
            tool_call(scoped, helper_run, f"c-{n}", "bench.noop", {"n": n}, noop, repeatable=True)

        def plain_repeatable() -> None:
            found = raw.execute("SELECT ledger.find_tool_call(%s, %s, %s, tool_call_id => %s)",
                                (raw_run, "bench.noop", Jsonb({"n": n}), f"c-{n}")).fetchone()
            assert found is not None and found[0]["outcome"] == "unrecorded"
            raw.execute("SELECT ledger.record_tool_call(%s, %s, %s, 'succeeded', %s, tool_call_id => %s)",
                        (raw_run, "bench.noop", Jsonb({"n": n}), Jsonb(noop({"n": n})), f"c-{n}"))

        ways: dict[str, Callable[[], None]] = {"helper": helper, "handle": handle, "raw": plain, "raw2": plain2,
                                               "rep": repeatable, "raw_rep": plain_repeatable}
        wal = dict.fromkeys(ways, 0)

        def lsn() -> int:
            row = raw.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
            assert row is not None
            return int(row[0])

        samples: dict[str, list[float]] = {name: [] for name in ways}
        elapsed = dict.fromkeys(ways, 0.0)
        for block in range(blocks + 1):  # block 0 warms every way up and is not counted
            if block == 1:
                raw.execute("ANALYZE")  # as autovacuum would within its minute: plans for tables that grew
            for name, way in ways.items():
                before = lsn()
                for _ in range(calls):
                    n += 1
                    start = time.perf_counter()
                    way()
                    took = time.perf_counter() - start
                    if block:
                        samples[name].append(took)
                        elapsed[name] += took
                if block:
                    wal[name] += lsn() - before
        def stats(name: str) -> list[str]:
            return [f"{statistics.median(samples[name]) * 1000:.3f}", f"{len(samples[name]) / elapsed[name]:.0f}"]

        print("\t".join(["python", *stats("helper"), *stats("raw"), *stats("raw2")]))
        print("\t".join(["python-handle", *stats("handle"), *stats("raw"), *stats("raw2")]))

        def kb(name: str) -> str:
            return f"{wal[name] / len(samples[name]) / 1024:.2f}"

        print("\t".join(["repeatable", "python", *stats("rep"), *stats("raw_rep"), *stats("helper"),
                         kb("rep"), kb("raw_rep"), kb("helper")]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
