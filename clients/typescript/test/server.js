// Starts the real `inflight serve` on a temp SQLite file and a free port.
// The binary is INFLIGHT_BIN, else the repository's target/debug/inflight.
import { execFileSync, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync, writeFileSync, existsSync, openSync, readFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { Agent, fetch as undiciFetch } from "undici";

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
 * `config`: more TOML for the config file. `tls`: {cert, key, ca} files, to
 * serve https. `store`: a store URL (`memory:`), else a temp SQLite file.
 * Returns {url, token, dir, stop()}.
 */
export async function startServer({ lanes = {}, token, config: extra = "", tls, store } = {}) {
  if (!existsSync(BIN)) {
    throw new Error(`no inflight binary at ${BIN}: run \`cargo build --bin inflight\` or set INFLIGHT_BIN`);
  }
  const dir = mkdtempSync(join(tmpdir(), "inflight-ts-"));
  const config = join(dir, "inflight.toml");
  writeFileSync(
    config,
    Object.entries(lanes)
      .map(([lane, cap]) => `[lanes."${lane}"]\ncap = ${cap}\n`)
      .join("") + extra,
  );
  const port = await freePort();
  const url = `${tls ? "https" : "http"}://127.0.0.1:${port}`;
  const args = ["serve", "--config", config, "--listen", `127.0.0.1:${port}`, "--store", store ?? `sqlite://${join(dir, "inflight.db")}`];
  if (token) args.push("--token", token);
  if (tls) args.push("--tls-cert", tls.cert, "--tls-key", tls.key);
  const log = openSync(join(dir, "server.log"), "w");
  const child = spawn(BIN, args, { stdio: ["ignore", log, log], env: { ...process.env, INFLIGHT_TOKEN: "" } });
  let exited = false;
  child.once("exit", () => (exited = true));
  const deadline = Date.now() + 30_000;
  const agent = tls ? new Agent({ connect: { ca: readFileSync(tls.ca, "utf8") } }) : undefined;
  for (;;) {
    try {
      const res = await (agent ? undiciFetch(`${url}/healthz`, { dispatcher: agent }) : fetch(`${url}/healthz`));
      if (res.ok) break;
    } catch {
      // not up yet
    }
    if (exited || Date.now() > deadline) throw new Error(`the server did not start; see ${dir}/server.log`);
    await new Promise((r) => setTimeout(r, 50));
  }
  await agent?.close();
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

/**
 * The lane's counts in the server's snapshot. A lane the snapshot does not
 * show throws: every lane a test uses has had a call, so its absence is a
 * defect, never a lane with nothing in flight.
 */
export async function laneCounts(client, lane) {
  const snap = await client.snapshot({ limit: 1000 });
  const l = snap.nativeAdmission[lane];
  if (l === undefined) {
    throw new Error(`the snapshot shows no lane ${lane}: it has ${Object.keys(snap.nativeAdmission).join(", ")}`);
  }
  const inFlight = snap.inFlight.filter((r) => `${r.service}::${r.provider}` === lane).length;
  return { executing: l.executing, waiting: l.waiting, inFlight };
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * A certificate authority and a server certificate it signed for
 * 127.0.0.1 and localhost, made with the openssl program in `dir`.
 * Returns the files: {ca, cert, key}.
 */
export function makeCertificates(dir) {
  const file = (name) => join(dir, name);
  const openssl = (...args) => execFileSync("openssl", args, { stdio: ["ignore", "ignore", "pipe"] });
  const p256 = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
  openssl("req", "-x509", ...p256, "-keyout", file("ca.key"), "-out", file("ca.pem"), "-days", "2",
    "-subj", "/CN=inflight test CA", "-addext", "basicConstraints=critical,CA:TRUE",
    "-addext", "keyUsage=critical,keyCertSign,cRLSign");
  openssl("req", ...p256, "-keyout", file("server.key"), "-out", file("server.csr"), "-subj", "/CN=localhost");
  writeFileSync(file("server.ext"),
    "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n" +
    "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n");
  openssl("x509", "-req", "-in", file("server.csr"), "-CA", file("ca.pem"), "-CAkey", file("ca.key"),
    "-set_serial", `0x${randomBytes(8).toString("hex")}`, "-days", "2", "-out", file("server.pem"),
    "-extfile", file("server.ext"));
  return { ca: file("ca.pem"), cert: file("server.pem"), key: file("server.key") };
}
