/**
 * The one rule by which the client turns your values into JSON (tool arguments and results, run
 * inputs, payloads): JSON's, plus the common types JSON gets wrong or refuses.
 *
 * - `bigint` → its decimal string; `Date` → ISO 8601 (its `toJSON`); `Buffer` and `Uint8Array`
 *   → a base64 string; `Map` → an object (keys as strings); `Set` → an array;
 * - any other object with `toJSON` as JSON does, then the result by this rule; other objects by
 *   their own enumerable properties; `undefined` leaves a property out (`null` in an array);
 * - a function, a symbol, a cycle, a number that is not finite (`NaN`, `Infinity`) or a `Map`
 *   key that is not a string, number, bigint or boolean cannot be encoded: {@link NotEncodableError}
 *   names where it is and what it is, and nothing is sent.
 */

/** A value this client cannot encode as JSON: `path` says where (`$.items[2]`), `type` what it is. */
export class NotEncodableError extends TypeError {
  constructor(
    readonly path: string,
    readonly type: string,
    /** What was being encoded (a call's arguments), for the message. */
    what?: string,
  ) {
    super(`ledger: ${what ? `${what}: ` : ""}cannot encode ${type} at ${path} as JSON`);
    this.name = new.target.name;
  }
}

function typeName(value: unknown): string {
  if (typeof value === "function") return `a function${value.name ? ` (${value.name})` : ""}`;
  if (typeof value === "symbol") return `a symbol (${value.toString()})`;
  if (typeof value === "number") return `the number ${String(value)}`;
  return typeof value;
}

/** `value` as plain JSON data (objects, arrays, strings, finite numbers, booleans, null) by the rule above. */
export function toJson(value: unknown): unknown {
  const stack = new Set<object>();
  const walk = (v: unknown, path: string, inArray: boolean): unknown => {
    switch (typeof v) {
      case "string":
      case "boolean":
        return v;
      case "number":
        if (!Number.isFinite(v)) throw new NotEncodableError(path, typeName(v));
        return v;
      case "bigint":
        return v.toString();
      case "undefined":
        return inArray ? null : undefined;
      case "function":
      case "symbol":
        throw new NotEncodableError(path, typeName(v));
    }
    if (v === null) return null;
    const obj = v as object;
    if (stack.has(obj)) throw new NotEncodableError(path, `a cycle (${obj.constructor?.name ?? "Object"})`);
    stack.add(obj);
    try {
      if (obj instanceof Uint8Array) return Buffer.from(obj.buffer, obj.byteOffset, obj.byteLength).toString("base64");
      if (obj instanceof Date) return obj.toJSON();
      if (Array.isArray(obj)) return obj.map((item, i) => walk(item, `${path}[${i}]`, true));
      if (obj instanceof Set) return [...obj].map((item, i) => walk(item, `${path}[${i}]`, true));
      const out: Record<string, unknown> = {};
      const put = (key: string, item: unknown): void => {
        const encoded = walk(item, `${path}.${key}`, false);
        if (encoded !== undefined) out[key] = encoded;
      };
      if (obj instanceof Map) {
        for (const [key, item] of obj) {
          if (!["string", "number", "bigint", "boolean"].includes(typeof key)) throw new NotEncodableError(`${path}`, `a Map key of type ${typeof key}`);
          put(String(key), item);
        }
        return out;
      }
      const toJSON = (obj as { toJSON?: unknown }).toJSON;
      if (typeof toJSON === "function") return walk(toJSON.call(obj), path, inArray);
      for (const [key, item] of Object.entries(obj)) put(key, item);
      return out;
    } finally {
      stack.delete(obj);
    }
  };
  return walk(value, "$", false);
}
