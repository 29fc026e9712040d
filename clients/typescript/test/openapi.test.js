// The client's wire against the server's own OpenAPI document
// (`GET /openapi.json`): routes, query and header parameters, body and answer fields,
// error codes, priorities. Any disagreement fails.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { compareWithDocument } from "./openapi-check.js";
import { startServer } from "./server.js";

let server;
let doc;
let missing = false;

before(async () => {
  server = await startServer();
  const res = await fetch(`${server.url}/openapi.json`);
  if (res.status === 404) {
    missing = true;
  } else {
    assert.equal(res.status, 200, `GET /openapi.json answered ${res.status}`);
    doc = await res.json();
  }
});
after(async () => {
  await server?.stop();
});

function skipLoudly(t) {
  const message =
    "THE SERVER HAS NO /openapi.json (404): the client's wire was NOT checked against the document. " +
    "INFLIGHT_OPENAPI_REQUIRED=1 (which .ci/run always sets) makes this a failure.";
  console.error(`\n${"!".repeat(100)}\n${message}\n${"!".repeat(100)}\n`);
  if (process.env.INFLIGHT_OPENAPI_REQUIRED === "1") assert.fail(message);
  t.skip(message);
}

test("the client's routes, fields and error codes agree with GET /openapi.json", (t) => {
  if (missing) return skipLoudly(t);
  const problems = compareWithDocument(doc);
  assert.deepEqual(problems, [], `the client and the OpenAPI document disagree:\n  ${problems.join("\n  ")}`);
});

test("the check notices a field, a route, an error code and a priority the client does not know", (t) => {
  if (missing) return skipLoudly(t);
  const changed = structuredClone(doc);
  // A new field in every object schema, a new route, a new error code, a new priority.
  for (const schema of Object.values(changed.components?.schemas ?? {})) {
    if (schema.properties) schema.properties.brandNewField = { type: "string" };
    if (Array.isArray(schema.enum) && schema.enum.includes("lane_full")) schema.enum.push("brand_new_code");
    if (Array.isArray(schema.enum) && schema.enum.includes("interactive")) schema.enum.push("brand_new_priority");
  }
  changed.paths["/v1/brand-new"] = { get: { responses: {} } };
  const problems = compareWithDocument(changed).join("\n");
  assert.match(problems, /ActivityRecord fields: the document has brandNewField/);
  assert.match(problems, /BeginRequest fields: the document has brandNewField/);
  assert.match(problems, /GET \/v1\/brand-new/);
  assert.match(problems, /brand_new_code/);
  assert.match(problems, /priorities: the document has brand_new_priority/);
});

test("the check notices an older server's document: no refine route, no `refined` field", (t) => {
  if (missing) return skipLoudly(t);
  const older = structuredClone(doc);
  delete older.paths["/v1/activities/{id}/refine"];
  for (const schema of Object.values(older.components?.schemas ?? {})) delete schema.properties?.refined;
  const problems = compareWithDocument(older).join("\n");
  assert.match(problems, /the client calls POST \/v1\/activities\/\{id\}\/refine, which the document lacks/);
  assert.match(problems, /ActivityRecord fields: the client has refined, the document does not/);
});

test("the check notices an older server's document: no Idempotency-Key, no 200 repeat, no idempotency_conflict", (t) => {
  if (missing) return skipLoudly(t);
  const older = structuredClone(doc);
  const begin = older.paths["/v1/activities"].post;
  begin.parameters = begin.parameters.filter((p) => !(p.in === "header" && p.name.toLowerCase() === "idempotency-key"));
  delete begin.responses["200"];
  for (const schema of Object.values(older.components?.schemas ?? {})) {
    if (Array.isArray(schema.enum)) schema.enum = schema.enum.filter((code) => code !== "idempotency_conflict");
  }
  const problems = compareWithDocument(older).join("\n");
  assert.match(problems, /POST \/v1\/activities header parameters: the client has idempotency-key, the document does not/);
  assert.match(problems, /the document has no schema where the client expects ActivityRecord/);
  assert.match(problems, /error codes: the client has idempotency_conflict, the document does not/);
  // And a header parameter the client does not send is noticed too.
  const newer = structuredClone(doc);
  newer.paths["/v1/activities/{id}/settle"].post.parameters.push({ in: "header", name: "X-Brand-New", schema: { type: "string" } });
  assert.match(
    compareWithDocument(newer).join("\n"),
    /POST \/v1\/activities\/\{id\}\/settle header parameters: the document has x-brand-new, the client does not/,
  );
});

test("the check notices an older server's document: no traceparent header on a begin, none on records", (t) => {
  if (missing) return skipLoudly(t);
  const older = structuredClone(doc);
  const begin = older.paths["/v1/activities"].post;
  begin.parameters = begin.parameters.filter((p) => !(p.in === "header" && p.name.toLowerCase() === "traceparent"));
  for (const schema of Object.values(older.components?.schemas ?? {})) delete schema.properties?.traceparent;
  const problems = compareWithDocument(older).join("\n");
  assert.match(problems, /POST \/v1\/activities header parameters: the client has traceparent, the document does not/);
  assert.match(problems, /ActivityRecord fields: the client has traceparent, the document does not/);
});

test("the check notices an older server's document: no usage on settle, no tokens on records and aggregates", (t) => {
  if (missing) return skipLoudly(t);
  const older = structuredClone(doc);
  for (const schema of Object.values(older.components?.schemas ?? {})) {
    for (const name of ["usage", "inputTokens", "outputTokens"]) delete schema.properties?.[name];
  }
  const problems = compareWithDocument(older).join("\n");
  assert.match(problems, /SettleRequest fields: the client has usage, the document does not/);
  assert.match(problems, /the document has no schema where the client expects Usage \(under usage\)/);
  assert.match(problems, /ActivityRecord fields: the client has inputTokens, outputTokens, the document does not/);
  assert.match(problems, /Aggregate \(under aggregates\.items\) fields: the client has inputTokens, outputTokens/);
});
