// One durable no-op tool call through the TypeScript helper's toolCall on a pooled scoped handle,
// against raw node-postgres on one client that stated its scope once: the three statements (claim,
// begin, complete) and the two the helper sends (claimToolCalls with begin, complete); alternating
// blocks. Prints one line as bench_py.py does.
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
};
const samples = { helper: [], raw: [], raw2: [] };
for (let block = 0; block <= blocks; block++) { // block 0 warms every way up and is not counted
  if (block === 1) await raw.query("ANALYZE"); // as autovacuum would within its minute: plans for tables that grew
  for (const [name, way] of Object.entries(ways)) {
    for (let i = 0; i < calls; i++) {
      n++;
      const start = process.hrtime.bigint();
      await way();
      if (block) samples[name].push(Number(process.hrtime.bigint() - start) / 1e6);
    }
  }
}
const row = ["typescript"];
for (const name of ["helper", "raw", "raw2"]) {
  const sorted = [...samples[name]].sort((a, b) => a - b);
  const total = sorted.reduce((a, b) => a + b, 0);
  row.push(sorted[Math.floor(sorted.length / 2)].toFixed(3), (sorted.length / (total / 1000)).toFixed(0));
}
console.log(row.join("\t"));
await raw.end();
await pool.end();
