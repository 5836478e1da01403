// A support agent worked to the end on two orders: a model step with its cost, a lookup tool, a
// refund that needs a person's approval (given for one order, rejected for the other, as a person
// would), followed event by event.
// Run it against `make demo`: LEDGER_DSN='host=... port=28915 user=postgres dbname=ledger_demo'.
import { follow, Ledger, RejectedError, work, type RunContext } from "ledger-client";

const dsn = process.env["LEDGER_DSN"];
if (!dsn) throw new Error("set LEDGER_DSN (make demo prints it)");
const ledger = Ledger.connect(dsn);
const support = ledger.scoped("acme", "examples-ts"); // a workspace of its own: it claims only its runs

// The model and the tools: stand-ins for your LLM client and your APIs.
async function callModel(prompt: string, reply: string) {
  console.log(`  model: ${prompt}`);
  return { text: reply, usage: { input_tokens: 120, output_tokens: 30 }, amount: "0.00042", currency: "USD" };
}
async function lookupOrder(args: { order: number }, signal: AbortSignal) {
  await fetchLike(signal);
  return { order: args.order, status: "delivered damaged", paid: args.order === 1042 ? "12.50" : "480.00" };
}
async function refund(args: { order: number; amount: string }, signal: AbortSignal) {
  await fetchLike(signal);
  return { refunded: args.amount, reference: `rf-${args.order}` };
}
async function fetchLike(signal: AbortSignal) {
  await new Promise((resolve) => setTimeout(resolve, 50)); // a real call passes `signal` to fetch
  signal.throwIfAborted();
}

// The agent, written as if it ran from the start every time: finished steps and calls are found
// again by key and never redone when a worker resumes the run.
async function supportAgent(ctx: RunContext): Promise<string> {
  const order = Number(ctx.inputs["order"]);
  await ctx.llmStep("plan", () => callModel(`plan: ${String(ctx.inputs["question"])}`, "Look the order up, refund it."));
  const found = await ctx.toolCall("lookup", "crm.lookup_order", { order }, lookupOrder, { timeoutSeconds: 10 });
  let done;
  try {
    done = await ctx.toolCall("refund", "payments.refund", { order, amount: found.paid }, refund, {
      approval: { title: `Refund ${found.paid} for order ${order}`, policyRef: "refunds/v1" },
    });
  } catch (error) {
    // Uncaught, a rejection ends the run failed with error_code TOOL_APPROVAL_REJECTED.
    if (!(error instanceof RejectedError)) throw error;
    return ctx.llmStep("apology", () => callModel(`answer: ${error.message}`, "A colleague will call you about a return."));
  }
  return ctx.llmStep("answer", () =>
    callModel(`answer: refund ${done.reference}`, `Sorry about the parcel: ${done.refunded} is refunded (${done.reference}).`),
  );
}

const question = "My parcel arrived damaged";
const runs = [];
for (const order of [1042, 1043]) runs.push(await support.createRun("agent", { inputs: { order, question }, userId: "customer-7" }));

const stop = new AbortController();
const worker = work(support, supportAgent, {
  leaseOwner: "examples-ts-worker",
  idleSeconds: 0.2,
  signal: stop.signal,
  onRun: (claimed, outcome) => console.log(`  worker: ${claimed.runId} -> ${outcome.status}`),
});

// Follow each run to its end; decide its refund when it waits, as a person would (the queue shows
// the call's arguments): up to 50.00 without a return.
for (const run of runs) {
  console.log(`following ${run.id}`);
  for await (const event of follow(support, run.id)) {
    const to = event.payload["to"];
    console.log(`  #${event.seq} ${event.eventType}${typeof to === "string" ? ` -> ${to}` : ""}`);
    if (event.eventType === "run.status" && to === "waiting_approval") {
      const [pending] = await support.pendingApprovals({ runId: run.id });
      if (!pending) continue;
      const amount = Number((pending.arguments as { amount: string }).amount);
      const decision = amount <= 50 ? "approved" : "rejected";
      const note = amount <= 50 ? "damage photo checked" : "over 50.00: needs a return";
      await support.resolveApproval(pending.id, decision, { actor: "lead@acme", note });
      console.log(`  person: ${decision} "${String(pending.title)}"`);
    }
  }
}
stop.abort();
await worker;

let failed = 0;
for (const run of runs) {
  const final = await support.getRun(run.id);
  const [overview] = await support.query("SELECT steps, tool_calls, cost FROM ledger.run_overview WHERE id = $1", [run.id]);
  const ready = await support.replayReady(run.id);
  console.log(`${run.id}: ${final?.status}: ${final?.outputSummary}`);
  const [steps, calls, cost] = [overview?.["steps"], overview?.["tool_calls"], overview?.["cost"]];
  console.log(`  steps ${String(steps)}, tool calls ${String(calls)}, cost ${JSON.stringify(cost)}`);
  console.log(`  replay_ready ${String(ready["status"])}`);
  if (final?.status !== "succeeded") failed++;
}
await ledger.close();
process.exitCode = failed ? 1 : 0;
