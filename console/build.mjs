#!/usr/bin/env node
// Builds the console page into exactly three files, which the broker embeds:
//
//   dist/index.html   src/index.html, as written
//   dist/console.js   src/main.ts bundled with the TypeScript client's sources
//                     (../clients/typescript/src, imported by relative path)
//                     and their packages, minified, one IIFE, no source map
//   dist/console.css  src/console.css, minified
//
//   node build.mjs [OUTDIR]         the page (default: dist)
//   node build.mjs --tests OUTDIR   the browser test, bundled for Node (test/*.test.ts)
//
// The output depends only on the sources and the exact package versions of
// package-lock.json: no timestamps, no absolute paths, no source maps, so
// run-tests.sh can rebuild into a temporary directory and diff against the
// committed dist/. Every bare import — the client sources' too — resolves
// from this folder's node_modules (see `consolePackages`), so the console
// needs no npm install in clients/typescript, and the bundle cannot differ
// with whatever is installed there.
import * as esbuild from "esbuild";
import { mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const OUTPUTS = ["index.html", "console.js", "console.css"];

/** Bare imports from outside this folder (the client's sources) resolve from here, like those from inside it. */
const consolePackages = {
  name: "console-packages",
  setup(build) {
    build.onResolve({ filter: /^[^./]/ }, async (args) => {
      if (args.pluginData?.consolePackages || args.resolveDir.startsWith(here + path.sep)) return undefined;
      const resolved = await build.resolve(args.path, {
        kind: args.kind,
        importer: args.importer,
        resolveDir: here,
        pluginData: { consolePackages: true },
      });
      if (resolved.errors.length > 0) return { errors: resolved.errors };
      return resolved;
    });
  },
};

const common = {
  absWorkingDir: here,
  bundle: true,
  write: false,
  logLevel: "warning",
  legalComments: "eof",
  plugins: [consolePackages],
};

async function buildPage(outdir) {
  const js = await esbuild.build({
    ...common,
    entryPoints: ["src/main.ts"],
    outfile: "console.js",
    format: "iife",
    platform: "browser",
    target: ["es2022", "chrome109", "firefox115", "safari16"],
    minify: true,
    sourcemap: false,
    charset: "ascii",
  });
  const css = await esbuild.build({
    ...common,
    entryPoints: ["src/console.css"],
    outfile: "console.css",
    minify: true,
    charset: "ascii",
  });
  const files = {
    "index.html": readFileSync(path.join(here, "src/index.html")),
    "console.js": single(js),
    "console.css": single(css),
  };
  mkdirSync(outdir, { recursive: true });
  for (const name of readdirSync(outdir)) {
    if (!OUTPUTS.includes(name)) rmSync(path.join(outdir, name), { recursive: true, force: true });
  }
  for (const name of OUTPUTS) writeFileSync(path.join(outdir, name), files[name]);
}

function single(result) {
  if (result.outputFiles.length !== 1) throw new Error(`expected one output, got ${result.outputFiles.map((f) => f.path).join(", ")}`);
  return result.outputFiles[0].contents;
}

async function buildTests(outdir) {
  const entries = readdirSync(path.join(here, "test"))
    .filter((name) => name.endsWith(".test.ts"))
    .map((name) => `test/${name}`);
  const result = await esbuild.build({
    ...common,
    write: true,
    entryPoints: entries,
    outdir,
    outExtension: { ".js": ".mjs" },
    format: "esm",
    platform: "node",
    target: "node20",
    packages: "external",
    sourcemap: "inline",
  });
  if (result.errors.length > 0) process.exit(1);
}

const args = process.argv.slice(2);
if (args[0] === "--tests") {
  if (args[1] === undefined) throw new Error("usage: node build.mjs --tests OUTDIR");
  await buildTests(path.resolve(args[1]));
} else {
  await buildPage(path.resolve(args[0] ?? path.join(here, "dist")));
}
