// Idempotent begins: every begin carries a fresh `Idempotency-Key` (a random
// UUID), is retried with that key after a lost answer or a 5xx, and is made
// anew with a new key once its answer is known (lane_full, a record that
// ended). First the requests, against a scripted fetch (no server); then
// against the real server, whose repeat answers the record the first made.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  ConflictError,
  IdempotencyConflictError,
  InflightClient,
  isInflightError,
  LaneFullError,
  UnavailableError,
  WaitTimeoutError,
} from "../dist/index.js";
import { laneCounts, sleep, startServer } from "./server.js";

const TOKEN = "ts-idempotency-test-token";
const ID = "01939b1c-0000-7000-8000-0000000000a1";
const OTHER = "01939b1c-0000-7000-8000-0000000000a2";
const UUID_V4 = /^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;

/** A record as the server answers it. */
function record(fields = {}) {
  return {
    activityId: ID, service: "kb", provider: "ollama", class: "embedding", operationStage: "unknown",
    model: "unknown", priority: "unknown", admission: "queued", state: "waiting", disposition: null,
    reapReason: null, ownerId: null, enqueuedAt: "2026-01-01T00:00:00.000Z", startedAt: null,
    completedAt: null, reapedAt: null, deadlineMs: 300000, reapableAt: "2026-01-01T00:20:00.000Z",
    queueWaitMs: null, executionMs: null, success: null, failureStage: null, lateSettle: false,
    refined: false, ...fields,
  };
}
const executing = (fields = {}) => record({ state: "executing", startedAt: "2026-01-01T00:00:00.000Z", queueWaitMs: 0, ...fields });
/** What a repeat answers when the first begin's record has since been cancelled (it never started). */
const cancelled = (fields = {}) => record({ state: "cancelled", completedAt: "2026-01-01T00:00:01.000Z", ...fields });

const json = (status, body, headers = {}) =>
  new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json", ...headers } });
const replay = (body) => json(200, body, { "idempotent-replayed": "true" });
const serverError = (status, code) => json(status, { error: { code, message: `said ${code}` } });
const reset = () =>
  Promise.reject(new TypeError("fetch failed", { cause: Object.assign(new Error("socket hang up"), { code: "ECONNRESET" }) }));

/**
 * A client whose fetch answers from `script` (one function per request, in
 * order; each gets the request and its fetch `init`), recording every
 * request as `{method, path, wait, start, body, key}`.
 */
function scripted(script, options = {}) {
  const seen = [];
  const client = new InflightClient({
    baseUrl: "http://127.0.0.1:9",
    retry: { retries: 3, baseDelayMs: 1 },
    ...options,
    fetch: async (url, init) => {
      const u = new URL(url);
      const request = {
        method: init.method,
        path: u.pathname.replace(ID, "{id}").replace(OTHER, "{other}"),
        start: u.searchParams.get("start"),
        wait: u.searchParams.get("wait"),
        body: init.body ? JSON.parse(init.body) : undefined,
        key: init.headers["idempotency-key"],
      };
      seen.push(request);
      const next = script.shift();
      if (!next) throw new Error(`unscripted request ${request.method} ${request.path}`);
      return next(request, init);
    },
  });
  return { client, seen };
}

const begins = (seen) => seen.filter((r) => r.method === "POST" && r.path === "/v1/activities");

describe("idempotent begins, the requests (a scripted fetch)", () => {
  test("every begin carries a fresh random UUID (v4) as its Idempotency-Key; nothing else carries one", async () => {
    const { client, seen } = scripted([
      () => json(201, record()), // begin
      () => json(201, executing()), // begin ?start=now
      () => json(201, executing()), // begin ?start=now&wait=
      () => json(201, record()), // admit: begin
      () => json(200, executing()), //        start
      () => json(201, record()), // run: begin
      () => json(200, executing()), //      start
      () => json(200, executing({ state: "succeeded", success: true })), // settle
      () => json(201, executing({ admission: "direct" })), // observeUnqueued: begin
      () => json(200, executing({ state: "succeeded", success: true })), // settle
    ]);
    const spec = { service: "kb", provider: "ollama" };
    await client.begin(spec);
    await client.begin(spec, { startNow: true });
    await client.begin(spec, { startNow: true, waitMs: 500 });
    await client.admit(spec);
    await client.run(spec, async () => "ok");
    await client.observeUnqueued(spec, async () => "ok");
    const keys = begins(seen).map((r) => r.key);
    assert.equal(keys.length, 6);
    for (const key of keys) assert.match(key, UUID_V4);
    assert.equal(new Set(keys).size, 6, "a new key for each begin");
    for (const r of seen.filter((r) => r.path !== "/v1/activities")) assert.equal(r.key, undefined, r.path);
  });

  test("a begin whose answer was lost (reset, timed out) is sent again with the same key, body and query", async () => {
    // No answer until the client's own timeout aborts the request (whose
    // timer is unref'd: a real socket would keep the process alive meanwhile).
    const hang = (_r, init) =>
      new Promise((_, reject) => {
        const alive = setTimeout(() => {}, 10_000);
        init.signal.addEventListener("abort", () => (clearTimeout(alive), reject(init.signal.reason)), { once: true });
      });
    for (const options of [{}, { startNow: true }, { startNow: true, waitMs: 40 }]) {
      const { client, seen } = scripted([reset, hang, () => replay(executing())], { requestTimeoutMs: 60 });
      const call = await client.begin({ service: "kb", provider: "ollama", model: "m" }, options);
      assert.equal(call.id, ID);
      assert.equal(seen.length, 3);
      assert.match(seen[0].key, UUID_V4);
      assert.deepEqual(seen[1], seen[0], "the same request: key, body, query");
      assert.deepEqual(seen[2], seen[0]);
      assert.equal(seen[0].start, options.startNow ? "now" : null);
      assert.equal(seen[0].wait, options.waitMs ? "40ms" : null);
    }
  });

  test("a 5xx (a proxy's, the server's 500 and 503) is retried with the same key", async () => {
    const { client, seen } = scripted([
      () => new Response("bad gateway", { status: 502 }),
      () => serverError(500, "internal"),
      () => serverError(503, "unavailable"),
      () => json(201, record()),
    ]);
    const call = await client.begin({ service: "kb", provider: "ollama" });
    assert.equal(call.record.state, "waiting");
    assert.equal(seen.length, 4);
    assert.equal(new Set(seen.map((r) => r.key)).size, 1);
    assert.ok(seen.every((r) => JSON.stringify(r) === JSON.stringify(seen[0])), "the same request each time");
  });

  test("after lane_full the next begin has a new key", async () => {
    const full = () => json(429, { error: { code: "lane_full", message: "full" } }, { "retry-after": "1" });
    const { client, seen } = scripted([full, full, () => json(201, executing())]);
    const spec = { service: "kb", provider: "ollama" };
    await assert.rejects(client.begin(spec, { startNow: true }), LaneFullError);
    assert.equal(seen.length, 1, "a 429 is an answer: not retried");
    await assert.rejects(client.begin(spec, { startNow: true, waitMs: 20 }), LaneFullError);
    const call = await client.begin(spec, { startNow: true, waitMs: 20 });
    assert.equal(call.record.state, "executing");
    const keys = seen.map((r) => r.key);
    assert.equal(new Set(keys).size, 3, "each begin after a lane_full has its own key");
  });

  test("409 idempotency_conflict is IdempotencyConflictError, never retried; run does not call fn", async () => {
    const { client, seen } = scripted([() => serverError(409, "idempotency_conflict"), () => serverError(409, "idempotency_conflict")]);
    await assert.rejects(client.begin({ service: "kb", provider: "ollama" }), (err) => {
      assert.ok(err instanceof IdempotencyConflictError, String(err));
      assert.equal(err instanceof ConflictError, false, "not the record's conflict");
      assert.ok(isInflightError(err, "idempotency_conflict"));
      assert.equal(err.code, "idempotency_conflict");
      assert.equal(err.status, 409);
      assert.equal(err.fromServer, true);
      assert.match(err.message, /^POST \/v1\/activities: said idempotency_conflict$/);
      return true;
    });
    assert.equal(seen.length, 1);
    let called = false;
    await assert.rejects(
      client.run({ service: "kb", provider: "ollama" }, async () => {
        called = true;
      }),
      IdempotencyConflictError,
    );
    assert.equal(called, false);
    assert.equal(seen.length, 2);
  });

  test("a 200 replay is taken like a 201: begin, run and observeUnqueued go on with the record", async () => {
    const { client, seen } = scripted([
      () => replay(record()),
      reset,
      () => replay(record()),
      () => json(200, executing()),
      () => json(200, executing({ state: "succeeded", success: true })),
      () => replay(executing({ admission: "direct" })),
      () => json(200, executing({ admission: "direct", state: "succeeded", success: true })),
    ]);
    const call = await client.begin({ service: "kb", provider: "ollama" });
    assert.equal(call.record.state, "waiting");
    assert.equal(await client.run({ service: "kb", provider: "ollama" }, async (_s, a) => a.id), ID);
    assert.equal(await client.observeUnqueued({ service: "kb", provider: "ollama" }, async (_s, a) => a.id), ID);
    assert.deepEqual(
      seen.map((r) => `${r.method} ${r.path}`),
      [
        "POST /v1/activities",
        "POST /v1/activities",
        "POST /v1/activities",
        "POST /v1/activities/{id}/start",
        "POST /v1/activities/{id}/settle",
        "POST /v1/activities",
        "POST /v1/activities/{id}/settle",
      ],
    );
  });

  test("a repeat that finds its record ended: begin anew with a new key; run never calls fn with the ended record", async () => {
    const { client, seen } = scripted([
      reset,
      () => replay(cancelled({ cancelReason: "owner released" })),
      () => json(201, record({ activityId: OTHER })),
      () => json(200, executing({ activityId: OTHER })),
      () => json(200, executing({ activityId: OTHER, state: "succeeded", success: true })),
    ]);
    const ids = [];
    const result = await client.run({ service: "kb", provider: "ollama" }, async (_s, activity) => {
      ids.push(activity.id);
      return activity.record.state;
    });
    assert.equal(result, "executing");
    assert.deepEqual(ids, [OTHER], "fn ran once, with the record begun anew");
    const [first, repeat, anew] = begins(seen);
    assert.equal(repeat.key, first.key);
    assert.notEqual(anew.key, first.key);
    assert.match(anew.key, UUID_V4);
    assert.deepEqual(anew.body, first.body, "the same begin, under a new key");
    assert.deepEqual(
      seen.slice(3).map((r) => `${r.method} ${r.path}`),
      ["POST /v1/activities/{other}/start", "POST /v1/activities/{other}/settle"],
      "the ended record is left alone",
    );
    // The handle's begin and admit do the same.
    const again = scripted([reset, () => replay(cancelled()), () => json(201, record({ activityId: OTHER }))]);
    assert.equal((await again.client.begin({ service: "kb", provider: "ollama" })).id, OTHER);
    const admitted = scripted([
      () => replay(cancelled()),
      () => json(201, record({ activityId: OTHER })),
      () => json(200, executing({ activityId: OTHER })),
    ]);
    assert.equal((await admitted.client.admit({ service: "kb", provider: "ollama" })).id, OTHER);
    assert.notEqual(begins(admitted.seen)[0].key, begins(admitted.seen)[1].key);
  });

  test("observeUnqueued: a direct record that ended before its answer came is begun anew too", async () => {
    const { client, seen } = scripted([
      reset,
      () => replay(cancelled({ admission: "direct", startedAt: "2026-01-01T00:00:00.000Z" })),
      () => json(201, executing({ activityId: OTHER, admission: "direct" })),
      () => json(200, executing({ activityId: OTHER, admission: "direct", state: "succeeded", success: true })),
    ]);
    const ids = [];
    await client.observeUnqueued({ service: "kb", provider: "openai" }, async (_s, activity) => ids.push(activity.id));
    assert.deepEqual(ids, [OTHER]);
    const [first, repeat, anew] = begins(seen);
    assert.equal(repeat.key, first.key);
    assert.notEqual(anew.key, first.key);
    assert.equal(anew.body.admission, "direct");
  });

  test("begin with startNow and waitMs: an ended record past the wait is LaneFullError; within it, begun anew for what is left", async () => {
    const late = scripted([
      async () => {
        await sleep(60);
        return reset();
      },
      () => replay(cancelled({ cancelReason: "wait ended" })),
    ]);
    await assert.rejects(late.client.begin({ service: "kb", provider: "ollama" }, { startNow: true, waitMs: 50 }), (err) => {
      assert.ok(err instanceof LaneFullError, String(err));
      assert.equal(err.code, "lane_full");
      assert.match(err.message, new RegExp(`did not admit activity ${ID} within 50 ms; it is recorded cancelled`));
      return true;
    });
    assert.equal(late.seen.length, 2, "no begin anew once the wait has passed");
    assert.equal(late.seen[1].key, late.seen[0].key);

    const early = scripted([reset, () => replay(cancelled()), () => json(201, executing({ activityId: OTHER }))]);
    const call = await early.client.begin({ service: "kb", provider: "ollama" }, { startNow: true, waitMs: 5000 });
    assert.equal(call.id, OTHER);
    const [first, repeat, anew] = early.seen;
    assert.equal(repeat.key, first.key);
    assert.equal(repeat.wait, "5000ms", "a repeat is the same request");
    assert.notEqual(anew.key, first.key);
    assert.equal(anew.start, "now");
    const left = Number(anew.wait.replace(/ms$/, ""));
    assert.ok(left > 0 && left <= 5000, `the wait that is left: ${anew.wait}`);
  });

  test("run with maxWaitMs: an ended record past it is WaitTimeoutError; fn is not called, nothing is cancelled", async () => {
    const { client, seen } = scripted([
      async () => {
        await sleep(40);
        return reset();
      },
      () => replay(cancelled()),
    ]);
    let called = false;
    await assert.rejects(
      client.run({ service: "kb", provider: "ollama" }, async () => (called = true), { maxWaitMs: 30 }),
      (err) => err instanceof WaitTimeoutError && err.code === "wait_timeout" && new RegExp(`activity ${ID} was not admitted`).test(err.message),
    );
    assert.equal(called, false);
    assert.deepEqual(seen.map((r) => r.path), ["/v1/activities", "/v1/activities"]);
  });

  test("begins made anew are bounded by retries: then UnavailableError", async () => {
    const { client, seen } = scripted([() => replay(cancelled()), () => replay(cancelled())], { retry: { retries: 1, baseDelayMs: 1 } });
    await assert.rejects(client.begin({ service: "kb", provider: "ollama" }), (err) => {
      assert.ok(err instanceof UnavailableError, String(err));
      assert.match(err.message, /the record of each of 2 begins ended before its answer arrived/);
      return true;
    });
    assert.equal(new Set(seen.map((r) => r.key)).size, 2);
  });

  test("request() sends a given key on a begin, makes one when none is given, and refuses one elsewhere", async () => {
    const { client, seen } = scripted([() => json(201, record()), () => json(201, record())]);
    await client.request("begin", { body: { service: "kb", provider: "p" }, idempotencyKey: "my-key-1" });
    await client.request("begin", { body: { service: "kb", provider: "p" } });
    assert.equal(seen[0].key, "my-key-1");
    assert.match(seen[1].key, UUID_V4);
    await assert.rejects(client.request("get", { id: ID, idempotencyKey: "k" }), TypeError);
  });
});

describe("idempotent begins against the real server", () => {
  const LANE = "idem-wait::capped";
  let server;
  let client;

  before(async () => {
    server = await startServer({ lanes: { [LANE]: 1, "idem-full::capped": 1 }, token: TOKEN });
    client = new InflightClient({ baseUrl: server.url, token: TOKEN });
  });
  after(async () => {
    await server?.stop();
  });

  const total = async () => (await client.snapshot({ limit: 1000 })).totalActivities;
  const inFlight = async (service) => (await client.snapshot({ limit: 1000 })).inFlight.filter((r) => r.service === service);

  async function until(check) {
    const deadline = Date.now() + 10_000;
    while (!(await check())) {
      if (Date.now() > deadline) throw new Error("timed out");
      await sleep(10);
    }
  }

  /**
   * A client whose fetch lets the first begin reach the server and drops its
   * answer (read, then "the connection was reset"); `onDropped(answer)` runs
   * before the drop. Every begin's key and status are recorded.
   */
  function lossy(onDropped = async () => {}) {
    const begun = [];
    let dropped = false;
    const c = new InflightClient({
      baseUrl: server.url,
      token: TOKEN,
      retry: { retries: 3, baseDelayMs: 5 },
      fetch: async (url, init) => {
        const { pathname, search } = new URL(url);
        if (init.method !== "POST" || pathname !== "/v1/activities") return fetch(url, init);
        const response = await fetch(url, init);
        begun.push({ key: init.headers["idempotency-key"], status: response.status, search, replayed: response.headers.get("idempotent-replayed") });
        if (!dropped) {
          dropped = true;
          await onDropped(JSON.parse(await response.text())); // the server answered; the answer never arrives
          return reset();
        }
        return response;
      },
    });
    return { client: c, begun };
  }

  test("a begin whose answer was lost is retried and makes exactly one record (begin, startNow, run, observeUnqueued)", async () => {
    const ways = {
      begin: async (c) => {
        const call = await c.begin({ service: "idem-lost-begin", provider: "p" });
        assert.equal(call.record.state, "waiting");
        await call.start();
        await call.succeed();
        return call.id;
      },
      startNow: async (c) => {
        const call = await c.begin({ service: "idem-lost-now", provider: "p" }, { startNow: true, waitMs: 1000 });
        assert.equal(call.record.state, "executing");
        await call.succeed();
        return call.id;
      },
      run: (c) => c.run({ service: "idem-lost-run", provider: "p" }, async (_s, activity) => activity.id),
      observeUnqueued: (c) => c.observeUnqueued({ service: "idem-lost-direct", provider: "p" }, async (_s, activity) => activity.id),
    };
    for (const [name, way] of Object.entries(ways)) {
      const before = await total();
      const { client: c, begun } = lossy();
      const id = await way(c);
      assert.equal(await total(), before + 1, `${name}: exactly one record`);
      assert.equal(begun.length, 2, `${name}: the begin was sent twice`);
      assert.equal(begun[1].key, begun[0].key, `${name}: with the same key`);
      assert.equal(begun[1].search, begun[0].search);
      assert.deepEqual([begun[0].status, begun[1].status], [201, 200], `${name}: the repeat is answered 200`);
      assert.equal(begun[1].replayed, "true");
      const done = await client.getActivity(id);
      assert.equal(done.state, "succeeded", name);
    }
  });

  test("a ?start=now&wait= begin whose answer was lost after it waited: the repeat answers the same record", async () => {
    const [service, provider] = LANE.split("::");
    const holder = await client.admit({ service, provider });
    const before = await total();
    const { client: c, begun } = lossy();
    const held = c.begin({ service, provider }, { startNow: true, waitMs: 10_000 });
    await until(async () => (await laneCounts(client, LANE)).waiting === 1);
    await holder.succeed();
    const call = await held;
    assert.equal(call.record.state, "executing");
    assert.equal(await total(), before + 1, "one record: the repeat did not wait in line again");
    assert.deepEqual(begun.map((b) => b.status), [201, 200]);
    assert.equal(begun[1].key, begun[0].key);
    await call.succeed();
    assert.deepEqual(await laneCounts(client, LANE), { executing: 0, waiting: 0, inFlight: 0 });
  });

  test("a repeat after a wait that ran out finds the record cancelled: LaneFullError, one record, the lane clear", async () => {
    const [service, provider] = LANE.split("::");
    const holder = await client.admit({ service, provider });
    const before = await total();
    const { client: c, begun } = lossy();
    await assert.rejects(c.begin({ service, provider }, { startNow: true, waitMs: 200 }), (err) => {
      assert.ok(err instanceof LaneFullError, String(err));
      assert.match(err.message, /it is recorded cancelled and holds no place in line/);
      return true;
    });
    assert.deepEqual(begun.map((b) => b.status), [429, 200], "the 429 was lost; its repeat answered the cancelled record");
    assert.equal(begun[1].key, begun[0].key);
    assert.equal(await total(), before + 1);
    assert.deepEqual(await laneCounts(client, LANE), { executing: 1, waiting: 0, inFlight: 1 });
    await holder.succeed();
  });

  test("run never calls fn with a record that ended before its begin's answer came: it begins anew, a new key", async () => {
    let first;
    const { client: c, begun } = lossy(async (answer) => {
      first = answer.activityId;
      await client.request("cancel", { id: first, body: { reason: "gone" } }); // ended by someone else meanwhile
    });
    const before = await total();
    const ids = [];
    await c.run({ service: "idem-ended-run", provider: "p" }, async (_s, activity) => {
      ids.push(activity.id);
      assert.equal(activity.record.state, "executing");
    });
    assert.equal(ids.length, 1);
    assert.notEqual(ids[0], first, "fn got the record begun anew");
    assert.deepEqual(begun.map((b) => b.status), [201, 200, 201]);
    assert.equal(begun[1].key, begun[0].key);
    assert.notEqual(begun[2].key, begun[0].key);
    assert.equal(await total(), before + 2, "the cancelled record and the new one");
    assert.equal((await client.getActivity(first)).state, "cancelled");
    assert.equal((await client.getActivity(ids[0])).state, "succeeded");
    assert.deepEqual(await inFlight("idem-ended-run"), []);
  });

  test("after lane_full the next begin has a new key and makes a new record", async () => {
    const [service, provider] = ["idem-full", "capped"];
    const holder = await client.admit({ service, provider });
    const keys = [];
    const c = new InflightClient({
      baseUrl: server.url,
      token: TOKEN,
      fetch: (url, init) => {
        if (new URL(url).pathname === "/v1/activities") keys.push(init.headers["idempotency-key"]);
        return fetch(url, init);
      },
    });
    await assert.rejects(c.begin({ service, provider }, { startNow: true, waitMs: 100 }), LaneFullError);
    await holder.succeed();
    const call = await c.begin({ service, provider }, { startNow: true, waitMs: 100 });
    assert.equal(call.record.state, "executing", "a new record, admitted (not the first one's, cancelled)");
    await call.succeed();
    assert.equal(keys.length, 2);
    assert.notEqual(keys[0], keys[1]);
  });

  test("the same key: the same request is answered the same record (200); another request is IdempotencyConflictError, never retried", async () => {
    const sent = [];
    const c = new InflightClient({
      baseUrl: server.url,
      token: TOKEN,
      retry: { retries: 3, baseDelayMs: 5 },
      fetch: (url, init) => {
        sent.push(`${init.method} ${new URL(url).pathname}`);
        return fetch(url, init);
      },
    });
    const key = `ts-idem-${Date.now()}`;
    const body = { service: "idem-conflict", provider: "p", model: "m" };
    const before = await total();
    const first = await c.request("begin", { body, idempotencyKey: key });
    const again = await c.request("begin", { body, idempotencyKey: key });
    assert.equal(again.activityId, first.activityId);
    assert.equal(await total(), before + 1);
    sent.length = 0;
    for (const [changed, query] of [[{ ...body, model: "other" }, {}], [body, { start: "now" }]]) {
      await assert.rejects(c.request("begin", { body: changed, query, idempotencyKey: key }), (err) => {
        assert.ok(err instanceof IdempotencyConflictError, String(err));
        assert.equal(err.code, "idempotency_conflict");
        assert.equal(err.status, 409);
        return true;
      });
    }
    assert.equal(sent.length, 2, "each refused once, never retried");
    assert.equal(await total(), before + 1, "a refused repeat records nothing");
    // A malformed key is the server's 400, naming the header.
    await assert.rejects(c.request("begin", { body, idempotencyKey: "k".repeat(256) }), (err) => {
      assert.equal(err.code, "invalid_request");
      assert.match(err.message, /Idempotency-Key/i);
      return true;
    });
    await client.request("cancel", { id: first.activityId, body: {} });
  });
});
