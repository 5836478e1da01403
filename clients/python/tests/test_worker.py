"""The worker loop against the real extension: a worker process killed mid-call and taken over, an
approval round trip, graceful shutdown (SIGTERM, and a release at the grace deadline), failures, and
what wakes an idle worker (a notification, next_wake, a stop)."""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import SCOPE, one, wait_for
from psycopg.rows import DictRow
from support_agent import count, lookup_order, refund, support_agent

from ledger_client import (
    ChildRun,
    ChildrenTimedOut,
    ConflictError,
    InDoubt,
    InputTimedOut,
    Ledger,
    ModelReply,
    RunContext,
    RunStatus,
    ScopedLedger,
    ScopeError,
    WaitingForChildren,
    WaitingForInput,
    WaitingUntil,
    Worker,
    WrongStateError,
)

HERE = Path(__file__).parent


@pytest.fixture
def effects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EFFECTS_DIR", str(tmp_path))
    return tmp_path


@contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    """The worker's loop in a thread, stopped and joined at the end."""
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive(), "the worker did not stop"


def status(person: psycopg.Connection[DictRow], run_id: str) -> str:
    value: str = one(person, "SELECT status FROM ledger.runs WHERE id = %s", (run_id,))
    return value


def spawn(dsn: str, owner: str, effects: Path, lookup_seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "support_agent.py"), dsn, SCOPE[1], owner, str(effects)],
        env={**os.environ, "LOOKUP_SECONDS": str(lookup_seconds), "PYTHONPATH": str(HERE.parent / "src")},
    )


def test_a_killed_worker_is_taken_over_parked_in_doubt_and_finished_after_a_person_decides(
    dsn: str, ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path
) -> None:
    scoped.create_run("agent", {"order": 7}, run_id="r-killed")
    first = spawn(dsn, "worker-1", effects, lookup_seconds=600)
    try:
        wait_for("the lookup's request", lambda: count(effects, "lookup") == 1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # Its leases would run out in a minute; the test ends them now instead of waiting.
    person.execute("UPDATE ledger.runs SET lease_expires_at = now() WHERE id = 'r-killed'")
    person.execute("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() WHERE run_id = 'r-killed'")

    with running(Worker(ledger, support_agent, scope=SCOPE, lease_owner="worker-2", idle_s=0.05)):
        wait_for("the run parked in doubt", lambda: status(person, "r-killed") == "paused")
        doubt = person.execute("SELECT id, lease_owner FROM ledger.tool_calls_in_doubt").fetchall()
        assert [d["lease_owner"] for d in doubt] == ["worker-1"]
        run = person.execute("SELECT lease_owner, run_token FROM ledger.runs WHERE id = 'r-killed'").fetchone()
        assert run == {"lease_owner": None, "run_token": 2}  # taken over (token 2), then released
        scoped.resolve_tool_call(doubt[0]["id"], "succeeded", {"order": 7, "paid": "12.50"},
                                 actor="ops@acme", note="seen in the CRM")
        wait_for("the run to finish", lambda: status(person, "r-killed") in ("succeeded", "failed"))
    assert status(person, "r-killed") == "succeeded"
    assert {n: count(effects, n) for n in ("model-plan", "lookup", "model-answer")} == {
        "model-plan": 1, "lookup": 1, "model-answer": 1}
    assert scoped.replay_ready("r-killed").ready
    said = scoped.execute("SELECT payload FROM ledger.response_events WHERE run_id = 'r-killed'")
    assert said == [{"payload": {"text": "Order 7 was paid 12.50."}}]


def test_an_approval_round_trip(
    pooled: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path
) -> None:
    scoped.create_run("agent", {"order": 8, "refund": True}, run_id="r-refund")
    with running(Worker(pooled, support_agent, scope=SCOPE, lease_owner="worker-1", idle_s=0.05)):
        wait_for("the run parked for approval", lambda: status(person, "r-refund") == "waiting_approval")
        pending = person.execute("SELECT id, title FROM ledger.pending_approvals").fetchall()
        assert [p["title"] for p in pending] == ["Refund order 8"] and count(effects, "refund") == 0
        assert one(person, "SELECT lease_owner FROM ledger.runs WHERE id = 'r-refund'") is None  # released
        scoped.resolve_approval(pending[0]["id"], "approved", actor="lead@acme", note="paid twice")
        wait_for("the run to finish", lambda: status(person, "r-refund") in ("succeeded", "failed"))
    assert status(person, "r-refund") == "succeeded"
    assert {n: count(effects, n) for n in ("model-plan", "lookup", "refund", "model-answer")} == {
        "model-plan": 1, "lookup": 1, "refund": 1, "model-answer": 1}
    assert scoped.replay_ready("r-refund").ready


def test_a_call_another_attempt_holds_keeps_the_run_until_that_attempt_ends(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path
) -> None:
    scoped.create_run("agent", {"order": 9}, run_id="r-busy")
    # Someone else's attempt at the lookup is out (a previous owner, still at work).
    held = scoped.claim_tool_call("r-busy", "crm.lookup_order", {"order": 9}, tool_call_id="lookup",
                                  lease_owner="worker-0", timeout_seconds=600).tool_call
    assert held is not None
    scoped.begin_tool_call(held.id, held.attempt)
    with running(Worker(ledger, support_agent, scope=SCOPE, lease_owner="worker-1", idle_s=0.05)):
        wait_for("the worker's first try", lambda: count(effects, "model-plan") == 1)
        time.sleep(0.5)  # time for several more tries
        row = person.execute("SELECT status, lease_owner FROM ledger.runs WHERE id = 'r-busy'").fetchone()
        assert row == {"status": "running", "lease_owner": "worker-1"}  # kept, not parked
        scoped.complete_tool_call(held.id, held.attempt, "succeeded", {"order": 9, "paid": "3.00"})
        wait_for("the run to finish", lambda: status(person, "r-busy") in ("succeeded", "failed"))
    assert status(person, "r-busy") == "succeeded" and count(effects, "lookup") == 0
    said = scoped.execute("SELECT payload FROM ledger.response_events WHERE run_id = 'r-busy'")
    assert said == [{"payload": {"text": "Order 9 was paid 3.00."}}]
    claims = one(person, "SELECT count(*) FROM ledger.run_events WHERE run_id = 'r-busy' AND event_type = 'run.claimed'")
    assert claims == 1  # held all along: no churn through the claim queue


def test_sigterm_lets_the_current_run_finish_and_claims_no_more(
    dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path
) -> None:
    scoped.create_run("agent", {"order": 1}, run_id="r-current")
    worker = spawn(dsn, "worker-1", effects, lookup_seconds=2.0)
    try:
        wait_for("the lookup's request", lambda: count(effects, "lookup") == 1)
        scoped.create_run("agent", {"order": 2}, run_id="r-next")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    finally:
        worker.kill()
    assert status(person, "r-current") == "succeeded"
    waiting = person.execute("SELECT status, run_token FROM ledger.runs WHERE id = 'r-next'").fetchone()
    assert waiting == {"status": "queued", "run_token": 0}  # never claimed


def test_at_the_grace_deadline_the_run_is_released(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", run_id="r-stuck")
    started, unblock = threading.Event(), threading.Event()

    def stuck_agent(ctx: RunContext) -> str:
        started.set()
        unblock.wait(60)
        ctx.ledger.create_step(ctx.run_id, "llm", step_key="too-late", run_token=ctx.run_token)
        return "never recorded"

    worker = Worker(ledger, stuck_agent, scope=SCOPE, lease_owner="worker-1", shutdown_grace_s=0.3, idle_s=0.05)
    try:
        with running(worker):
            assert started.wait(30)
        row = person.execute("SELECT status, lease_owner, run_token FROM ledger.runs WHERE id = 'r-stuck'").fetchone()
        assert row == {"status": "running", "lease_owner": None, "run_token": 1}
        taken = scoped.claim_run("worker-2")
        assert taken is not None and taken.run_id == "r-stuck" and not taken.takeover  # released, claimable
    finally:
        unblock.set()
    # The abandoned agent's write carried the old token: refused, nothing written.
    wait_for("the abandoned agent", lambda: all(t.name != "agent r-stuck" for t in threading.enumerate()))
    assert one(person, "SELECT count(*) FROM ledger.run_steps WHERE run_id = 'r-stuck'") == 0


def test_an_agent_exception_fails_the_run_and_a_stopped_call_parks_it(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", {"fail": True}, run_id="r-error")
    scoped.create_run("agent", {"fail": False}, run_id="r-doubt")

    def agent(ctx: RunContext) -> str:
        if ctx.inputs["fail"]:
            raise ValueError("the model answered nonsense")
        raise InDoubt("a call nobody can vouch for")

    worker = Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1")
    assert worker.run_once() and worker.run_once()
    failed = scoped.get_run("r-error")
    assert failed is not None and failed.status == "failed"
    assert (failed.error_code, failed.error_message) == ("ValueError", "the model answered nonsense")
    assert status(person, "r-doubt") == "paused"


def test_a_used_up_budget_parks_the_run_until_a_person_raises_it(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    done: list[str] = []

    def model(text: str) -> Callable[[], ModelReply]:
        def call_model() -> ModelReply:
            done.append(text)
            return ModelReply(text, {"total_tokens": 40})
        return call_model

    def lookup(arguments: dict[str, Any]) -> Any:
        done.append("lookup")
        return {"paid": "3.00"}

    def agent(ctx: RunContext) -> str:
        ctx.llm_step("plan", model("plan"))
        found = ctx.tool_call("lookup", "crm.lookup_order", {"order": 5}, lookup)
        return ctx.llm_step("answer", model(f"paid {found['paid']}"))

    def run() -> dict[str, Any]:
        row = person.execute("SELECT status, error_code, lease_owner FROM ledger.runs WHERE id = 'r-budget'").fetchone()
        assert row is not None
        return row

    scoped.create_run("agent", run_id="r-budget")
    scoped.set_budget("llm_steps", 1, level="run", run_id="r-budget")
    scoped.set_budget("tool_calls", 1)
    worker = Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1")
    # The plan's step uses up the run's llm_steps: the lookup is refused, and not executed.
    assert worker.run_once() and done == ["plan"]
    assert run() == {"status": "paused", "error_code": "BUDGET_EXHAUSTED", "lease_owner": None}  # parked, released
    assert not worker.run_once()  # not claimable while the budget is used up
    scoped.set_budget("llm_steps", 3, level="run", run_id="r-budget", actor="lead@acme", note="go on")
    # The lookup uses up the workspace's tool_calls: the answer's llm step is refused, the model not called.
    assert worker.run_once() and done == ["plan", "lookup"]
    assert run() == {"status": "paused", "error_code": "BUDGET_EXHAUSTED", "lease_owner": None}
    step = person.execute("SELECT status, error_code FROM ledger.run_steps WHERE step_key = 'answer'").fetchone()
    assert step == {"status": "paused", "error_code": "BUDGET_EXHAUSTED"}
    scoped.set_budget("tool_calls", 5, actor="lead@acme")
    assert worker.run_once() and done == ["plan", "lookup", "paid 3.00"]
    assert run()["status"] == "succeeded"
    refusals = person.execute("SELECT payload->>'decision' AS decision FROM ledger.run_events"
                              " WHERE run_id = 'r-budget' AND event_type = 'budget.exhausted' ORDER BY seq").fetchall()
    assert [r["decision"] for r in refusals] == ["tool_call", "llm_step"]


def test_a_worker_of_every_scope_and_a_login_role_that_is_no_operator(
    dsn: str, ledger: Ledger, person: psycopg.Connection[DictRow]
) -> None:
    ledger.scoped("acme", "support").create_run("agent", run_id="r-acme")
    ledger.scoped("globex", "billing").create_run("agent", run_id="r-globex")

    def agent(ctx: RunContext) -> str:
        return f"served in {ctx.ledger.tenant_id}/{ctx.ledger.workspace_id}"

    worker = Worker(ledger, agent, lease_owner="pool-1")  # no scope: claim_run(any_scope => true)
    assert worker.run_once() and worker.run_once() and not worker.run_once()
    ended = person.execute("SELECT id, status, output_summary FROM ledger.runs ORDER BY id").fetchall()
    assert ended == [{"id": "r-acme", "status": "succeeded", "output_summary": "served in acme/support"},
                     {"id": "r-globex", "status": "succeeded", "output_summary": "served in globex/billing"}]
    person.execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'ledger_py_app') THEN"
                   " CREATE ROLE ledger_py_app LOGIN IN ROLE ledger_writer; END IF; END $$")
    app = Ledger(dsn.replace("user=postgres", "user=ledger_py_app"))
    with pytest.raises(ScopeError) as refused:
        Worker(app, agent).run_once()
    assert (refused.value.sqlstate, refused.value.code) == ("42501", "OPERATOR_REQUIRED")


def test_three_retries_and_a_replay_make_each_side_effect_once(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow], effects: Path
) -> None:
    scoped.create_run("agent", {"order": 3}, run_id="r-first")

    def agent(ctx: RunContext) -> str:
        # The same agent every time, no key of its own: the ledger answers a re-run's calls
        # from the record its lineage holds.
        found = ctx.tool_call("lookup", "crm.lookup_order", {"order": ctx.inputs["order"]}, lookup_order)
        if ctx.run.attempt_no >= 2:
            ctx.tool_call("refund", "payments.refund", {"amount": found["paid"]}, refund)
        if ctx.run.attempt_no < 4:
            raise RuntimeError("the model timed out")
        return f"refunded {found['paid']}"

    worker = Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1")
    assert worker.run_once() and status(person, "r-first") == "failed"
    runs = ["r-first"]
    for _ in range(3):
        retry = scoped.retry_run(runs[-1])
        assert (retry.source_run_id, retry.status) == (runs[-1], "queued")
        assert worker.run_once()
        runs.append(retry.id)
    assert [status(person, run) for run in runs] == ["failed", "failed", "failed", "succeeded"]
    replay = scoped.replay_run(runs[-1])
    assert worker.run_once() and status(person, replay.id) == "succeeded"
    assert (count(effects, "lookup"), count(effects, "refund")) == (1, 1)  # once across five runs
    reused = scoped.replay_bundle(replay.id)["reused_tool_calls"]
    assert sorted(r["source_run_id"] for r in reused) == sorted(["r-first", runs[1]])


def test_an_agent_that_waits_until_a_time_is_parked_and_resumed_by_a_later_claim(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", {"order": 4}, run_id="r-wait")
    turns: list[datetime] = []

    def agent(ctx: RunContext) -> str:
        asked = datetime.now(timezone.utc) + timedelta(seconds=1)  # another time on every turn
        turns.append(asked)
        woke = ctx.wait_until("follow-up", asked)
        return f"followed up on order {ctx.inputs['order']} at {woke.isoformat()}"

    def run() -> dict[str, Any]:
        row = person.execute("SELECT status, lease_owner, run_token, not_before FROM ledger.runs WHERE id = 'r-wait'").fetchone()
        assert row is not None
        return row

    worker = Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1")
    assert worker.run_once() and len(turns) == 1
    # Parked by wait_run, lease given up (nothing released or moved after it), until the step's time.
    assert run() == {"status": "waiting_input", "lease_owner": None, "run_token": 1, "not_before": turns[0]}
    step = person.execute("SELECT step_type, status, input_summary FROM ledger.run_steps WHERE run_id = 'r-wait'").fetchone()
    assert step == {"step_type": "wait", "status": "waiting_input", "input_summary": turns[0].isoformat()}
    assert not worker.run_once() and len(turns) == 1  # not claimable before the wake time

    wait_for("a claim after the wake time", worker.run_once)  # the next worker's claim resumes it
    assert len(turns) == 2 and turns[1] > turns[0]
    ended = person.execute("SELECT status, run_token, output_summary FROM ledger.runs WHERE id = 'r-wait'").fetchone()
    assert ended == {"status": "succeeded", "run_token": 2,  # the first wake time, not the resume's
                     "output_summary": f"followed up on order 4 at {turns[0].isoformat()}"}
    moves = person.execute("SELECT payload->>'from' AS f, payload->>'to' AS t FROM ledger.run_events"
                           " WHERE run_id = 'r-wait' AND event_type = 'run.status' ORDER BY seq").fetchall()
    assert [(m["f"], m["t"]) for m in moves] == [
        ("queued", "running"), ("running", "waiting_input"), ("waiting_input", "running"), ("running", "succeeded")]
    assert one(person, "SELECT status FROM ledger.run_steps WHERE run_id = 'r-wait'") == "succeeded"

    # Outside a worker the agent's turn ends with the exception; a naive time is refused.
    scoped.create_run("agent", run_id="r-alone")
    claimed = scoped.claim_run("worker-2", run_id="r-alone")
    assert claimed is not None
    ctx = RunContext(scoped, claimed)
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    with pytest.raises(WaitingUntil) as waiting:
        ctx.wait_until("tomorrow", later)
    assert (waiting.value.step_key, waiting.value.wake_at) == ("tomorrow", later)
    with pytest.raises(ValueError):
        ctx.wait_until("naive", datetime.now())


def test_an_agent_that_waits_for_an_input_is_parked_until_it_is_sent_and_reads_it_on_every_resume(
    dsn: str, ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", {"order": 5}, run_id="r-ask")
    asked: list[datetime] = []
    answers: list[Any] = []

    def agent(ctx: RunContext) -> str:
        ctx.step("ask", "message", lambda: "asked the customer")
        asked.append(datetime.now(timezone.utc))  # the timeout counts from here on every turn
        answer = ctx.wait_for_input("refund-ok", "refund-ok", timeout=timedelta(hours=1))
        answers.append(answer)
        ctx.wait_until("cool-off", datetime.now(timezone.utc) + timedelta(seconds=0.5))
        return f"refund {answer['answer']}"

    def run() -> dict[str, Any]:
        row = person.execute("SELECT status, lease_owner, run_token FROM ledger.runs WHERE id = 'r-ask'").fetchone()
        assert row is not None
        return row

    worker = Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1")
    assert worker.run_once() and len(asked) == 1 and answers == []
    # Parked by the wait itself, its lease given up; the step records the first turn's deadline.
    assert run() == {"status": "waiting_input", "lease_owner": None, "run_token": 1}
    step = person.execute("SELECT status, input_summary FROM ledger.run_steps WHERE step_key = 'refund-ok'").fetchone()
    assert step is not None and step["status"] == "waiting_input"
    deadline = datetime.fromisoformat(step["input_summary"])
    assert abs(asked[0] + timedelta(hours=1) - deadline) < timedelta(seconds=1)
    assert one(person, "SELECT wait_deadline FROM ledger.run_mailbox WHERE input_key = 'refund-ok'") == deadline
    assert not worker.run_once() and not worker.run_once()  # not claimable while it waits

    # Someone answers through another connection: the run is claimable at once and resumed.
    Ledger(dsn).scoped(*SCOPE).send_input("r-ask", "refund-ok", {"answer": "yes"}, sender="lead@acme")
    assert worker.run_once() and answers == [{"answer": "yes"}]
    assert run() == {"status": "waiting_input", "lease_owner": None, "run_token": 2}  # now the cool-off
    wait_for("a claim after the cool-off", worker.run_once)
    # The third turn read the same input again without waiting (the step had succeeded).
    assert answers == [{"answer": "yes"}] * 2 and len(asked) == 3
    ended = person.execute("SELECT status, run_token, output_summary FROM ledger.runs WHERE id = 'r-ask'").fetchone()
    assert ended == {"status": "succeeded", "run_token": 3, "output_summary": "refund yes"}
    steps = person.execute("SELECT step_key, status, input_summary FROM ledger.run_steps WHERE run_id = 'r-ask'"
                           " AND step_type = 'wait' ORDER BY step_no").fetchall()
    assert [(s["step_key"], s["status"]) for s in steps] == [("refund-ok", "succeeded"), ("cool-off", "succeeded")]
    assert steps[0]["input_summary"] == deadline.isoformat()  # the later turns' deadlines did not move it
    moves = person.execute("SELECT payload->>'from' AS f, payload->>'to' AS t FROM ledger.run_events"
                           " WHERE run_id = 'r-ask' AND event_type = 'run.status' ORDER BY seq").fetchall()
    assert [(m["f"], m["t"]) for m in moves] == [
        ("queued", "running"), ("running", "waiting_input"), ("waiting_input", "running"),
        ("running", "waiting_input"), ("waiting_input", "running"), ("running", "succeeded")]


def test_a_wait_for_an_input_without_a_deadline_parks_the_run_until_infinity_and_is_read(
    dsn: str, pooled: Ledger, person: psycopg.Connection[DictRow]
) -> None:
    scoped = pooled.scoped(*SCOPE)  # a pool's connections: the client's cursors load 'infinity' on them too
    scoped.create_run("agent", run_id="r-open")

    def agent(ctx: RunContext) -> str:
        return f"answer {ctx.wait_for_input('ask', 'answer')['n']}"

    worker = Worker(pooled, agent, scope=SCOPE, lease_owner="worker-1")
    assert worker.run_once()
    assert one(person, "SELECT not_before::text FROM ledger.runs WHERE id = 'r-open'") == "infinity"
    parked = scoped.get_run("r-open")
    assert parked is not None and parked.status is RunStatus.WAITING_INPUT
    assert parked.not_before == datetime.max.replace(tzinfo=timezone.utc)
    assert not worker.run_once()  # nothing but the input wakes it
    Ledger(dsn).scoped(*SCOPE).send_input("r-open", "answer", {"n": 7})
    assert worker.run_once()
    ended = scoped.get_run("r-open")
    assert ended is not None and (ended.status, ended.output_summary) == (RunStatus.SUCCEEDED, "answer 7")


def test_a_wait_for_an_input_that_does_not_come_times_out_at_its_first_deadline(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("agent", run_id="r-silent")
    deadlines: list[datetime | None] = []

    def agent(ctx: RunContext) -> str:
        try:
            ctx.wait_for_input("confirm", "confirmed", timeout=timedelta(seconds=1))  # another deadline each turn
        except InputTimedOut as late:
            deadlines.append(late.deadline)
            return "no answer: closed"
        return "confirmed"

    worker = Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1")
    assert worker.run_once() and deadlines == []
    parked = person.execute("SELECT status, not_before FROM ledger.runs WHERE id = 'r-silent'").fetchone()
    assert parked is not None and parked["status"] == "waiting_input"
    wait_for("a claim at the deadline", worker.run_once)
    assert deadlines == [parked["not_before"]]  # the resume asked with the first deadline: timed out
    ended = person.execute("SELECT status, output_summary, run_token FROM ledger.runs WHERE id = 'r-silent'").fetchone()
    assert ended == {"status": "succeeded", "output_summary": "no answer: closed", "run_token": 2}
    assert one(person, "SELECT status FROM ledger.run_steps WHERE step_key = 'confirm'") == "expired"
    # Too late now: the run has ended.
    with pytest.raises(WrongStateError) as closed:
        scoped.send_input("r-silent", "confirmed", {"ok": True})
    assert closed.value.code == "RUN_TERMINAL"

    # Outside a worker: the wait parks the run (its token is over) and raises; its arguments are checked.
    scoped.create_run("agent", run_id="r-alone")
    claimed = scoped.claim_run("worker-2", run_id="r-alone")
    assert claimed is not None
    scoped.transition_run("r-alone", "running", run_token=claimed.run_token)
    ctx = RunContext(scoped, claimed)
    later = datetime.now(timezone.utc) + timedelta(days=1)
    with pytest.raises(WaitingForInput) as waiting:
        ctx.wait_for_input("ask", "form", deadline=later)
    assert (waiting.value.step_key, waiting.value.input_key, waiting.value.deadline) == ("ask", "form", later)
    with pytest.raises(ConflictError) as over:
        scoped.heartbeat_run("r-alone", claimed.run_token)
    assert over.value.code == "LEASE_STALE"
    with pytest.raises(ValueError):
        ctx.wait_for_input("both", "form", deadline=later, timeout=timedelta(hours=1))
    with pytest.raises(ValueError):
        ctx.wait_for_children("naive", deadline=datetime.now())
    with pytest.raises(ValueError):
        ctx.wait_for_children("zero", timeout=timedelta(0))


def test_a_parent_waits_for_its_two_children_and_resumes_with_their_outcomes(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.create_run("parent", {"orders": [1, 2]}, run_id="r-parent")
    turns: list[int] = []

    def agent(ctx: RunContext) -> str:
        if ctx.run.mode == "child":
            if ctx.inputs["order"] == 2:
                raise RuntimeError("the carrier is down")
            return f"label for order {ctx.inputs['order']}"
        turns.append(ctx.run_token)
        for order in ctx.inputs["orders"]:  # found again by run_id on a resume
            ctx.ledger.create_run("child", {"order": order}, run_id=f"r-child-{order}", parent_run_id=ctx.run_id)
        children = ctx.wait_for_children("labels")
        return "; ".join(f"{c.run_id} {c.status}: {c.output_summary or c.error_message}" for c in children)

    def status(run_id: str) -> str:
        value: str = one(person, "SELECT status FROM ledger.runs WHERE id = %s", (run_id,))
        return value

    worker = Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1")
    assert worker.run_once() and turns == [1] and status("r-parent") == "waiting_input"
    assert worker.run_once() and status("r-child-1") == "succeeded"  # the worker drives the children too
    assert scoped.claim_run("probe", run_id="r-parent") is None  # one child still runs
    assert worker.run_once() and status("r-child-2") == "failed"
    assert worker.run_once() and turns == [1, 2]  # the last end woke the parent
    assert not worker.run_once()
    ended = person.execute("SELECT status, output_summary FROM ledger.runs WHERE id = 'r-parent'").fetchone()
    assert ended == {"status": "succeeded", "output_summary":
                     "r-child-1 succeeded: label for order 1; r-child-2 failed: the carrier is down"}
    step = person.execute("SELECT status, metrics FROM ledger.run_steps WHERE step_key = 'labels'").fetchone()
    assert step is not None and step["status"] == "succeeded"
    assert [(c["run_id"], c["status"], c["error_code"]) for c in step["metrics"]["children"]] == [
        ("r-child-1", "succeeded", None), ("r-child-2", "failed", "RuntimeError")]

    # A deadline that passes first: the step expires with the children as they stood, and a resume
    # raises again from the step (not asking the ledger, whose answer changed); a wait that ended
    # keeps its children's outcomes the same way.
    scoped.create_run("parent", run_id="r-late")
    claimed = scoped.claim_run("worker-2", run_id="r-late")
    assert claimed is not None
    scoped.transition_run("r-late", "running", run_token=claimed.run_token)
    scoped.create_run("child", run_id="r-slow", parent_run_id="r-late")
    ctx = RunContext(scoped, claimed)
    past = datetime.now(timezone.utc) - timedelta(seconds=1)
    stood = (ChildRun("r-slow", RunStatus.QUEUED, None, None, None),)
    with pytest.raises(ChildrenTimedOut) as late:
        ctx.wait_for_children("slow", deadline=past)
    assert (late.value.deadline, late.value.children) == (past, stood)
    scoped.transition_run("r-slow", "canceled", error_message="too slow")
    with pytest.raises(ChildrenTimedOut) as again:
        ctx.wait_for_children("slow", deadline=past)
    assert again.value.children == stood
    assert one(person, "SELECT status FROM ledger.run_steps WHERE step_key = 'slow'") == "expired"
    outcomes = ctx.wait_for_children("ended")
    assert outcomes == (ChildRun("r-slow", RunStatus.CANCELED, None, None, "too slow"),)
    scoped.create_run("child", run_id="r-next", parent_run_id="r-late")
    assert ctx.wait_for_children("ended") == outcomes  # the recorded outcomes: r-next is another wait's
    with pytest.raises(WaitingForChildren) as waiting:
        ctx.wait_for_children("next")
    assert [c.run_id for c in waiting.value.children] == ["r-slow", "r-next"]


def test_a_worker_fires_the_due_schedules_when_asked_to(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    scoped.set_schedule("nightly", "30 1 * * *", "digest", {"team": "support"})
    person.execute("UPDATE ledger.schedules SET next_fire_at = now() - interval '1 minute'")  # the night came

    def agent(ctx: RunContext) -> str:
        return f"digest for {ctx.inputs['team']}"

    assert not Worker(ledger, agent, scope=SCOPE).run_once()  # by default a worker fires nothing
    with pytest.raises(ValueError):
        Worker(ledger, agent, scope=SCOPE, fire_schedules_s=0)
    # A worker of every scope fires every scope's schedules (fire_schedules(any_scope => true)).
    worker = Worker(ledger, agent, lease_owner="worker-1", fire_schedules_s=60)
    assert worker.run_once()
    run = person.execute("SELECT request_id, status, output_summary FROM ledger.runs").fetchone()
    assert run is not None and run["request_id"].startswith("schedule:nightly:")
    assert (run["status"], run["output_summary"]) == ("succeeded", "digest for support")
    # Not before fire_schedules_s has passed: a firing due now waits for the next sweep.
    person.execute("UPDATE ledger.schedules SET next_fire_at = now() - interval '1 minute'")
    assert not worker.run_once()


def test_an_idle_worker_is_woken_by_a_new_run_not_by_its_idle_bound(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    claimed: dict[str, float] = {}

    def agent(ctx: RunContext) -> str:
        claimed[ctx.run_id] = time.monotonic()
        return "done"

    with running(Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1", idle_s=60)):
        time.sleep(0.5)  # its first claim found nothing: it sleeps
        created = time.monotonic()
        scoped.create_run("agent", run_id="r-new")  # another connection's commit notifies ledger_runs
        wait_for("the new run's claim", lambda: "r-new" in claimed)
        assert claimed["r-new"] - created < 5  # woken, not polled after 60 s
        # Idle again after the run: the next one wakes it too.
        time.sleep(0.5)
        created = time.monotonic()
        scoped.create_run("agent", run_id="r-next")
        wait_for("the next run's claim", lambda: "r-next" in claimed)
        assert claimed["r-next"] - created < 5


def test_an_idle_worker_sleeps_until_next_wake_not_its_idle_bound(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    claimed: dict[str, datetime] = {}

    def agent(ctx: RunContext) -> str:
        claimed[ctx.run_id] = datetime.now(timezone.utc)
        return "done"

    # Parked before the worker starts, so that no notification can tell it: only next_wake does.
    scoped.create_run("agent", run_id="r-later")
    parking = scoped.claim_run("someone", run_id="r-later")
    assert parking is not None
    scoped.transition_run("r-later", RunStatus.RUNNING, run_token=parking.run_token)
    wake_at = datetime.now(timezone.utc) + timedelta(seconds=2)
    scoped.wait_run("r-later", parking.run_token, wake_at)
    assert scoped.next_wake() == wake_at
    # A worker of every scope: next_wake(any_scope => true).
    with running(Worker(ledger, agent, lease_owner="worker-1", idle_s=60)):
        wait_for("the claim at the wake time", lambda: "r-later" in claimed)
    assert wake_at <= claimed["r-later"] < wake_at + timedelta(seconds=5)


def test_stop_ends_an_idle_worker_promptly(ledger: Ledger) -> None:
    worker = Worker(ledger, lambda ctx: "done", scope=SCOPE, lease_owner="worker-1", idle_s=60)
    thread = threading.Thread(target=worker.run)
    thread.start()
    time.sleep(0.5)  # its first claim found nothing: it sleeps
    asked = time.monotonic()
    worker.stop()
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - asked < 5


def test_an_idle_worker_listens_again_after_its_connection_is_lost(
    ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]
) -> None:
    claimed: list[str] = []

    def agent(ctx: RunContext) -> str:
        claimed.append(ctx.run_id)
        return "done"

    def listening() -> list[int]:
        rows = person.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                              " AND query LIKE '%ledger.next_wake(any_scope%' AND pid <> pg_backend_pid()").fetchall()
        return [r["pid"] for r in rows]

    with running(Worker(ledger, agent, scope=SCOPE, lease_owner="worker-1", idle_s=60)):
        wait_for("the worker's listening connection", lambda: len(listening()) == 1)
        [lost] = listening()
        person.execute("SELECT pg_terminate_backend(%s)", (lost,))
        wait_for("a new listening connection", lambda: listening() not in ([], [lost]))
        created = time.monotonic()
        scoped.create_run("agent", run_id="r-after")
        wait_for("the run's claim", lambda: claimed == ["r-after"])
        assert time.monotonic() - created < 5
