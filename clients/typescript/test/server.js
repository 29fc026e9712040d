// Starts the real `inflight serve` on a temp SQLite file and a free port.
// The binary is INFLIGHT_BIN, else the repository's target/debug/inflight.
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync, existsSync, openSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
export const BIN = process.env.INFLIGHT_BIN ?? resolve(here, "../../../target/debug/inflight");

/** A port nothing listens on (now). */
export function freePort() {
  return new Promise((res, rej) => {
    const srv = createServer();
    srv.once("error", rej);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => res(port));
    });
  });
}

/**
 * `lanes`: {"service::provider": cap}. `token`: a bearer token, or none.
 * Returns {url, token, stop()}.
 */
export async function startServer({ lanes = {}, token } = {}) {
  if (!existsSync(BIN)) {
    throw new Error(`no inflight binary at ${BIN}: run \`cargo build --bin inflight\` or set INFLIGHT_BIN`);
  }
  const dir = mkdtempSync(join(tmpdir(), "inflight-ts-"));
  const config = join(dir, "inflight.toml");
  writeFileSync(
    config,
    Object.entries(lanes)
      .map(([lane, cap]) => `[lanes."${lane}"]\ncap = ${cap}\n`)
      .join(""),
  );
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const args = ["serve", "--config", config, "--listen", `127.0.0.1:${port}`, "--store", `sqlite://${join(dir, "inflight.db")}`];
  if (token) args.push("--token", token);
  const log = openSync(join(dir, "server.log"), "w");
  const child = spawn(BIN, args, { stdio: ["ignore", log, log], env: { ...process.env, INFLIGHT_TOKEN: "" } });
  let exited = false;
  child.once("exit", () => (exited = true));
  const deadline = Date.now() + 30_000;
  for (;;) {
    try {
      const res = await fetch(`${url}/healthz`);
      if (res.ok) break;
    } catch {
      // not up yet
    }
    if (exited || Date.now() > deadline) throw new Error(`the server did not start; see ${dir}/server.log`);
    await new Promise((r) => setTimeout(r, 50));
  }
  return {
    url,
    token,
    dir,
    async stop() {
      if (!exited) {
        const gone = new Promise((r) => child.once("exit", r));
        child.kill("SIGTERM");
        await gone;
      }
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** The lane's counts in the server's snapshot (zeros when it does not show). */
export async function laneCounts(client, lane) {
  const snap = await client.snapshot({ limit: 1000 });
  const l = snap.nativeAdmission[lane];
  const inFlight = snap.inFlight.filter((r) => `${r.service}::${r.provider}` === lane).length;
  return { executing: l?.executing ?? 0, waiting: l?.waiting ?? 0, inFlight };
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
