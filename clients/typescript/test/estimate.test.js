// A begin's token estimate (`maxTokens`): refused by the client when out of
// range, against a scripted fetch (no server); then the record and the
// lane's `tokensReserved` of the real server, with each store.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { InflightClient, MAX_USAGE_TOKENS } from "../dist/index.js";
import { startServer } from "./server.js";

const TOKEN = "ts-estimate-test-token";
const LANE = "est::openai";

describe("maxTokens, the requests (a scripted fetch)", () => {
  /** A client whose fetch records each request and refuses it (400, `scripted refusal`). */
  function scripted() {
    const seen = [];
    const client = new InflightClient({
      baseUrl: "http://127.0.0.1:9",
      retry: { retries: 0 },
      fetch: async (url, init) => {
        seen.push({ method: init.method, path: new URL(url).pathname, body: init.body && JSON.parse(init.body) });
        const error = { error: { code: "invalid_request", message: "scripted refusal" } };
        return new Response(JSON.stringify(error), { status: 400, headers: { "content-type": "application/json" } });
      },
    });
    return { client, seen };
  }

  test("out of range: a TypeError naming maxTokens, and nothing is sent", async () => {
    const { client, seen } = scripted();
    const spec = { service: "est", provider: "openai" };
    for (const maxTokens of [-1, MAX_USAGE_TOKENS + 1, 1.5, NaN, "100", Infinity]) {
      const bad = { ...spec, maxTokens };
      const refused = (err) => err instanceof TypeError && /begin: invalid maxTokens: must be a whole number from 0 to 1000000000/.test(err.message);
      await assert.rejects(client.begin(bad), refused, String(maxTokens));
      await assert.rejects(client.begin(bad, { startNow: true }), refused);
      await assert.rejects(client.admit(bad), refused);
      await assert.rejects(client.run(bad, async () => "never"), refused);
    }
    assert.deepEqual(seen, [], "nothing was sent");
  });

  test("in range (the bounds too) and null are sent as given", async () => {
    const { client, seen } = scripted();
    for (const maxTokens of [0, MAX_USAGE_TOKENS, null]) {
      await assert.rejects(client.begin({ service: "est", provider: "openai", maxTokens }), /scripted refusal/);
    }
    assert.deepEqual(seen.map((r) => r.body.maxTokens), [0, MAX_USAGE_TOKENS, null]);
  });
});

for (const store of ["memory:", undefined]) describe(`maxTokens against the real server (${store ?? "sqlite"})`, () => {
  let server;
  let client;

  before(async () => {
    server = await startServer({ lanes: { [LANE]: 4 }, token: TOKEN, store });
    client = new InflightClient({ baseUrl: server.url, token: TOKEN });
  });

  after(async () => {
    await server?.stop();
  });

  const lane = async () => (await client.snapshot({ limit: 10 })).nativeAdmission[LANE];

  test("the record carries the estimate; the lane reserves it while the call executes", async () => {
    const call = await client.begin({ service: "est", provider: "openai", maxTokens: 1500 });
    assert.equal(call.record.maxTokens, 1500);
    assert.equal(call.record.ignoredFields, undefined, "the server knows maxTokens");
    assert.equal((await lane()).tokensReserved, 0, "a waiting call reserves nothing");
    await call.start();
    assert.equal(call.record.maxTokens, 1500);
    assert.equal((await lane()).tokensReserved, 1500);
    const done = await call.succeed({ usage: { inputTokens: 100, outputTokens: 200 } });
    assert.equal(done.maxTokens, 1500);
    const settled = await lane();
    assert.equal(settled.tokensReserved, 0);
    assert.equal(settled.tokensLastMinute, 300, "reported usage counts, not the estimate");
  });

  test("no estimate: maxTokens is null and nothing is reserved; one with no usage is charged its estimate", async () => {
    const plain = await client.begin({ service: "est", provider: "openai" }, { startNow: true });
    assert.equal(plain.record.maxTokens, null);
    assert.equal((await lane()).tokensReserved, 0);
    await plain.succeed();
    const before = (await lane()).tokensLastMinute;
    const unreported = await client.begin({ service: "est", provider: "openai", maxTokens: 700 }, { startNow: true });
    assert.equal((await lane()).tokensReserved, 700);
    await unreported.succeed();
    const after = await lane();
    assert.equal(after.tokensReserved, 0);
    assert.equal(after.tokensLastMinute, before + 700);
  });

  test("past the bound the server refuses too, naming maxTokens", async () => {
    await assert.rejects(
      client.request("begin", { body: { service: "est", provider: "openai", maxTokens: MAX_USAGE_TOKENS + 1 } }),
      (err) => err.code === "invalid_request" && err.message.includes("maxTokens"),
    );
  });
});
