// What `npm pack` would ship (run by .ci/run): the ESM and CommonJS builds
// with their declarations, the README, and nothing else of the repository
// (no sources, tests, examples or scripts). Fails loudly, listing the files.
import { execFileSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const npm = process.platform === "win32" ? "npm.cmd" : "npm";
const [pack] = JSON.parse(execFileSync(npm, ["pack", "--dry-run", "--json"], { cwd: root, encoding: "utf8" }));
const files = pack.files.map((f) => f.path).sort();

const required = [
  "package.json",
  "README.md",
  "dist/index.js",
  "dist/index.d.ts",
  "dist/cjs/index.js",
  "dist/cjs/index.d.ts",
  "dist/cjs/package.json",
];
const missing = required.filter((f) => !files.includes(f));
const unwanted = files.filter((f) => /^(src|test|examples|scripts|node_modules)\//.test(f) || /\.test\.|\.tgz$|tsconfig/.test(f));
// Every module of each build has its declarations next to it.
const undeclared = files.filter((f) => f.endsWith(".js") && !files.includes(f.replace(/\.js$/, ".d.ts")));

console.log(`${pack.filename}: ${files.length} files, ${pack.size} bytes packed`);
for (const f of files) console.log(`  ${f}`);
if (missing.length || unwanted.length || undeclared.length) {
  if (missing.length) console.error(`missing from the package: ${missing.join(", ")}`);
  if (unwanted.length) console.error(`should not be in the package: ${unwanted.join(", ")}`);
  if (undeclared.length) console.error(`without declarations: ${undeclared.join(", ")}`);
  process.exit(1);
}
