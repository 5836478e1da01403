"""The outbox consumer against the real extension: ack, nack with the ledger's backoff, a
redelivery, LISTEN waking it up, several scopes, a graceful stop; and a person's replay."""

import threading
import time

import psycopg
import pytest
from conftest import SCOPE, one, wait_for
from psycopg.rows import DictRow

from ledger_client import InvalidArgumentError, Ledger, OutboxConsumer, OutboxEvent, OutboxStatus, ScopedLedger


def test_ack_nack_and_the_backoff(ledger: Ledger, scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    for run_id in ("r-1", "r-2", "r-3"):
        scoped.create_run("agent", run_id=run_id)
    delivered: list[tuple[str | None, int]] = []

    def handler(event: OutboxEvent) -> None:
        assert event.event_type == "run.created" and event.status is OutboxStatus.PROCESSING
        delivered.append((event.run_id, event.attempt_count))
        if event.run_id == "r-2" and event.attempt_count == 1:
            raise ConnectionError("HTTP 503 from billing")

    consumer = OutboxConsumer(ledger, handler, lease_owner="billing-sync", scope=SCOPE)
    assert consumer.run_once() == 3
    rows = {r["run_id"]: r for r in person.execute(
        "SELECT run_id, status, attempt_count, error_message,"
        "       available_at >= occurred_at + interval '1 second' AS backing_off FROM ledger.outbox")}
    assert rows["r-1"]["status"] == rows["r-3"]["status"] == "done"
    assert rows["r-2"] == {"run_id": "r-2", "status": "pending", "attempt_count": 1,
                           "error_message": "HTTP 503 from billing", "backing_off": True}
    # The nacked event comes due again after the ledger's backoff, and is acked this time.
    wait_for("the redelivery", lambda: consumer.run_once() == 1)
    assert delivered == [("r-1", 1), ("r-2", 1), ("r-3", 1), ("r-2", 2)]
    assert one(person, "SELECT count(*) FROM ledger.outbox WHERE status <> 'done'") == 0


def test_listen_wakes_the_consumer_of_every_scope_and_it_stops_gracefully(
    pooled: Ledger, person: psycopg.Connection[DictRow]
) -> None:
    ledger = pooled  # the LISTEN connection is one of the pool's, given back without its LISTEN
    seen: list[tuple[str, str, str | None]] = []
    both = threading.Event()

    def handler(event: OutboxEvent) -> None:
        seen.append((event.tenant_id, event.workspace_id, event.run_id))
        if len(seen) == 2:
            both.set()

    # wait_s is far longer than the test may take: only a notification can wake the consumer.
    consumer = OutboxConsumer(ledger, handler, lease_owner="audit-export", wait_s=600)
    thread = threading.Thread(target=consumer.run)
    thread.start()
    try:
        wait_for("the consumer's LISTEN", lambda: bool(one(
            person, "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN ledger_outbox' AND state = 'idle'")))
        time.sleep(0.3)  # past its first (empty) claim, into the wait
        ledger.scoped("acme", "support").create_run("agent", run_id="r-support")
        ledger.scoped("globex", "billing").create_run("agent", run_id="r-billing")
        assert both.wait(60), f"delivered only {seen}"
    finally:
        consumer.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert sorted(seen) == [("acme", "support", "r-support"), ("globex", "billing", "r-billing")]
    done = person.execute("SELECT tenant_id, status FROM ledger.outbox ORDER BY tenant_id").fetchall()
    assert done == [{"tenant_id": "acme", "status": "done"}, {"tenant_id": "globex", "status": "done"}]
    with pooled.connection() as conn:
        row = conn.execute("SELECT count(*) FROM pg_listening_channels()").fetchone()
        assert row == (0,) and not conn.autocommit


def test_replay_outbox_event_records_who_replayed_it(scoped: ScopedLedger, person: psycopg.Connection[DictRow]) -> None:
    scoped.create_run("agent", run_id="r-1")
    event_id = one(person, "SELECT id FROM ledger.outbox")
    person.execute("UPDATE ledger.outbox SET status = 'failed', attempt_count = 64")  # as 64 failed deliveries
    replayed = scoped.replay_outbox_event(event_id, actor="ops@acme", note="billing is back")
    assert (replayed.id, replayed.status, replayed.attempt_count, replayed.replay_count) == (
        event_id, OutboxStatus.PENDING, 64, 1)
    audit = person.execute("SELECT run_id, gateway_type, outcome, actor, payload FROM ledger.audit_events").fetchall()
    assert audit == [{"run_id": "r-1", "gateway_type": "outbox.replay", "outcome": "replayed", "actor": "ops@acme",
                      "payload": {"outbox_event_id": event_id, "event_type": "run.created", "replay_count": 1,
                                  "note": "billing is back"}}]
    # No one named: refused, and nothing changes.
    person.execute("UPDATE ledger.outbox SET status = 'failed'")
    with pytest.raises(InvalidArgumentError) as refused:
        scoped.replay_outbox_event(event_id, actor="")
    assert refused.value.code == "ARGUMENT_REQUIRED"
    assert one(person, "SELECT status FROM ledger.outbox") == "failed"
    assert one(person, "SELECT count(*) FROM ledger.audit_events") == 1
