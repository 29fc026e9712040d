// The attribution context of `InflightClient.withContext`: what it may hold,
// how a context is checked (as the server checks a begin's fields), how a
// nested one merges over its parent, and how a begin takes it.
import type { BeginRequest, Priority } from "./wire.js";
import { LABEL_PATTERN, PRIORITIES } from "./wire.js";

/**
 * Attribution that every record begun inside `withContext` takes for the
 * fields its spec leaves out (`undefined`). A field left out here is
 * inherited from the enclosing context, if any.
 */
export interface ActivityContext {
  service?: string;
  operationStage?: string;
  priority?: Priority;
}

const CONTEXT_FIELDS = ["service", "operationStage", "priority"] as const satisfies readonly (keyof ActivityContext)[];
const LABEL_FIELDS = ["service", "operationStage"] as const satisfies readonly (keyof ActivityContext)[];
/** The server's label rule: `LABEL_PATTERN` decides; the two below only word the refusal. */
const LABEL = new RegExp(LABEL_PATTERN);
const MAX_LABEL_LEN = 64;
const LABEL_CHAR = /[A-Za-z0-9._-]/;

/**
 * The context as given, checked: an object with no field but `service`,
 * `operationStage` and `priority`, each `undefined` or what a begin accepts
 * (a label; a priority of `PRIORITIES`). Throws a `TypeError` naming the
 * field otherwise. Returns a frozen copy of the fields that are set.
 */
export function checkContext(context: unknown, where = "withContext"): Readonly<ActivityContext> {
  if (context === null || typeof context !== "object" || Array.isArray(context)) {
    throw new TypeError(`${where}: the context must be an object ({ service, operationStage, priority }), not ${describe(context)}`);
  }
  const given = context as Record<string, unknown>;
  for (const key of Object.keys(given)) {
    if (!(CONTEXT_FIELDS as readonly string[]).includes(key)) {
      throw new TypeError(`${where}: unknown field ${JSON.stringify(key)} (a context has ${CONTEXT_FIELDS.join(", ")})`);
    }
  }
  const checked: ActivityContext = {};
  for (const field of LABEL_FIELDS) {
    const value = given[field];
    if (value === undefined) continue;
    const problem = labelProblem(value);
    if (problem !== undefined) throw new TypeError(`${where}: invalid ${field}: ${problem}`);
    checked[field] = value as string;
  }
  const priority = given.priority;
  if (priority !== undefined) {
    if (!(PRIORITIES as readonly unknown[]).includes(priority)) {
      throw new TypeError(
        `${where}: invalid priority: ${describe(priority)} is not one of ${PRIORITIES.map((p) => JSON.stringify(p)).join(", ")}`,
      );
    }
    checked.priority = priority as Priority;
  }
  return Object.freeze(checked);
}

/** What is wrong with `value` as a label, in the server's words; `undefined` when nothing. */
function labelProblem(value: unknown): string | undefined {
  if (typeof value !== "string") return `must be a string, not ${describe(value)}`;
  if (LABEL.test(value)) return undefined;
  if (value.length === 0) return "must not be empty";
  if (value.length > MAX_LABEL_LEN) return `must be at most ${MAX_LABEL_LEN} characters`;
  for (const c of value) {
    if (!LABEL_CHAR.test(c)) return `character ${JSON.stringify(c)} is not allowed (use A-Z, a-z, 0-9, '.', '_', '-')`;
  }
  return `must match ${LABEL_PATTERN}`;
}

/** A value as a refusal names it: a string quoted, an object or an array by its kind. */
export function describe(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "an array";
  return typeof value === "string" ? JSON.stringify(value) : typeof value === "object" ? "an object" : String(value);
}

/** `inner` over `outer`: the inner context's fields win, the ones it leaves out are the outer's. */
export function mergeContexts(
  outer: Readonly<ActivityContext> | undefined,
  inner: Readonly<ActivityContext>,
): Readonly<ActivityContext> {
  if (outer === undefined) return inner;
  const merged: ActivityContext = { ...outer };
  for (const field of CONTEXT_FIELDS) {
    const value = inner[field];
    if (value !== undefined) (merged as Record<string, unknown>)[field] = value;
  }
  return Object.freeze(merged);
}

/** The spec with the context's values for the fields the spec leaves `undefined`; the spec's own win. */
export function withContextFields<S extends Partial<BeginRequest>>(spec: S, context: Readonly<ActivityContext> | undefined): S {
  if (context === undefined) return spec;
  const filled: S = { ...spec };
  for (const field of CONTEXT_FIELDS) {
    if (filled[field] === undefined && context[field] !== undefined) {
      (filled as Record<string, unknown>)[field] = context[field];
    }
  }
  return filled;
}
