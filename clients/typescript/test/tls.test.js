// The client over https: a CA made at test time, the real server serving
// TLS (`--tls-cert`, `--tls-key`), the CA trusted by `caFile`, `ca` or
// INFLIGHT_CA_FILE; without it, a TLSError at once, never retried.
import assert from "node:assert/strict";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { InflightClient, TLSError, UnavailableError } from "../dist/index.js";
import { makeCertificates, startServer } from "./server.js";

let dir;
let certs;
let server;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "inflight-ts-tls-"));
  certs = makeCertificates(dir);
  server = await startServer({ tls: certs });
});
after(async () => {
  await server?.stop();
  if (dir) rmSync(dir, { recursive: true, force: true });
});

test("a lifecycle over https with the CA in caFile", async () => {
  assert.match(server.url, /^https:/);
  const client = new InflightClient({ baseUrl: server.url, caFile: certs.ca });
  const call = await client.begin({ service: "tls", provider: "p" });
  assert.equal((await call.start()).state, "executing");
  assert.equal((await call.succeed()).state, "succeeded");
  assert.equal((await client.getActivity(call.id)).state, "succeeded");
});

test("the CA as PEM text, or from INFLIGHT_CA_FILE", async () => {
  const withText = new InflightClient({ baseUrl: server.url, ca: readFileSync(certs.ca, "utf8") });
  assert.equal(await withText.healthy(), true);
  const saved = process.env.INFLIGHT_CA_FILE;
  process.env.INFLIGHT_CA_FILE = certs.ca;
  try {
    const fromEnv = new InflightClient({ baseUrl: server.url });
    assert.equal((await fromEnv.run({ service: "tls", provider: "env" }, async () => "ok")), "ok");
  } finally {
    if (saved === undefined) delete process.env.INFLIGHT_CA_FILE;
    else process.env.INFLIGHT_CA_FILE = saved;
  }
});

test("without the CA: a TLSError naming the certificate, at once and never retried", async () => {
  let calls = 0;
  const counting = (url, init) => {
    calls++;
    return fetch(url, init);
  };
  const client = new InflightClient({ baseUrl: server.url, fetch: counting, retry: { retries: 3, baseDelayMs: 500 } });
  const t = Date.now();
  // A read is idempotent, so a mere network error would be retried.
  await assert.rejects(client.snapshot(), (err) => {
    assert.ok(err instanceof TLSError, String(err));
    assert.ok(err instanceof UnavailableError);
    assert.equal(err.code, "unavailable");
    assert.match(err.message, /certificate/);
    assert.match(err.message, /caFile|INFLIGHT_CA_FILE/);
    return true;
  });
  assert.equal(calls, 1);
  assert.ok(Date.now() - t < 2000);
});

test("a plain http:// URL to the TLS server says to use https", async () => {
  const client = new InflightClient({ baseUrl: server.url.replace("https://", "http://"), retry: { retries: 0 } });
  await assert.rejects(client.snapshot(), (err) => err instanceof UnavailableError && /https:\/\//.test(err.message));
});

test("a CA that did not sign the server's certificate is refused too", async () => {
  const other = makeCertificates(mkdtempSync(join(dir, "other-")));
  const client = new InflightClient({ baseUrl: server.url, caFile: other.ca });
  await assert.rejects(client.begin({ service: "tls", provider: "p" }), TLSError);
});

test("an unreadable CA file fails at construction, naming it", () => {
  assert.throws(() => new InflightClient({ baseUrl: server.url, caFile: join(dir, "missing.pem") }), /missing\.pem/);
  assert.throws(() => new InflightClient({ caFile: certs.ca, ca: "x" }), TypeError);
});
