/**
 * The manual's promise: every public parameter is in its Reference, so that none is documented
 * only by its signature. The names come from the source (the compiler reads what src/index.ts
 * exports), so a new parameter or option fails here until the manual names it. No database.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import ts from "typescript";

/** The package's directory (this file runs as dist/test/reference.test.js). */
const ROOT = fileURLToPath(new URL("../../", import.meta.url));
const SRC = join(ROOT, "src");
const RECORDS = join(SRC, "types.ts");
const MANUAL = join(ROOT, "README.md");

/**
 * The "### " subsections of the manual's Reference, and what each documents: `name` (a function's
 * parameters, a class's constructor's, an interface's fields, a function type's parameters) or
 * `Class.method` (the method's parameters).
 */
const REFERENCED: Record<string, string[]> = {
  Ledger: ["Ledger", "Ledger.connect", "Ledger.scoped", "parseConninfo"],
  "ScopedLedger, Transaction": [
    "ScopedLedger.transaction",
    "ScopedLedger.query",
    "ScopedLedger.getRun",
    "ScopedLedger.toolCallsInDoubt",
    "ScopedLedger.pendingApprovals",
    "ScopedLedger.failedOutboxEvents",
    "ScopedLedger.setBudget",
    "ScopedLedger.budgets",
    "ScopedLedger.waitRun",
    "ScopedLedger.waitForInput",
    "ScopedLedger.sendInput",
    "ScopedLedger.waitForChildren",
    "ScopedLedger.setSchedule",
    "ScopedLedger.pauseSchedule",
    "ScopedLedger.dropSchedule",
    "ScopedLedger.setRateLimit",
    "ScopedLedger.nextWake",
    "ScopedLedger.inbox",
    "Transaction",
  ],
  work: ["work"],
  RunContext: [
    "RunContext.step",
    "RunContext.llmStep",
    "RunContext.toolCall",
    "RunContext.toolCalls",
    "RunContext.waitUntil",
    "RunContext.waitForInput",
    "RunContext.waitForChildren",
    "ModelReply",
  ],
  "toolCall, toolCalls": ["toolCall", "toolCalls", "ToolFn", "ApprovalRequest"],
  OutboxConsumer: ["OutboxConsumer"],
  follow: ["follow"],
  "Errors, JSON and lost connections": ["toLedgerError", "stopped", "toJson", "isConnectionError", "reconnecting"],
  Records: [
    "parseRun",
    "parseStep",
    "parseClaimedRun",
    "parseToolCall",
    "parseApproval",
    "parseClaim",
    "parseEvent",
    "parseOutboxEvent",
    "parseToolCallInDoubt",
    "parsePendingApproval",
    "parseInbox",
    "parseEvidenceItem",
    "parseCostEntry",
    "parseBudget",
    "parseBudgetUsage",
    "parseMailboxInput",
    "parseInputWait",
    "parseChildRun",
    "parseChildrenWait",
    "parseSchedule",
  ],
};

/** Exported classes users never construct nor call directly: the Reference documents them through others. */
const NOT_REFERENCED: Record<string, string> = {
  LedgerCalls: "the abstract base of ScopedLedger and Transaction: its methods are theirs",
};

/** The compiler's view of the package: what src/index.ts exports, by name. */
const source = (() => {
  const config = ts.getParsedCommandLineOfConfigFile(join(ROOT, "tsconfig.json"), {}, {
    ...ts.sys,
    onUnRecoverableConfigFileDiagnostic: (d) => assert.fail(ts.flattenDiagnosticMessageText(d.messageText, "\n")),
  });
  assert.ok(config, "tsconfig.json could not be read");
  const program = ts.createProgram([join(SRC, "index.ts")], config.options);
  const checker = program.getTypeChecker();
  const index = program.getSourceFile(join(SRC, "index.ts"));
  const module = index && checker.getSymbolAtLocation(index);
  assert.ok(module, "src/index.ts is not a module");
  const exports = new Map<string, ts.Symbol>();
  for (const symbol of checker.getExportsOfModule(module)) {
    exports.set(symbol.name, symbol.flags & ts.SymbolFlags.Alias ? checker.getAliasedSymbol(symbol) : symbol);
  }
  return { checker, exports };
})();

function isInSrc(declaration: ts.Declaration): boolean {
  return declaration.getSourceFile().fileName.startsWith(SRC);
}

/**
 * The fields of an object type of the package that callers fill in (an options interface, a
 * request, an inline `{ ... }`), also behind `?`, `undefined` or an array; null for any other
 * type, and for the records of src/types.ts, which the client returns (a parameter of one, such
 * as `stopped(claim)`, is named, not its fields).
 */
function fieldsOf(type: ts.Type): string[] | null {
  const { checker } = source;
  let t = checker.getNonNullableType(type);
  if (checker.isArrayType(t)) t = checker.getTypeArguments(t as ts.TypeReference)[0] ?? t;
  const declaration = t.getSymbol()?.declarations?.[0];
  if (declaration === undefined || !isInSrc(declaration) || declaration.getSourceFile().fileName === RECORDS) return null;
  if (!ts.isInterfaceDeclaration(declaration) && !ts.isTypeLiteralNode(declaration)) return null;
  return checker.getPropertiesOfType(t).map((p) => p.name);
}

/**
 * The names a signature's callers write: each parameter's, or, for a parameter that is an object
 * of the package (an options object), its fields instead.
 */
function signatureNames(signatures: readonly ts.Signature[], where: ts.Node): string[] {
  const names = new Set<string>();
  for (const signature of signatures) {
    for (const parameter of signature.getParameters()) {
      const fields = fieldsOf(source.checker.getTypeOfSymbolAtLocation(parameter, where));
      for (const name of fields ?? [parameter.name]) names.add(name);
    }
  }
  return [...names];
}

/** The names `target` (`name` or `Class.method`) takes, read from the source. */
function namesOf(target: string): string[] {
  const { checker, exports } = source;
  const [name = "", member] = target.split(".");
  const symbol = exports.get(name);
  assert.ok(symbol, `${name} is not exported by src/index.ts (the test's REFERENCED names it)`);
  const where = symbol.declarations?.[0];
  assert.ok(where, `${name} has no declaration`);
  if (member !== undefined) {
    const method =
      checker.getPropertyOfType(checker.getDeclaredTypeOfSymbol(symbol), member) ??
      checker.getPropertyOfType(checker.getTypeOfSymbol(symbol), member);
    assert.ok(method, `${target} does not exist`);
    return signatureNames(checker.getTypeOfSymbolAtLocation(method, where).getCallSignatures(), where);
  }
  if (symbol.flags & ts.SymbolFlags.Class) return signatureNames(checker.getTypeOfSymbol(symbol).getConstructSignatures(), where);
  if (symbol.flags & ts.SymbolFlags.Function) return signatureNames(checker.getTypeOfSymbol(symbol).getCallSignatures(), where);
  const type = checker.getDeclaredTypeOfSymbol(symbol);
  const calls = type.getCallSignatures();
  if (calls.length > 0) return signatureNames(calls, where);
  return checker.getPropertiesOfType(type).map((p) => p.name);
}

/** Whether an exported class is an error (the client throws those; users do not construct them). */
function isError(symbol: ts.Symbol): boolean {
  const { checker } = source;
  const pending = [checker.getDeclaredTypeOfSymbol(symbol)];
  for (let type = pending.pop(); type !== undefined; type = pending.pop()) {
    if (type.getSymbol()?.name === "Error") return true;
    if (type.isClassOrInterface()) pending.push(...checker.getBaseTypes(type));
  }
  return false;
}

/** The manual's Reference, by "### " subsection. */
function referenceSections(): Map<string, string> {
  const text = readFileSync(MANUAL, "utf8");
  const reference = /^## Reference\n([\s\S]*?)(?=^## |(?![\s\S]))/m.exec(text);
  assert.ok(reference, 'clients/typescript/README.md has no section "## Reference"');
  const parts = (reference[1] ?? "").split(/^### (.*)\n/m);
  const sections = new Map<string, string>();
  for (let i = 1; i + 1 < parts.length; i += 2) sections.set(parts[i] ?? "", parts[i + 1] ?? "");
  return sections;
}

test("the manual's Reference has each subsection the test expects", () => {
  const sections = referenceSections();
  const missing = Object.keys(REFERENCED).filter((heading) => !sections.has(heading));
  assert.deepEqual(missing, [], `the manual's Reference has no ${missing.map((h) => `"### ${h}"`).join(", ")}`);
});

test("every exported function and class is in the Reference, or an error, or known not to need it", () => {
  const targets = Object.values(REFERENCED).flat();
  const covered = (name: string): boolean => targets.some((t) => t === name || t.startsWith(`${name}.`));
  const unreferenced = [...source.exports]
    .filter(([name, symbol]) => symbol.flags & (ts.SymbolFlags.Function | ts.SymbolFlags.Class) && !covered(name))
    .filter(([name, symbol]) => !(name in NOT_REFERENCED) && !(symbol.flags & ts.SymbolFlags.Class && isError(symbol)))
    .map(([name]) => name);
  assert.deepEqual(
    unreferenced,
    [],
    `${unreferenced.join(", ")}: public; add each (and its parameters) to the manual's Reference and to REFERENCED here,` +
      " or to NOT_REFERENCED with the reason users never call it",
  );
});

for (const [heading, targets] of Object.entries(REFERENCED)) {
  for (const target of targets) {
    test(`every public parameter of ${target} is in the Reference's "### ${heading}"`, () => {
      const section = referenceSections().get(heading);
      assert.ok(section !== undefined, `the manual's Reference has no "### ${heading}" (for ${target})`);
      const names = namesOf(target);
      assert.ok(names.length > 0, `${target}: the test read no parameter from the source`);
      const missing = names.filter((name) => !section.includes(`\`${name}\``));
      assert.deepEqual(missing, [], `${target}: ${missing.map((n) => `\`${n}\``).join(", ")} not in the manual's Reference, "### ${heading}"`);
    });
  }
}
