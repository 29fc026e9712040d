// Scoped tokens (`[[tokens]]` in the server's config): a read token reads
// and is refused every write; a write token bound to services acts only for
// them. A refusal is ForbiddenError (403 `forbidden`) with the server's
// message, and is never retried.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { Activity, ForbiddenError, InflightClient, InflightError } from "../dist/index.js";
import { startServer } from "./server.js";

const ADMIN = "ts-scopes-admin"; // the config's single `token`: write, every service
const READ = "ts-scopes-read";
const KB = "ts-scopes-kb-writer";

let server;
let admin;

before(async () => {
  server = await startServer({
    token: ADMIN,
    config: `
[[tokens]]
token = "${READ}"
scope = "read"

[[tokens]]
token = "${KB}"
scope = "write"
services = ["kb"]
`,
  });
  admin = new InflightClient({ baseUrl: server.url, token: ADMIN });
});
after(async () => {
  await server?.stop();
});

/** A client whose requests are counted, to see that refusals are not retried. */
function counted(token) {
  const calls = [];
  const client = new InflightClient({
    baseUrl: server.url,
    token,
    retry: { retries: 3, baseDelayMs: 5 },
    fetch: (url, init) => {
      calls.push(`${init.method} ${new URL(url).pathname}`);
      return fetch(url, init);
    },
  });
  return { client, calls };
}

function forbidden(pattern) {
  return (err) => {
    assert.ok(err instanceof ForbiddenError, String(err));
    assert.ok(err instanceof InflightError);
    assert.equal(err.code, "forbidden");
    assert.equal(err.status, 403);
    assert.equal(err.fromServer, true);
    assert.match(err.message, pattern);
    return true;
  };
}

test("a read token reads, and every write is ForbiddenError, never retried", async () => {
  const done = await admin.begin({ service: "kb", provider: "p" });
  await done.succeed();
  const { client: reader, calls } = counted(READ);
  assert.equal((await reader.snapshot()).status, "ok");
  assert.equal((await reader.getActivity(done.id)).state, "succeeded");
  const metrics = await fetch(`${server.url}/metrics`, { headers: { authorization: `Bearer ${READ}` } });
  assert.equal(metrics.status, 200, "a scrape takes a read token");

  calls.length = 0;
  let called = false;
  await assert.rejects(
    reader.run({ service: "kb", provider: "p" }, async () => {
      called = true;
    }),
    forbidden(/read/),
  );
  assert.equal(called, false, "a refused begin runs nothing");
  const open = await admin.begin({ service: "kb", provider: "p" });
  const held = await reader.getActivity(open.id);
  assert.equal(held.state, "waiting");
  // start and cancel are idempotent, so a 5xx would be retried; a 403 is not.
  const handle = new Activity(reader, held);
  await assert.rejects(handle.start(), forbidden(/write/));
  await assert.rejects(handle.cancel(), ForbiddenError);
  await assert.rejects(reader.reap(), ForbiddenError);
  assert.deepEqual(calls, [
    "POST /v1/activities",
    "GET /v1/activities/" + open.id,
    `POST /v1/activities/${open.id}/start`,
    `POST /v1/activities/${open.id}/cancel`,
    "POST /v1/reap",
  ]);
  assert.equal((await admin.getActivity(open.id)).state, "waiting", "the refused requests changed nothing");
  await open.cancel();
});

test("a write token bound to kb runs kb's calls and is refused other services' records", async () => {
  const { client: kb, calls } = counted(KB);
  assert.equal(await kb.run({ service: "kb", provider: "ollama" }, async () => "embedded"), "embedded");
  const mine = await kb.begin({ service: "kb", provider: "ollama" });
  await mine.start();
  await mine.settle(true);

  calls.length = 0;
  let called = false;
  await assert.rejects(
    kb.run({ service: "assistant", provider: "openai" }, async () => {
      called = true;
    }),
    forbidden(/assistant/),
  );
  assert.equal(called, false);
  assert.deepEqual(calls, ["POST /v1/activities"], "not retried");

  // A record of another service, begun by a token that may: kb's token can
  // read it, but neither start, settle nor cancel it.
  const theirs = await admin.begin({ service: "assistant", provider: "openai" });
  const handle = new Activity(kb, await kb.getActivity(theirs.id));
  await assert.rejects(handle.start(), forbidden(/assistant/));
  await assert.rejects(handle.settle(true), ForbiddenError);
  await assert.rejects(handle.cancel(), ForbiddenError);
  assert.equal((await admin.getActivity(theirs.id)).state, "waiting");
  await theirs.cancel();
});
