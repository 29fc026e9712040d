// releaseOnSignals: SIGTERM releases the lease (its in-flight records are
// cancelled), then the process ends as SIGTERM would have ended it.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { once } from "node:events";
import { createInterface } from "node:readline";
import { after, before, test } from "node:test";

import { InflightClient } from "../dist/index.js";
import { startServer } from "./server.js";

let server;
before(async () => {
  server = await startServer();
});
after(async () => {
  await server?.stop();
});

test("SIGTERM releases the lease, then terminates the process", async () => {
  const script = `
    import { InflightClient } from ${JSON.stringify(new URL("../dist/index.js", import.meta.url).href)};
    const client = new InflightClient({ baseUrl: ${JSON.stringify(server.url)} });
    const lease = await client.joinAsOwner("ts-sigterm", 30000, { releaseOnSignals: true });
    const call = await client.begin({ service: "sigterm", provider: "p" });
    console.log(JSON.stringify({ owner: lease.id, activity: call.id }));
    setInterval(() => {}, 1000); // a busy process that never ends by itself
  `;
  const child = spawn(process.execPath, ["--input-type=module", "-e", script], { stdio: ["ignore", "pipe", "inherit"] });
  const [line] = await once(createInterface({ input: child.stdout }), "line");
  const ids = JSON.parse(line);
  child.kill("SIGTERM");
  const [code, signal] = await once(child, "exit");
  assert.equal(code, null);
  assert.equal(signal, "SIGTERM");
  const client = new InflightClient({ baseUrl: server.url });
  assert.equal((await client.getActivity(ids.activity)).state, "cancelled");
  const owner = (await client.snapshot()).owners.find((o) => o.ownerId === ids.owner);
  assert.equal(owner.state, "released");
  assert.equal(owner.cancelledRecords, 1);
});

test("a lease's timers do not keep the process alive", async () => {
  const script = `
    import { InflightClient } from ${JSON.stringify(new URL("../dist/index.js", import.meta.url).href)};
    const client = new InflightClient({ baseUrl: ${JSON.stringify(server.url)} });
    await client.joinAsOwner("ts-unref", 30000);
    console.log("joined");
  `;
  const child = spawn(process.execPath, ["--input-type=module", "-e", script], { stdio: ["ignore", "pipe", "inherit"] });
  const t = Date.now();
  const [code] = await once(child, "exit");
  assert.equal(code, 0);
  assert.ok(Date.now() - t < 5000, "the process ended on its own");
});
