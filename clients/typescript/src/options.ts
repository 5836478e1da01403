/** Checks of the helpers' options, made before anything is written. */

/**
 * `seconds` when it is undefined (the default) or a positive finite number; a `RangeError` before
 * anything is claimed otherwise (a heartbeat of 0 would beat without pause).
 */
export function positiveSeconds(name: string, seconds: number | undefined): number | undefined {
  if (seconds !== undefined && !(Number.isFinite(seconds) && seconds > 0)) {
    throw new RangeError(`ledger: ${name} must be a positive number of seconds, got ${String(seconds)}`);
  }
  return seconds;
}
