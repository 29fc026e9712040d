// Token budgets against the real server: a lane's `tokens_per_minute` (and a
// provider's) refuses a start whose `maxTokens` does not fit
// (`budget_exhausted`, 429 with Retry-After), a begin whose estimate alone
// exceeds the whole budget is refused (`invalid_request`), and the client
// waits in line through a used-up budget until a settle makes room. A
// lane's token window outlives its test, so each test has lanes of its own.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  BudgetExhaustedError,
  errorFor,
  FIELDS,
  InflightClient,
  InflightError,
  InvalidRequestError,
  isInflightError,
  LaneCoolingError,
  LaneFullError,
  WaitTimeoutError,
} from "../dist/index.js";
import { sleep, startServer } from "./server.js";

const BUDGETED = ["refuse", "admit", "run", "maxwait", "now", "estimate"].map((s) => `${s}::budgeted`);

let server;
let client;

before(async () => {
  const config =
    BUDGETED.map((lane) => `[lanes."${lane}"]\ntokens_per_minute = 1000\n`).join("") +
    // A provider's budget, shared by its lanes (none of their own).
    '[providers.metered]\ntokens_per_minute = 1000\n';
  server = await startServer({ config, store: "memory:" });
  client = new InflightClient({ baseUrl: server.url });
});
after(async () => {
  await server?.stop();
});

const specOf = (lane, maxTokens = 400) => {
  const [service, provider] = lane.split("::");
  return { service, provider, maxTokens };
};

async function laneOf(lane) {
  const snap = await client.snapshot({ limit: 1000 });
  const l = snap.nativeAdmission[lane];
  assert.ok(l, `the snapshot shows no lane ${lane}`);
  return l;
}

/** Begins two calls of 400 tokens on `lane` and starts them: 800 of its 1000 are taken. */
async function fillTo800(lane) {
  const first = await client.admit(specOf(lane));
  const second = await client.admit(specOf(lane));
  assert.equal(first.record.state, "executing");
  assert.equal(second.record.state, "executing");
  assert.equal((await laneOf(lane)).tokensReserved, 800);
  return [first, second];
}

/** A client that counts its `start` requests. */
function countingClient() {
  const counts = { start: 0 };
  const c = new InflightClient({
    baseUrl: server.url,
    fetch: (url, init) => {
      if (new URL(url).pathname.endsWith("/start")) counts.start++;
      return fetch(url, init);
    },
  });
  return { c, counts };
}

function assertBudgetExhausted(err) {
  assert.ok(err instanceof BudgetExhaustedError, String(err));
  assert.ok(err instanceof InflightError);
  assert.ok(!(err instanceof LaneFullError) && !(err instanceof LaneCoolingError));
  assert.equal(err.name, "BudgetExhaustedError");
  assert.equal(err.code, "budget_exhausted");
  assert.equal(err.status, 429);
  assert.equal(err.fromServer, true);
  // Only a settle can make room (nothing was reported in the last minute): 60 s.
  assert.equal(err.retryAfterMs, 60_000);
  assert.match(err.message, /token budget/);
  return true;
}

test("budget_exhausted maps to BudgetExhaustedError, an InflightError with its code", () => {
  const err = errorFor("budget_exhausted", "no room", { status: 429, retryAfterMs: 60_000, fromServer: true });
  assert.ok(err instanceof BudgetExhaustedError);
  assert.ok(err instanceof InflightError);
  assert.equal(err.name, "BudgetExhaustedError");
  assert.equal(err.retryAfterMs, 60_000);
  assert.equal(isInflightError(err, "budget_exhausted"), true);
  assert.equal(isInflightError(err, "lane_cooling"), false);
});

describe("a lane's token budget", () => {
  test("the third start of 400 tokens in 1000 is refused budget_exhausted, Retry-After 60, and keeps its place", async () => {
    const lane = "refuse::budgeted";
    const [first, second] = await fillTo800(lane);
    const third = await client.begin(specOf(lane));
    assert.equal(third.record.state, "waiting");
    await assert.rejects(third.start(), assertBudgetExhausted);
    // A held wait: the server waits for room, then refuses the same way.
    const started = Date.now();
    await assert.rejects(third.start({ waitMs: 300 }), assertBudgetExhausted);
    assert.ok(Date.now() - started >= 250, `answered after ${Date.now() - started} ms: the wait was not held`);
    assert.equal((await client.getActivity(third.id)).state, "waiting", "the refused record keeps its place in line");

    const l = await laneOf(lane);
    assert.deepEqual(Object.keys(l).sort(), [...FIELDS.Lane].sort());
    assert.equal(l.tokensPerMinute, 1000);
    assert.equal(l.providerTokensPerMinute, null);
    assert.equal(l.executing, 2);
    assert.equal(l.waiting, 1);
    assert.equal(l.tokensReserved, 800);

    await third.cancel();
    await first.succeed({ usage: { inputTokens: 400 } });
    await second.succeed({ usage: { inputTokens: 400 } });
  });

  test("a maxTokens above the whole budget is invalid_request, naming the budget", async () => {
    for (const startNow of [false, true]) {
      await assert.rejects(client.begin(specOf("estimate::budgeted", 4000), { startNow }), (err) => {
        assert.ok(err instanceof InvalidRequestError, String(err));
        assert.equal(err.code, "invalid_request");
        assert.equal(err.status, 400);
        assert.match(err.message, /tokens_per_minute/);
        assert.match(err.message, /4000/);
        return true;
      });
    }
    const l = (await client.snapshot({ limit: 1000 })).nativeAdmission["estimate::budgeted"];
    assert.ok(l === undefined || (l.executing === 0 && l.waiting === 0), "nothing was recorded");
  });

  test("a start now is refused budget_exhausted, with or without a wait, and holds nothing", async () => {
    const lane = "now::budgeted";
    const [first, second] = await fillTo800(lane);
    await assert.rejects(client.begin(specOf(lane), { startNow: true }), assertBudgetExhausted);
    await assert.rejects(client.begin(specOf(lane), { startNow: true, waitMs: 200 }), assertBudgetExhausted);
    const l = await laneOf(lane);
    assert.equal(l.executing, 2);
    assert.equal(l.waiting, 0);
    await first.succeed({ usage: { inputTokens: 400 } });
    await second.succeed({ usage: { inputTokens: 400 } });
  });

  test("admit waits through budget_exhausted, not for its Retry-After, and is admitted once a settle makes room", async () => {
    const lane = "admit::budgeted";
    const [first, second] = await fillTo800(lane);
    // Waits of 150 ms at a time, so that admit is answered budget_exhausted
    // (Retry-After 60) several times before the settle; a maxWaitMs below
    // the Retry-After, which must not make it give up at once.
    const { c, counts } = countingClient();
    const began = Date.now();
    const waiting = c.admit(specOf(lane), { maxWaitMs: 20_000, waitStepMs: 150 });
    await sleep(700);
    // Settling the first with 50 tokens of its 400 frees room: 50 + 400 + 400 <= 1000.
    await first.succeed({ usage: { inputTokens: 50 } });
    const admitted = await waiting;
    const took = Date.now() - began;
    assert.equal(admitted.record.state, "executing");
    assert.ok(counts.start >= 3, `${counts.start} start requests: admit was not refused budget_exhausted before the settle`);
    assert.ok(took < 5_000, `admitted ${took} ms after it began: it slept on the Retry-After`);
    const l = await laneOf(lane);
    assert.equal(l.tokensLastMinute, 50);
    assert.equal(l.tokensReserved, 800);
    assert.equal(l.waiting, 0);
    await admitted.succeed({ usage: { inputTokens: 400 } });
    await second.succeed({ usage: { inputTokens: 400 } });
  });

  test("run waits through a used-up budget too (its held wait wakes on the settle), then calls fn", async () => {
    const lane = "run::budgeted";
    const [first, second] = await fillTo800(lane);
    let called = 0;
    const running = client.run(specOf(lane), async (_signal, activity) => {
      called++;
      assert.equal(activity.record.state, "executing");
      return "done";
    }, { maxWaitMs: 20_000 });
    await sleep(500);
    assert.equal(called, 0, "fn ran before there was room");
    await first.succeed({ usage: { inputTokens: 50 } });
    assert.equal(await running, "done");
    assert.equal(called, 1);
    await second.succeed({ usage: { inputTokens: 400 } });
  });

  test("past maxWaitMs: WaitTimeoutError with the BudgetExhaustedError and its Retry-After; the record is cancelled", async () => {
    const lane = "maxwait::budgeted";
    const [first, second] = await fillTo800(lane);
    const started = Date.now();
    await assert.rejects(client.admit(specOf(lane), { maxWaitMs: 600, waitStepMs: 200 }), (err) => {
      assert.ok(err instanceof WaitTimeoutError, String(err));
      assertBudgetExhausted(err.cause);
      assert.equal(err.retryAfterMs, 60_000);
      assert.match(err.message, /token budget/);
      return true;
    });
    const took = Date.now() - started;
    assert.ok(took >= 550 && took < 3_000, `gave up after ${took} ms`);
    assert.equal((await laneOf(lane)).waiting, 0, "the timed-out record was cancelled");
    await first.succeed({ usage: { inputTokens: 400 } });
    await second.succeed({ usage: { inputTokens: 400 } });
  });
});

describe("a provider's token budget", () => {
  test("is shared by its lanes, shown on each, and refuses as a lane's does", async () => {
    const one = await client.admit({ service: "a", provider: "metered", maxTokens: 400 });
    const two = await client.admit({ service: "b", provider: "metered", maxTokens: 400 });
    const three = await client.begin({ service: "a", provider: "metered", maxTokens: 400 });
    await assert.rejects(three.start(), assertBudgetExhausted);
    for (const lane of ["a::metered", "b::metered"]) {
      const l = await laneOf(lane);
      assert.equal(l.tokensPerMinute, null);
      assert.equal(l.providerTokensPerMinute, 1000);
    }
    // The settle on the other lane makes room: the waiting call is admitted.
    const waiting = three.admit({ maxWaitMs: 20_000, waitStepMs: 150 });
    await sleep(400);
    await two.succeed({ usage: { inputTokens: 50 } });
    assert.equal((await waiting).state, "executing");
    await one.succeed({ usage: { inputTokens: 400 } });
    await three.succeed({ usage: { inputTokens: 400 } });
  });
});
