/**
 * A dedicated connection that LISTENs, for the follower, the outbox consumer and the idle worker:
 * it wakes its reader on a notification, on the connection's loss, or on a timer, whichever comes
 * first. Notifications only say "read again"; the rows are the authority.
 */
import pg from "pg";

export class Listener {
  readonly client: pg.Client;
  private dirty = false;
  private broken: Error | null = null;
  private wakeUp: (() => void) | null = null;

  private constructor(config: pg.ClientConfig) {
    this.client = new pg.Client(config);
    this.client.on("notification", () => this.wake());
    this.client.on("error", (error) => this.fail(error));
    this.client.on("end", () => this.fail(new Error("ledger: the listening connection ended")));
  }

  /** A connected client (not from the pool: it holds its LISTEN for as long as it lives). */
  static async open(pool: pg.Pool): Promise<Listener> {
    const listener = new Listener(pool.options);
    try {
      await listener.client.connect();
    } catch (error) {
      await listener.close();
      throw error;
    }
    return listener;
  }

  /** LISTEN on `channel` (an identifier the ledger made: quoted as one). */
  async listen(channel: string): Promise<void> {
    await this.client.query(`LISTEN ${this.client.escapeIdentifier(channel)}`);
  }

  /** Whether the connection was lost (or closed): listen on another. */
  get lost(): boolean {
    return this.broken !== null;
  }

  /** Forgets the notifications seen so far: call it right before reading the rows. */
  reset(): void {
    this.dirty = false;
  }

  /**
   * Waits for a notification since the last {@link reset}, at most `ms`, or until `signal` aborts.
   * Throws if the connection was lost, so that the caller reconnects.
   */
  async wait(ms: number, signal?: AbortSignal): Promise<void> {
    if (!this.dirty && this.broken === null && !signal?.aborted) {
      await new Promise<void>((resolve) => {
        const done = (): void => {
          clearTimeout(timer);
          signal?.removeEventListener("abort", done);
          this.wakeUp = null;
          resolve();
        };
        const timer = setTimeout(done, ms);
        signal?.addEventListener("abort", done, { once: true });
        this.wakeUp = done;
      });
    }
    if (this.broken !== null) throw this.broken;
  }

  async close(): Promise<void> {
    this.broken ??= new Error("ledger: the listening connection was closed");
    await this.client.end().catch(() => undefined);
  }

  private wake(): void {
    this.dirty = true;
    this.wakeUp?.();
  }

  private fail(error: Error): void {
    this.broken ??= error;
    this.wakeUp?.();
  }
}
