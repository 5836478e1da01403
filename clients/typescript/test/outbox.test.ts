/** The outbox consumer: woken by NOTIFY, ack on success, nack with the ledger's backoff on failure, graceful stop; a person's replay. */
import assert from "node:assert/strict";
import { test } from "node:test";

import { InvalidArgumentError, OutboxConsumer, type OutboxEvent } from "../src/index.js";
import { freshDb, waitFor } from "./helpers.js";

test("the outbox consumer: ack on delivery, nack on failure, redelivery after the backoff", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "outbox");
  const acme = db.ledger.scoped("acme", "ts");
  const delivered: OutboxEvent[] = [];
  const failedOnce = new Set<string>();
  const handler = async (event: OutboxEvent): Promise<void> => {
    delivered.push(event);
    if (event.runId === "flaky" && !failedOnce.has(event.id)) {
      failedOnce.add(event.id);
      throw new Error("HTTP 503 from billing");
    }
  };

  // 1. An idle consumer (its timer 10 minutes away) is woken by the notification of each insert.
  const consumer = new OutboxConsumer(acme, handler, { leaseOwner: "billing-sync", idleSeconds: 600 });
  const running = consumer.run();
  await acme.createRun("agent", { runId: "steady" });
  await waitFor("the first delivery", () => delivered.length === 1);
  await acme.createRun("agent", { runId: "flaky" });
  await waitFor("the flaky delivery", () => delivered.length === 2);
  consumer.stop();
  await running;
  const rows = await db.sql(
    "SELECT run_id, status, attempt_count, error_message, available_at > now() AS backing_off FROM ledger.outbox ORDER BY run_id",
  );
  assert.deepEqual(rows, [
    { run_id: "flaky", status: "pending", attempt_count: 1, error_message: "HTTP 503 from billing", backing_off: true },
    { run_id: "steady", status: "done", attempt_count: 1, error_message: null, backing_off: false },
  ]);
  assert.equal(delivered[0]?.eventType, "run.created");
  assert.equal(delivered[0]?.subject, "run:steady");
  assert.equal(delivered[0]?.status, "processing");

  // 2. Backoffs come due without a notification: a consumer on a short timer delivers it again.
  const stop2 = new AbortController();
  const again = new OutboxConsumer(acme, handler, { leaseOwner: "billing-sync", idleSeconds: 0.2, signal: stop2.signal }).run();
  await waitFor("the redelivery", () => delivered.length === 3);
  stop2.abort();
  await again;
  assert.equal(delivered[2]?.runId, "flaky");
  assert.equal(delivered[2]?.attemptCount, 2);
  const after = await db.sql("SELECT run_id, status, attempt_count FROM ledger.outbox ORDER BY run_id");
  assert.deepEqual(after, [
    { run_id: "flaky", status: "done", attempt_count: 2 },
    { run_id: "steady", status: "done", attempt_count: 1 },
  ]);
});

test("one batch by hand, and a failed event replayed by a named person", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "outbox_replay");
  const acme = db.ledger.scoped("acme", "ts");
  await acme.createRun("agent", { runId: "r-1" });
  const consumer = new OutboxConsumer(acme, async () => {
    throw new Error("HTTP 503 from billing");
  }, { leaseOwner: "billing-sync" });
  assert.equal(await consumer.runOnce(), 1);
  // As 64 failed deliveries would leave it.
  await db.sql("UPDATE ledger.outbox SET status = 'failed', attempt_count = 64");
  const [{ id }] = (await db.sql("SELECT id FROM ledger.outbox")) as [{ id: string }];
  const replayed = await acme.replayOutboxEvent(id, { actor: "ops@acme", note: "billing is back" });
  assert.deepEqual([replayed.id, replayed.status, replayed.attemptCount, replayed.replayCount], [id, "pending", 64, 1]);
  assert.deepEqual(await db.sql("SELECT run_id, gateway_type, outcome, actor, payload FROM ledger.audit_events"), [
    {
      run_id: "r-1",
      gateway_type: "outbox.replay",
      outcome: "replayed",
      actor: "ops@acme",
      payload: { outbox_event_id: id, event_type: "run.created", replay_count: 1, note: "billing is back" },
    },
  ]);
  // No one named: refused, and nothing changes.
  await db.sql("UPDATE ledger.outbox SET status = 'failed'");
  await assert.rejects(acme.replayOutboxEvent(id, { actor: "" }), (e: unknown) => e instanceof InvalidArgumentError && e.code === "ARGUMENT_REQUIRED");
  assert.deepEqual(await db.sql("SELECT status, (SELECT count(*)::int FROM ledger.audit_events) AS audits FROM ledger.outbox"), [
    { status: "failed", audits: 1 },
  ]);
});
