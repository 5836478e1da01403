/**
 * Connection strings: node-postgres's `connectionString` takes a URL only, while the ledger's
 * tools print libpq's `key=value` form (`host=/tmp/x port=28915 user=postgres dbname=ledger_demo`).
 * This reads both into a `pg.ClientConfig`.
 */
import type pg from "pg";

const KEYS: Record<string, keyof pg.ClientConfig> = {
  host: "host",
  hostaddr: "host",
  port: "port",
  user: "user",
  dbname: "database",
  password: "password",
  application_name: "application_name",
  connect_timeout: "connectionTimeoutMillis",
};

/** Splits a libpq conninfo into its pairs: values may be single-quoted, with `\'` and `\\` escapes. */
function pairs(conninfo: string): [string, string][] {
  const out: [string, string][] = [];
  const re = /\s*([A-Za-z_]+)\s*=\s*(?:'((?:[^'\\]|\\.)*)'|([^\s']*))/y;
  let at = 0;
  for (let match = re.exec(conninfo); match !== null && match[0] !== ""; match = re.exec(conninfo)) {
    const [, key = "", quoted, bare] = match;
    out.push([key, quoted !== undefined ? quoted.replace(/\\(.)/g, "$1") : (bare ?? "")]);
    at = re.lastIndex;
  }
  if (conninfo.slice(at).trim() !== "") {
    throw new Error(`ledger: cannot read the connection string near "${conninfo.slice(at, at + 20).trim()}"`);
  }
  return out;
}

/**
 * A `pg.ClientConfig` for `dsn`: a URL is passed as `connectionString`; a conninfo is read key by
 * key (`host` may be a socket directory; `connect_timeout` is in seconds, as libpq has it).
 * Unknown keys are refused rather than ignored.
 */
export function parseConninfo(dsn: string): pg.ClientConfig {
  if (/^postgres(ql)?:\/\//.test(dsn)) return { connectionString: dsn };
  const config: Record<string, unknown> = {};
  for (const [key, value] of pairs(dsn)) {
    const target = KEYS[key];
    if (target === undefined) throw new Error(`ledger: connection option ${key} is not supported here; use a URL`);
    config[target] = key === "port" ? Number(value) : key === "connect_timeout" ? Number(value) * 1000 : value;
  }
  return config as pg.ClientConfig;
}
