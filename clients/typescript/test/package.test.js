// The package as others load it: require() (CommonJS, from dist/cjs) and
// import (ESM, from dist/), each running a call against the real server; a
// project made by a plain `npm init` (CommonJS by default) that requires it;
// and the type declarations each condition gives, checked by tsc.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";

import { startServer } from "./server.js";

const TOKEN = "ts-package-test-token";
const packageDir = resolve(dirname(fileURLToPath(import.meta.url)), "..");
// The package refers to itself by name through its "exports", as a dependent would.
const require = createRequire(import.meta.url);

let server;
let project;

before(async () => {
  server = await startServer({ token: TOKEN });
  // A project as `npm init -y` makes it: no "type", so its .js files are CommonJS.
  project = mkdtempSync(join(tmpdir(), "inflight-ts-consumer-"));
  writeFileSync(join(project, "package.json"), JSON.stringify({ name: "consumer", version: "1.0.0", main: "index.js" }));
  mkdirSync(join(project, "node_modules"));
  symlinkSync(packageDir, join(project, "node_modules", "inflight-ledger"), "dir");
});
after(async () => {
  await server?.stop();
  if (project) rmSync(project, { recursive: true, force: true });
});

async function aCall(mod) {
  const client = new mod.InflightClient({ baseUrl: server.url, token: TOKEN });
  const value = await client.run({ service: "package", provider: "p" }, async (_signal, activity) => activity.id);
  return (await client.getActivity(value)).state;
}

test("require() loads the CommonJS build and runs a call", async () => {
  assert.equal(require.resolve("inflight-ledger"), join(packageDir, "dist", "cjs", "index.js"));
  const cjs = require("inflight-ledger");
  assert.equal(typeof cjs.InflightClient, "function");
  assert.equal(await aCall(cjs), "succeeded");
});

test("import loads the ESM build and runs a call", async () => {
  assert.equal(import.meta.resolve("inflight-ledger"), new URL("../dist/index.js", import.meta.url).href);
  const esm = await import("inflight-ledger");
  assert.equal(await aCall(esm), "succeeded");
});

test("isInflightError holds across the two builds (instanceof cannot)", async () => {
  const cjs = require("inflight-ledger");
  const esm = await import("inflight-ledger");
  const err = new cjs.LaneFullError("lane_full", "full");
  assert.equal(err instanceof esm.LaneFullError, false, "two copies of each class");
  assert.equal(esm.isInflightError(err), true);
  assert.equal(esm.isInflightError(err, "lane_full"), true);
  assert.equal(esm.isInflightError(err, "conflict"), false);
  assert.equal(cjs.isInflightError(new esm.WaitTimeoutError("wait_timeout", "late"), "wait_timeout"), true);
  assert.equal(esm.isInflightError(new Error("plain")), false);
  assert.equal(esm.isInflightError({ code: "lane_full" }), false);
});

test("a default npm init project requires it (and an .mjs imports it)", () => {
  const script = (load) => `
    ${load}
    const client = new InflightClient({ baseUrl: ${JSON.stringify(server.url)}, token: ${JSON.stringify(TOKEN)} });
    client.run({ service: "package", provider: "consumer" }, async () => 7)
      .then((v) => console.log(JSON.stringify({ v })), (e) => { console.error(e); process.exit(1); });`;
  writeFileSync(join(project, "index.js"), script('const { InflightClient } = require("inflight-ledger");'));
  writeFileSync(join(project, "index.mjs"), script('import { InflightClient } from "inflight-ledger";'));
  for (const file of ["index.js", "index.mjs"]) {
    const out = execFileSync(process.execPath, [file], { cwd: project, encoding: "utf8" });
    assert.deepEqual(JSON.parse(out), { v: 7 }, file);
  }
});

test("the declarations fit each: a .cts gets the CommonJS types, a .mts the ESM ones", () => {
  const use = `
    const client = new InflightClient({ baseUrl: "http://127.0.0.1:7878", onWarning: (m: string) => void m });
    export const n: Promise<number> = client.run({ service: "a", provider: "b" }, async () => 1);
    export const full: boolean = isInflightError(new Error("x"), "lane_full");
    const context: ActivityContext = { service: "a", operationStage: "s", priority: "batch" };
    export const inContext: Promise<number> = client.withContext(context, () => client.run({ provider: "b" }, async () => 1));
    export const model: Promise<string> = client.run({ service: "a", provider: "b" }, async (_signal, activity) =>
      (await activity.refine("llama3.1:8b")).model);
    export const refined = (record: ActivityRecord): boolean => record.refined ?? false;
    const traced = new InflightClient({ propagateTrace: false });
    const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    export const tracedRun: Promise<number> = traced.run({ service: "a", provider: "b" }, async () => 1, { traceparent });
    export const tracedBegin = traced.begin({ service: "a", provider: "b" }, { startNow: true, traceparent });
    export const parentOf = (record: ActivityRecord): string | undefined => record.traceparent;
    const recorder = new ProviderActivityRecorder(client, { onError: (err: unknown, event: RecorderEvent) => void [err, event.id] });
    export const id: string = recorder.beginProviderActivity({ service: "a", role: "chat", provider: "b", queueDisposition: "neo-queued" });
    export const tracedId: string = recorder.beginProviderActivity({ service: "a", provider: "b", traceparent });
    recorder.completeProviderActivity(id, { completedAt: Date.now(), success: false, failureStage: "provider" });
    export const flushed: Promise<void> = recorder.flush();`;
  const imports =
    "import { InflightClient, isInflightError, ProviderActivityRecorder, type ActivityContext, type ActivityRecord, " +
    'type RecorderEvent } from "inflight-ledger";';
  writeFileSync(join(project, "use.cts"), `${imports}\n${use}`);
  writeFileSync(join(project, "use.mts"), `${imports}\n${use}`);
  const tsc = require.resolve("typescript/bin/tsc");
  // Under node16 (unlike nodenext, which knows require(esm) of Node 22), tsc
  // refuses a .cts that gets ESM declarations (TS1479): the check fails then.
  execFileSync(
    process.execPath,
    [tsc, "--noEmit", "--strict", "--module", "node16", "--moduleResolution", "node16", "--target", "es2022",
      "--types", "node", "--typeRoots", join(packageDir, "node_modules", "@types"), "use.cts", "use.mts"],
    { cwd: project, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] },
  );
});
