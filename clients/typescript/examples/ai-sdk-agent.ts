// A support agent on the Vercel AI SDK, under the ledger: it looks an order up and refunds it once a
// person approves (in SQL, as the console does); the second turn replays the lookup, runs the refund
// once, and records the answer and the model's costs.
// Run it against `make demo`: LEDGER_DSN='host=... port=28915 user=postgres dbname=ledger_demo'.
import { generateText, isStepCount, jsonSchema, tool, type ModelMessage } from "ai";
import { MockLanguageModelV4 } from "ai/test";
import { Ledger } from "ledger-client";
import { LedgerAi } from "ledger-client/ai-sdk";

const dsn = process.env["LEDGER_DSN"];
if (!dsn) throw new Error("set LEDGER_DSN (make demo prints it)");
const ledger = Ledger.connect(dsn);
const support = ledger.scoped("acme", "examples-ai-sdk");

// The tools: stand-ins for your APIs. The refund is the side effect that must happen once.
const order = jsonSchema<{ order: number }>({ type: "object", properties: { order: { type: "number" } }, required: ["order"] });
const tools = {
  lookupOrder: tool({
    description: "Look an order up",
    inputSchema: order,
    execute: async ({ order }: { order: number }) => {
      console.log(`  crm: lookup ${order}`);
      return { order, status: "delivered damaged", paid: "12.50" };
    },
  }),
  refund: tool({
    description: "Refund an order",
    inputSchema: jsonSchema<{ order: number; amount: string }>({
      type: "object",
      properties: { order: { type: "number" }, amount: { type: "string" } },
    }),
    execute: async ({ order, amount }: { order: number; amount: string }) => {
      console.log(`  payments: refund ${amount} for order ${order}`);
      return { refunded: amount, reference: `rf-${order}` };
    },
  }),
};

// The model: a stand-in for your provider's (the AI SDK's mock, scripted on what the prompt holds).
const usage = {
  inputTokens: { total: 120, noCache: 120, cacheRead: undefined, cacheWrite: undefined },
  outputTokens: { total: 30, text: 30, reasoning: undefined },
};
const model = new MockLanguageModelV4({
  doGenerate: async ({ prompt }) => {
    const results = prompt.flatMap((m) => (m.role === "tool" ? m.content : [])).flatMap((p) => (p.type === "tool-result" ? [p] : []));
    const call = (toolCallId: string, toolName: string, input: object) => ({
      content: [{ type: "tool-call" as const, toolCallId, toolName, input: JSON.stringify(input) }],
      finishReason: { unified: "tool-calls" as const, raw: undefined },
      usage,
      warnings: [],
    });
    if (results.length === 0) return call("call-lookup-1042", "lookupOrder", { order: 1042 });
    if (results.length === 1) return call("call-refund-1042", "refund", { order: 1042, amount: "12.50" });
    const text = "Sorry about the parcel: 12.50 is refunded (rf-1042).";
    return { content: [{ type: "text", text }], finishReason: { unified: "stop", raw: undefined }, usage, warnings: [] };
  },
});

// One user turn is one ledger run, found again by its request id: a repeat of the turn (after a
// crash, or once a person decided) redoes nothing that was done.
const messages: ModelMessage[] = [{ role: "user", content: "My parcel 1042 arrived damaged." }];
const turnId = `conversation-1042-${Date.now()}:turn-1`;
async function turn(): Promise<LedgerAi> {
  const ai = await LedgerAi.start(support, turnId, {
    inputs: { messages },
    userId: "customer-7",
    approvals: { refund: { title: "Refund 12.50 for order 1042", policyRef: "refunds-over-10" } },
    price: (u) => ({ amount: ((u.inputTokens ?? 0) * 2 + (u.outputTokens ?? 0) * 6) / 1_000_000, currency: "USD" }),
  });
  const result = await generateText({
    model,
    messages,
    tools: ai.tools(tools),
    toolApproval: ai.toolApproval,
    stopWhen: [isStepCount(5), ai.stopWhen],
    telemetry: { integrations: [ai.telemetry] },
  });
  const outcome = await ai.finish(result);
  console.log(`run ${ai.runId}: ${outcome.status}: ${outcome.status === "succeeded" ? outcome.text : outcome.reason}`);
  return ai;
}

const first = await turn(); // the lookup runs; the refund waits for a person
const [approval] = await support.pendingApprovals({ runId: first.runId });
if (approval === undefined) throw new Error("no approval asked for");
console.log(`person: approves "${approval.title}"`);
await support.query("SELECT ledger.resolve_approval($1, 'approved', actor => 'lead@acme', note => 'damage photo checked')", [approval.id]);
await turn(); // the lookup is replayed, the refund runs once, the answer is recorded
console.log(`replay_ready: ${(await support.replayReady(first.runId))["status"]}`);
await ledger.close();
