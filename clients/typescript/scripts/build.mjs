// Builds the package: ESM to dist/, CommonJS to dist/cjs/ (with a
// package.json saying so, since the package itself is "type": "module"),
// each with its declarations. dist/ is emptied first so that no file of an
// older build is packed.
import { execFileSync } from "node:child_process";
import { mkdirSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const tsc = createRequire(import.meta.url).resolve("typescript/bin/tsc");

rmSync(join(root, "dist"), { recursive: true, force: true });
for (const project of ["tsconfig.json", "tsconfig.cjs.json"]) {
  execFileSync(process.execPath, [tsc, "-p", join(root, project)], { stdio: "inherit" });
}
mkdirSync(join(root, "dist/cjs"), { recursive: true });
writeFileSync(join(root, "dist/cjs/package.json"), '{\n  "type": "commonjs"\n}\n');
