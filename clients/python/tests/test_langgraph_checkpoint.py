"""LedgerSaver, the ledger as LangGraph's checkpointer, against the real extension: a graph's
process SIGKILLed while its tool ran is resumed by another from the ledger's checkpoints (the
side effect ran once; the tool calls and the checkpoints are one run), the async face, the
state byte for byte while a secret in the metadata is redacted (and an EncryptedSerializer's
state is ciphertext in the tables), another scope sees nothing, the reader role reads but
cannot write, purge_runs takes a purged run's checkpoints, and a write that meets a terminated
connection is stored on a fresh one. The manual shows
examples/langgraph_checkpointer.py verbatim, and the example runs. (The upstream conformance
suite: test_langgraph_conformance.py.)"""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import SCOPE, assert_shows_verbatim, one, wait_for
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer
from langgraph.types import Command
from langgraph_support import ask, build, count, make_tools
from psycopg.rows import DictRow
from psycopg_pool import ConnectionPool

from ledger_client import AsyncLedger, Busy, Ledger, LedgerError, ScopedLedger
from ledger_client.integrations.langgraph import LedgerToolGuard, finish_run, start_run
from ledger_client.integrations.langgraph_checkpoint import LedgerSaver

CLIENT = Path(__file__).resolve().parents[1]
SUPPORT = Path(__file__).with_name("langgraph_checkpoint_support.py")
EXAMPLE = CLIENT / "examples" / "langgraph_checkpointer.py"
MANUAL = CLIENT / "docs" / "langgraph.md"
SECRET = "sk-live-0123456789abcdef"


def answer(state: dict[str, Any]) -> str:
    return str(state["messages"][-1].text)


def checkpoint_runs(person: psycopg.Connection[DictRow], thread: str) -> set[str]:
    rows = person.execute("SELECT DISTINCT run_id FROM ledger.graph_checkpoints WHERE thread_id = %s", (thread,))
    return {r["run_id"] for r in rows.fetchall()}


def test_a_killed_process_is_resumed_from_the_ledgers_checkpoints_and_the_effect_ran_once(
        dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], tmp_path: Path) -> None:
    first = subprocess.Popen([sys.executable, str(SUPPORT), dsn, str(tmp_path), "t-ckpt-kill", "req-ckpt-kill", "1042"],
                             env={**os.environ, "PYTHONPATH": str(CLIENT / "src")})
    try:
        wait_for("the refund to start", lambda: count(tmp_path, "refund") == 1)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    call = person.execute("SELECT run_id, status FROM ledger.run_step_tool_calls"
                          " WHERE tool_call_id = 'call-refund-1042'").fetchone()
    assert call is not None and call["status"] == "running"
    # The killed invocation's checkpoints (up to the model's tool call) are in the ledger, in its run.
    assert checkpoint_runs(person, "t-ckpt-kill") == {call["run_id"]}

    graph = build(LedgerToolGuard(scoped), make_tools(tmp_path), LedgerSaver(scoped))
    config = start_run(scoped, "t-ckpt-kill", "req-ckpt-kill")
    assert config["configurable"]["ledger_run_id"] == call["run_id"]
    with pytest.raises(Busy):  # resumed at the tools node from the ledger's checkpoint: the lease is live
        graph.invoke(None, config)
    person.execute("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() - interval '1 hour'")
    state = graph.invoke(None, config)
    [pause] = state["__interrupt__"]
    assert (pause.value["ledger"], pause.value["tool_call_id"]) == ("in_doubt", "call-refund-1042")
    person.execute("SELECT ledger.resolve_tool_call(%s, 'succeeded', result => '\"Refund rf-1042 sent\"',"
                   " actor => 'ops@acme')", (pause.value["tool_call_record_id"],))
    state = graph.invoke(Command(resume="resolved"), start_run(scoped, "t-ckpt-kill", "req-ckpt-kill"))
    assert answer(state) == "Done: Refund rf-1042 sent"
    assert count(tmp_path, "refund") == 1
    finish_run(scoped, config, answer(state))
    assert scoped.replay_ready(call["run_id"]).status == "pass"
    assert checkpoint_runs(person, "t-ckpt-kill") == {call["run_id"]}


def test_the_async_face_checkpoints_a_graph_in_the_run(dsn: str, person: psycopg.Connection[DictRow],
                                                       tmp_path: Path) -> None:
    aledger = AsyncLedger(dsn).scoped(*SCOPE)
    saver = LedgerSaver(aledger=aledger)
    config = start_run(Ledger(dsn).scoped(*SCOPE), "t-async", "req-async")
    graph = build(LedgerToolGuard(aledger=aledger), make_tools(tmp_path), saver)

    async def drive() -> dict[str, Any]:
        state = await graph.ainvoke(ask(("lookup", "call-lookup-1", {"order": 7})), config)
        latest = await saver.aget_tuple({"configurable": {"thread_id": "t-async"}})
        assert latest is not None and latest.checkpoint["channel_values"]["messages"] == state["messages"]
        return state

    state = asyncio.run(drive())
    assert answer(state) == "Done: Order 7 paid 12.50"
    assert checkpoint_runs(person, "t-async") == {config["configurable"]["ledger_run_id"]}


class Reverse:
    """A stand-in cipher for the test (LangGraph's CipherProtocol); use AES (the manual)."""

    def encrypt(self, plaintext: bytes) -> tuple[str, bytes]:
        return "reverse", plaintext[::-1]

    def decrypt(self, ciphername: str, ciphertext: bytes) -> bytes:
        assert ciphername == "reverse"
        return ciphertext[::-1]


def test_state_comes_back_byte_for_byte_while_a_secret_in_the_metadata_is_redacted(
        scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    for serde, thread in [(None, "t-plain"), (EncryptedSerializer(Reverse()), "t-encrypted")]:
        saver = LedgerSaver(scoped, serde=serde)
        values = {"note": f"the key is {SECRET}", "raw": b"\x00\xff\x00", "password": SECRET}
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = values
        checkpoint["channel_versions"] = {k: saver.get_next_version(None, None) for k in values}
        stored = saver.put({"configurable": {"thread_id": thread, "checkpoint_ns": ""}}, checkpoint,
                           {"source": "input", "step": -1, "api_key": SECRET, "note": f"key {SECRET}"},  # type: ignore[typeddict-unknown-key]
                           checkpoint["channel_versions"])
        got = saver.get_tuple(stored)
        assert got is not None and got.checkpoint["channel_values"] == values
        assert got.checkpoint["channel_versions"] == checkpoint["channel_versions"]
        assert (got.metadata["api_key"], got.metadata["step"]) == ("[REDACTED]", -1)  # type: ignore[typeddict-item]
        assert SECRET not in str(got.metadata)
        # Each value is stored as the serializer's own bytes.
        blobs = {r["channel"]: (r["blob_type"], bytes(r["blob"])) for r in person.execute(
            "SELECT channel, blob_type, blob FROM ledger.graph_checkpoint_blobs WHERE thread_id = %s", (thread,))}
        for channel, value in values.items():
            kind, data = blobs[channel]
            assert saver.serde.loads_typed((kind, data)) == value
            assert (SECRET.encode() in data) is (serde is None and channel != "raw")
        assert one(person, "SELECT count(*) FROM ledger.graph_checkpoints WHERE metadata::text LIKE %s",
                   (f"%{SECRET}%",)) == 0


def test_another_scope_sees_none_of_the_thread_and_a_reader_cannot_write(
        dsn: str, scoped: ScopedLedger, person: psycopg.Connection[DictRow], tmp_path: Path) -> None:
    graph = build(LedgerToolGuard(scoped), make_tools(tmp_path), LedgerSaver(scoped))
    config = start_run(scoped, "t-rls", "req-rls")
    graph.invoke(ask(("lookup", "call-lookup-2", {"order": 8})), config)
    thread: RunnableConfig = {"configurable": {"thread_id": "t-rls"}}

    other = LedgerSaver(Ledger(dsn).scoped("other-tenant", "tests"))
    assert other.get_tuple(thread) is None and list(other.list(thread)) == [] and list(other.list(None)) == []
    other.delete_thread("t-rls")
    other.prune(["t-rls"], strategy="delete")

    reader = LedgerSaver(Ledger(f"{dsn} options='-c role=ledger_reader'").scoped(*SCOPE))
    latest = reader.get_tuple(thread)
    assert latest is not None and len(list(reader.list(thread))) == len(list(LedgerSaver(scoped).list(thread)))
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        reader.delete_thread("t-rls")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        reader.put_writes(latest.config, [("messages", "forged")], "task-x")
    assert one(person, "SELECT count(*) FROM ledger.graph_checkpoint_writes WHERE task_id = 'task-x'") == 0
    assert LedgerSaver(scoped).get_tuple(thread) == latest


def test_purge_runs_takes_a_purged_runs_checkpoints_writes_and_values(
        scoped: ScopedLedger, person: psycopg.Connection[DictRow], tmp_path: Path) -> None:
    saver = LedgerSaver(scoped)
    graph = build(LedgerToolGuard(scoped), make_tools(tmp_path), saver)
    config = start_run(scoped, "t-purge", "req-purge")
    state = graph.invoke(ask(("lookup", "call-lookup-3", {"order": 9})), config)
    finish_run(scoped, config, answer(state))
    assert one(person, "SELECT count(*) FROM ledger.graph_checkpoint_writes WHERE thread_id = 't-purge'") > 0
    person.execute("UPDATE ledger.runs SET ended_at = now() - interval '40 days'")
    assert one(person, "SELECT ledger.purge_runs('30 days')") == 1
    assert saver.get_tuple({"configurable": {"thread_id": "t-purge"}}) is None
    for table in ("graph_checkpoints", "graph_checkpoint_blobs", "graph_checkpoint_writes"):
        assert one(person, f"SELECT count(*) FROM ledger.{table}") == 0, table


def test_a_checkpoint_without_a_configured_run_gets_a_run_of_its_own(
        scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    saver = LedgerSaver(scoped)
    for thread, metadata in [("t-own", {"run_id": "lg-run-1"}), ("t-own", {}), ("a thread with spaces", {})]:
        saver.put({"configurable": {"thread_id": thread, "checkpoint_ns": ""}}, empty_checkpoint(),
                  {"source": "input", "step": -1, **metadata}, {})  # type: ignore[typeddict-item]
    runs = person.execute("SELECT request_id, mode, status FROM ledger.runs ORDER BY request_id").fetchall()
    assert [r["request_id"] for r in runs] == [
        "langgraph-run:lg-run-1", "langgraph-thread:90925d9ee1f35616b31b728e641f403c40f0e10a", "langgraph-thread:t-own"]
    assert {(r["mode"], r["status"]) for r in runs} == {("langgraph", "running")}
    saver.delete_for_runs(["lg-run-1"])
    assert one(person, "SELECT count(*) FROM ledger.graph_checkpoints WHERE thread_id = 't-own'") == 1
    with pytest.raises(LedgerError) as refused:
        saver.prune(["t-own"], strategy="everything")
    assert refused.value.code == "STRATEGY_UNKNOWN"


def test_a_saver_remembers_a_bounded_number_of_its_runs_and_finds_a_forgotten_one_again(
        scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    saver = LedgerSaver(scoped)
    saver.runs_kept = 2
    for thread in ["k1", "k2", "k3", "k1"]:
        saver.put({"configurable": {"thread_id": thread, "checkpoint_ns": ""}}, empty_checkpoint(),
                  {"source": "input", "step": -1}, {})
        assert len(saver._runs) <= 2
    assert one(person, "SELECT count(*) FROM ledger.runs") == 3
    assert one(person, "SELECT count(DISTINCT run_id) FROM ledger.graph_checkpoints WHERE thread_id = 'k1'") == 1


def test_the_manual_shows_the_example_verbatim() -> None:
    assert_shows_verbatim(MANUAL, EXAMPLE)


def test_the_example_runs_and_leaves_its_run_and_checkpoints_in_the_ledger(dsn: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LEDGER_DSN": dsn, "PYTHONPATH": str(CLIENT / "src")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "paused: Refund order 1042?",
        "notes: ['order 1042 paid 12.50', 'a person said yes']",
        "checkpoints of run: True",
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT ledger.set_scope('acme', 'examples-checkpointer')")
        row = conn.execute("SELECT r.status, count(c.*) FROM ledger.runs r JOIN ledger.graph_checkpoints c"
                           " ON c.run_id = r.id GROUP BY r.status").fetchall()
        assert len(row) == 1 and row[0][0] == "succeeded" and row[0][1] >= 3


def test_a_checkpoint_meeting_a_terminated_connection_is_stored_on_a_fresh_one(
        dsn: str, person: psycopg.Connection[DictRow]) -> None:
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True, kwargs={"application_name": "ckpt-saver"}) as pool:
        saver = LedgerSaver(Ledger(pool).scoped(*SCOPE))
        config = saver.put({"configurable": {"thread_id": "t-cut", "checkpoint_ns": ""}}, empty_checkpoint(),
                           {"source": "input", "step": -1}, {})
        # The pool hands out its (unchecked) connection, which the server has terminated meanwhile.
        assert one(person, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                           " WHERE datname = current_database() AND application_name = 'ckpt-saver'") >= 1
        saver.put_writes(config, [("messages", "kept")], "task-1")
        got = saver.get_tuple(config)
        assert got is not None and [w[1:] for w in got.pending_writes or []] == [("messages", "kept")]
