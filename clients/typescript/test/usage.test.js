// Token usage on settle: `usageOf(result)` on each answer shape it knows and
// on junk (no server); the settles the handle and `run` send, against a
// scripted fetch (no server); then the records and aggregates of the real
// server.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { Activity, InflightClient, InvalidRequestError, MAX_USAGE_TOKENS, usageOf } from "../dist/index.js";
import { startServer } from "./server.js";

const TOKEN = "ts-usage-test-token";
const ID = "01939b1c-0000-7000-8000-0000000000a5";

// ---- answers as the providers give them (trimmed to what matters) ---------

const OPENAI_CHAT = {
  id: "chatcmpl-1",
  object: "chat.completion",
  model: "gpt-4o-mini-2024-07-18",
  choices: [{ index: 0, message: { role: "assistant", content: "Hi." }, finish_reason: "stop" }],
  usage: {
    prompt_tokens: 12,
    completion_tokens: 40,
    total_tokens: 52,
    prompt_tokens_details: { cached_tokens: 0 },
    completion_tokens_details: { reasoning_tokens: 0 },
  },
};
const OPENAI_EMBEDDINGS = {
  object: "list",
  data: [{ object: "embedding", index: 0, embedding: [0.1, 0.2] }],
  model: "text-embedding-3-small",
  usage: { prompt_tokens: 8, total_tokens: 8 },
};
const OPENAI_RESPONSES = {
  id: "resp_1",
  object: "response",
  status: "completed",
  output: [{ type: "message", role: "assistant", content: [{ type: "output_text", text: "Hi." }] }],
  usage: {
    input_tokens: 36,
    input_tokens_details: { cached_tokens: 0 },
    output_tokens: 87,
    output_tokens_details: { reasoning_tokens: 0 },
    total_tokens: 123,
  },
};
const OLLAMA_CHAT = {
  model: "llama3.2",
  created_at: "2026-01-01T00:00:00Z",
  message: { role: "assistant", content: "Hi." },
  done: true,
  done_reason: "stop",
  total_duration: 4883583458,
  load_duration: 1334875,
  prompt_eval_count: 26,
  prompt_eval_duration: 342546000,
  eval_count: 282,
  eval_duration: 4535599000,
};
const OLLAMA_GENERATE = { model: "llama3.2", response: "Hi.", done: true, context: [1, 2, 3], prompt_eval_count: 9, eval_count: 3 };
const OLLAMA_EMBED = { model: "all-minilm", embeddings: [[0.01, -0.02]], total_duration: 14143917, prompt_eval_count: 8 };
const GEMINI = {
  candidates: [{ content: { parts: [{ text: "Hi." }], role: "model" }, finishReason: "STOP" }],
  usageMetadata: { promptTokenCount: 5, candidatesTokenCount: 7, totalTokenCount: 12 },
  modelVersion: "gemini-2.0-flash",
};

describe("usageOf", () => {
  test("OpenAI Chat Completions: usage.prompt_tokens, usage.completion_tokens", () => {
    assert.deepEqual(usageOf(OPENAI_CHAT), { inputTokens: 12, outputTokens: 40 });
    assert.deepEqual(usageOf(OPENAI_EMBEDDINGS), { inputTokens: 8 }, "an embedding has no output");
  });

  test("OpenAI Responses: usage.input_tokens, usage.output_tokens", () => {
    assert.deepEqual(usageOf(OPENAI_RESPONSES), { inputTokens: 36, outputTokens: 87 });
  });

  test("Ollama /api/chat, /api/generate, /api/embed: prompt_eval_count, eval_count", () => {
    assert.deepEqual(usageOf(OLLAMA_CHAT), { inputTokens: 26, outputTokens: 282 });
    assert.deepEqual(usageOf(OLLAMA_GENERATE), { inputTokens: 9, outputTokens: 3 });
    assert.deepEqual(usageOf(OLLAMA_EMBED), { inputTokens: 8 });
  });

  test("Gemini: usageMetadata.promptTokenCount, usageMetadata.candidatesTokenCount", () => {
    assert.deepEqual(usageOf(GEMINI), { inputTokens: 5, outputTokens: 7 });
    assert.deepEqual(usageOf({ usageMetadata: { promptTokenCount: 5, totalTokenCount: 5 } }), { inputTokens: 5 });
  });

  test("the bounds: 0 and 1000000000 are counts", () => {
    assert.equal(MAX_USAGE_TOKENS, 1_000_000_000);
    assert.deepEqual(usageOf({ usage: { prompt_tokens: 0, completion_tokens: 1_000_000_000 } }), {
      inputTokens: 0,
      outputTokens: 1_000_000_000,
    });
    assert.deepEqual(usageOf({ prompt_eval_count: 1_000_000_000, eval_count: 0 }), {
      inputTokens: 1_000_000_000,
      outputTokens: 0,
    });
  });

  test("anything else: undefined", () => {
    for (const value of [
      undefined, null, 0, 12, "usage", true, [], [OPENAI_CHAT], {}, () => {},
      { usage: null }, { usage: 12 }, { usage: {} }, { usage: { total_tokens: 52 } },
      { usageMetadata: null }, { usageMetadata: { totalTokenCount: 12 } },
      { choices: [] }, { done: true },
      new Response(JSON.stringify(OPENAI_CHAT)), // a fetch answer's body is not read
    ]) {
      assert.equal(usageOf(value), undefined, `${typeof value}: ${JSON.stringify(value)}`);
    }
  });

  test("junk counts: undefined, not a guess", () => {
    const junk = [-1, 1.5, 1_000_000_001, Number.MAX_SAFE_INTEGER, NaN, Infinity, -0.5, "12", null, true, {}, [12], 12n];
    for (const count of junk) {
      const label = typeof count === "bigint" ? `${count}n` : String(count);
      assert.equal(usageOf({ usage: { prompt_tokens: count, completion_tokens: 40 } }), undefined, `prompt_tokens ${label}`);
      assert.equal(usageOf({ usage: { prompt_tokens: 12, completion_tokens: count } }), undefined, `completion_tokens ${label}`);
      assert.equal(usageOf({ usage: { input_tokens: count, output_tokens: 40 } }), undefined, `input_tokens ${label}`);
      assert.equal(usageOf({ usage: { input_tokens: 12, output_tokens: count } }), undefined, `output_tokens ${label}`);
      assert.equal(usageOf({ prompt_eval_count: count, eval_count: 40 }), undefined, `prompt_eval_count ${label}`);
      assert.equal(usageOf({ prompt_eval_count: 12, eval_count: count }), undefined, `eval_count ${label}`);
      assert.equal(usageOf({ usageMetadata: { promptTokenCount: count, candidatesTokenCount: 40 } }), undefined, `promptTokenCount ${label}`);
      assert.equal(usageOf({ usageMetadata: { promptTokenCount: 12, candidatesTokenCount: count } }), undefined, `candidatesTokenCount ${label}`);
    }
  });

  test("never throws: a getter or a proxy that throws reads nothing", () => {
    const boom = () => {
      throw new Error("boom");
    };
    assert.equal(usageOf({ get usage() { return boom(); } }), undefined);
    assert.equal(usageOf({ usage: { get prompt_tokens() { return boom(); } } }), undefined);
    assert.equal(usageOf(new Proxy({}, { get: boom, has: boom, ownKeys: boom })), undefined);
    assert.equal(usageOf(Object.create(null)), undefined);
  });
});

// ---- the settles, against a scripted fetch --------------------------------

/** A record as the server answers it. */
function record(fields = {}) {
  return {
    activityId: ID, service: "kb", provider: "openai", class: "chat", operationStage: "unknown",
    model: "unknown", priority: "unknown", admission: "queued", state: "executing", disposition: null,
    reapReason: null, ownerId: null, enqueuedAt: "2026-01-01T00:00:00.000Z",
    startedAt: "2026-01-01T00:00:00.000Z", completedAt: null, reapedAt: null, deadlineMs: 300000,
    reapableAt: "2026-01-01T00:20:00.000Z", queueWaitMs: 0, executionMs: null, success: null,
    failureStage: null, lateSettle: false, refined: false, inputTokens: null, outputTokens: null, ...fields,
  };
}

const json = (status, body) => new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json" } });

/**
 * A client whose fetch plays a server that admits every begin at once and
 * settles as asked, recording every request as `{method, path, body}`.
 */
function scripted() {
  const seen = [];
  const client = new InflightClient({
    baseUrl: "http://127.0.0.1:9",
    retry: { retries: 0 },
    fetch: async (url, init) => {
      const path = new URL(url).pathname;
      const body = init.body ? JSON.parse(init.body) : undefined;
      seen.push({ method: init.method, path, body });
      if (path === "/v1/activities") return json(201, record({ state: "waiting", startedAt: null }));
      if (path.endsWith("/start")) return json(200, record());
      if (path.endsWith("/settle")) {
        return json(200, record({
          state: body.success ? "succeeded" : "failed",
          success: body.success,
          inputTokens: body.usage?.inputTokens ?? null,
          outputTokens: body.usage?.outputTokens ?? null,
        }));
      }
      if (path.endsWith("/cancel")) return json(200, record({ state: "cancelled" }));
      throw new Error(`unscripted request ${init.method} ${path}`);
    },
  });
  const settles = () => seen.filter((r) => r.path.endsWith("/settle")).map((r) => r.body);
  return { client, seen, settles };
}

const SPEC = { service: "kb", provider: "openai", class: "chat" };

describe("usage on settle, the requests (a scripted fetch)", () => {
  test("settle, succeed and fail send usage; a count left out is not sent", async () => {
    const { client, settles } = scripted();
    const call = new Activity(client, record());
    await call.succeed({ usage: { inputTokens: 12, outputTokens: 40 } });
    await call.fail("provider", { retryAfterMs: 2000, usage: { inputTokens: 7 } });
    await call.settle({ success: true, usage: { outputTokens: 0 } });
    await call.settle(true);
    await call.succeed();
    // null is "not reported", as on the wire.
    await call.succeed({ usage: { inputTokens: null, outputTokens: 5 } });
    await call.settle({ success: true, usage: null });
    assert.deepEqual(settles(), [
      { success: true, usage: { inputTokens: 12, outputTokens: 40 } },
      { success: false, failureStage: "provider", retryAfterMs: 2000, usage: { inputTokens: 7 } },
      { success: true, usage: { outputTokens: 0 } },
      { success: true },
      { success: true },
      { success: true, usage: { outputTokens: 5 } },
      { success: true },
    ]);
    assert.equal(call.record.inputTokens, null);
  });

  test("an invalid usage rejects with a TypeError naming the field, and nothing is sent", async () => {
    const { client, seen } = scripted();
    const call = new Activity(client, record());
    const cases = [
      [{ inputTokens: 1_000_000_001 }, /settle: invalid usage\.inputTokens: must be a whole number from 0 to 1000000000, not 1000000001/],
      [{ outputTokens: -1 }, /invalid usage\.outputTokens: .* not -1/],
      [{ inputTokens: 1.5 }, /invalid usage\.inputTokens/],
      [{ outputTokens: "40" }, /invalid usage\.outputTokens: .* not "40"/],
      [{ inputTokens: NaN }, /invalid usage\.inputTokens/],
      [{ input_tokens: 12 }, /unknown field usage\.input_tokens \(usage has inputTokens, outputTokens\)/],
      [12, /usage must be an object/],
      [[12, 40], /usage must be an object .* not an array/],
    ];
    for (const [usage, message] of cases) {
      await assert.rejects(call.succeed({ usage }), (err) => err instanceof TypeError && message.test(err.message), JSON.stringify(usage));
      await assert.rejects(call.fail("provider", { usage }), TypeError);
      await assert.rejects(call.settle({ success: true, usage }), TypeError);
    }
    assert.throws(() => call.reportUsage({ outputTokens: 1_000_000_001 }), /reportUsage: invalid usage\.outputTokens/);
    assert.equal(call.reportedUsage, undefined, "a refused report keeps nothing");
    assert.deepEqual(seen, [], "nothing was sent");
  });

  test("reportUsage: the handle's settles carry it unless given their own; counts merge", async () => {
    const { client, settles } = scripted();
    const call = new Activity(client, record());
    call.reportUsage({ inputTokens: 3 });
    call.reportUsage({ outputTokens: 4 });
    call.reportUsage({ inputTokens: 5 });
    assert.deepEqual(call.reportedUsage, { inputTokens: 5, outputTokens: 4 });
    await call.succeed();
    await call.fail("provider");
    await call.succeed({ usage: { inputTokens: 1 } });
    assert.deepEqual(settles(), [
      { success: true, usage: { inputTokens: 5, outputTokens: 4 } },
      { success: false, failureStage: "provider", usage: { inputTokens: 5, outputTokens: 4 } },
      { success: true, usage: { inputTokens: 1 } },
    ]);
  });

  test("run settles with the usage of an answer it recognises", async () => {
    for (const [answer, usage] of [
      [OPENAI_CHAT, { inputTokens: 12, outputTokens: 40 }],
      [OPENAI_RESPONSES, { inputTokens: 36, outputTokens: 87 }],
      [OLLAMA_EMBED, { inputTokens: 8 }],
      [GEMINI, { inputTokens: 5, outputTokens: 7 }],
    ]) {
      const { client, settles } = scripted();
      assert.equal(await client.run(SPEC, async () => answer), answer, "run gives fn's result");
      assert.deepEqual(settles(), [{ success: true, usage }]);
    }
    // observeUnqueued too.
    const { client, settles } = scripted();
    await client.observeUnqueued(SPEC, async () => OLLAMA_CHAT);
    assert.deepEqual(settles(), [{ success: true, usage: { inputTokens: 26, outputTokens: 282 } }]);
  });

  test("run: an answer it does not recognise settles with no usage", async () => {
    const { client, settles } = scripted();
    await client.run(SPEC, async () => "plain text");
    await client.run(SPEC, async () => ({ usage: { prompt_tokens: -1, completion_tokens: 3 } }));
    await client.run(SPEC, async () => undefined);
    assert.deepEqual(settles(), [{ success: true }, { success: true }, { success: true }]);
  });

  test("run: options.usage reads it instead; false reads none; a wrong or throwing one sends none", async () => {
    const { client, settles } = scripted();
    await client.run(SPEC, async () => ({ tokens: { in: 2, out: 3 } }), {
      usage: (result) => ({ inputTokens: result.tokens.in, outputTokens: result.tokens.out }),
    });
    await client.run(SPEC, async () => OPENAI_CHAT, { usage: false });
    await client.run(SPEC, async () => OPENAI_CHAT, { usage: () => undefined });
    await client.run(SPEC, async () => OPENAI_CHAT, { usage: () => ({ inputTokens: -5 }) });
    await client.run(SPEC, async () => OPENAI_CHAT, { usage: () => ({ inputTokens: 1, extra: 2 }) });
    await client.run(SPEC, async () => OPENAI_CHAT, { usage: () => { throw new Error("boom"); } });
    assert.deepEqual(settles(), [
      { success: true, usage: { inputTokens: 2, outputTokens: 3 } },
      { success: true },
      { success: true },
      { success: true },
      { success: true },
      { success: true },
    ]);
  });

  test("run: what fn reports wins over what the answer says, and over options.usage", async () => {
    const { client, settles } = scripted();
    await client.run(SPEC, async (_s, activity) => {
      activity.reportUsage({ inputTokens: 1, outputTokens: 2 });
      return OPENAI_CHAT;
    });
    await client.run(
      SPEC,
      async (_s, activity) => {
        activity.reportUsage({ outputTokens: 9 });
        return OPENAI_CHAT;
      },
      { usage: () => ({ inputTokens: 100, outputTokens: 100 }) },
    );
    assert.deepEqual(settles(), [
      { success: true, usage: { inputTokens: 1, outputTokens: 2 } },
      { success: true, usage: { outputTokens: 9 } },
    ]);
  });

  test("run: a failure carries what fn reported, and only that", async () => {
    const { client, settles } = scripted();
    const err = Object.assign(new Error("stream broke"), { usage: { prompt_tokens: 50, completion_tokens: 5 } });
    await assert.rejects(
      client.run(SPEC, async (_s, activity) => {
        activity.reportUsage({ inputTokens: 50 });
        throw err;
      }),
      (thrown) => thrown === err,
    );
    await assert.rejects(client.run(SPEC, async () => {
      throw err;
    }), (thrown) => thrown === err);
    assert.deepEqual(settles(), [
      { success: false, failureStage: "provider", usage: { inputTokens: 50 } },
      { success: false, failureStage: "provider" },
    ]);
  });

  test("run: an invalid report throws inside fn, which then fails as any throw does", async () => {
    const { client, settles } = scripted();
    await assert.rejects(
      client.run(SPEC, async (_s, activity) => {
        activity.reportUsage({ inputTokens: 2 ** 40 });
        return OPENAI_CHAT;
      }),
      /reportUsage: invalid usage\.inputTokens/,
    );
    assert.deepEqual(settles(), [{ success: false, failureStage: "provider" }]);
  });
});

// ---- against the server ---------------------------------------------------

describe("usage on settle, against the server", () => {
  let server;
  let client;

  before(async () => {
    server = await startServer({ lanes: { "usage-run::openai": 2 }, token: TOKEN });
    client = new InflightClient({ baseUrl: server.url, token: TOKEN });
  });
  after(async () => {
    await server?.stop();
  });

  /** The aggregates of `service`, summed: calls and tokens. */
  async function tokensOf(service) {
    const snap = await client.snapshot({ limit: 1000 });
    const mine = snap.aggregates.filter((a) => a.service === service);
    assert.ok(mine.length > 0, `the snapshot has no aggregate of ${service}`);
    return mine.reduce(
      (sum, a) => ({ calls: sum.calls + a.calls, inputTokens: sum.inputTokens + a.inputTokens, outputTokens: sum.outputTokens + a.outputTokens }),
      { calls: 0, inputTokens: 0, outputTokens: 0 },
    );
  }

  test("run with an OpenAI answer: the record has its tokens, and the aggregate sums them", async () => {
    const settled = [];
    const spec = { service: "usage-run", provider: "openai", class: "chat", model: "gpt-4o-mini" };
    const id = await client.run(spec, async (_s, activity) => ({ ...OPENAI_CHAT, id: activity.id }), {
      onSettled: (r) => settled.push(r),
    }).then((answer) => answer.id);
    const done = await client.getActivity(id);
    assert.equal(done.state, "succeeded");
    assert.equal(done.inputTokens, 12);
    assert.equal(done.outputTokens, 40);
    assert.equal(settled[0].inputTokens, 12, "the settle's answer carries them too");
    // A second call with a Responses answer, and a third with no usage, in the same aggregate.
    await client.run(spec, async () => OPENAI_RESPONSES);
    const plain = await client.run(spec, async (_s, activity) => activity.id);
    const none = await client.getActivity(plain);
    assert.equal(none.inputTokens, null, "no usage reported: null");
    assert.equal(none.outputTokens, null);
    assert.deepEqual(await tokensOf("usage-run"), { calls: 3, inputTokens: 12 + 36, outputTokens: 40 + 87 });
    const snap = await client.snapshot({ limit: 1000 });
    const recent = snap.recentCompletions.find((r) => r.activityId === id);
    assert.equal(recent?.inputTokens, 12, "the snapshot's records carry them");
  });

  test("what fn reports wins over the answer, and a failure carries it", async () => {
    const spec = { service: "usage-explicit", provider: "ollama", class: "chat" };
    let id;
    await client.run(spec, async (_s, activity) => {
      id = activity.id;
      activity.reportUsage({ inputTokens: 1000, outputTokens: 2000 });
      return OLLAMA_CHAT;
    });
    let done = await client.getActivity(id);
    assert.deepEqual([done.inputTokens, done.outputTokens], [1000, 2000]);
    const boom = new Error("the stream broke after the prompt");
    await assert.rejects(
      client.observeUnqueued(spec, async (_s, activity) => {
        id = activity.id;
        activity.reportUsage({ inputTokens: 77 });
        throw boom;
      }),
      (err) => err === boom,
    );
    done = await client.getActivity(id);
    assert.equal(done.state, "failed");
    assert.deepEqual([done.inputTokens, done.outputTokens], [77, null]);
    assert.deepEqual(await tokensOf("usage-explicit"), { calls: 2, inputTokens: 1077, outputTokens: 2000 });
  });

  test("out of range: refused by the client with no request sent; the record stays in flight", async () => {
    const settles = [];
    const counting = new InflightClient({
      baseUrl: server.url,
      token: TOKEN,
      fetch: (url, init) => {
        if (String(url).endsWith("/settle")) settles.push(JSON.parse(init.body));
        return fetch(url, init);
      },
    });
    const call = await counting.begin({ service: "usage-range", provider: "openai" }, { startNow: true });
    await assert.rejects(
      call.succeed({ usage: { inputTokens: MAX_USAGE_TOKENS + 1, outputTokens: 1 } }),
      (err) => err instanceof TypeError && /usage\.inputTokens/.test(err.message),
    );
    await assert.rejects(call.fail("provider", { usage: { outputTokens: -1 } }), /usage\.outputTokens/);
    assert.deepEqual(settles, [], "no settle was sent");
    assert.equal((await call.refresh()).state, "executing");
    // The bounds themselves are taken.
    const done = await call.succeed({ usage: { inputTokens: MAX_USAGE_TOKENS, outputTokens: 0 } });
    assert.equal(settles.length, 1);
    assert.deepEqual([done.state, done.inputTokens, done.outputTokens], ["succeeded", MAX_USAGE_TOKENS, 0]);
  });

  test("the server's own check agrees: past the bound it refuses, naming the field", async () => {
    const call = await client.begin({ service: "usage-range", provider: "openai" }, { startNow: true });
    for (const field of ["inputTokens", "outputTokens"]) {
      await assert.rejects(
        client.request("settle", { id: call.id, body: { success: true, usage: { [field]: MAX_USAGE_TOKENS + 1 } } }),
        (err) => err instanceof InvalidRequestError && err.message.includes(`usage.${field}`),
      );
    }
    assert.equal((await call.refresh()).state, "executing");
    await call.cancel();
    assert.equal(call.record.inputTokens, null, "a cancel takes no usage");
  });
});
