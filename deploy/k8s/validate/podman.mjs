#!/usr/bin/env node
// Adapts a rendered overlay (deploy/k8s/overlays/cpu-dev) for `podman kube play` (podman 4.3, Debian 12), which
// runs only Pods, Deployments, PersistentVolumeClaims and ConfigMaps, and ignores Services and readiness probes:
//
//   StatefulSet N replicas  -> N Pods named like the StatefulSet pods' DNS names, <name>-<i>.<serviceName>, with
//                              hostname <name>-<i>: on a podman network with DNS (aardvark) a pod is found by its
//                              name, so the addresses in hypic-config (hypic-scatter-worker-0.hypic-scatter-worker
//                              :50061, ...) resolve exactly as they do in Kubernetes, unchanged; each
//                              volumeClaimTemplate -> a PersistentVolumeClaim <claim>-<name>-<i> (a podman volume)
//   Deployment              -> one Pod named like the Deployment, which is also its Service's name (hypic-router)
//   gRPC liveness probe     -> exec `hypic-client health --target 127.0.0.1:PORT [--service S]` (podman turns an
//                              exec liveness probe into a health check: `podman healthcheck run CONTAINER`)
//   HTTP probes, startup and readiness probes -> dropped (podman 4.3 would run curl, which the images lack; the
//                              HTTP front's /health is checked from the host through its published port)
//   Service, HorizontalPodAutoscaler, PodDisruptionBudget, NetworkPolicy -> dropped (podman has no use for them)
//   emptyDir volumes        -> renamed <pod>-<volume> (podman 4.3 makes each a named volume shared by every pod
//                              with a volume of the same name)
//   Secret                  -> refused (podman 4.3's kube play crashes on secret volumes; cpu-dev uses none)
// With --publish every container port is published on 127.0.0.1 at a free port (the host reaches the pods only so).
//
//   node podman.mjs DIR|FILE --out PLAY.yaml [--state STATE.json] [--publish] [--exclude APP]...
//     --exclude APP: leave out the workloads labelled app.kubernetes.io/name=APP (e.g. hypic-openai when its image
//     is not built)
//   STATE.json: {"pods": {POD: {"containers": [NAME...], "health": [NAME...], "ports": {PORTNAME: HOSTPORT}}},
//                "volumes": [NAME...], "dropped": [KIND/NAME...]}   (what scripts/deploy_test.sh waits on and removes)
import fs from "node:fs";
import net from "node:net";
import { render, parseDocs, toYaml } from "./kustomize.mjs";

function usage(msg) {
  if (msg) console.error(`podman.mjs: ${msg}`);
  console.error("usage: podman.mjs DIR|FILE --out PLAY.yaml [--state STATE.json] [--publish] [--exclude APP]...");
  process.exit(2);
}

const argv = process.argv.slice(2);
let input = null, out = null, stateFile = null, publish = false;
const exclude = [];
for (let i = 0; i < argv.length; i++) {
  const a = argv[i];
  if (a === "--out") out = argv[++i];
  else if (a === "--state") stateFile = argv[++i];
  else if (a === "--publish") publish = true;
  else if (a === "--exclude") exclude.push(argv[++i]);
  else if (a.startsWith("-")) usage(`unknown option ${a}`);
  else if (input) usage("one input only");
  else input = a;
}
if (!input || !out) usage();

const objects = fs.statSync(input).isDirectory() ? render(input) : parseDocs(fs.readFileSync(input, "utf8"), input);
const CLIENT = "/usr/local/bin/hypic-client";

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

const state = { pods: {}, volumes: [], dropped: [] };
const result = [];
const taken = new Set();

async function podFrom(name, meta, spec, extraVolumes = []) {
  spec = structuredClone(spec);
  spec.restartPolicy = "Always";
  spec.volumes = [...(spec.volumes || []), ...extraVolumes];
  // podman 4.3 makes an emptyDir a named volume called like the pod's volume, shared by every pod that has a volume
  // of that name: give each pod its own (<pod>-<volume>), removed at teardown.
  const renamed = {};
  for (const v of spec.volumes) {
    if (v.emptyDir) {
      renamed[v.name] = `${name.split(".")[0]}-${v.name}`;
      v.name = renamed[v.name];
      state.volumes.push(v.name);
    }
  }
  const entry = { containers: [], health: [], ports: {} };
  for (const c of [...(spec.containers || []), ...(spec.initContainers || [])]) {
    for (const m of c.volumeMounts || []) if (renamed[m.name]) m.name = renamed[m.name];
  }
  for (const c of spec.containers || []) {
    entry.containers.push(`${name}-${c.name}`);
    delete c.startupProbe;
    delete c.readinessProbe;
    const lp = c.livenessProbe;
    if (lp?.grpc) {
      const cmd = [CLIENT, "health", "--target", `127.0.0.1:${lp.grpc.port}`];
      if (lp.grpc.service) cmd.push("--service", lp.grpc.service);
      const { grpc, ...rest } = lp;
      c.livenessProbe = { ...rest, exec: { command: cmd } };
    } else if (lp && !lp.exec) {
      delete c.livenessProbe;
    }
    if (c.livenessProbe) entry.health.push(`${name}-${c.name}`);
    if (publish) {
      for (const p of c.ports || []) {
        let hp;
        do hp = await freePort(); while (taken.has(hp));
        taken.add(hp);
        p.hostPort = hp;
        p.hostIP = "127.0.0.1";
        entry.ports[p.name || String(p.containerPort)] = hp;
      }
    }
  }
  state.pods[name] = entry;
  return { apiVersion: "v1", kind: "Pod", metadata: { name, labels: meta?.labels || {}, annotations: meta?.annotations || {} }, spec };
}

const appOf = (o) => o.spec?.template?.metadata?.labels?.["app.kubernetes.io/name"] ?? o.metadata?.labels?.["app.kubernetes.io/name"];
for (const o of objects) {
  if (exclude.includes(appOf(o))) {
    state.dropped.push(`${o.kind}/${o.metadata.name} (--exclude)`);
    continue;
  }
  switch (o.kind) {
    case "ConfigMap":
    case "PersistentVolumeClaim":
      result.push(o);
      if (o.kind === "PersistentVolumeClaim") state.volumes.push(o.metadata.name);
      break;
    case "Secret":
      console.error(`podman.mjs: Secret/${o.metadata.name}: podman 4.3 kube play cannot mount Secrets (it crashes); use a hostPath`);
      process.exit(1);
      break;
    case "Deployment":
      if ((o.spec.replicas ?? 1) > 1) console.error(`podman.mjs: Deployment/${o.metadata.name}: ${o.spec.replicas} replicas -> one pod`);
      result.push(await podFrom(o.metadata.name, o.spec.template.metadata, o.spec.template.spec));
      break;
    case "StatefulSet": {
      const n = o.spec.replicas ?? 1;
      for (let i = 0; i < n; i++) {
        const pod = `${o.metadata.name}-${i}`;
        const claims = [];
        for (const t of o.spec.volumeClaimTemplates || []) {
          const claim = `${t.metadata.name}-${pod}`;
          result.push({ apiVersion: "v1", kind: "PersistentVolumeClaim", metadata: { name: claim, labels: t.metadata.labels || {} }, spec: t.spec });
          state.volumes.push(claim);
          claims.push({ name: t.metadata.name, persistentVolumeClaim: { claimName: claim } });
        }
        const spec = { ...o.spec.template.spec, hostname: pod, subdomain: o.spec.serviceName };
        result.push(await podFrom(`${pod}.${o.spec.serviceName}`, o.spec.template.metadata, spec, claims));
      }
      break;
    }
    case "Pod":
      result.push(await podFrom(o.metadata.name, o.metadata, o.spec));
      break;
    default:
      state.dropped.push(`${o.kind}/${o.metadata.name}`);
  }
}

// podman creates what a pod needs before the pod (ConfigMaps and volumes first) and starts pods in file order:
// the services each one calls first (cache, workers, router, then the HTTP front), so that their names resolve.
const rank = { ConfigMap: 0, PersistentVolumeClaim: 1, Pod: 2 };
const order = ["segment-cache", "scatter-worker", "combine-worker", "router", "openai"];
const comp = (o) => {
  const i = order.indexOf(o.metadata?.labels?.["app.kubernetes.io/component"]);
  return i < 0 ? order.length : i;
};
result.sort((a, b) => rank[a.kind] - rank[b.kind] || (a.kind === "Pod" ? comp(a) - comp(b) : 0));
fs.writeFileSync(out, toYaml(result));
if (stateFile) fs.writeFileSync(stateFile, JSON.stringify(state, null, 2) + "\n");
console.error(`podman.mjs: ${result.filter((o) => o.kind === "Pod").length} pods, ${state.volumes.length} volumes; `
  + `dropped ${state.dropped.length} objects podman does not run`);
