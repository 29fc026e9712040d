// retryAfterMs(response): a provider's Retry-After read from its answer,
// for a failure's settle. No server: the function reads only its argument.
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import { errorFor, InflightError, isInflightError, LaneCoolingError, MAX_RETRY_AFTER_MS, retryAfterMs } from "../dist/index.js";

const NOW = Date.parse("2026-03-04T12:00:00.000Z");
/** An answer of `status` with a `Retry-After` of `value` (none when undefined), as fetch gives it. */
const answer = (status, value) => new Response(null, { status, headers: value === undefined ? {} : { "Retry-After": value } });

describe("retryAfterMs", () => {
  test("delta-seconds: milliseconds", () => {
    assert.equal(retryAfterMs(answer(429, "1"), NOW), 1_000);
    assert.equal(retryAfterMs(answer(429, "120"), NOW), 120_000);
    assert.equal(retryAfterMs(answer(503, "7"), NOW), 7_000);
    assert.equal(retryAfterMs(answer(429, " 3 "), NOW), 3_000, "surrounding blanks are no part of the value");
    // Without `now`, from the present (delta-seconds do not depend on it).
    assert.equal(retryAfterMs(answer(429, "2")), 2_000);
  });

  test("an HTTP-date: the time from now until then, in each of its three forms", () => {
    // IMF-fixdate, RFC 850 and asctime all name 2026-03-04 12:00:30 GMT.
    assert.equal(retryAfterMs(answer(429, "Wed, 04 Mar 2026 12:00:30 GMT"), NOW), 30_000);
    assert.equal(retryAfterMs(answer(429, "Wednesday, 04-Mar-26 12:00:30 GMT"), NOW), 30_000);
    assert.equal(retryAfterMs(answer(429, "Wed Mar  4 12:00:30 2026"), NOW), 30_000);
    assert.equal(retryAfterMs(answer(503, "Wed, 04 Mar 2026 13:00:00 GMT"), NOW), 3_600_000);
    // From the present when no `now` is given.
    const soon = new Date(Date.now() + 20_000).toUTCString(); // toUTCString is IMF-fixdate
    const ms = retryAfterMs(answer(429, soon));
    assert.ok(ms > 18_000 && ms <= 20_000, `${soon}: ${ms}`);
  });

  test("absent: undefined", () => {
    assert.equal(retryAfterMs(answer(429), NOW), undefined);
    assert.equal(retryAfterMs(answer(429, ""), NOW), undefined);
    assert.equal(retryAfterMs({ status: 429 }, NOW), undefined, "no headers at all");
    assert.equal(retryAfterMs({ status: 429, headers: null }, NOW), undefined);
    assert.equal(retryAfterMs({ status: 429, headers: { "x-ratelimit-reset": "5" } }, NOW), undefined);
    assert.equal(retryAfterMs(undefined), undefined);
    assert.equal(retryAfterMs(null), undefined);
  });

  test("garbage: undefined, never a guess", () => {
    for (const value of [
      "soon",
      "1.5", // delta-seconds are whole
      "-1",
      "+5",
      "1e3",
      "0x10",
      "5 s",
      "Infinity",
      "2026-03-04T12:00:30Z", // ISO 8601 is no HTTP-date
      "Wed, 04 Mar 2026 12:00:30", // no GMT
      "Wed, 04 Mar 2026 12:00:30 PST",
      "Wed, 31 Feb 2026 12:00:30 GMT", // no such day
      "Wed, 04 Mar 2026 25:00:30 GMT", // no such hour
      "Wed, 04 Foo 2026 12:00:30 GMT",
      "Mar 2", // what Date.parse alone would take
    ]) {
      assert.equal(retryAfterMs(answer(429, value), NOW), undefined, JSON.stringify(value));
    }
  });

  test("clamped to 1 .. 3600000 ms", () => {
    assert.equal(MAX_RETRY_AFTER_MS, 3_600_000);
    assert.equal(retryAfterMs(answer(429, "0"), NOW), 1, "now: the least a settle takes");
    assert.equal(retryAfterMs(answer(429, "3600"), NOW), 3_600_000);
    assert.equal(retryAfterMs(answer(429, "3601"), NOW), 3_600_000);
    assert.equal(retryAfterMs(answer(429, "99999999999999999999999"), NOW), 3_600_000);
    assert.equal(retryAfterMs(answer(429, "Wed, 04 Mar 2026 11:59:00 GMT"), NOW), 1, "a date already past");
    assert.equal(retryAfterMs(answer(429, "Sun, 06 Nov 1994 08:49:37 GMT"), NOW), 1);
    assert.equal(retryAfterMs(answer(429, "Thu, 04 Mar 2027 12:00:00 GMT"), NOW), 3_600_000, "a year ahead");
    // A date a fraction of a second ahead is at least 1 ms, never 0.
    assert.equal(retryAfterMs(answer(429, "Wed, 04 Mar 2026 12:00:01 GMT"), NOW + 999.5), 1);
  });

  test("only for a 429 or a 503", () => {
    for (const status of [200, 202, 301, 400, 404, 408, 413, 500, 502, 504]) {
      assert.equal(retryAfterMs(answer(status, "5"), NOW), undefined, String(status));
    }
    assert.equal(retryAfterMs({ status: "429", headers: { "retry-after": "5" } }, NOW), undefined, "a status that is not a number");
    assert.equal(retryAfterMs({ headers: { "retry-after": "5" } }, NOW), undefined, "no status");
  });

  test("headers with a get, or a plain object in any case (the openai package's APIError before and since v5)", () => {
    // openai v5: `status` and a Web `Headers`.
    assert.equal(retryAfterMs({ status: 429, headers: new Headers({ "retry-after": "4" }) }, NOW), 4_000);
    // openai v4: `status` and a plain object of lower-case names.
    assert.equal(retryAfterMs({ status: 429, headers: { "retry-after": "4" } }, NOW), 4_000);
    assert.equal(retryAfterMs({ status: 503, headers: { "Retry-After": "6" } }, NOW), 6_000);
    assert.equal(retryAfterMs({ status: 503, headers: { "RETRY-AFTER": ["8", "9"] } }, NOW), 8_000, "Node's arrays: the first");
    assert.equal(retryAfterMs({ status: 429, headers: { get: (name) => (name === "retry-after" ? "2" : null) } }, NOW), 2_000);
    // An error object with status and headers, as thrown.
    const apiError = Object.assign(new Error("429 Rate limit reached"), { status: 429, headers: { "retry-after": "1" } });
    assert.equal(retryAfterMs(apiError, NOW), 1_000);
  });
});

describe("lane_cooling", () => {
  test("maps to LaneCoolingError, an InflightError with its code", () => {
    const err = errorFor("lane_cooling", "cooling", { status: 429, retryAfterMs: 2_000, fromServer: true });
    assert.ok(err instanceof LaneCoolingError);
    assert.ok(err instanceof InflightError);
    assert.equal(err.name, "LaneCoolingError");
    assert.equal(err.code, "lane_cooling");
    assert.equal(err.retryAfterMs, 2_000);
    assert.equal(isInflightError(err, "lane_cooling"), true);
    assert.equal(isInflightError(err, "lane_full"), false);
  });
});
