/**
 * The follower: a run's events, each exactly once, across dropped connections and server
 * restarts, ending after the event that ended the run.
 *
 * It follows the README's "Catching up" contract on a dedicated connection: (1) LISTEN on the
 * run's channel first, (2) read `events_since` from the cursor while pages come back full, (3) on
 * every notification, and on a timer (the backstop for a notification lost in a crash), read
 * again. After a connection error it reconnects with backoff and starts again at (1) from the last
 * event it yielded: LISTEN before the read loses nothing, the exclusive cursor duplicates nothing.
 */
import { setTimeout as sleep } from "node:timers/promises";

import { LedgerError } from "./errors.js";
import { Transaction, type ScopedLedger } from "./client.js";
import { Listener } from "./notifier.js";
import type { RunEvent } from "./types.js";

/** Options of {@link follow}. */
export interface FollowOptions {
  /** The last event already seen (exclusive); null or absent: from the run's first event. */
  cursor?: string | null;
  /** Events per read; default 1000. */
  pageSize?: number;
  /** Seconds between reads when no notification comes (the backstop; the poll with `ledger.notify = off`); default 5. */
  backstopSeconds?: number;
  /** First and longest wait before reconnecting, in seconds; default 0.1 and 5. */
  minBackoffSeconds?: number;
  maxBackoffSeconds?: number;
  /** Ends the iteration (quietly) when aborted. */
  signal?: AbortSignal;
  /** Called with each connection error before the reconnect (for logs). */
  onReconnect?: (error: unknown) => void;
}

/**
 * The run's events after `cursor`, each once, in seq order; the iteration ends after the event
 * with `endsRun` (the run's move to a terminal status), or when `signal` aborts. A ledger error
 * (an unknown run or cursor, no scope) ends it with that error; connection errors are retried.
 */
export async function* follow(ledger: ScopedLedger, runId: string, options: FollowOptions = {}): AsyncGenerator<RunEvent, void, undefined> {
  const page = options.pageSize ?? 1000;
  const backstopMs = (options.backstopSeconds ?? 5) * 1000;
  const minBackoff = (options.minBackoffSeconds ?? 0.1) * 1000;
  const maxBackoff = (options.maxBackoffSeconds ?? 5) * 1000;
  const signal = options.signal;
  let cursor = options.cursor ?? null;
  let failures = 0;
  while (!signal?.aborted) {
    let listener: Listener | null = null;
    try {
      listener = await Listener.open(ledger.ledger.pool);
      const tx = new Transaction(listener.client);
      // A dedicated session: its scope is the session's, not a transaction's.
      await tx.query("SELECT ledger.set_scope($1, $2)", [ledger.tenant, ledger.workspace]);
      await listener.listen(await tx.runChannel(runId)); // 1. LISTEN first
      failures = 0;
      for (;;) {
        listener.reset();
        for (;;) {
          // 2. read to the end
          const events = await tx.eventsSince(runId, cursor, page);
          for (const event of events) {
            cursor = event.eventId;
            yield event;
            if (event.endsRun) return;
          }
          if (events.length < page) break;
        }
        await listener.wait(backstopMs, signal); // 3. a notification, or the backstop
        if (signal?.aborted) return;
      }
    } catch (error) {
      if (error instanceof LedgerError) throw error;
      options.onReconnect?.(error);
      const backoff = Math.min(maxBackoff, minBackoff * 2 ** failures);
      failures += 1;
      await sleep(backoff * (0.5 + Math.random() / 2), undefined, signal ? { signal } : {}).catch(() => undefined);
    } finally {
      await listener?.close();
    }
  }
}
