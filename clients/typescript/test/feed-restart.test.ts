/**
 * The follower across a server restart (pg_ctl restart as user postgres). It restarts the server
 * every other test uses, so test.sh runs this file alone, after the others.
 */
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { test } from "node:test";

import { Ledger } from "../src/index.js";
import { followWhile, writeRun } from "./fixtures/feed.js";
import { freshDb } from "./helpers.js";

test("the follower yields every event once across a server restart", { timeout: 90_000 }, async (t) => {
  const bindir = process.env["LEDGER_TEST_BINDIR"];
  const pgdata = process.env["LEDGER_TEST_PGDATA"];
  assert.ok(bindir && pgdata, "LEDGER_TEST_BINDIR and LEDGER_TEST_PGDATA are needed to restart the server");
  const db = await freshDb(t, "restart");
  const writer = db.ledger.scoped("acme", "ts");
  await writer.createRun("agent", { runId: "r" });
  const followers = Ledger.connect(db.dsn, { application_name: "ts-follower" });
  t.after(() => followers.close());
  const restart = async (): Promise<void> => {
    const pgCtl = [`${bindir}/pg_ctl`, "-D", pgdata, "-w", "-m", "fast", "restart"];
    const [cmd, args] = process.getuid?.() === 0 ? ["sudo", ["-u", "postgres", ...pgCtl]] : [pgCtl[0] ?? "", pgCtl.slice(1)];
    execFileSync(cmd, args, { stdio: "ignore" });
  };
  const reconnects = await followWhile(followers.scoped("acme", "ts"), "r", 8, () => writeRun(writer, "r", 8, restart));
  assert.ok(reconnects >= 1, "the follower reconnected");
});
