// Compares what the client sends and reads (FIELDS, ROUTES in src/wire.ts)
// with the server's OpenAPI document. Returns every disagreement.
import { FIELDS, LABEL_PATTERN, PRIORITIES, ROUTES, ROUTES_NOT_CALLED, SERVER_ERROR_CODES } from "../dist/index.js";

const METHODS = ["get", "put", "post", "delete", "patch", "options", "head"];

function deref(doc, schema) {
  const seen = new Set();
  while (schema && schema.$ref) {
    if (seen.has(schema.$ref)) throw new Error(`a $ref cycle at ${schema.$ref}`);
    seen.add(schema.$ref);
    const path = schema.$ref.replace(/^#\//, "").split("/").map((p) => p.replace(/~1/g, "/").replace(/~0/g, "~"));
    schema = path.reduce((node, key) => node?.[key], doc);
  }
  return schema;
}

/** The schema's variants that are not `null` (a nullable `$ref` is `oneOf: [null, $ref]`). */
function variants(doc, schema) {
  schema = deref(doc, schema);
  if (!schema) return [];
  const alternatives = schema.oneOf ?? schema.anyOf;
  if (alternatives) {
    return alternatives.flatMap((s) => variants(doc, s)).filter((s) => s.type !== "null");
  }
  return [schema];
}

/** Every property name of an object schema (through `allOf`, `oneOf`, `$ref`). */
export function propertyNames(doc, schema) {
  const names = new Set();
  for (const s of variants(doc, schema)) {
    for (const name of Object.keys(s.properties ?? {})) names.add(name);
    for (const part of s.allOf ?? []) for (const name of propertyNames(doc, part)) names.add(name);
  }
  return names;
}

/** The schema one step down: a property, `items` or `additionalProperties`. */
function child(doc, schema, step) {
  for (const s of variants(doc, schema)) {
    if (step === "items" || step === "additionalProperties") {
      if (s[step] && typeof s[step] === "object") return s[step];
      continue;
    }
    if (s.properties?.[step]) return s.properties[step];
    for (const part of s.allOf ?? []) {
      const found = child(doc, part, step);
      if (found) return found;
    }
  }
  return undefined;
}

function enumValues(doc, schema) {
  const values = new Set();
  for (const s of variants(doc, schema)) {
    for (const v of s.enum ?? []) values.add(v);
    if (s.const !== undefined) values.add(s.const);
  }
  return values;
}

export function compareWithDocument(doc) {
  const problems = [];
  const operation = (route) => doc.paths?.[ROUTES[route].path]?.[ROUTES[route].method.toLowerCase()];
  const jsonSchema = (content) => content?.["application/json"]?.schema;
  const requestBody = (route) => jsonSchema(operation(route)?.requestBody?.content);
  const response = (route, status) => jsonSchema(operation(route)?.responses?.[status]?.content);

  // Routes, both ways.
  const documented = new Set();
  for (const [path, item] of Object.entries(doc.paths ?? {})) {
    for (const m of METHODS) if (item[m]) documented.add(`${m.toUpperCase()} ${path}`);
  }
  const called = new Set(Object.values(ROUTES).map((r) => `${r.method} ${r.path}`));
  for (const r of called) if (!documented.has(r)) problems.push(`the client calls ${r}, which the document lacks`);
  for (const r of documented) {
    if (!called.has(r) && !ROUTES_NOT_CALLED.includes(r)) {
      problems.push(`the document has ${r}, which the client neither calls nor lists in ROUTES_NOT_CALLED`);
    }
  }

  // Query and header parameters (a header's name in lower case: HTTP does not tell case apart).
  for (const [name, route] of Object.entries(ROUTES)) {
    const op = operation(name);
    if (!op) continue;
    const params = (op.parameters ?? []).map((p) => deref(doc, p));
    const named = (where) => params.filter((p) => p.in === where).map((p) => p.name);
    compareSets(problems, `${route.method} ${route.path} query parameters`, route.query, named("query"));
    compareSets(
      problems,
      `${route.method} ${route.path} header parameters`,
      route.headers.map((h) => h.toLowerCase()),
      named("header").map((h) => h.toLowerCase()),
    );
  }

  // Bodies and answers.
  const ok = (route) => response(route, "200");
  const targets = [
    ["BeginRequest", requestBody("begin")],
    ["StartRequest", requestBody("start")],
    ["SettleRequest", requestBody("settle")],
    ["Usage", [requestBody("settle"), "usage"]],
    ["CancelRequest", requestBody("cancel")],
    ["RefineRequest", requestBody("refine")],
    ["RegisterOwnerRequest", requestBody("registerOwner")],
    ["ActivityRecord", response("begin", "201")],
    ["ActivityRecord", response("begin", "200")],
    ["ActivityRecord", ok("get")],
    ["ActivityRecord", ok("start")],
    ["ActivityRecord", ok("settle")],
    ["ActivityRecord", ok("cancel")],
    ["ActivityRecord", ok("refine")],
    ["Owner", response("registerOwner", "201")],
    ["Owner", ok("renewOwner")],
    ["Owner", ok("releaseOwner")],
    ["ReapCounts", ok("reap")],
    ["Snapshot", ok("snapshot")],
    ["Lane", [ok("snapshot"), "nativeAdmission", "additionalProperties"]],
    ["ReapCounts", [ok("snapshot"), "nativeAdmission", "additionalProperties", "reaped"]],
    ["LaneByPriority", [ok("snapshot"), "nativeAdmission", "additionalProperties", "byPriority"]],
    ["LanePriorityCounts", [ok("snapshot"), "nativeAdmission", "additionalProperties", "byPriority", "interactive"]],
    ["LanePriorityCounts", [ok("snapshot"), "nativeAdmission", "additionalProperties", "byPriority", "batch"]],
    ["LanePriorityCounts", [ok("snapshot"), "nativeAdmission", "additionalProperties", "byPriority", "unknown"]],
    ["InFlightRecord", [ok("snapshot"), "inFlight", "items"]],
    ["ActivityRecord", [ok("snapshot"), "recentCompletions", "items"]],
    ["ReapedRecord", [ok("snapshot"), "reaped", "items"]],
    ["Aggregate", [ok("snapshot"), "aggregates", "items"]],
    ["Owner", [ok("snapshot"), "owners", "items"]],
    ["SnapshotWarning", [ok("snapshot"), "warnings", "items"]],
    ["ErrorBody", response("begin", "400")],
    ["ErrorDetail", [response("begin", "400"), "error"]],
  ];
  for (const [type, where] of targets) {
    let schema = where;
    let label = type;
    if (Array.isArray(where)) {
      const [root, ...steps] = where;
      schema = steps.reduce((s, step) => (s ? child(doc, s, step) : undefined), root);
      label = `${type} (under ${steps.join(".")})`;
    }
    if (!schema) {
      problems.push(`the document has no schema where the client expects ${label}`);
      continue;
    }
    compareSets(problems, `${label} fields`, FIELDS[type], [...propertyNames(doc, schema)]);
  }

  // The error codes.
  const codeSchema = child(doc, child(doc, response("begin", "400"), "error") ?? {}, "code");
  if (codeSchema) {
    compareSets(problems, "error codes", SERVER_ERROR_CODES, [...enumValues(doc, codeSchema)]);
  } else {
    problems.push("the document has no schema for the error code");
  }

  // The priorities (withContext checks a context's against the client's list).
  const prioritySchema = child(doc, requestBody("begin") ?? {}, "priority");
  if (prioritySchema) {
    compareSets(problems, "priorities", PRIORITIES, [...enumValues(doc, prioritySchema)]);
  } else {
    problems.push("the document has no schema for a begin's priority");
  }

  // The label rule (withContext checks a context's labels with it).
  for (const field of ["service", "operationStage"]) {
    const patterns = variants(doc, child(doc, requestBody("begin") ?? {}, field)).map((s) => s.pattern);
    if (!patterns.includes(LABEL_PATTERN)) {
      problems.push(`a begin's ${field}: the document's pattern ${JSON.stringify(patterns)}, the client's ${LABEL_PATTERN}`);
    }
  }
  return problems;
}

function compareSets(problems, what, client, documented) {
  const c = new Set(client);
  const d = new Set(documented);
  const onlyClient = [...c].filter((x) => !d.has(x));
  const onlyDoc = [...d].filter((x) => !c.has(x));
  if (onlyClient.length) problems.push(`${what}: the client has ${onlyClient.join(", ")}, the document does not`);
  if (onlyDoc.length) problems.push(`${what}: the document has ${onlyDoc.join(", ")}, the client does not`);
}
