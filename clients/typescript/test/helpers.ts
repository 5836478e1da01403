/**
 * Test fixtures: a fresh database with `CREATE EXTENSION ledger` per test, on the server of
 * LEDGER_TEST_HOST (a socket directory) and LEDGER_TEST_PORT, as user postgres; dropped after.
 */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import type { TestContext } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";

import pg from "pg";

import { Ledger } from "../src/index.js";

function env(name: string): string {
  const value = process.env[name];
  if (value === undefined || value === "") throw new Error(`${name} is not set`);
  return value;
}

/** The conninfo of database `dbname` on the test server. */
export function conninfo(dbname: string): string {
  return `host=${env("LEDGER_TEST_HOST")} port=${env("LEDGER_TEST_PORT")} user=postgres dbname=${dbname}`;
}

/** A test's database: a Ledger over it, and a superuser session (no RLS) to look and to play a person. */
export interface TestDb {
  dbname: string;
  dsn: string;
  ledger: Ledger;
  /** One statement as the superuser, outside any scope (row-level security does not apply). */
  sql(text: string, values?: unknown[]): Promise<Record<string, unknown>[]>;
}

async function admin<T>(dbname: string, fn: (client: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({
    host: env("LEDGER_TEST_HOST"),
    port: Number(env("LEDGER_TEST_PORT")),
    user: "postgres",
    database: dbname,
  });
  client.on("error", () => undefined);
  await client.connect();
  try {
    return await fn(client);
  } finally {
    await client.end().catch(() => undefined);
  }
}

/** A new database `ledger_ts_<name>` with the extension, dropped when the test ends. */
export async function freshDb(t: TestContext, name: string): Promise<TestDb> {
  const dbname = `ledger_ts_${name}`;
  await admin("postgres", async (c) => {
    await c.query(`DROP DATABASE IF EXISTS ${dbname} WITH (FORCE)`);
    await c.query(`CREATE DATABASE ${dbname}`);
  });
  await admin(dbname, (c) => c.query("CREATE EXTENSION ledger"));
  const dsn = conninfo(dbname);
  const ledger = Ledger.connect(dsn, { max: 8 });
  t.after(async () => {
    await ledger.close();
    await admin("postgres", (c) => c.query(`DROP DATABASE IF EXISTS ${dbname} WITH (FORCE)`));
  });
  return {
    dbname,
    dsn,
    ledger,
    sql: (text, values = []) => admin(dbname, async (c) => (await c.query<Record<string, unknown>>(text, values)).rows),
  };
}

/** Waits until `check` holds (polling), failing after `seconds`: only to stop a hung test. */
export async function waitFor(what: string, check: () => Promise<boolean> | boolean, seconds = 30): Promise<void> {
  const deadline = Date.now() + seconds * 1000;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(25);
  }
}

/** Ends every live lease of a run and its calls now, as if their time had passed. */
export async function expireLeases(db: TestDb, runId: string): Promise<void> {
  await db.sql("UPDATE ledger.runs SET lease_expires_at = now() WHERE id = $1", [runId]);
  await db.sql("UPDATE ledger.run_step_tool_calls SET lease_expires_at = now() WHERE run_id = $1", [runId]);
}

/** A path of the repository (from dist/test/). */
export const root = (path: string): string => fileURLToPath(new URL(`../../../../${path}`, import.meta.url));

/** The manual (a path of the repository) has a ```ts block that is the example file verbatim. */
export function assertShowsVerbatim(manual: string, example: string): void {
  const text = readFileSync(root(manual), "utf8");
  const file = readFileSync(root(example), "utf8");
  const firstLine = file.split("\n")[0] ?? "";
  const block = [...text.matchAll(/```ts\n([\s\S]*?)```/g)].map((m) => m[1] ?? "").find((b) => b.startsWith(firstLine));
  assert.ok(block !== undefined, `no \`\`\`ts block of ${manual} starts with ${firstLine}`);
  assert.equal(block, file, `${manual}'s block differs from ${example}`);
}

/** Runs a compiled example (a path of the repository) against the test's database to its end; returns what it printed. */
export async function runExample(t: TestContext, db: TestDb, compiled: string): Promise<string> {
  const child = spawn(process.execPath, [root(compiled)], {
    env: { ...process.env, LEDGER_DSN: db.dsn },
    stdio: ["ignore", "pipe", "inherit"],
  });
  t.after(() => child.kill("SIGKILL"));
  let out = "";
  child.stdout.on("data", (chunk: Buffer) => (out += chunk.toString()));
  const code = await new Promise((resolve) => child.once("exit", resolve));
  assert.equal(code, 0, out);
  return out;
}
