/**
 * Dropped connections. A connection error is never a run's failure: the helpers repeat the writes
 * whose repetition is harmless (fenced by a run token or an attempt, or idempotent by key) on a
 * fresh pooled connection, and give anything else back (a worker releases its run).
 */
import { setTimeout as sleep } from "node:timers/promises";

import pg from "pg";

/** Server-sent SQLSTATEs of a lost connection: admin or crash shutdown, cannot connect now, idle session timeout. */
const DROPPED = new Set(["57P01", "57P02", "57P03", "57P05"]);
/** node-postgres's own errors for a connection that broke, and the pool's timeout. */
const DRIVER = /^(Connection terminated|Client has encountered a connection error|timeout exceeded when trying to connect|Query read timeout)/;
/** Node's socket errors. */
const SOCKET = new Set(["ECONNRESET", "ECONNREFUSED", "EPIPE", "ETIMEDOUT", "EHOSTUNREACH", "ENETUNREACH", "ENOTFOUND", "EAI_AGAIN", "ECONNABORTED"]);

/**
 * Whether `error` is a lost connection rather than an answer: SQLSTATE class 08, 57P01, 57P02,
 * 57P03 or 57P05, a socket error, node-postgres's "Connection terminated ..." (no code), or the
 * pool's connection timeout. Follows `cause`.
 */
export function isConnectionError(error: unknown): boolean {
  for (let e = error, depth = 0; e instanceof Error && depth < 5; e = e.cause, depth += 1) {
    const code = (e as { code?: unknown }).code;
    if (e instanceof pg.DatabaseError) return typeof code === "string" && (code.startsWith("08") || DROPPED.has(code));
    if (typeof code === "string" && SOCKET.has(code)) return true;
    if (code === undefined && DRIVER.test(e.message)) return true;
  }
  return false;
}

/** Delays between the repeats of a write after a lost connection: 0.1 s doubling, 6.3 s in all. */
export const RECONNECT_DELAYS_MS = [100, 200, 400, 800, 1600, 3200];

/**
 * Runs `write` (given its try number, from 1) and repeats it after a lost connection, on a fresh
 * connection, at most `RECONNECT_DELAYS_MS.length` times; any other error, and the last lost
 * connection, is thrown. Only for writes whose repetition is harmless.
 */
export async function reconnecting<T>(write: (tryNo: number) => Promise<T>): Promise<T> {
  for (let tryNo = 1; ; tryNo += 1) {
    try {
      return await write(tryNo);
    } catch (error) {
      const delay = RECONNECT_DELAYS_MS[tryNo - 1];
      if (delay === undefined || !isConnectionError(error)) throw error;
      await sleep(delay);
    }
  }
}
