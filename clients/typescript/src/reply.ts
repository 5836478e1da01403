/** How a driven run ends with its reply: the worker's and the AI SDK adapter's (not exported by the package's index). */
import type { ScopedLedger } from "./client.js";
import { reconnecting } from "./faults.js";

/**
 * What the user is shown (a `message` response event with `reply`) and the run's success, at once;
 * repeated after a lost connection. `runToken` fences it when the run was claimed.
 */
export async function succeedWith(ledger: ScopedLedger, runId: string, reply: string, runToken?: number): Promise<void> {
  await reconnecting((tryNo) =>
    ledger.transaction(async (tx) => {
      // A repeat after a lost connection first looks whether the first try committed (the
      // response event is not keyed: it must not be written twice).
      if (tryNo > 1 && (await tx.getRun(runId))?.status === "succeeded") return;
      await tx.recordResponseEvent(runId, "message", { text: reply });
      await tx.transitionRun(runId, "succeeded", { outputSummary: reply, ...(runToken !== undefined ? { runToken } : {}) });
    }),
  );
}
