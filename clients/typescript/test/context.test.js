// withContext against the real server: what a begin inside a context
// records, read back from the server (never from the request sent).
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { InflightClient, InvalidRequestError } from "../dist/index.js";
import { sleep, startServer } from "./server.js";

const TOKEN = "ts-context-test-token";

let server;
let client;

before(async () => {
  server = await startServer({ token: TOKEN });
  client = new InflightClient({ baseUrl: server.url, token: TOKEN });
});
after(async () => {
  await server?.stop();
});

/** The attribution of the record `activity` began, as the server has it; the record is then cancelled. */
async function recorded(activity) {
  const record = await client.getActivity(activity.id);
  if (!activity.ended) await activity.cancel();
  return { service: record.service, operationStage: record.operationStage, priority: record.priority };
}

/** The attribution of a record, as the server has it, by id. */
async function recordedById(id) {
  const record = await client.getActivity(id);
  return { service: record.service, operationStage: record.operationStage, priority: record.priority };
}

describe("withContext", () => {
  test("every way of beginning inside it takes the context's service, stage and priority", async () => {
    const context = { service: "ctx-svc", operationStage: "ctx-ingest", priority: "batch" };
    const expected = { ...context };
    const ids = await client.withContext(context, async () => {
      const begun = await client.begin({ provider: "p" });
      const startedNow = await client.begin({ provider: "p" }, { startNow: true });
      const admitted = await client.admit({ provider: "p" });
      let ran;
      await client.run({ provider: "p" }, async (_signal, activity) => {
        ran = activity.id;
      });
      let observed;
      await client.observeUnqueued({ provider: "p" }, async (_signal, activity) => {
        observed = activity.id;
      });
      const ids = { begun: begun.id, startedNow: startedNow.id, admitted: admitted.id, ran, observed };
      await begun.cancel();
      await startedNow.succeed();
      await admitted.succeed();
      return ids;
    });
    for (const [how, id] of Object.entries(ids)) {
      assert.deepEqual(await recordedById(id), expected, how);
    }
  });

  test("a spec's own fields win over the context's", async () => {
    const a = await client.withContext({ service: "ctx-outer", operationStage: "ctx-stage", priority: "batch" }, () =>
      client.begin({ service: "ctx-own", provider: "p", operationStage: "own-stage", priority: "interactive" }),
    );
    assert.deepEqual(await recorded(a), { service: "ctx-own", operationStage: "own-stage", priority: "interactive" });
    // One field set, the others from the context; `undefined` counts as left out.
    const b = await client.withContext({ service: "ctx-outer", operationStage: "ctx-stage", priority: "batch" }, () =>
      client.begin({ provider: "p", service: undefined, operationStage: "own-stage" }),
    );
    assert.deepEqual(await recorded(b), { service: "ctx-outer", operationStage: "own-stage", priority: "batch" });
  });

  test("nested contexts: the inner's fields override, the ones it leaves out are inherited", async () => {
    const outer = { service: "ctx-nest", operationStage: "outer-stage", priority: "batch" };
    const seen = await client.withContext(outer, async () => {
      const before = await client.begin({ provider: "p" });
      const stageOnly = await client.withContext({ operationStage: "inner-stage" }, () => client.begin({ provider: "p" }));
      const deeper = await client.withContext({ service: "ctx-nest-inner", priority: "interactive" }, () =>
        client.withContext({ operationStage: "deepest-stage" }, () => client.begin({ provider: "p" })),
      );
      const afterInner = await client.begin({ provider: "p" });
      return Promise.all([before, stageOnly, deeper, afterInner].map(recorded));
    });
    assert.deepEqual(seen, [
      outer,
      { service: "ctx-nest", operationStage: "inner-stage", priority: "batch" },
      { service: "ctx-nest-inner", operationStage: "deepest-stage", priority: "interactive" },
      outer,
    ]);
  });

  test("the context survives awaits, setTimeout and promise callbacks", async () => {
    const context = { service: "ctx-async", operationStage: "ctx-later", priority: "interactive" };
    const activities = await client.withContext(context, async () => {
      await sleep(20);
      const afterSleep = await client.begin({ provider: "p" });
      const fromTimer = await new Promise((resolve, reject) => {
        setTimeout(() => client.begin({ provider: "p" }).then(resolve, reject), 30);
      });
      const fromThen = await Promise.resolve().then(() => sleep(5)).then(() => client.begin({ provider: "p" }));
      return [afterSleep, fromTimer, fromThen];
    });
    // A timer set inside but firing after withContext's promise resolved still has it.
    const late = await new Promise((resolve, reject) => {
      client.withContext(context, () => {
        setTimeout(() => client.begin({ provider: "p" }).then(resolve, reject), 50);
      });
    });
    for (const activity of [...activities, late]) assert.deepEqual(await recorded(activity), context);
  });

  test("two concurrent contexts do not leak into each other", async () => {
    const runIn = (service, stage, priority, pause) =>
      client.withContext({ service, operationStage: stage, priority }, async () => {
        const mine = [];
        for (let i = 0; i < 4; i++) {
          await sleep(pause);
          mine.push(await client.begin({ provider: "p" }));
        }
        return mine;
      });
    const [left, right] = await Promise.all([
      runIn("ctx-left", "left-stage", "batch", 7),
      runIn("ctx-right", "right-stage", "interactive", 11),
    ]);
    for (const a of left) {
      assert.deepEqual(await recorded(a), { service: "ctx-left", operationStage: "left-stage", priority: "batch" });
    }
    for (const a of right) {
      assert.deepEqual(await recorded(a), { service: "ctx-right", operationStage: "right-stage", priority: "interactive" });
    }
  });

  test("outside any context (and for another client) nothing is filled in", async () => {
    const unknown = { operationStage: "unknown", priority: "unknown" };
    const plain = await client.begin({ service: "ctx-none", provider: "p" });
    assert.deepEqual(await recorded(plain), { service: "ctx-none", ...unknown });
    // After a context has ended, too.
    await client.withContext({ service: "ctx-ended", operationStage: "s", priority: "batch" }, () => sleep(5));
    const after = await client.begin({ service: "ctx-none", provider: "p" });
    assert.deepEqual(await recorded(after), { service: "ctx-none", ...unknown });
    // No service from anywhere: the server refuses the begin, naming the field.
    await assert.rejects(client.begin({ provider: "p" }), (err) => {
      assert.ok(err instanceof InvalidRequestError);
      assert.match(err.message, /service/);
      return true;
    });
    // The context is the client's: another client's begins inside it take nothing.
    const other = new InflightClient({ baseUrl: server.url, token: TOKEN });
    const foreign = await client.withContext({ service: "ctx-mine", operationStage: "mine", priority: "batch" }, () =>
      other.begin({ service: "ctx-other", provider: "p" }),
    );
    assert.deepEqual(await recorded(foreign), { service: "ctx-other", ...unknown });
  });

  test("a bad context throws a TypeError naming the field, before fn runs", () => {
    let called = false;
    const fn = () => {
      called = true;
    };
    const cases = [
      [{ service: "bad service!" }, /withContext: invalid service: character " " is not allowed/],
      [{ service: "" }, /withContext: invalid service: must not be empty/],
      [{ operationStage: "x".repeat(65) }, /withContext: invalid operationStage: must be at most 64 characters/],
      [{ operationStage: 7 }, /withContext: invalid operationStage: must be a string, not 7/],
      [{ priority: "urgent" }, /withContext: invalid priority: "urgent" is not one of "interactive", "batch", "unknown"/],
      [{ servce: "kb" }, /withContext: unknown field "servce"/],
      [null, /withContext: the context must be an object/],
    ];
    for (const [context, message] of cases) {
      assert.throws(() => client.withContext(context, fn), (err) => {
        assert.ok(err instanceof TypeError, `${JSON.stringify(context)}: ${err}`);
        assert.match(err.message, message);
        return true;
      });
    }
    // Inside a good context, a bad nested one is refused the same way.
    client.withContext({ service: "ctx-ok" }, () => {
      assert.throws(() => client.withContext({ priority: "high" }, fn), /invalid priority/);
    });
    assert.equal(called, false);
    // Fields left undefined are fine, and a sync fn's result is returned as is.
    assert.equal(client.withContext({ service: undefined, priority: "unknown" }, () => 42), 42);
  });
});
