#!/usr/bin/env node
// Renders a Kustomize directory with the subset in kustomize.mjs and prints the YAML stream.
//   node deploy/k8s/validate/render.mjs DIR [--out FILE]
import fs from "node:fs";
import { render, toYaml, KustomizeError } from "./kustomize.mjs";

const args = process.argv.slice(2);
const outIdx = args.indexOf("--out");
const out = outIdx >= 0 ? args.splice(outIdx, 2)[1] : null;
if (args.length !== 1 || args[0].startsWith("-")) {
  console.error("usage: render.mjs DIR [--out FILE]");
  process.exit(2);
}
try {
  const text = toYaml(render(args[0]));
  if (out) fs.writeFileSync(out, text);
  else process.stdout.write(text);
} catch (e) {
  if (e instanceof KustomizeError) {
    console.error(`render.mjs: ${e.message}`);
    process.exit(1);
  }
  throw e;
}
