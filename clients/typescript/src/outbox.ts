/**
 * The outbox consumer loop: claim a batch, hand each event to your handler, ack what it
 * delivered, nack what it failed (the ledger backs the event off: due again after min(300,
 * 2^(n-1)) seconds for its n-th attempt), and when nothing is due wait for a NOTIFY on
 * `ledger_outbox` (or the idle timer: backoffs and expired leases come due without one).
 *
 * Delivery is at least once (a consumer that dies holding a batch has it delivered again once the
 * lease is over): deduplicate on the event's `id`.
 */
import { hostname } from "node:os";
import { setTimeout as sleep } from "node:timers/promises";

import type { ScopedLedger } from "./ledger.js";
import { Listener } from "./listen.js";
import type { OutboxEvent } from "./types.js";

/** Options of {@link consumeOutbox}. */
export interface OutboxConsumerOptions {
  /** Who holds the batches' leases; default `<hostname>:<pid>`. */
  leaseOwner?: string;
  /** Events per claim (1 to 1000); default 50. */
  maxEvents?: number;
  /** Lease of a batch: the time to deliver it; default 60. */
  leaseSeconds?: number;
  /** Longest wait for a notification when nothing is due; default 5. */
  idleSeconds?: number;
  /** Stops the loop after the batch in hand. */
  signal?: AbortSignal;
  /** Called with an error that is not a handler's (the server unreachable); the loop goes on. Default: stderr. */
  onError?: (error: unknown) => void;
}

/**
 * Consumes the scope's outbox with `handler` until `signal` aborts. A handler that returns
 * delivered its event (acked); one that throws did not (nacked with the error's message).
 */
export async function consumeOutbox(
  ledger: ScopedLedger,
  handler: (event: OutboxEvent) => Promise<void>,
  options: OutboxConsumerOptions = {},
): Promise<void> {
  const leaseOwner = options.leaseOwner ?? `${hostname()}:${process.pid}`;
  const idleMs = (options.idleSeconds ?? 5) * 1000;
  const onError = options.onError ?? ((e: unknown) => console.error("ledger outbox consumer:", e));
  const signal = options.signal;
  let listener: Listener | null = null;
  try {
    while (!signal?.aborted) {
      try {
        if (listener === null) {
          listener = await Listener.open(ledger.ledger.pool);
          await listener.listen("ledger_outbox");
        }
        listener.reset();
        const events = await ledger.claimOutboxEvents(leaseOwner, {
          ...(options.maxEvents !== undefined ? { maxEvents: options.maxEvents } : {}),
          ...(options.leaseSeconds !== undefined ? { leaseSeconds: options.leaseSeconds } : {}),
        });
        const delivered: string[] = [];
        const failed: [string, string][] = [];
        for (const event of events) {
          try {
            await handler(event);
            delivered.push(event.id);
          } catch (error) {
            failed.push([event.id, error instanceof Error ? error.message : String(error)]);
          }
        }
        if (delivered.length > 0) await ledger.ackOutboxEvents(leaseOwner, delivered);
        for (const [id, message] of failed) {
          // One at a time: each keeps its own error. A lease another consumer took since is theirs.
          await ledger.nackOutboxEvents(leaseOwner, [id], message).catch(onError);
        }
        if (events.length === 0) await listener.wait(idleMs, signal);
      } catch (error) {
        onError(error);
        await listener?.close();
        listener = null;
        await sleep(Math.min(idleMs, 1000), undefined, signal ? { signal } : {}).catch(() => undefined);
      }
    }
  } finally {
    await listener?.close();
  }
}
