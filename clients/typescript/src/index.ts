/**
 * A thin TypeScript client of the `ledger` PostgreSQL extension over node-postgres: a scope-aware
 * handle with typed results, typed errors, the tool-call helper, a worker loop, a follower of a
 * run's events and an outbox consumer. Every rule (statuses, fencing, redaction, hashing) is the
 * extension's: each helper is a sequence of its SQL calls.
 */
export * from "./client.js";
export { parseConninfo } from "./conninfo.js";
export { NotEncodableError, toJson } from "./encoding.js";
export * from "./errors.js";
export { isConnectionError, reconnecting, RECONNECT_DELAYS_MS } from "./faults.js";
export { follow, type FollowOptions } from "./feed.js";
export { DEFAULT_OUTBOX_LEASE_SECONDS, OutboxConsumer, type OutboxConsumerOptions } from "./outbox.js";
export * from "./tool_calls.js";
export * from "./types.js";
export * from "./worker.js";
