// Refining a record's model: `activity.refine(model)` on the handle, and
// from inside `run` / `observeUnqueued` through the handle they give `fn`.
// First the request itself, against a scripted fetch (no server); then the
// rules, against the real server.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { Activity, ConflictError, InflightClient, InvalidRequestError, NotFoundError } from "../dist/index.js";
import { startServer } from "./server.js";

const TOKEN = "ts-refine-test-token";
const ID = "01939b1c-0000-7000-8000-00000000beef";

/** A record as the server answers it; `refined` left out, as an older server does, when `refined` is undefined. */
function record(fields = {}) {
  return {
    activityId: ID, service: "kb", provider: "ollama", class: "embedding", operationStage: "unknown",
    model: "unknown", priority: "unknown", admission: "queued", state: "executing", disposition: null,
    reapReason: null, ownerId: null, enqueuedAt: "2026-01-01T00:00:00.000Z",
    startedAt: "2026-01-01T00:00:00.000Z", completedAt: null, reapedAt: null, deadlineMs: 300000,
    reapableAt: "2026-01-01T00:20:00.000Z", queueWaitMs: 0, executionMs: null, success: null,
    failureStage: null, lateSettle: false, ...fields,
  };
}

const json = (status, body) => new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json" } });
const serverError = (status, code) => json(status, { error: { code, message: `said ${code}` } });

/**
 * A client whose fetch answers from `script` (one function per request, in
 * order; each gets `{method, path, body}`), recording every request.
 */
function scripted(script) {
  const seen = [];
  const client = new InflightClient({
    baseUrl: "http://127.0.0.1:9",
    retry: { retries: 3, baseDelayMs: 1 },
    fetch: async (url, init) => {
      const request = { method: init.method, path: new URL(url).pathname, body: init.body ? JSON.parse(init.body) : undefined };
      seen.push(request);
      const next = script.shift();
      if (!next) throw new Error(`unscripted request ${request.method} ${request.path}`);
      return next(request);
    },
  });
  return { client, seen };
}

describe("refine, the request (a scripted fetch)", () => {
  test("POSTs {model} to /v1/activities/{id}/refine and keeps the answer as the handle's record", async () => {
    const { client, seen } = scripted([(r) => json(200, record({ model: r.body.model, refined: true }))]);
    const call = new Activity(client, record({ model: "auto" }));
    const answer = await call.refine("llama3.1:8b");
    assert.deepEqual(seen, [{ method: "POST", path: `/v1/activities/${ID}/refine`, body: { model: "llama3.1:8b" } }]);
    assert.equal(answer.model, "llama3.1:8b");
    assert.equal(answer.refined, true);
    assert.equal(call.record, answer);
  });

  test("an older server's record, without `refined`, is taken as it is", async () => {
    const { client } = scripted([() => json(200, record())]);
    const got = await client.getActivity(ID);
    assert.equal("refined" in got, false);
    assert.equal(got.refined ?? false, false);
  });

  test("retried like settle: after no answer and after a proxy's 5xx", async () => {
    const { client, seen } = scripted([
      () => Promise.reject(new TypeError("fetch failed", { cause: Object.assign(new Error("reset"), { code: "ECONNRESET" }) })),
      () => new Response("bad gateway", { status: 502 }),
      () => serverError(500, "internal"),
      (r) => json(200, record({ model: r.body.model, refined: true })),
    ]);
    const answer = await new Activity(client, record()).refine("gpt-4o-mini");
    assert.equal(answer.model, "gpt-4o-mini");
    assert.equal(seen.length, 4);
    assert.ok(seen.every((r) => r.path.endsWith("/refine") && r.body.model === "gpt-4o-mini"), "the same request each time");
  });

  test("a 409, 404 or 400 is typed and never retried", async () => {
    const cases = [
      [409, "conflict", ConflictError],
      [404, "not_found", NotFoundError],
      [400, "invalid_request", InvalidRequestError],
    ];
    for (const [status, code, type] of cases) {
      const { client, seen } = scripted([() => serverError(status, code)]);
      await assert.rejects(new Activity(client, record()).refine("m"), (err) => {
        assert.ok(err instanceof type, String(err));
        assert.equal(err.code, code);
        assert.equal(err.status, status);
        assert.match(err.message, /^POST \/v1\/activities\/\{id\}\/refine: /);
        return true;
      });
      assert.equal(seen.length, 1, code);
    }
  });

  test("run and observeUnqueued give fn the handle, which refines the record they settle", async () => {
    for (const direct of [false, true]) {
      const { client, seen } = scripted([
        (r) => json(201, record({ state: direct ? "executing" : "waiting", admission: r.body.admission ?? "queued" })),
        ...(direct ? [] : [() => json(200, record())]),
        (r) => json(200, record({ model: r.body.model, refined: true })),
        () => json(200, record({ model: "qwen2.5:7b", refined: true, state: "succeeded", success: true })),
      ]);
      const spec = { service: "kb", provider: "ollama" };
      const fn = async (signal, activity) => {
        assert.equal(signal.aborted, false);
        assert.equal(activity.id, ID);
        return (await activity.refine("qwen2.5:7b")).model;
      };
      const settled = [];
      const options = { onSettled: (r) => settled.push(r) };
      const model = direct ? await client.observeUnqueued(spec, fn, options) : await client.run(spec, fn, options);
      assert.equal(model, "qwen2.5:7b");
      assert.deepEqual(
        seen.map((r) => `${r.method} ${r.path.replace(ID, "{id}")}`),
        [
          "POST /v1/activities",
          ...(direct ? [] : ["POST /v1/activities/{id}/start"]),
          "POST /v1/activities/{id}/refine",
          "POST /v1/activities/{id}/settle",
        ],
      );
      assert.equal(settled[0].model, "qwen2.5:7b", "onSettled sees the refined record");
    }
  });
});

describe("refine against the real server", () => {
  let server;
  let client;

  before(async () => {
    server = await startServer({ token: TOKEN });
    client = new InflightClient({ baseUrl: server.url, token: TOKEN });
  });
  after(async () => {
    await server?.stop();
  });

  /** The calls the snapshot's aggregates count for `service`, by model. */
  async function callsByModel(service) {
    const snap = await client.snapshot({ limit: 1000 });
    const calls = {};
    for (const a of snap.aggregates.filter((a) => a.service === service)) calls[a.model] = (calls[a.model] ?? 0) + a.calls;
    for (const model of Object.keys(calls)) if (calls[model] === 0) delete calls[model];
    return calls;
  }

  test("inside run, a refinement replaces the begin's model, and the call counts under it", async () => {
    const spec = { service: "refine-run", provider: "ollama", class: "chat", model: "auto" };
    const seen = [];
    const result = await client.run(spec, async (_signal, activity) => {
      seen.push(activity.record);
      const refined = await activity.refine("llama3.1:8b");
      seen.push(refined);
      return activity.id;
    });
    assert.equal(seen[0].model, "auto");
    assert.equal(seen[0].refined, false, "a record not refined says so");
    assert.equal(seen[1].model, "llama3.1:8b");
    assert.equal(seen[1].refined, true);
    assert.equal(seen[1].state, "executing");
    const done = await client.getActivity(result);
    assert.equal(done.state, "succeeded");
    assert.equal(done.model, "llama3.1:8b");
    assert.equal(done.refined, true);
    assert.deepEqual(await callsByModel("refine-run"), { "llama3.1:8b": 1 });
  });

  test("observeUnqueued refines too, from a begin that named no model", async () => {
    const id = await client.observeUnqueued({ service: "refine-direct", provider: "openai" }, async (_s, activity) => {
      await activity.refine("gpt-4o-mini");
      return activity.id;
    });
    const done = await client.getActivity(id);
    assert.equal(done.admission, "direct");
    assert.equal(done.model, "gpt-4o-mini");
    assert.equal(done.refined, true);
  });

  test("the same model again changes nothing; a different one folds to unknown, for good", async () => {
    const call = await client.begin({ service: "refine-fold", provider: "ollama", model: "auto" });
    assert.equal(call.record.state, "waiting");
    assert.equal((await call.refine("llama3.1:8b")).model, "llama3.1:8b", "a waiting record can be refined");
    assert.equal((await call.refine("llama3.1:8b")).model, "llama3.1:8b");
    const folded = await call.refine("llama3.1:70b");
    assert.equal(folded.model, "unknown");
    assert.equal(folded.refined, true);
    assert.equal((await call.refine("llama3.1:8b")).model, "unknown", "no way back");
    await call.start();
    await call.succeed();
    assert.equal(call.record.model, "unknown");
    // Inside run, the same.
    const id = await client.run({ service: "refine-fold", provider: "ollama" }, async (_s, activity) => {
      await activity.refine("a");
      await activity.refine("b");
      return activity.id;
    });
    assert.equal((await client.getActivity(id)).model, "unknown");
    assert.deepEqual(await callsByModel("refine-fold"), { unknown: 2 });
  });

  test("an ended record is ConflictError; an unknown id NotFoundError; an empty model InvalidRequestError", async () => {
    const settled = await client.begin({ service: "refine-ended", provider: "p", model: "m" });
    await settled.start();
    await settled.succeed();
    await assert.rejects(settled.refine("other"), (err) => err instanceof ConflictError && err.status === 409);
    const cancelled = await client.begin({ service: "refine-ended", provider: "p" });
    await cancelled.cancel("gave up");
    await assert.rejects(cancelled.refine("m"), ConflictError);
    assert.equal((await settled.refresh()).model, "m", "a refused refinement changed nothing");
    // run: once fn has returned, the record is settled; a refinement after that is refused.
    let handle;
    await client.run({ service: "refine-ended", provider: "p" }, async (_s, activity) => {
      handle = activity;
    });
    await assert.rejects(handle.refine("late"), ConflictError);
    const ghost = new Activity(client, { ...settled.record, activityId: "01939b1c-0000-7000-8000-000000000000" });
    await assert.rejects(ghost.refine("m"), NotFoundError);
    const live = await client.begin({ service: "refine-ended", provider: "p" });
    await assert.rejects(live.refine(""), (err) => err instanceof InvalidRequestError && /model/.test(err.message));
    // Kept like a begin's model: an endpoint (or a key) where the model belongs is not.
    assert.equal((await live.refine("http://10.0.0.1:11434")).model, "redacted");
    await live.cancel();
  });

  test("a refinement whose answer was lost is sent again, harmlessly", async () => {
    const refines = [];
    let dropped = 0;
    const lossy = new InflightClient({
      baseUrl: server.url,
      token: TOKEN,
      retry: { retries: 3, baseDelayMs: 5 },
      fetch: async (url, init) => {
        if (!String(url).endsWith("/refine")) return fetch(url, init);
        refines.push(JSON.parse(init.body).model);
        const response = await fetch(url, init);
        if (dropped++ === 0) {
          await response.text(); // the server applied it; the answer never arrives
          throw new TypeError("fetch failed", { cause: Object.assign(new Error("socket hang up"), { code: "ECONNRESET" }) });
        }
        return response;
      },
    });
    const id = await lossy.run({ service: "refine-lossy", provider: "ollama", model: "auto" }, async (_s, activity) => {
      const answer = await activity.refine("mistral:7b");
      assert.equal(answer.model, "mistral:7b", "the retry found it refined, not folded");
      assert.equal(answer.refined, true);
      return activity.id;
    });
    assert.deepEqual(refines, ["mistral:7b", "mistral:7b"], "sent twice: the answer of the first was lost");
    const done = await client.getActivity(id);
    assert.equal(done.state, "succeeded");
    assert.equal(done.model, "mistral:7b");
    assert.deepEqual(await callsByModel("refine-lossy"), { "mistral:7b": 1 });
  });
});
