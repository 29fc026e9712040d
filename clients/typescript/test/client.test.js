// The client against the real server: every path of a call's life.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  InflightClient,
  InflightError,
  InvalidRequestError,
  LaneFullError,
  NotFoundError,
  UnauthorizedError,
  UnavailableError,
  WaitTimeoutError,
} from "../dist/index.js";
import { freePort, laneCounts, sleep, startServer } from "./server.js";

const TOKEN = "ts-client-test-token";
const CAPPED = ["wait", "exec", "timeout", "owner", "full", "maxwait", "now"].map((s) => `${s}::capped`);

let server;
let client;

before(async () => {
  server = await startServer({ lanes: Object.fromEntries(CAPPED.map((l) => [l, 1])), token: TOKEN });
  client = new InflightClient({ baseUrl: server.url, token: TOKEN });
});
after(async () => {
  await server?.stop();
});

/** Polls `check` until it is true (at most 10 s). */
async function until(check) {
  const deadline = Date.now() + 10_000;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error("timed out");
    await sleep(10);
  }
}

/** Asserts the lane has nothing in flight and counts nothing. */
async function assertLaneEmpty(lane) {
  assert.deepEqual(await laneCounts(client, lane), { executing: 0, waiting: 0, inFlight: 0 }, lane);
}

/** Holds the lane's only slot until `release()` settles it. */
async function holdSlot(lane) {
  const [service, provider] = lane.split("::");
  const holder = await client.admit({ service, provider });
  assert.equal(holder.record.state, "executing");
  return holder;
}

describe("begin with startNow", () => {
  test("admits at once, waits in line, and on a wait that ends is refused with its record cancelled", async () => {
    const spec = { service: "now", provider: "capped" };
    const first = await client.begin(spec, { startNow: true });
    assert.equal(first.record.state, "executing");
    assert.equal(first.record.startedAt, first.record.enqueuedAt, "stamped with the server's clock");
    await assert.rejects(client.begin(spec, { startNow: true }), LaneFullError);
    await assert.rejects(client.begin(spec, { startNow: true, waitMs: 200 }), LaneFullError);
    assert.deepEqual(await laneCounts(client, "now::capped"), { executing: 1, waiting: 0, inFlight: 1 });
    const held = client.begin(spec, { startNow: true, waitMs: 10_000 });
    await until(async () => (await laneCounts(client, "now::capped")).waiting === 1);
    await first.succeed();
    const second = await held;
    assert.equal(second.record.state, "executing");
    await second.succeed();
    await assertLaneEmpty("now::capped");
    await assert.rejects(client.begin(spec, { waitMs: 200 }), TypeError);
  });
});

describe("run", () => {
  test("a full lifecycle: begun, admitted, started, settled succeeded, hooks in order", async () => {
    const events = [];
    const result = await client.run(
      { service: "life", provider: "ollama", class: "embedding", model: "nomic-embed-text", operationStage: "ingest" },
      async (signal, activity) => {
        assert.equal(signal.aborted, false);
        assert.equal(activity.record.state, "executing");
        return 42;
      },
      {
        onEnqueued: (r) => events.push(["enqueued", r.state]),
        onStarted: (r) => events.push(["started", r.state]),
        onSettled: (r) => events.push(["settled", r.state]),
      },
    );
    assert.equal(result, 42);
    assert.deepEqual(events, [
      ["enqueued", "waiting"],
      ["started", "executing"],
      ["settled", "succeeded"],
    ]);
    const snap = await client.snapshot();
    const done = snap.recentCompletions.find((r) => r.service === "life");
    assert.equal(done.state, "succeeded");
    assert.equal(done.success, true);
    assert.equal(done.model, "nomic-embed-text");
    await assertLaneEmpty("life::ollama");
  });

  test("a failure: the callback's error is rethrown and the record failed at the provider", async () => {
    let id;
    const boom = new Error("provider said 500");
    await assert.rejects(
      client.run({ service: "fail", provider: "ollama" }, async (_signal, activity) => {
        id = activity.id;
        throw boom;
      }),
      (err) => err === boom,
    );
    const record = await client.getActivity(id);
    assert.equal(record.state, "failed");
    assert.equal(record.success, false);
    assert.equal(record.failureStage, "provider");
    await assertLaneEmpty("fail::ollama");
  });

  test("a failureStage function that throws: the call's own error is thrown, and the record failed `unknown`", async () => {
    let id;
    const boom = new Error("no response here");
    await assert.rejects(
      client.run(
        { service: "fail", provider: "ollama" },
        async (_signal, activity) => {
          id = activity.id;
          throw boom;
        },
        { failureStage: (err) => (err.response.status >= 500 ? "provider" : "queue") },
      ),
      (err) => err === boom,
    );
    const record = await client.getActivity(id);
    assert.equal(record.state, "failed", "not left in flight");
    assert.equal(record.failureStage, "unknown");
    await assertLaneEmpty("fail::ollama");
  });

  test("a waitStepMs of 0 or less is a TypeError before anything is recorded", async () => {
    const before = (await client.snapshot()).totalActivities;
    for (const bad of [0, -5, Number.NaN, "10"]) {
      await assert.rejects(client.admit({ service: "kb", provider: "ollama" }, { waitStepMs: bad }), /waitStepMs must be a number of milliseconds above 0/);
    }
    assert.equal((await client.snapshot()).totalActivities, before);
  });

  test("an abort while waiting in line cancels the record and leaves nothing in flight", async () => {
    const lane = "wait::capped";
    const holder = await holdSlot(lane);
    const controller = new AbortController();
    let called = false;
    let waiting;
    const started = Date.now();
    const run = client.run(
      { service: "wait", provider: "capped" },
      async () => {
        called = true;
      },
      { signal: controller.signal, onEnqueued: (r) => (waiting = r) },
    );
    await until(async () => waiting !== undefined);
    await sleep(200); // in its ?wait= request
    assert.deepEqual(await laneCounts(client, lane), { executing: 1, waiting: 1, inFlight: 2 });
    controller.abort();
    await assert.rejects(run, { name: "AbortError" });
    assert.ok(Date.now() - started < 2000, "the abort ended the wait at once");
    assert.equal(called, false);
    const record = await client.getActivity(waiting.activityId);
    assert.equal(record.state, "cancelled");
    assert.equal(record.startedAt, null);
    await holder.succeed();
    await assertLaneEmpty(lane);
  });

  test("an abort while executing aborts the callback's signal and cancels the record", async () => {
    const lane = "exec::capped";
    const controller = new AbortController();
    let id;
    let sawAbort = false;
    const run = client.run(
      { service: "exec", provider: "capped" },
      (signal, activity) =>
        new Promise((_, reject) => {
          id = activity.id;
          signal.addEventListener("abort", () => {
            sawAbort = true;
            reject(signal.reason);
          });
        }),
      { signal: controller.signal },
    );
    await until(async () => id !== undefined); // the callback runs
    assert.deepEqual(await laneCounts(client, lane), { executing: 1, waiting: 0, inFlight: 1 });
    controller.abort();
    await assert.rejects(run, { name: "AbortError" });
    assert.ok(sawAbort);
    const record = await client.getActivity(id);
    assert.equal(record.state, "cancelled");
    assert.notEqual(record.startedAt, null);
    await assertLaneEmpty(lane);
  });

  test("an abort ends run at once even when the callback ignores its signal", async () => {
    const controller = new AbortController();
    const run = client.run({ service: "deaf", provider: "p" }, () => sleep(3000), { signal: controller.signal });
    await sleep(100);
    const t = Date.now();
    controller.abort();
    await assert.rejects(run, { name: "AbortError" });
    assert.ok(Date.now() - t < 1000);
    await assertLaneEmpty("deaf::p");
  });

  test("a timeout cancels the record with the reason `timeout`", async () => {
    const lane = "timeout::capped";
    let id;
    const t = Date.now();
    await assert.rejects(
      client.run(
        { service: "timeout", provider: "capped" },
        (signal, activity) => {
          id = activity.id;
          return new Promise((resolve, reject) => {
            const timer = setTimeout(resolve, 5000);
            signal.addEventListener("abort", () => {
              clearTimeout(timer);
              reject(signal.reason);
            });
          });
        },
        { timeoutMs: 300 },
      ),
      { name: "TimeoutError" },
    );
    assert.ok(Date.now() - t < 2000);
    const record = await client.getActivity(id);
    assert.equal(record.state, "cancelled");
    assert.equal(record.cancelReason, "timeout");
    await assertLaneEmpty(lane);
  });

  test("waiting in line past maxWaitMs is wait_timeout, and the record is cancelled", async () => {
    const lane = "maxwait::capped";
    const holder = await holdSlot(lane);
    let waiting;
    await assert.rejects(
      client.run({ service: "maxwait", provider: "capped" }, async () => assert.fail("never admitted"), {
        maxWaitMs: 300,
        onEnqueued: (r) => (waiting = r),
      }),
      (err) => err instanceof WaitTimeoutError && err.code === "wait_timeout",
    );
    assert.equal((await client.getActivity(waiting.activityId)).state, "cancelled");
    await holder.succeed();
    await assertLaneEmpty(lane);
  });

  test("observeUnqueued records a direct call, never counted in a lane", async () => {
    let id;
    const value = await client.observeUnqueued({ service: "direct", provider: "openai" }, async (_s, activity) => {
      id = activity.id;
      assert.equal(activity.record.state, "executing");
      assert.equal(activity.record.admission, "direct");
      return "ok";
    });
    assert.equal(value, "ok");
    assert.equal((await client.getActivity(id)).state, "succeeded");
  });
});

describe("the handle and errors", () => {
  test("lane_full: a start whose turn has not come is LaneFullError, and the record keeps its place", async () => {
    const lane = "full::capped";
    const holder = await holdSlot(lane);
    const second = await client.begin({ service: "full", provider: "capped" });
    await assert.rejects(second.start(), (err) => {
      assert.ok(err instanceof LaneFullError);
      assert.equal(err.code, "lane_full");
      assert.equal(err.status, 429);
      assert.equal(err.retryAfterMs, 1000);
      return true;
    });
    assert.equal((await second.refresh()).state, "waiting");
    // A begin already started on the full lane is refused and records nothing.
    await assert.rejects(client.begin({ service: "full", provider: "capped", startedAt: new Date() }), LaneFullError);
    assert.deepEqual(await laneCounts(client, lane), { executing: 1, waiting: 1, inFlight: 2 });
    // The slot freed, the waiting record's turn comes within its wait.
    setTimeout(() => holder.succeed(), 100);
    const started = await second.start({ waitMs: 5000 });
    assert.equal(started.state, "executing");
    await second.settle({ success: false, failureStage: "queue" });
    assert.equal(second.record.failureStage, "queue");
    // Every transition repeated is harmless.
    await second.settle({ success: false, failureStage: "queue" });
    await assertLaneEmpty(lane);
  });

  test("errors are typed by the server's code", async () => {
    await assert.rejects(client.begin({ service: "bad label!", provider: "p" }), (err) => {
      assert.ok(err instanceof InvalidRequestError);
      assert.equal(err.code, "invalid_request");
      assert.match(err.message, /service/);
      return true;
    });
    await assert.rejects(client.getActivity("01939b1c-0000-7000-8000-000000000000"), NotFoundError);
    const a = await client.begin({ service: "conflict", provider: "p" });
    await a.succeed();
    await assert.rejects(a.cancel(), { code: "conflict" });
    const anonymous = new InflightClient({ baseUrl: server.url, token: "" });
    await assert.rejects(anonymous.snapshot(), (err) => err instanceof UnauthorizedError && err.status === 401);
  });

  test("the server unreachable: unavailable; requests retried, a begin too (with its key)", async () => {
    const port = await freePort();
    let calls = [];
    const keys = new Set();
    const counting = (url, init) => {
      calls.push(`${init.method} ${new URL(url).pathname}`);
      if (init.headers["idempotency-key"]) keys.add(init.headers["idempotency-key"]);
      return fetch(url, init);
    };
    const down = new InflightClient({
      baseUrl: `http://127.0.0.1:${port}`,
      fetch: counting,
      retry: { retries: 2, baseDelayMs: 5 },
    });
    let fnCalled = false;
    await assert.rejects(
      down.run({ service: "down", provider: "p" }, async () => {
        fnCalled = true;
      }),
      (err) => {
        assert.ok(err instanceof UnavailableError && err instanceof InflightError);
        assert.equal(err.code, "unavailable");
        // The message names the server and why it could not be reached.
        assert.equal(
          err.message,
          `POST /v1/activities: cannot reach http://127.0.0.1:${port}: connection refused (ECONNREFUSED)`,
        );
        return true;
      },
    );
    assert.equal(fnCalled, false);
    assert.deepEqual(calls, Array(3).fill("POST /v1/activities"), "a begin is tried 1 + 2 times, with one key");
    assert.equal(keys.size, 1);
    calls = [];
    await assert.rejects(down.snapshot(), {
      name: "UnavailableError",
      message: `GET /v1/snapshot: cannot reach http://127.0.0.1:${port}: connection refused (ECONNREFUSED)`,
    });
    assert.equal(calls.length, 3, "a read is tried 1 + 2 times");
    // A host that does not resolve is named too.
    const nowhere = new InflightClient({ baseUrl: "http://inflight.invalid:7878", retry: { retries: 0 } });
    await assert.rejects(nowhere.snapshot(), {
      // No such host, or no DNS server at all on a sandboxed machine.
      message: /^GET \/v1\/snapshot: cannot reach http:\/\/inflight\.invalid:7878: .+ \((ENOTFOUND|EAI_AGAIN)\)$/,
    });
    assert.equal(await down.healthy(), false);
  });

  test("a begin is retried with its key after a 503, a 408 and a proxy's 502; a registration only after the server's", async () => {
    const seen = [];
    const answers = [];
    const scripted = async (url, init) => {
      seen.push(`${init.method} ${new URL(url).pathname} ${init.headers["idempotency-key"] ?? "-"}`);
      const next = answers.shift();
      if (next) return next();
      return fetch(url, init);
    };
    const c = new InflightClient({ baseUrl: server.url, token: TOKEN, fetch: scripted, retry: { baseDelayMs: 5 } });
    const serverBody = (code) => JSON.stringify({ error: { code, message: "at a limit" } });
    answers.push(
      () => new Response(serverBody("unavailable"), { status: 503 }),
      () => new Response(serverBody("request_timeout"), { status: 408 }),
      () => new Response("bad gateway", { status: 502 }),
    );
    const a = await c.begin({ service: "retry", provider: "p" });
    assert.equal(a.record.state, "waiting");
    assert.equal(seen.length, 4, "three refusals, then the begin");
    assert.equal(new Set(seen).size, 1, "the same begin each time, with the same key");
    // A registration carries no key: a proxy's 502 proves nothing, it may have been registered.
    seen.length = 0;
    answers.push(() => new Response("bad gateway", { status: 502 }));
    await assert.rejects(c.registerOwner({ name: "retry-owner", ttlMs: 5000 }), (err) => {
      assert.equal(err.code, "unavailable");
      assert.equal(err.fromServer, false);
      return true;
    });
    assert.deepEqual(seen, ["POST /v1/owners -"]);
    await a.cancel();
  });

  test("a 5xx without the server's body is unavailable and retried for idempotent transitions", async () => {
    let attempts = 0;
    const flaky = async (url, init) => {
      attempts++;
      if (attempts < 3) return new Response("bad gateway", { status: 502 });
      return fetch(url, init);
    };
    const c = new InflightClient({ baseUrl: server.url, token: TOKEN, fetch: flaky, retry: { baseDelayMs: 5 } });
    const snap = await c.snapshot();
    assert.equal(typeof snap.totalActivities, "number");
    assert.equal(attempts, 3);
  });
});

describe("warnings", () => {
  test("a begin's ignored fields are told through onWarning, once per set of field names", async () => {
    const told = [];
    const c = new InflightClient({
      baseUrl: server.url,
      token: TOKEN,
      onWarning: (message, warning) => told.push({ message, warning }),
    });
    const a = await c.begin({ service: "typo", provider: "p", clas: "chat", modle: "m" });
    assert.deepEqual([...a.record.ignoredFields].sort(), ["clas", "modle"]);
    assert.equal(told.length, 1);
    assert.equal(told[0].warning.kind, "ignoredFields");
    assert.deepEqual([...told[0].warning.fields].sort(), ["clas", "modle"]);
    assert.equal(told[0].warning.record.activityId, a.id);
    assert.match(told[0].message, /ignored .*"clas".*"modle".* typo::p/);
    // The same set again (in any order, through run too): not told again.
    await c.begin({ service: "typo", provider: "p", modle: "m", clas: "chat" });
    await c.run({ service: "typo", provider: "p", clas: "chat", modle: "m" }, async () => "ok");
    assert.equal(told.length, 1);
    // Another set is told; a begin with only known fields is not.
    await c.run({ service: "typo", provider: "p", clas: "chat" }, async () => "ok");
    await c.run({ service: "typo", provider: "p", class: "chat", model: "m" }, async () => "ok");
    assert.equal(told.length, 2);
    assert.deepEqual(told[1].warning.fields, ["clas"]);
    // Once per client: another client tells its own.
    const other = [];
    const d = new InflightClient({ baseUrl: server.url, token: TOKEN, onWarning: (m) => other.push(m) });
    await d.begin({ service: "typo", provider: "p", clas: "chat", modle: "m" });
    assert.equal(other.length, 1);
    await a.cancel();
  });

  test("by default an ignored field goes to console.warn", async () => {
    const warned = [];
    const original = console.warn;
    console.warn = (...args) => warned.push(args.join(" "));
    try {
      const c = new InflightClient({ baseUrl: server.url, token: TOKEN });
      await c.run({ service: "typo", provider: "p", modle: "m" }, async () => "ok");
      await c.run({ service: "typo", provider: "p", modle: "m" }, async () => "ok");
    } finally {
      console.warn = original;
    }
    assert.equal(warned.length, 1);
    assert.match(warned[0], /"modle"/);
  });
});

describe("owner leases", () => {
  test("a dead owner's slot comes back once its lease runs out", async () => {
    const lane = "owner::capped";
    const owners = new InflightClient({ baseUrl: server.url, token: TOKEN });
    const lease = await owners.joinAsOwner("ts-dying-worker", 300);
    const held = await owners.admit({ service: "owner", provider: "capped" });
    assert.equal(held.record.ownerId, lease.id);
    // The process "dies": no more renewals, no settle.
    lease.stop();
    const t = Date.now();
    const next = await client.admit({ service: "owner", provider: "capped" }, { maxWaitMs: 5000 });
    assert.ok(Date.now() - t < 3000, "the slot came back within the lease, not the deadline bound");
    const dead = await client.getActivity(held.id);
    assert.equal(dead.state, "reaped");
    assert.equal(dead.reapReason, "owner-lost");
    assert.equal(dead.disposition, "unsettled");
    await next.succeed();
    // The dead process's late settle is absorbed, never counted.
    const late = await held.succeed();
    assert.equal(late.state, "reaped");
    assert.equal(late.lateSettle, true);
    await assertLaneEmpty(lane);
  });

  test("a lease renews in the background, tags records, and release cancels its in-flight records", async () => {
    const owners = new InflightClient({ baseUrl: server.url, token: TOKEN });
    const lease = await owners.joinAsOwner("ts-worker", 300);
    const a = await owners.begin({ service: "lease", provider: "p" });
    assert.equal(a.record.ownerId, lease.id);
    await sleep(900); // three TTLs: alive only if renewed
    assert.equal(lease.lost, false);
    assert.equal((await a.refresh()).state, "waiting");
    const owner = await lease.release();
    assert.equal(owner.state, "released");
    assert.equal(owner.cancelledRecords, 1);
    assert.equal((await a.refresh()).state, "cancelled");
    assert.equal(owners.ownerId, undefined, "records are no longer tagged");
    await lease.release(); // twice is harmless
  });

  test("renewNow by hand keeps one renewal loop; a renewal answered after the release is not a loss", async () => {
    let renewals = 0;
    // Once set: a renewal is held until `released` resolves.
    let held;
    let released;
    const counting = async (url, init) => {
      if (String(url).endsWith("/renew")) {
        renewals++;
        if (held) {
          held();
          await released;
        }
      }
      return fetch(url, init);
    };
    const owners = new InflightClient({ baseUrl: server.url, token: TOKEN, fetch: counting });
    const lost = [];
    const lease = await owners.joinAsOwner("ts-renew-now", 600, { onLost: (err) => lost.push(err) });
    for (let i = 0; i < 4; i++) await lease.renewNow();
    renewals = 0;
    await sleep(700); // every 200 ms: about 3, not 15
    assert.ok(renewals <= 5, `${renewals} renewals in 700 ms`);
    let release;
    released = new Promise((resolve) => (release = resolve));
    const underWay = new Promise((resolve) => (held = resolve));
    const renewing = lease.renewNow();
    await underWay;
    await lease.release();
    release();
    await renewing; // the server refuses it: the owner is released
    assert.equal(lease.lost, false);
    assert.deepEqual(lost, []);
  });

  test("a release that failed is tried again by the next call", async () => {
    let refusing = true;
    const flaky = (url, init) =>
      refusing && init?.method === "DELETE" ? Promise.reject(new TypeError("fetch failed")) : fetch(url, init);
    const owners = new InflightClient({ baseUrl: server.url, token: TOKEN, fetch: flaky, retry: { retries: 1, baseDelayMs: 1 } });
    const lease = await owners.joinAsOwner("ts-release-again", 5_000);
    await assert.rejects(lease.release(), (err) => err.code === "unavailable");
    refusing = false;
    assert.equal((await lease.release()).state, "released");
  });

  test("a lease cut off longer than its TTL is lost, and reported once", async () => {
    let partitioned = false;
    const cutOff = (url, init) => {
      if (partitioned && String(url).endsWith("/renew")) return Promise.reject(new TypeError("fetch failed"));
      return fetch(url, init);
    };
    const owners = new InflightClient({ baseUrl: server.url, token: TOKEN, fetch: cutOff, retry: { baseDelayMs: 5 } });
    const lost = [];
    const lease = await owners.joinAsOwner("ts-partitioned", 150, { onLost: (err) => lost.push(err) });
    partitioned = true;
    await sleep(400);
    assert.equal(lease.lost, false, "unreachable is not lost: the client keeps trying");
    partitioned = false;
    for (let i = 0; i < 40 && !lease.lost; i++) await sleep(25);
    assert.equal(lease.lost, true);
    assert.equal(lost.length, 1);
    assert.equal(lost[0].code, "conflict");
    assert.equal(owners.ownerId, undefined, "records are no longer tagged with a lost owner");
  });
});
