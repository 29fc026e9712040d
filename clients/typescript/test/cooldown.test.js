// Cooldowns against the real server: a failure settled with the provider's
// Retry-After cools its lane down (`lane_cooling`), the client waits through
// a cooldown as through a full lane, no sooner than the Retry-After and never
// past maxWaitMs, and `run` sends the Retry-After of the error its function
// throws. Every lane here is capped at 1; each test uses lanes of its own.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  FIELDS,
  InflightClient,
  InflightError,
  InvalidRequestError,
  LaneCoolingError,
  LaneFullError,
  WaitTimeoutError,
} from "../dist/index.js";
import { startServer } from "./server.js";

const TOKEN = "ts-cooldown-test-token";
const LANES = [
  "settle", "retry", "short", "runwait", "v4", "v5", "response", "ignored", "own", "none", "custom", "off", "direct", "counts",
].map((s) => `${s}::capped`);

let server;
let client;

before(async () => {
  server = await startServer({ lanes: Object.fromEntries(LANES.map((l) => [l, 1])), token: TOKEN });
  client = new InflightClient({ baseUrl: server.url, token: TOKEN });
});
after(async () => {
  await server?.stop();
});

const specOf = (lane) => {
  const [service, provider] = lane.split("::");
  return { service, provider };
};

/** The lane as the snapshot shows it. */
async function laneOf(lane) {
  const snap = await client.snapshot({ limit: 1000 });
  const l = snap.nativeAdmission[lane];
  assert.ok(l, `the snapshot shows no lane ${lane}`);
  return l;
}

/** Admits a call on `lane` and settles it failed with `retryAfterMs`; its record. */
async function coolDown(lane, retryAfterMs) {
  const call = await client.admit(specOf(lane));
  const record = await call.fail("provider", { retryAfterMs });
  assert.equal(record.state, "failed");
  return record;
}

/** A client that counts its `start` requests. */
function countingClient() {
  const counts = { start: 0 };
  const c = new InflightClient({
    baseUrl: server.url,
    token: TOKEN,
    fetch: (url, init) => {
      if (new URL(url).pathname.endsWith("/start")) counts.start++;
      return fetch(url, init);
    },
  });
  return { c, counts };
}

/** An error shaped as the openai package's APIError (status, headers) before version 5: plain headers. */
class OpenAIv4LikeError extends Error {
  constructor(status, headers) {
    super(`${status} Rate limit reached`);
    this.name = "RateLimitError";
    this.status = status;
    this.headers = headers;
  }
}

describe("a failure settled with the provider's Retry-After", () => {
  test("cools the lane: lane_cooling for a start now or a short wait, admitted once the cooldown ends and not before", async () => {
    const lane = "settle::capped";
    const spec = specOf(lane);
    // With a success it is refused by the server, naming the field.
    const ok = await client.admit(spec);
    await assert.rejects(ok.settle({ success: true, retryAfterMs: 2_000 }), (err) => {
      assert.ok(err instanceof InvalidRequestError, String(err));
      assert.match(err.message, /retryAfterMs/);
      return true;
    });
    await ok.succeed();
    assert.equal((await laneOf(lane)).coolingUntil, null, "a success cools nothing");

    const failed = await coolDown(lane, 2_000);
    const completedAt = Date.parse(failed.completedAt);
    const l = await laneOf(lane);
    assert.equal(Date.parse(l.coolingUntil) - completedAt, 2_000, `coolingUntil ${l.coolingUntil}, completedAt ${failed.completedAt}`);
    assert.equal(l.cooldowns, 1);
    assert.equal(l.effectiveCap, 1);
    assert.equal(l.executing, 0);

    // A start now: refused at once, nothing holds a slot or a place.
    await assert.rejects(client.begin(spec, { startNow: true }), (err) => {
      assert.ok(err instanceof LaneCoolingError, String(err));
      assert.ok(!(err instanceof LaneFullError));
      assert.equal(err.code, "lane_cooling");
      assert.equal(err.status, 429);
      assert.equal(err.fromServer, true);
      assert.ok(err.retryAfterMs > 0 && err.retryAfterMs <= 2_000, `retryAfterMs ${err.retryAfterMs}`);
      return true;
    });
    // A start now with a wait shorter than the cooldown: the server waited through it, then lane_cooling.
    await assert.rejects(client.begin(spec, { startNow: true, waitMs: 200 }), LaneCoolingError);
    // admit with a short maxWaitMs: wait_timeout at its maxWaitMs, not at the Retry-After, telling it.
    const started = Date.now();
    await assert.rejects(client.admit(spec, { maxWaitMs: 300 }), (err) => {
      assert.ok(err instanceof WaitTimeoutError, String(err));
      assert.ok(err.cause instanceof LaneCoolingError, String(err.cause));
      assert.ok(err.retryAfterMs > 0 && err.retryAfterMs <= 2_000, `retryAfterMs ${err.retryAfterMs}`);
      assert.match(err.message, /cooling down/);
      return true;
    });
    assert.ok(Date.now() - started < 1_500, `gave up after ${Date.now() - started} ms`);
    assert.equal((await laneOf(lane)).waiting, 0, "the timed-out record was cancelled");

    // admit with maxWaitMs 5000: admitted when the cooldown ends (2 s after the failure), not before.
    const admitted = await client.admit(spec, { maxWaitMs: 5_000 });
    assert.equal(admitted.record.state, "executing");
    const startedAt = Date.parse(admitted.record.startedAt);
    assert.ok(startedAt >= completedAt + 2_000, `started ${startedAt - completedAt} ms after the failure`);
    assert.ok(startedAt < completedAt + 3_500, `started ${startedAt - completedAt} ms after the failure`);
    await admitted.succeed();
  });

  test("admit asks again no sooner than the Retry-After, and never past maxWaitMs", async () => {
    // Waits of 100 ms at a time: without heeding Retry-After, 2 s of cooldown would be some 20 requests.
    const failed = await coolDown("retry::capped", 2_000);
    const { c, counts } = countingClient();
    const call = await c.admit(specOf("retry::capped"), { maxWaitMs: 5_000, waitStepMs: 100 });
    assert.equal(call.record.state, "executing");
    assert.ok(Date.parse(call.record.startedAt) >= Date.parse(failed.completedAt) + 2_000);
    assert.ok(counts.start <= 3, `${counts.start} start requests`);
    await call.succeed();

    // A Retry-After past maxWaitMs: given up at once, not after sleeping to it.
    await coolDown("short::capped", 2_000);
    const short = countingClient();
    const started = Date.now();
    await assert.rejects(short.c.admit(specOf("short::capped"), { maxWaitMs: 800, waitStepMs: 100 }), (err) => {
      assert.ok(err instanceof WaitTimeoutError, String(err));
      assert.ok(err.cause instanceof LaneCoolingError);
      assert.ok(err.retryAfterMs > 0);
      return true;
    });
    const took = Date.now() - started;
    assert.ok(took < 800, `gave up after ${took} ms`);
    assert.equal(short.counts.start, 1, "no second request before the Retry-After");
  });

  test("run waits through a cooldown within its maxWaitMs, and gives up with wait_timeout past it", async () => {
    const failed = await coolDown("runwait::capped", 1_000);
    await assert.rejects(
      client.run(specOf("runwait::capped"), async () => assert.fail("fn must not run"), { maxWaitMs: 100 }),
      (err) => err instanceof WaitTimeoutError && err.cause instanceof LaneCoolingError,
    );
    const id = await client.run(specOf("runwait::capped"), async (_signal, activity) => activity.id, { maxWaitMs: 5_000 });
    const record = await client.getActivity(id);
    assert.equal(record.state, "succeeded");
    assert.ok(Date.parse(record.startedAt) >= Date.parse(failed.completedAt) + 1_000);
  });
});

describe("run sends the Retry-After of the error its function throws", () => {
  /** Runs a call on `lane` whose function throws `err`; the failed record and the lane. */
  async function runThrowing(lane, err, options = {}) {
    let id;
    await assert.rejects(
      client.run(
        specOf(lane),
        async (_signal, activity) => {
          id = activity.id;
          throw err;
        },
        options,
      ),
      (thrown) => thrown === err,
    );
    const record = await client.getActivity(id);
    assert.equal(record.state, "failed");
    assert.equal(record.failureStage, "provider");
    return { record, lane: await laneOf(lane) };
  }

  /** Asserts the lane cools down `ms` after the record's completion. */
  function assertCooling({ record, lane }, ms) {
    assert.notEqual(lane.coolingUntil, null, "the lane cools down");
    assert.equal(Date.parse(lane.coolingUntil) - Date.parse(record.completedAt), ms, `coolingUntil ${lane.coolingUntil}`);
    assert.equal(lane.cooldowns, 1);
  }

  /** Asserts the lane never cooled down. */
  function assertNotCooling({ lane }) {
    assert.equal(lane.coolingUntil, null);
    assert.equal(lane.cooldowns, 0);
  }

  test("the openai package's APIError before v5: status 429, plain headers with retry-after: 1", async () => {
    const result = await runThrowing("v4::capped", new OpenAIv4LikeError(429, { "retry-after": "1", "x-request-id": "req_1" }));
    assertCooling(result, 1_000);
    // The lane is cooling: the next start now is refused lane_cooling.
    await assert.rejects(client.begin(specOf("v4::capped"), { startNow: true }), LaneCoolingError);
  });

  test("the openai package's APIError since v5: status 503, a Web Headers", async () => {
    assertCooling(await runThrowing("v5::capped", new OpenAIv4LikeError(503, new Headers({ "Retry-After": "2" }))), 2_000);
  });

  test("an error carrying the fetch Response", async () => {
    const err = Object.assign(new Error("provider answered 429"), {
      response: new Response(null, { status: 429, headers: { "retry-after": "3" } }),
    });
    assertCooling(await runThrowing("response::capped", err), 3_000);
  });

  test("not from another status, not from the ledger's own refusal, not from a plain error", async () => {
    assertNotCooling(await runThrowing("ignored::capped", new OpenAIv4LikeError(500, { "retry-after": "1" })));
    // An InflightError has a status and a retryAfterMs but no headers: a refusal of the ledger is no provider's.
    const own = new LaneFullError("lane_full", "another lane is full", { status: 429, retryAfterMs: 1_000, fromServer: true });
    assert.ok(own instanceof InflightError);
    assertNotCooling(await runThrowing("own::capped", own));
    assertNotCooling(await runThrowing("none::capped", new Error("provider said no")));
  });

  test("observeUnqueued sends it too: the observed call's refusal cools its lane", async () => {
    let id;
    const err = new OpenAIv4LikeError(429, { "retry-after": "2" });
    await assert.rejects(
      client.observeUnqueued(specOf("direct::capped"), async (_signal, activity) => {
        id = activity.id;
        throw err;
      }),
      (thrown) => thrown === err,
    );
    const record = await client.getActivity(id);
    assert.equal(record.admission, "direct");
    assertCooling({ record, lane: await laneOf("direct::capped") }, 2_000);
  });

  test("options.retryAfterMs reads another shape, or turns it off", async () => {
    const custom = Object.assign(new Error("throttled"), { waitMs: 1_500.4 });
    assertCooling(await runThrowing("custom::capped", custom, { retryAfterMs: (err) => err.waitMs }), 1_500);
    const rateLimited = new OpenAIv4LikeError(429, { "retry-after": "1" });
    assertNotCooling(await runThrowing("off::capped", rateLimited, { retryAfterMs: () => undefined }));
  });
});

describe("the snapshot's lanes", () => {
  test("carry effectiveCap, coolingUntil, cooldowns and byPriority", async () => {
    const spec = specOf("counts::capped");
    const interactive = await client.admit({ ...spec, priority: "interactive" });
    const batch = await client.begin({ ...spec, priority: "batch" });
    const l = await laneOf("counts::capped");
    // Exactly the fields the client declares, here and in byPriority.
    assert.deepEqual(Object.keys(l).sort(), [...FIELDS.Lane].sort());
    assert.deepEqual(Object.keys(l.byPriority).sort(), [...FIELDS.LaneByPriority].sort());
    for (const counts of Object.values(l.byPriority)) {
      assert.deepEqual(Object.keys(counts).sort(), [...FIELDS.LanePriorityCounts].sort());
    }
    assert.equal(l.cap, 1);
    assert.equal(l.effectiveCap, 1);
    assert.equal(l.coolingUntil, null);
    assert.equal(l.cooldowns, 0);
    assert.deepEqual(l.byPriority, {
      interactive: { executing: 1, waiting: 0 },
      batch: { executing: 0, waiting: 1 },
      unknown: { executing: 0, waiting: 0 },
    });
    await batch.cancel();
    await interactive.succeed();
    // A lane with no cap: no effective cap either.
    await client.run({ service: "uncapped", provider: "p" }, async () => 1);
    const free = await laneOf("uncapped::p");
    assert.equal(free.cap, null);
    assert.equal(free.effectiveCap, null);
  });
});
