// The example against the real server and a stub provider (a tiny local
// HTTP server speaking Ollama's /api/embed and OpenAI's /v1/chat/completions),
// so it runs with no network. While the calls run, the snapshot the
// dashboard reads and /metrics show the lane busy; afterwards, empty.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { after, before, test } from "node:test";

import { InflightClient } from "inflight-ledger";
import { laneCounts, sleep, startServer } from "../test/server.js";
import { chat, embed } from "./ollama-embed.js";

const LANE = "knowledge-base::ollama";
let server;
let provider;
let providerUrl;
let client;
let concurrent = 0;
let maxConcurrent = 0;
let failNext = false;
/** While set, the stub holds every call: the test decides when they finish. */
let gate;

before(async () => {
  server = await startServer({ lanes: { [LANE]: 2 } });
  client = new InflightClient({ baseUrl: server.url });
  provider = createServer(async (req, res) => {
    let body = "";
    for await (const chunk of req) body += chunk;
    const input = JSON.parse(body);
    concurrent++;
    maxConcurrent = Math.max(maxConcurrent, concurrent);
    const done = () => concurrent--;
    res.on("close", done);
    if (failNext) {
      failNext = false;
      res.writeHead(500).end("model not loaded");
      return;
    }
    await gate?.promise;
    await sleep(input.model === "slow" ? 5000 : 50);
    if (res.destroyed) return;
    res.writeHead(200, { "content-type": "application/json" });
    if (req.url === "/api/embed") {
      res.end(JSON.stringify({ model: input.model, embeddings: [[0.1, 0.2, 0.3, input.input.length]] }));
    } else {
      res.end(JSON.stringify({ choices: [{ message: { role: "assistant", content: "stub answer" } }] }));
    }
  });
  await new Promise((r) => provider.listen(0, "127.0.0.1", r));
  providerUrl = `http://127.0.0.1:${provider.address().port}`;
});
after(async () => {
  provider?.closeAllConnections();
  await new Promise((r) => provider?.close(r));
  await server?.stop();
});

function deferred() {
  let resolve;
  const promise = new Promise((r) => (resolve = r));
  return { promise, resolve };
}

/** Polls `check` until it returns a value (at most 10 s). */
async function until(check) {
  const deadline = Date.now() + 10_000;
  for (;;) {
    const value = await check();
    if (value !== undefined) return value;
    if (Date.now() > deadline) throw new Error("timed out waiting for the lane to fill");
    await sleep(20);
  }
}

async function metric(name, lane) {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const [service, prov] = lane.split("::");
  const line = text.split("\n").find((l) => l.startsWith(`${name}{service="${service}",provider="${prov}"}`));
  return line === undefined ? undefined : Number(line.split(" ").pop());
}

test("embeddings wait for the lane's 2 slots; the snapshot and /metrics move, then return to zero", async () => {
  const dashboard = await fetch(`${server.url}/`);
  assert.equal(dashboard.status, 200, "the dashboard is served at /");
  const texts = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"];
  gate = deferred();
  const all = Promise.all(texts.map((t) => embed(client, t, { ollamaUrl: providerUrl })));
  const busy = await until(async () => {
    const counts = await laneCounts(client, LANE);
    return counts.executing + counts.waiting === 6 && concurrent === 2 ? counts : undefined;
  });
  assert.equal(busy.executing, 2, "two calls hold the two slots");
  assert.equal(busy.waiting, 4, "the rest wait in line");
  assert.equal(await metric("inflight_lane_executing", LANE), 2);
  assert.equal(await metric("inflight_lane_waiting", LANE), 4);
  gate.resolve();
  gate = undefined;
  const vectors = await all;
  assert.deepEqual(vectors.map((v) => v[3]), [1, 2, 3, 4, 5, 6]);
  assert.equal(maxConcurrent, 2, "the provider never saw more than the cap");
  assert.deepEqual(await laneCounts(client, LANE), { executing: 0, waiting: 0, inFlight: 0 });
  assert.equal(await metric("inflight_lane_executing", LANE), 0);
});

test("a provider error is recorded `failed`; an abort `cancelled` and the provider call is aborted", async () => {
  failNext = true;
  await assert.rejects(embed(client, "x", { ollamaUrl: providerUrl }), /ollama answered 500/);
  const controller = new AbortController();
  const call = embed(client, "y", { ollamaUrl: providerUrl, model: "slow", signal: controller.signal });
  await until(async () => (concurrent === 1 ? true : undefined)); // the provider is working on it
  controller.abort();
  await assert.rejects(call, { name: "AbortError" });
  await until(async () => (concurrent === 0 ? true : undefined)); // the provider's connection was closed
  const snap = await client.snapshot();
  const recent = snap.recentCompletions.filter((r) => r.service === "knowledge-base").slice(0, 2);
  assert.deepEqual(recent.map((r) => r.state), ["cancelled", "failed"]);
  assert.deepEqual(await laneCounts(client, LANE), { executing: 0, waiting: 0, inFlight: 0 });
});

test("an OpenAI-compatible chat call with a timeout", async () => {
  assert.equal(await chat(client, [{ role: "user", content: "hi" }], { baseUrl: providerUrl }), "stub answer");
  await assert.rejects(
    chat(client, [{ role: "user", content: "hi" }], { baseUrl: providerUrl, model: "slow", timeoutMs: 200 }),
    { name: "TimeoutError" },
  );
  const snap = await client.snapshot();
  const chats = snap.recentCompletions.filter((r) => r.service === "assistant");
  assert.deepEqual(chats.map((r) => r.state), ["cancelled", "succeeded"]);
  assert.equal(chats[0].cancelReason, "timeout");
});
