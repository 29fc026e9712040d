// A call's token usage: checking the usage a caller reports (as the server
// checks a settle's), and reading it from a provider's answer for `run`.
import { describe } from "./context.js";
import type { Usage } from "./wire.js";
import { FIELDS, MAX_USAGE_TOKENS } from "./wire.js";

const USAGE_FIELDS: readonly (keyof Usage)[] = FIELDS.Usage;

/** Whether `value` is a count a settle's `usage` takes: a whole number from 0 to `MAX_USAGE_TOKENS`. */
function isTokenCount(value: unknown): value is number {
  return typeof value === "number" && Number.isInteger(value) && value >= 0 && value <= MAX_USAGE_TOKENS;
}

/**
 * The usage as given, checked as the server checks a settle's: `undefined`,
 * `null`, or an object with no field but `inputTokens` and `outputTokens`,
 * each `undefined`, `null` (not reported) or a whole number from 0 to
 * `MAX_USAGE_TOKENS`. Throws a `TypeError` naming the field
 * (`usage.inputTokens`) otherwise. Returns a copy of the counts that are
 * set, or `undefined` when none is (nothing to send).
 */
export function checkUsage(usage: unknown, where: string): Usage | undefined {
  if (usage === undefined || usage === null) return undefined;
  if (typeof usage !== "object" || Array.isArray(usage)) {
    throw new TypeError(`${where}: usage must be an object ({ inputTokens, outputTokens }), not ${describe(usage)}`);
  }
  const given = usage as Record<string, unknown>;
  for (const key of Object.keys(given)) {
    if (!(USAGE_FIELDS as readonly string[]).includes(key)) {
      throw new TypeError(`${where}: unknown field usage.${key} (usage has ${USAGE_FIELDS.join(", ")})`);
    }
  }
  const checked: Usage = {};
  for (const field of USAGE_FIELDS) {
    const value = given[field];
    if (value === undefined || value === null) continue;
    if (!isTokenCount(value)) {
      throw new TypeError(
        `${where}: invalid usage.${field}: must be a whole number from 0 to ${MAX_USAGE_TOKENS}, not ${describe(value)}`,
      );
    }
    checked[field] = value;
  }
  return Object.keys(checked).length === 0 ? undefined : checked;
}

/**
 * A begin's `maxTokens` as given, checked as the server checks it:
 * `undefined`, `null` (none: the class's default) or a whole number from 0
 * to `MAX_USAGE_TOKENS`. Throws a `TypeError` naming `maxTokens` otherwise.
 */
export function checkMaxTokens(value: unknown, where: string): void {
  if (value === undefined || value === null || isTokenCount(value)) return;
  throw new TypeError(`${where}: invalid maxTokens: must be a whole number from 0 to ${MAX_USAGE_TOKENS}, not ${describe(value)}`);
}

/**
 * The usage of two counts read from an answer: `undefined` when neither is
 * present, or when one present is not a whole number from 0 to
 * `MAX_USAGE_TOKENS` (an answer with a count that makes no sense is not
 * trusted for the other either).
 */
function counts(input: unknown, output: unknown): Usage | undefined {
  if (input === undefined && output === undefined) return undefined;
  if (input !== undefined && !isTokenCount(input)) return undefined;
  if (output !== undefined && !isTokenCount(output)) return undefined;
  return {
    ...(input === undefined ? {} : { inputTokens: input }),
    ...(output === undefined ? {} : { outputTokens: output }),
  };
}

function objectAt(value: unknown, key: string): Record<string, unknown> | undefined {
  if (typeof value !== "object" || value === null) return undefined;
  const found = (value as Record<string, unknown>)[key];
  return typeof found === "object" && found !== null && !Array.isArray(found) ? (found as Record<string, unknown>) : undefined;
}

/**
 * The token usage in a provider's answer, as `run` reads it from what its
 * function returns:
 *
 * - OpenAI Chat Completions (and Completions, Embeddings):
 *   `usage.prompt_tokens`, `usage.completion_tokens`;
 * - OpenAI Responses: `usage.input_tokens`, `usage.output_tokens`;
 * - Ollama (`/api/chat`, `/api/generate`, `/api/embed`):
 *   `prompt_eval_count`, `eval_count`;
 * - Gemini: `usageMetadata.promptTokenCount`, `usageMetadata.candidatesTokenCount`.
 *
 * Either count may be missing (an embedding has no output). `undefined`
 * for any other value, and for a shape whose count is not a whole number
 * from 0 to 1000000000. It never throws.
 */
export function usageOf(result: unknown): Usage | undefined {
  try {
    if (typeof result !== "object" || result === null) return undefined;
    const usage = objectAt(result, "usage");
    if (usage !== undefined) {
      if (usage.prompt_tokens !== undefined || usage.completion_tokens !== undefined) {
        return counts(usage.prompt_tokens, usage.completion_tokens);
      }
      if (usage.input_tokens !== undefined || usage.output_tokens !== undefined) {
        return counts(usage.input_tokens, usage.output_tokens);
      }
    }
    const metadata = objectAt(result, "usageMetadata");
    if (metadata !== undefined) {
      return counts(metadata.promptTokenCount, metadata.candidatesTokenCount);
    }
    const answer = result as Record<string, unknown>;
    return counts(answer.prompt_eval_count, answer.eval_count);
  } catch {
    // A getter or a proxy that throws: no usage, never an error.
    return undefined;
  }
}

/**
 * What `run` settles with, of what its extractor returned: the counts when
 * they are valid usage, else `undefined` (an extractor's mistake never
 * costs the settle).
 */
export function extractedUsage(value: unknown): Usage | undefined {
  try {
    return checkUsage(value, "usage");
  } catch {
    return undefined;
  }
}
