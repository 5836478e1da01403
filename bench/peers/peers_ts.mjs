// One worker of bench/peers/peers.py's "ledger TS helper" design: durable no-op tool calls through
// the TypeScript helper's toolCall on a pooled scoped handle (a pool of one). It speaks to its
// Python worker process on stdin/stdout: warms up, prints "ready", calls from "go" until "stop",
// then prints the latencies (seconds, JSON) and leaves at "leave".
//   node peers_ts.mjs URL WARMUP
import { createRequire } from "node:module";
import { createInterface } from "node:readline";

const typescript = new URL("../../clients/typescript/", import.meta.url);
const pg = createRequire(new URL("package.json", typescript))("pg");
const { Ledger, toolCall } = await import(new URL("dist/src/index.js", typescript).href);

const [url, warmup] = [process.argv[2], Number(process.argv[3])];
const pool = new pg.Pool({ connectionString: url, max: 1 });
const scoped = new Ledger(pool).scoped("bench", "peers");
const runId = `peer-ts-${process.pid}-${Date.now()}`;
await scoped.createRun("agent", { runId });
let n = 0;
const call = () => {
  n++;
  return toolCall(scoped, { runId, toolCallId: `c-${n}`, toolRef: "bench.noop", arguments: { n }, execute: async () => ({ ok: true }) });
};

const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const expect = async (word) => {
  const { value } = await lines.next();
  if (value !== word) throw new Error(`expected ${word}, got ${value}`);
};
for (let i = 0; i < warmup; i++) await call();
console.log("ready");
await expect("go");
let stop = false;
const stopped = expect("stop").then(() => { stop = true; });
const samples = [];
while (!stop) {
  const start = process.hrtime.bigint();
  await call();
  samples.push(Number(process.hrtime.bigint() - start) / 1e9);
}
await stopped;
console.log(JSON.stringify(samples));
await expect("leave");
await pool.end();
