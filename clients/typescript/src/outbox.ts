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

import type { ScopedLedger } from "./client.js";
import { WrongStateError } from "./errors.js";
import { reconnecting } from "./faults.js";
import { Listener } from "./notifier.js";
import type { OutboxEvent } from "./types.js";

/** Options of {@link OutboxConsumer}. */
export interface OutboxConsumerOptions {
  /** Who holds the batches' leases; default `<hostname>:<pid>`. */
  leaseOwner?: string;
  /** Events per claim (1 to 1000); default 50. */
  maxEvents?: number;
  /**
   * Lease of a batch in seconds: the time to deliver it, after which another consumer may claim
   * its events again (there is no heartbeat: lower `maxEvents` for a slow handler); default 15. A
   * consumer killed holding a batch costs at most this before its events are delivered again.
   */
  leaseSeconds?: number;
  /** Longest wait for a notification when nothing is due; default 5. */
  idleSeconds?: number;
  /** Stops the loop after the batch in hand, like {@link OutboxConsumer.stop} (one signal for a worker and a consumer). */
  signal?: AbortSignal;
  /** Called with an error that is not a handler's (the server unreachable); the loop goes on. Default: stderr. */
  onError?: (error: unknown) => void;
}

/**
 * Consumes the scope's outbox with `handler`: a handler that returns delivered its event (acked);
 * one that throws did not (nacked with the error's message).
 */
export class OutboxConsumer {
  readonly leaseOwner: string;
  private readonly idleMs: number;
  private readonly onError: (error: unknown) => void;
  private readonly stopping = new AbortController();

  constructor(
    readonly scoped: ScopedLedger,
    readonly handler: (event: OutboxEvent) => Promise<void>,
    private readonly options: OutboxConsumerOptions = {},
  ) {
    this.leaseOwner = options.leaseOwner ?? `${hostname()}:${process.pid}`;
    this.idleMs = (options.idleSeconds ?? 5) * 1000;
    this.onError = options.onError ?? ((e: unknown) => console.error("ledger outbox consumer:", e));
    if (options.signal?.aborted) this.stop();
    options.signal?.addEventListener("abort", () => this.stop(), { once: true });
  }

  /** Stops {@link run} after the batch in hand is acked and nacked. */
  stop(): void {
    this.stopping.abort();
  }

  /** Consumes until {@link stop}; a lost connection is opened again (after at most a second). */
  async run(): Promise<void> {
    const signal = this.stopping.signal;
    let listener: Listener | null = null;
    try {
      while (!signal.aborted) {
        try {
          if (listener === null) {
            listener = await Listener.open(this.scoped.ledger.pool);
            await listener.listen("ledger_outbox");
          }
          // Before the claim: a notification that comes while the batch is delivered is not lost.
          listener.reset();
          if ((await this.runOnce()) === 0) await listener.wait(this.idleMs, signal);
        } catch (error) {
          this.onError(error);
          await listener?.close();
          listener = null;
          await sleep(Math.min(this.idleMs, 1000), undefined, { signal }).catch(() => undefined);
        }
      }
    } finally {
      await listener?.close();
    }
  }

  /**
   * One batch: claims, delivers, acks the delivered events, then nacks the failed ones (a refused
   * nack cannot cost the acks); returns how many events were claimed.
   */
  async runOnce(): Promise<number> {
    const { maxEvents, leaseSeconds } = this.options;
    const events = await this.scoped.claimOutboxEvents(this.leaseOwner, {
      ...(maxEvents !== undefined ? { maxEvents } : {}),
      leaseSeconds: leaseSeconds ?? DEFAULT_OUTBOX_LEASE_SECONDS,
    });
    const delivered: string[] = [];
    const failed: [string, string][] = [];
    for (const event of events) {
      try {
        await this.handler(event);
        delivered.push(event.id);
      } catch (error) {
        failed.push([event.id, error instanceof Error ? error.message : String(error)]);
      }
    }
    // Repeated on a fresh connection after a lost one: acking again acks nothing more.
    if (delivered.length > 0) await reconnecting(() => this.scoped.ackOutboxEvents(this.leaseOwner, delivered));
    for (const [id, message] of failed) {
      // One at a time: each keeps its own error. A lease another consumer took since is theirs; so
      // is an event a repeated nack no longer holds (the first try went through).
      await reconnecting(async (tryNo) => {
        try {
          await this.scoped.nackOutboxEvents(this.leaseOwner, [id], message);
        } catch (error) {
          if (!(tryNo > 1 && error instanceof WrongStateError && error.code === "OUTBOX_NOT_LEASED")) throw error;
        }
      }).catch(this.onError);
    }
    return events.length;
  }
}

/** The batch lease's default, in seconds. */
export const DEFAULT_OUTBOX_LEASE_SECONDS = 15;
