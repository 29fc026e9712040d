// The W3C trace context of a begin against the real server: an explicit
// `traceparent`, the active OpenTelemetry span's, neither, and a malformed
// one; each read back from the server (never from the request sent).
import assert from "node:assert/strict";
import { AsyncLocalStorage } from "node:async_hooks";
import { execFileSync } from "node:child_process";
import { cpSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";

import { context, ROOT_CONTEXT, trace } from "@opentelemetry/api";

import { InflightClient, InvalidRequestError, ProviderActivityRecorder } from "../dist/index.js";
import { startServer } from "./server.js";

const TOKEN = "ts-trace-test-token";
const packageDir = resolve(dirname(fileURLToPath(import.meta.url)), "..");

/**
 * The smallest context manager of the OpenTelemetry API, on
 * AsyncLocalStorage (what `@opentelemetry/context-async-hooks` provides,
 * whose current releases need Node 22): the context follows `await`s.
 */
class StorageContextManager {
  #storage = new AsyncLocalStorage();
  active() {
    return this.#storage.getStore() ?? ROOT_CONTEXT;
  }
  with(ctx, fn, thisArg, ...args) {
    return this.#storage.run(ctx, () => fn.call(thisArg, ...args));
  }
  bind(ctx, target) {
    if (typeof target !== "function") return target;
    const manager = this;
    return function (...args) {
      return manager.with(ctx, () => target.apply(this, args));
    };
  }
  enable() {
    return this;
  }
  disable() {
    this.#storage.disable();
    return this;
  }
}

let server;
let client;

before(async () => {
  assert.equal(context.setGlobalContextManager(new StorageContextManager()), true, "the context manager registered");
  server = await startServer({ token: TOKEN });
  client = new InflightClient({ baseUrl: server.url, token: TOKEN });
});
after(async () => {
  context.disable();
  await server?.stop();
});

const hex = (n) => Array.from({ length: n }, () => Math.floor(Math.random() * 16).toString(16)).join("");

/** A span context of fresh random ids (sampled unless `traceFlags` says otherwise). */
function aSpan(traceFlags = 1) {
  return { traceId: hex(32), spanId: hex(16), traceFlags };
}

/** Runs `fn` with `span` active, as a tracer's `startActiveSpan` would. */
function inSpan(span, fn) {
  return context.with(trace.setSpan(context.active(), trace.wrapSpanContext(span)), fn);
}

/** The record's `traceparent` as the server reads it back (`undefined`: none); the record is then ended. */
async function recordedTraceparent(activity) {
  const record = await client.getActivity(activity.id);
  if (!activity.ended) await activity.cancel();
  return record.traceparent;
}

/**
 * Begins a record each way the client has (begin, begin with startNow,
 * admit, run, observeUnqueued, the recorder), each with `options`, and
 * returns each record's id by the way it was begun.
 */
async function beginEveryWay(c, spec, options = {}) {
  const begun = await c.begin(spec, options);
  const startedNow = await c.begin(spec, { ...options, startNow: true, waitMs: 1000 });
  const admitted = await c.admit(spec, options);
  const ran = await c.run(spec, async (_signal, activity) => activity.id, options);
  const observed = await c.observeUnqueued(spec, async (_signal, activity) => activity.id, options);
  const recorded = await new Promise((resolve, reject) => {
    const recorder = new ProviderActivityRecorder(c, { onError: reject, onRecorded: resolve });
    recorder.beginProviderActivity({ ...spec, ...(options.traceparent === undefined ? {} : { traceparent: options.traceparent }) });
  });
  for (const a of [begun, startedNow, admitted]) await a.cancel();
  return { begun: begun.id, startedNow: startedNow.id, admitted: admitted.id, ran, observed, recorder: recorded.activityId };
}

/** Each record's `traceparent` as the server has it, by the way it was begun. */
async function traceparents(ids) {
  const seen = {};
  for (const [how, id] of Object.entries(ids)) seen[how] = (await client.getActivity(id)).traceparent;
  return seen;
}

const everyWay = (value) =>
  Object.fromEntries(["begun", "startedNow", "admitted", "ran", "observed", "recorder"].map((how) => [how, value]));

describe("an explicit traceparent", () => {
  test("is on the record begin answers, and on the record read back", async () => {
    const sent = `00-${hex(32)}-${hex(16)}-01`;
    const activity = await client.begin({ service: "trace", provider: "p" }, { traceparent: sent });
    assert.equal(activity.record.traceparent, sent, "the begin's answer");
    assert.equal(await recordedTraceparent(activity), sent, "GET /v1/activities/{id}");
  });

  test("every way of beginning sends it", async () => {
    const sent = `00-${hex(32)}-${hex(16)}-00`;
    const ids = await beginEveryWay(client, { service: "trace-every", provider: "p" }, { traceparent: sent });
    assert.deepEqual(await traceparents(ids), everyWay(sent));
  });

  test("wins over the active span's", async () => {
    const sent = `00-${hex(32)}-${hex(16)}-01`;
    const activity = await inSpan(aSpan(), () => client.begin({ service: "trace", provider: "p" }, { traceparent: sent }));
    assert.equal(await recordedTraceparent(activity), sent);
  });

  test("malformed, is refused by the server, naming traceparent; nothing is recorded and run's fn never runs", async () => {
    for (const bad of ["bogus", `00-${hex(32).toUpperCase()}-${hex(16)}-01`, ""]) {
      await assert.rejects(
        client.begin({ service: "trace-bad", provider: "p" }, { traceparent: bad }),
        (err) => err instanceof InvalidRequestError && err.code === "invalid_request" && /traceparent: /.test(err.message),
        JSON.stringify(bad),
      );
    }
    let called = false;
    await assert.rejects(
      client.run({ service: "trace-bad", provider: "p" }, async () => (called = true), { traceparent: "00-nope" }),
      (err) => err instanceof InvalidRequestError && /traceparent: /.test(err.message),
    );
    assert.equal(called, false);
    const snap = await client.snapshot({ limit: 1000 });
    assert.equal(snap.inFlight.filter((r) => r.service === "trace-bad").length, 0);
    assert.equal(snap.recentCompletions.filter((r) => r.service === "trace-bad").length, 0);
  });

  test("that is not a string is a TypeError, and nothing is sent", async () => {
    const sentRequests = [];
    const counting = new InflightClient({
      baseUrl: server.url,
      token: TOKEN,
      fetch: (url, init) => {
        sentRequests.push(`${init.method} ${new URL(url).pathname}`);
        return fetch(url, init);
      },
    });
    await assert.rejects(counting.begin({ service: "trace", provider: "p" }, { traceparent: 42 }), {
      name: "TypeError",
      message: "begin: traceparent must be a string, not number",
    });
    assert.deepEqual(sentRequests, []);
  });
});

describe("the active OpenTelemetry span", () => {
  test("is the traceparent of a begin given none: its trace id, span id and flags", async () => {
    const span = aSpan();
    const activity = await inSpan(span, () => client.begin({ service: "trace-otel", provider: "p" }));
    assert.equal(activity.record.traceparent, `00-${span.traceId}-${span.spanId}-01`);
    assert.equal(await recordedTraceparent(activity), `00-${span.traceId}-${span.spanId}-01`);
    const unsampled = aSpan(0);
    const other = await inSpan(unsampled, () => client.begin({ service: "trace-otel", provider: "p" }));
    assert.equal(await recordedTraceparent(other), `00-${unsampled.traceId}-${unsampled.spanId}-00`);
  });

  test("every way of beginning sends it, across awaits inside the span", async () => {
    const span = aSpan();
    const ids = await inSpan(span, async () => {
      await new Promise((r) => setTimeout(r, 5));
      return beginEveryWay(client, { service: "trace-otel-every", provider: "p" });
    });
    assert.deepEqual(await traceparents(ids), everyWay(`00-${span.traceId}-${span.spanId}-01`));
  });

  test("the recorder sends the span active where beginProviderActivity was called, not where its request goes out", async () => {
    const span = aSpan();
    const recorded = [];
    const recorder = new ProviderActivityRecorder(client, {
      onError: (err) => recorded.push(err),
      onRecorded: (record) => recorded.push(record),
    });
    const id = inSpan(span, () => recorder.beginProviderActivity({ service: "trace-rec", provider: "p" }));
    recorder.completeProviderActivity(id, { success: true });
    await recorder.flush();
    assert.equal(recorded.length, 2, String(recorded));
    assert.equal((await client.getActivity(recorded[0].activityId)).traceparent, `00-${span.traceId}-${span.spanId}-01`);
  });

  test("an invalid span context (the API's default) sends none", async () => {
    const invalid = { traceId: "0".repeat(32), spanId: "0".repeat(16), traceFlags: 1 };
    const activity = await inSpan(invalid, () => client.begin({ service: "trace-otel", provider: "p" }));
    assert.equal(await recordedTraceparent(activity), undefined);
  });
});

describe("a begin sent again", () => {
  test("after a 5xx carries the same traceparent and key, though another span is active by then", async () => {
    const sent = [];
    const retrying = new InflightClient({
      baseUrl: server.url,
      token: TOKEN,
      retry: { baseDelayMs: 1 },
      fetch: async (url, init) => {
        sent.push({ traceparent: init.headers.traceparent, key: init.headers["idempotency-key"] });
        if (sent.length === 1) {
          return new Response(JSON.stringify({ error: { code: "unavailable", message: "busy" } }), { status: 503 });
        }
        return fetch(url, init);
      },
    });
    const first = aSpan();
    const begun = inSpan(first, () => retrying.begin({ service: "trace-retry", provider: "p" }));
    const activity = await inSpan(aSpan(), () => begun);
    const expected = `00-${first.traceId}-${first.spanId}-01`;
    assert.deepEqual(sent.map((s) => s.traceparent), [expected, expected]);
    assert.equal(sent[0].key, sent[1].key);
    assert.equal(await recordedTraceparent(activity), expected);
  });
});

describe("no trace context", () => {
  test("outside any span, no way of beginning sends one", async () => {
    const ids = await beginEveryWay(client, { service: "trace-none", provider: "p" });
    assert.deepEqual(await traceparents(ids), everyWay(undefined));
    const record = await client.getActivity(ids.begun);
    assert.equal(Object.hasOwn(record, "traceparent"), false, "left out of the JSON");
  });

  test("propagateTrace: false sends none inside a span, but still an explicit one", async () => {
    const quiet = new InflightClient({ baseUrl: server.url, token: TOKEN, propagateTrace: false });
    assert.equal(quiet.propagateTrace, false);
    const span = aSpan();
    const ids = await inSpan(span, () => beginEveryWay(quiet, { service: "trace-off", provider: "p" }));
    assert.deepEqual(await traceparents(ids), everyWay(undefined));
    const sent = `00-${hex(32)}-${hex(16)}-01`;
    const explicit = await inSpan(span, () => quiet.begin({ service: "trace-off", provider: "p" }, { traceparent: sent }));
    assert.equal(await recordedTraceparent(explicit), sent);
  });
});

describe("the package without and with @opentelemetry/api installed", () => {
  let project;

  before(() => {
    // The package as a dependent installs it: a copy (not a link, which
    // would resolve from this repository's node_modules), beside undici.
    project = mkdtempSync(join(tmpdir(), "inflight-ts-trace-"));
    writeFileSync(join(project, "package.json"), JSON.stringify({ name: "consumer", version: "1.0.0" }));
    const installed = join(project, "node_modules", "inflight-ledger");
    mkdirSync(installed, { recursive: true });
    cpSync(join(packageDir, "package.json"), join(installed, "package.json"));
    cpSync(join(packageDir, "dist"), join(installed, "dist"), { recursive: true });
    symlinkSync(join(packageDir, "node_modules", "undici"), join(project, "node_modules", "undici"), "dir");
  });
  after(() => {
    if (project) rmSync(project, { recursive: true, force: true });
  });

  // Begins inside a span, right after the client is made (the API may not
  // have loaded yet), then with an explicit traceparent; prints both.
  const script = (load, loadOtel) => `
    ${load}
    ${loadOtel}
    const { AsyncLocalStorage } = require("node:async_hooks");
    const explicit = "00-${"ab".repeat(16)}-${"cd".repeat(8)}-01";
    async function main() {
      let inSpan = (fn) => fn();
      if (otel) {
        const storage = new AsyncLocalStorage();
        otel.context.setGlobalContextManager({
          active: () => storage.getStore() ?? otel.ROOT_CONTEXT,
          with: (ctx, fn, thisArg, ...args) => storage.run(ctx, () => fn.call(thisArg, ...args)),
          bind: (ctx, target) => target,
          enable() { return this; },
          disable() { return this; },
        });
        const span = otel.trace.wrapSpanContext({ traceId: "${"12".repeat(16)}", spanId: "${"34".repeat(8)}", traceFlags: 1 });
        inSpan = (fn) => otel.context.with(otel.trace.setSpan(otel.context.active(), span), fn);
      }
      const client = new InflightClient({ baseUrl: ${JSON.stringify(server.url)}, token: ${JSON.stringify(TOKEN)} });
      const active = await inSpan(() => client.begin({ service: "trace-package", provider: "p" }));
      const given = await client.begin({ service: "trace-package", provider: "p" }, { traceparent: explicit });
      const read = async (a) => (await client.getActivity(a.id)).traceparent ?? null;
      console.log(JSON.stringify({ active: await read(active), given: await read(given) }));
    }
    main().catch((e) => { console.error(e); process.exit(1); });`;
  const cjs = 'const { InflightClient } = require("inflight-ledger");';
  const esm = 'import { createRequire } from "node:module"; import { InflightClient } from "inflight-ledger"; const require = createRequire(import.meta.url);';
  const loadOtel = 'let otel; try { otel = require("@opentelemetry/api"); } catch { otel = undefined; }';
  const run = (file) => JSON.parse(execFileSync(process.execPath, [file], { cwd: project, encoding: "utf8" }));
  const explicit = `00-${"ab".repeat(16)}-${"cd".repeat(8)}-01`;

  test("absent: each build begins without a trace context, and still sends an explicit one", () => {
    writeFileSync(join(project, "absent.cjs"), script(cjs, loadOtel));
    writeFileSync(join(project, "absent.mjs"), script(esm, loadOtel));
    for (const file of ["absent.cjs", "absent.mjs"]) {
      assert.deepEqual(run(file), { active: null, given: explicit }, file);
    }
  });

  test("present: each build sends the span active at a begin made before the API had loaded", () => {
    const scope = join(project, "node_modules", "@opentelemetry");
    mkdirSync(scope, { recursive: true });
    symlinkSync(join(packageDir, "node_modules", "@opentelemetry", "api"), join(scope, "api"), "dir");
    try {
      writeFileSync(join(project, "present.cjs"), script(cjs, loadOtel));
      writeFileSync(join(project, "present.mjs"), script(esm, loadOtel));
      for (const file of ["present.cjs", "present.mjs"]) {
        assert.deepEqual(run(file), { active: `00-${"12".repeat(16)}-${"34".repeat(8)}-01`, given: explicit }, file);
      }
    } finally {
      rmSync(scope, { recursive: true, force: true });
    }
  });
});
