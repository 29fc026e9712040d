// A provider's `Retry-After`, read from its answer (a fetch `Response`, or
// an SDK's error carrying the status and headers), for a failure's settle.

import { MAX_RETRY_AFTER_MS } from "./wire.js";

/**
 * Headers as the answers of `fetch` and of SDKs carry them: with a `get`
 * (the Web `Headers`, as `fetch` and the `openai` package from version 5
 * give), or a plain object of names to values (as the `openai` package
 * before version 5 and Node's `http` give), whose names are matched
 * without regard to case.
 */
export type HeadersLike =
  | { get(name: string): string | null | undefined }
  | Record<string, string | readonly string[] | number | null | undefined>;

/** What `retryAfterMs` reads: an HTTP status and the answer's headers. */
export interface RetryAfterSource {
  status?: unknown;
  headers?: unknown;
}

/** The statuses whose `Retry-After` asks a client to wait: 429 Too Many Requests, 503 Service Unavailable. */
const RETRY_STATUSES: ReadonlySet<number> = new Set([429, 503]);

const DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
const LONG_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
const MONTH = `(?<month>${MONTHS.join("|")})`;
const TIME = "(?<hour>\\d{2}):(?<minute>\\d{2}):(?<second>\\d{2})";
/** `Sun, 06 Nov 1994 08:49:37 GMT` (IMF-fixdate, the form senders must send). */
const IMF_FIXDATE = new RegExp(`^(?:${DAYS.join("|")}), (?<day>\\d{2}) ${MONTH} (?<year>\\d{4}) ${TIME} GMT$`);
/** `Sunday, 06-Nov-94 08:49:37 GMT` (the obsolete RFC 850 form). */
const RFC850_DATE = new RegExp(`^(?:${LONG_DAYS.join("|")}), (?<day>\\d{2})-${MONTH}-(?<yy>\\d{2}) ${TIME} GMT$`);
/** `Sun Nov  6 08:49:37 1994` (the obsolete asctime form). */
const ASCTIME_DATE = new RegExp(`^(?:${DAYS.join("|")}) ${MONTH} (?<day> \\d|\\d{2}) ${TIME} (?<year>\\d{4})$`);

/** The time of an HTTP-date (RFC 9110 §5.6.7: its three forms), in epoch milliseconds, or `undefined`. */
function parseHttpDate(value: string, now: number): number | undefined {
  const g = (IMF_FIXDATE.exec(value) ?? RFC850_DATE.exec(value) ?? ASCTIME_DATE.exec(value))?.groups;
  if (g === undefined) return undefined;
  let year: number;
  if (g.yy !== undefined) {
    // A two-digit year more than 50 years ahead is of the past century (RFC 9110 §5.6.7).
    const thisYear = new Date(now).getUTCFullYear();
    year = Math.floor(thisYear / 100) * 100 + Number(g.yy);
    if (year > thisYear + 50) year -= 100;
  } else {
    year = Number(g.year);
  }
  const [day, hour, minute, second] = [g.day, g.hour, g.minute, g.second].map(Number) as [number, number, number, number];
  const time = Date.UTC(year, MONTHS.indexOf(g.month!), day, hour, minute, second);
  // A date that does not exist (31 Feb, 25:00) is not one: Date.UTC would roll it over.
  const d = new Date(time);
  if (d.getUTCFullYear() !== year || d.getUTCDate() !== day || d.getUTCHours() !== hour || d.getUTCMinutes() !== minute || d.getUTCSeconds() !== second) {
    return undefined;
  }
  return time;
}

/** The header's value, from headers with a `get` or a plain object (any case), or `undefined`. */
function headerValue(headers: unknown, name: string): string | undefined {
  if (typeof headers !== "object" || headers === null) return undefined;
  const get = (headers as { get?: unknown }).get;
  let value: unknown;
  if (typeof get === "function") {
    value = (get as (n: string) => unknown).call(headers, name);
  } else {
    const key = Object.keys(headers).find((k) => k.toLowerCase() === name);
    value = key === undefined ? undefined : (headers as Record<string, unknown>)[key];
  }
  if (Array.isArray(value)) value = value[0];
  if (typeof value === "number") value = String(value);
  return typeof value === "string" ? value : undefined;
}

/**
 * The `Retry-After` of an answer, in milliseconds from `now`, clamped to 1
 * to 3600000 (what a settle's `retryAfterMs` takes): for a 429 or a 503
 * only, as delta-seconds (`120`) or an HTTP-date (`Wed, 21 Oct 2015
 * 07:28:00 GMT`, or its two obsolete forms; a date already past is 1).
 * `undefined` when the answer is of another status, has no `Retry-After`,
 * or one that is neither form.
 *
 * `response` is a fetch `Response`, or any object with a numeric `status`
 * and `headers` (with a `get`, or a plain object of names to values): the
 * `openai` package's `APIError` is one.
 * `now` (epoch milliseconds, default the present) is what an HTTP-date is
 * measured from.
 *
 * ```js
 * const res = await fetch(url, init);
 * if (!res.ok) await activity.fail("provider", { retryAfterMs: retryAfterMs(res) });
 * ```
 */
export function retryAfterMs(response: RetryAfterSource | null | undefined, now: number = Date.now()): number | undefined {
  if (typeof response !== "object" || response === null) return undefined;
  if (typeof response.status !== "number" || !RETRY_STATUSES.has(response.status)) return undefined;
  const value = headerValue(response.headers, "retry-after")?.trim();
  if (value === undefined || value === "") return undefined;
  let ms: number;
  if (/^\d+$/.test(value)) {
    ms = Number(value) * 1000;
  } else {
    const at = parseHttpDate(value, now);
    if (at === undefined) return undefined;
    ms = at - now;
  }
  return Math.min(MAX_RETRY_AFTER_MS, Math.max(1, Math.ceil(ms)));
}

/**
 * `ms` as a settle's `retryAfterMs`: rounded and kept within 1 to 3600000;
 * `undefined` when it is not a finite number.
 */
export function settleRetryAfterMs(ms: unknown): number | undefined {
  if (typeof ms !== "number" || !Number.isFinite(ms)) return undefined;
  return Math.min(MAX_RETRY_AFTER_MS, Math.max(1, Math.round(ms)));
}

/**
 * The provider's `Retry-After` in an error thrown by `run`'s function: of
 * its `response` (a fetch `Response`, or an object with `status` and
 * `headers`), else of the error itself when it has `status` and `headers`
 * (the `openai` package's `APIError`). The ledger's own errors carry no
 * `headers`, so a refusal of the ledger inside the function cools nothing.
 */
export function retryAfterOfError(err: unknown): number | undefined {
  if (typeof err !== "object" || err === null) return undefined;
  const response = (err as { response?: unknown }).response;
  const fromResponse = typeof response === "object" && response !== null ? retryAfterMs(response as RetryAfterSource) : undefined;
  return fromResponse ?? retryAfterMs(err as RetryAfterSource);
}
