// One durable no-op tool call through the TypeScript helper's toolCall on a pooled scoped handle,
// against raw node-postgres on one client that stated its scope once: the three statements (claim,
// begin, complete) and the two the helper sends (claimToolCalls with begin, complete); alternating
// blocks. Prints one line as bench_py.py does; then the repeatable path (toolCall with repeatable:
// true, and its raw find_tool_call + record_tool_call) beside the helper, with WAL per call.
import { createRequire } from "node:module";

const typescript = new URL("../../clients/typescript/", import.meta.url);
const pg = createRequire(new URL("package.json", typescript))("pg");
const { Ledger, toolCall } = await import(new URL("dist/src/index.js", typescript).href);

const [dsn, calls, blocks] = [process.argv[2], Number(process.argv[3]), Number(process.argv[4])];
const scope = ["bench", "clients"];
const noop = async () => ({ ok: true });

const pool = new pg.Pool({ connectionString: dsn, max: 1 });
const raw = new pg.Client({ connectionString: dsn });
await raw.connect();
await raw.query("SELECT ledger.set_scope($1, $2)", scope);
const stamp = `${Date.now()}`;
const [helperRun, rawRun] = [`th-${stamp}`, `tr-${stamp}`];
for (const id of [helperRun, rawRun]) await raw.query("SELECT ledger.create_run('agent', run_id => $1)", [id]);
const scoped = new Ledger(pool).scoped(...scope);
let n = 0;

const ways = {
  helper: () => toolCall(scoped, { runId: helperRun, toolCallId: `c-${n}`, toolRef: "bench.noop", arguments: { n }, execute: noop }),
  raw: async () => {
    const claim = await raw.query("SELECT ledger.claim_tool_call($1, $2, $3, tool_call_id => $4) AS c",
      [rawRun, "bench.noop", JSON.stringify({ n }), `c-${n}`]);
    const record = claim.rows[0].c.tool_call;
    await raw.query("SELECT ledger.begin_tool_call($1, $2)", [record.id, record.attempt]);
    await raw.query("SELECT ledger.complete_tool_call($1, $2, 'succeeded', result => $3)",
      [record.id, record.attempt, JSON.stringify(await noop())]);
  },
  raw2: async () => {
    const calls = JSON.stringify([{ tool_ref: "bench.noop", arguments: { n }, tool_call_id: `c-${n}` }]);
    const claim = await raw.query("SELECT claim FROM ledger.claim_tool_calls($1, $2, begin => true)", [rawRun, calls]);
    const record = claim.rows[0].claim.tool_call;
    await raw.query("SELECT ledger.complete_tool_call($1, $2, 'succeeded', result => $3)",
      [record.id, record.attempt, JSON.stringify(await noop())]);
  },
  rep: () =>
    toolCall(scoped, { runId: helperRun, toolCallId: `c-${n}`, toolRef: "bench.noop", arguments: { n }, execute: noop, repeatable: true }),
  rawRep: async () => {
    const found = await raw.query("SELECT ledger.find_tool_call($1, $2, $3, tool_call_id => $4) AS f",
      [rawRun, "bench.noop", JSON.stringify({ n }), `c-${n}`]);
    if (found.rows[0].f.outcome !== "unrecorded") throw new Error("bench: the call was recorded already");
    await raw.query("SELECT ledger.record_tool_call($1, $2, $3, 'succeeded', $4, tool_call_id => $5)",
      [rawRun, "bench.noop", JSON.stringify({ n }), JSON.stringify(await noop()), `c-${n}`]);
  },
};
const samples = { helper: [], raw: [], raw2: [], rep: [], rawRep: [] };
const wal = { helper: 0, raw: 0, raw2: 0, rep: 0, rawRep: 0 };
const lsn = async () => Number((await raw.query("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn AS l")).rows[0].l);
for (let block = 0; block <= blocks; block++) { // block 0 warms every way up and is not counted
  if (block === 1) await raw.query("ANALYZE"); // as autovacuum would within its minute: plans for tables that grew
  for (const [name, way] of Object.entries(ways)) {
    const before = await lsn();
    for (let i = 0; i < calls; i++) {
      n++;
      const start = process.hrtime.bigint();
      await way();
      if (block) samples[name].push(Number(process.hrtime.bigint() - start) / 1e6);
    }
    if (block) wal[name] += (await lsn()) - before;
  }
}
const stats = (name) => {
  const sorted = [...samples[name]].sort((a, b) => a - b);
  const total = sorted.reduce((a, b) => a + b, 0);
  return [sorted[Math.floor(sorted.length / 2)].toFixed(3), (sorted.length / (total / 1000)).toFixed(0)];
};
const kb = (name) => (wal[name] / samples[name].length / 1024).toFixed(2);
console.log(["typescript", ...stats("helper"), ...stats("raw"), ...stats("raw2")].join("\t"));
console.log(["repeatable", "typescript", ...stats("rep"), ...stats("rawRep"), ...stats("helper"), kb("rep"), kb("rawRep"), kb("helper")].join("\t"));
await raw.end();
await pool.end();
