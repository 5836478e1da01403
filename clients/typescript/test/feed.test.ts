/** The follower: exactly once across a terminated connection, from a cursor, and ending with the run. */
import assert from "node:assert/strict";
import { test } from "node:test";

import { follow, Ledger, NotFoundError } from "../src/index.js";
import { collect, followWhile, writeRun } from "./fixtures/feed.js";
import { freshDb } from "./helpers.js";

test("the follower yields every event once across pg_terminate_backend, and ends with the run", { timeout: 60_000 }, async (t) => {
  const db = await freshDb(t, "follow");
  const writer = db.ledger.scoped("acme", "ts");
  await writer.createRun("agent", { runId: "r" });
  const followers = Ledger.connect(db.dsn, { application_name: "ts-follower" });
  t.after(() => followers.close());
  const terminate = async (): Promise<void> => {
    const killed = await db.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'ts-follower'");
    assert.equal(killed.length, 1, "the follower's connection was there to terminate");
  };
  const reconnects = await followWhile(followers.scoped("acme", "ts"), "r", 8, () => writeRun(writer, "r", 8, terminate));
  assert.ok(reconnects >= 1, "the follower reconnected");

  // From a cursor: only what came after it; a finished run's stream ends by itself.
  const all = await writer.eventsSince("r");
  const fromThird = await collect(follow(writer, "r", { cursor: all[2]?.eventId ?? null }));
  assert.deepEqual(
    fromThird.map((e) => e.seq),
    all.slice(3).map((e) => e.seq),
  );
  // An unknown run or cursor is the ledger's error, not a reconnect loop.
  await assert.rejects(
    collect(follow(writer, "r", { cursor: "evt_unknown" })),
    (e: unknown) => e instanceof NotFoundError && e.code === "EVENT_NOT_FOUND",
  );
});
