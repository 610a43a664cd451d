#!/usr/bin/env node
// Validates hypic's Kubernetes objects:
//   - every object against the Kubernetes OpenAPI schema of its kind (kubernetes-models 4.x: the API's JSON schemas,
//     checked with ajv), and no kind/name twice;
//   - hypic's own cross-checks: Services, PodDisruptionBudgets and NetworkPolicies select pods that exist and name
//     ports those pods have; each StatefulSet's serviceName is a headless Service selecting it; the addresses in the
//     hypic-config ConfigMap (--cache, --combine, --scatter, the router) name StatefulSet pods and ports that exist
//     (cache and combine lists exactly the replicas, the scatter list at least the autoscaler's maxReplicas); the
//     HorizontalPodAutoscaler's target exists; every $VAR a container command uses is defined; probes, volume
//     mounts and Prometheus annotations name ports and volumes that exist; containers run as non-root; images are
//     fully named (registry/name:tag, i.e. an overlay's images: applied).
//
//   node deploy/k8s/validate/validate.mjs [--compare-kubectl] DIR|FILE...
//     DIR: a kustomization (rendered with kustomize.mjs); FILE: a rendered YAML stream.
//     --compare-kubectl: also render each DIR with `kubectl kustomize` (when installed) and require the same objects.
// Exit status 0 when everything holds; 1 with one line per problem otherwise.
import fs from "node:fs";
import { execFileSync } from "node:child_process";
import { render, parseDocs, KustomizeError } from "./kustomize.mjs";

const args = process.argv.slice(2);
const compare = args.includes("--compare-kubectl");
const inputs = args.filter((a) => a !== "--compare-kubectl");
if (!inputs.length || inputs.some((a) => a.startsWith("-"))) {
  console.error("usage: validate.mjs [--compare-kubectl] DIR|FILE...");
  process.exit(2);
}

const canon = (v) =>
  JSON.stringify(v, (_k, x) =>
    x && typeof x === "object" && !Array.isArray(x) ? Object.fromEntries(Object.keys(x).sort().map((k) => [k, x[k]])) : x);
const idOf = (o) => `${o.kind}/${o.metadata?.name}`;

async function schemaErrors(o) {
  if (!o.apiVersion || !o.kind) return [`an object without apiVersion/kind: ${JSON.stringify(o).slice(0, 80)}`];
  const modPath = `kubernetes-models/${o.apiVersion}`;
  let mod;
  try {
    mod = await import(modPath);
  } catch {
    return [`${idOf(o)}: apiVersion ${o.apiVersion} unknown to kubernetes-models`];
  }
  const Cls = mod[o.kind];
  if (!Cls) return [`${idOf(o)}: kind ${o.kind} unknown in ${o.apiVersion}`];
  try {
    new Cls(o).validate();
    return [];
  } catch (e) {
    return [`${idOf(o)}: schema: ${e.message}`];
  }
}

// Fields the schema check does not catch: kubernetes-models' schemas allow unknown properties, so a misspelt field
// would pass silently. Known field names per object path pattern, for the kinds hypic uses.
function unknownFieldErrors(o) {
  const errs = [];
  const known = {
    container: ["name", "image", "command", "args", "env", "envFrom", "ports", "resources", "startupProbe",
      "readinessProbe", "livenessProbe", "securityContext", "volumeMounts", "imagePullPolicy", "workingDir",
      "lifecycle", "terminationMessagePath", "terminationMessagePolicy", "stdin", "tty", "volumeDevices"],
    probe: ["grpc", "exec", "httpGet", "tcpSocket", "periodSeconds", "failureThreshold", "timeoutSeconds",
      "initialDelaySeconds", "successThreshold", "terminationGracePeriodSeconds"],
    podSpec: ["containers", "initContainers", "volumes", "securityContext", "automountServiceAccountToken",
      "enableServiceLinks", "terminationGracePeriodSeconds", "nodeSelector", "tolerations", "affinity",
      "serviceAccountName", "hostname", "subdomain", "hostNetwork", "restartPolicy", "runtimeClassName",
      "priorityClassName", "topologySpreadConstraints", "imagePullSecrets", "dnsPolicy", "hostAliases"],
  };
  const check = (obj, kind, where) => {
    if (!obj || typeof obj !== "object") return;
    for (const k of Object.keys(obj)) if (!known[kind].includes(k)) errs.push(`${idOf(o)}: ${where}: unknown field '${k}'`);
  };
  for (const spec of podSpecs(o)) {
    check(spec, "podSpec", "pod spec");
    for (const c of [...(spec.containers || []), ...(spec.initContainers || [])]) {
      check(c, "container", `container ${c.name}`);
      for (const p of ["startupProbe", "readinessProbe", "livenessProbe"]) check(c[p], "probe", `container ${c.name} ${p}`);
    }
  }
  return errs;
}

function podSpecs(o) {
  if (o.kind === "Pod") return [o.spec];
  if (o.spec?.template?.spec) return [o.spec.template.spec];
  return [];
}
const podLabels = (o) => (o.kind === "Pod" ? o.metadata?.labels : o.spec?.template?.metadata?.labels) || {};
const podAnnotations = (o) => (o.kind === "Pod" ? o.metadata?.annotations : o.spec?.template?.metadata?.annotations) || {};
const matches = (sel, labels) => !!sel && Object.entries(sel.matchLabels || {}).every(([k, v]) => labels[k] === v)
  && !(sel.matchExpressions?.length);
const containerPorts = (o) => podSpecs(o).flatMap((s) => s.containers || []).flatMap((c) => c.ports || []);
const hasPort = (o, p) => containerPorts(o).some((cp) => cp.containerPort === p || cp.name === p);

// "2GiB", "512MB", "1048576" as CLI11's size options read them (k = 1024 and ki = 1024 alike, b optional).
function cliBytes(v) {
  const m = /^(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?$/i.exec(String(v).trim());
  if (!m) return NaN;
  return Number(m[1]) * 1024 ** "_kmgtp".indexOf((m[2] || "_").toLowerCase());
}
// A Kubernetes quantity ("3Gi", "512Mi", "10G") in bytes; null when absent.
function quantityBytes(q) {
  if (q === undefined || q === null) return null;
  const m = /^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$/.exec(String(q));
  if (!m) return NaN;
  const bin = { Ki: 1, Mi: 2, Gi: 3, Ti: 4, Pi: 5 }, dec = { k: 1, M: 2, G: 3, T: 4, P: 5 };
  const u = m[2];
  return Number(m[1]) * (u ? (bin[u] ? 1024 ** bin[u] : 1000 ** dec[u]) : 1);
}

function crossChecks(objects) {
  const errs = [];
  const notes = [];
  const ids = new Set();
  for (const o of objects) {
    if (ids.has(idOf(o))) errs.push(`${idOf(o)}: defined twice`);
    ids.add(idOf(o));
  }
  const byKind = (k) => objects.filter((o) => o.kind === k);
  const workloads = objects.filter((o) => ["Deployment", "StatefulSet", "Pod", "DaemonSet"].includes(o.kind));
  const selected = (sel) => workloads.filter((w) => matches(sel, podLabels(w)));

  for (const s of byKind("Service")) {
    const sel = { matchLabels: s.spec?.selector || {} };
    const ws = selected(sel);
    if (!ws.length) errs.push(`Service/${s.metadata.name}: its selector matches no pods`);
    for (const p of s.spec?.ports || []) {
      const t = p.targetPort ?? p.port;
      for (const w of ws) if (!hasPort(w, t)) errs.push(`Service/${s.metadata.name}: ${idOf(w)} has no port ${t}`);
    }
  }
  for (const st of byKind("StatefulSet")) {
    const svc = byKind("Service").find((s) => s.metadata.name === st.spec.serviceName);
    if (!svc) errs.push(`${idOf(st)}: serviceName ${st.spec.serviceName} is no Service`);
    else {
      if (svc.spec.clusterIP !== "None") errs.push(`${idOf(st)}: Service ${svc.metadata.name} is not headless`);
      if (!matches({ matchLabels: svc.spec.selector || {} }, podLabels(st))) {
        errs.push(`${idOf(st)}: Service ${svc.metadata.name} does not select its pods`);
      }
    }
  }
  for (const pdb of byKind("PodDisruptionBudget")) {
    if (!selected(pdb.spec.selector).length) errs.push(`${idOf(pdb)}: its selector matches no pods`);
  }
  for (const np of byKind("NetworkPolicy")) {
    const targets = selected(np.spec.podSelector);
    if (!targets.length) errs.push(`${idOf(np)}: its podSelector matches no pods`);
    for (const rule of np.spec.ingress || []) {
      for (const peer of rule.from || []) {
        if (peer.podSelector && !peer.namespaceSelector && !selected(peer.podSelector).length) {
          errs.push(`${idOf(np)}: a from.podSelector matches no pods: ${JSON.stringify(peer.podSelector)}`);
        }
      }
      for (const p of rule.ports || []) {
        // A range (endPort) admits ports picked at run time (NCCL's): it names no container port to check.
        if (p.endPort !== undefined) {
          if (!(Number(p.port) >= 1 && Number(p.endPort) >= Number(p.port) && Number(p.endPort) <= 65535)) {
            errs.push(`${idOf(np)}: port range ${p.port}-${p.endPort} is not within 1-65535`);
          }
          continue;
        }
        for (const t of targets) if (!hasPort(t, p.port)) errs.push(`${idOf(np)}: ${idOf(t)} has no port ${p.port}`);
      }
    }
  }
  const hpas = byKind("HorizontalPodAutoscaler");
  for (const h of hpas) {
    const ref = h.spec.scaleTargetRef;
    if (!objects.some((o) => o.kind === ref.kind && o.metadata.name === ref.name)) {
      errs.push(`${idOf(h)}: scaleTargetRef ${ref.kind}/${ref.name} does not exist`);
    }
    for (const m of h.spec.metrics || []) {
      if (m.type === "Pods" || m.type === "External") {
        notes.push(`${idOf(h)}: scales on the ${m.type.toLowerCase()} metric ${(m.pods || m.external).metric.name}: needs `
          + "a custom/external metrics API (the Prometheus adapter, deploy/KUBERNETES.md)");
      }
    }
  }

  // The flags ConfigMap and the addresses in it.
  const cm = byKind("ConfigMap").find((c) => c.metadata.name === "hypic-config");
  if (!cm) errs.push("ConfigMap/hypic-config is missing");
  const data = cm?.data || {};
  const sts = (name) => byKind("StatefulSet").find((s) => s.metadata.name === name);
  const addrLists = { HYPIC_CACHE_ADDRS: "--cache", HYPIC_COMBINE_ADDRS: "--combine", HYPIC_SCATTER_ADDRS: "--scatter" };
  for (const [key, flag] of Object.entries(addrLists)) {
    if (!cm) break;
    const words = (data[key] || "").split(/\s+/).filter(Boolean);
    const addrs = [];
    for (let i = 0; i < words.length; i += 2) {
      if (words[i] !== flag || !words[i + 1]) {
        errs.push(`ConfigMap/hypic-config ${key}: expected '${flag} HOST:PORT' pairs, got '${words.slice(i, i + 2).join(" ")}'`);
        break;
      }
      addrs.push(words[i + 1]);
    }
    const ordinals = new Map();
    for (const a of addrs) {
      const m = /^([a-z0-9-]+)-(\d+)\.([a-z0-9-]+):(\d+)$/.exec(a);
      if (!m) {
        errs.push(`ConfigMap/hypic-config ${key}: ${a} is not STATEFULSET-N.SERVICE:PORT`);
        continue;
      }
      const [, name, ord, svc, port] = m;
      // podman kube play's form (podman.mjs): one Pod named like the StatefulSet pod's DNS name.
      const pod = byKind("Pod").find((x) => x.metadata.name === `${name}-${ord}.${svc}`);
      if (pod) {
        if (!hasPort(pod, Number(port))) errs.push(`ConfigMap/hypic-config ${key}: ${a}: the pod has no port ${port}`);
        continue;
      }
      const s = sts(name);
      if (!s) {
        errs.push(`ConfigMap/hypic-config ${key}: ${a}: no StatefulSet ${name}`);
        continue;
      }
      if (s.spec.serviceName !== svc) errs.push(`ConfigMap/hypic-config ${key}: ${a}: ${name}'s service is ${s.spec.serviceName}`);
      if (!hasPort(s, Number(port))) errs.push(`ConfigMap/hypic-config ${key}: ${a}: ${name} has no port ${port}`);
      if (!ordinals.has(name)) ordinals.set(name, []);
      ordinals.get(name).push(Number(ord));
    }
    for (const [name, ords] of ordinals) {
      const s = sts(name);
      const replicas = s.spec.replicas ?? 1;
      const sorted = [...ords].sort((a, b) => a - b);
      if (sorted.some((v, i) => v !== i)) errs.push(`ConfigMap/hypic-config ${key}: ${name} ordinals ${sorted} are not 0..n-1`);
      const hpa = hpas.find((h) => h.spec.scaleTargetRef.kind === "StatefulSet" && h.spec.scaleTargetRef.name === name);
      if (hpa) {
        if (ords.length < hpa.spec.maxReplicas) {
          errs.push(`ConfigMap/hypic-config ${key}: ${ords.length} ${name} names, fewer than ${idOf(hpa)}'s maxReplicas ${hpa.spec.maxReplicas}`);
        }
      } else if (flag === "--scatter" ? ords.length < replicas : ords.length !== replicas) {
        errs.push(`ConfigMap/hypic-config ${key}: ${ords.length} ${name} names for ${replicas} replicas`);
      }
    }
  }
  if (cm && data.HYPIC_ROUTER_ADDR) {
    const [host, port] = data.HYPIC_ROUTER_ADDR.split(":");
    const svc = byKind("Service").find((s) => s.metadata.name === host);
    if (!svc) errs.push(`ConfigMap/hypic-config HYPIC_ROUTER_ADDR: no Service ${host}`);
    else if (!(svc.spec.ports || []).some((p) => p.port === Number(port))) {
      errs.push(`ConfigMap/hypic-config HYPIC_ROUTER_ADDR: Service ${host} has no port ${port}`);
    }
  }

  // The cache's byte budgets against what its pods get: --memory-bytes below the container's memory limit,
  // --disk-bytes within the disk tier's volume.
  const cacheSts = sts("hypic-segment-cache");
  if (cm && cacheSts) {
    const flag = (name) => {
      const w = (data.HYPIC_CACHE_FLAGS || "").split(/\s+/);
      const i = w.indexOf(name);
      return i >= 0 ? w[i + 1] : undefined;
    };
    const mem = cliBytes(flag("--memory-bytes") ?? "1GiB");
    const limit = quantityBytes(podSpecs(cacheSts)[0].containers[0].resources?.limits?.memory);
    if (limit !== null && mem >= limit) {
      errs.push(`StatefulSet/hypic-segment-cache: --memory-bytes ${flag("--memory-bytes")} is not below its memory limit`);
    }
    if (flag("--disk-dir")) {
      const disk = cliBytes(flag("--disk-bytes") ?? "8GiB");
      const claim = (cacheSts.spec.volumeClaimTemplates || []).find((t) => t.metadata.name === "cache-disk");
      const size = quantityBytes(claim?.spec?.resources?.requests?.storage);
      if (size === null) errs.push("StatefulSet/hypic-segment-cache: --disk-dir without a cache-disk volume claim");
      else if (disk > size) errs.push(`StatefulSet/hypic-segment-cache: --disk-bytes ${flag("--disk-bytes")} exceeds its volume (${claim.spec.resources.requests.storage})`);
    }
  }

  // Workloads: commands, probes, volumes, security, images, annotations.
  const externalSecrets = new Set();
  for (const w of workloads) {
    for (const spec of podSpecs(w)) {
      const volumes = new Set((spec.volumes || []).map((v) => v.name));
      for (const t of w.spec?.volumeClaimTemplates || []) volumes.add(t.metadata.name);
      for (const v of spec.volumes || []) {
        if (v.configMap && !byKind("ConfigMap").some((c) => c.metadata.name === v.configMap.name)) {
          errs.push(`${idOf(w)}: volume ${v.name}: no ConfigMap ${v.configMap.name}`);
        }
        if (v.persistentVolumeClaim && !byKind("PersistentVolumeClaim").some((c) => c.metadata.name === v.persistentVolumeClaim.claimName)) {
          errs.push(`${idOf(w)}: volume ${v.name}: no PersistentVolumeClaim ${v.persistentVolumeClaim.claimName}`);
        }
        if (v.secret && !byKind("Secret").some((c) => c.metadata.name === v.secret.secretName)) externalSecrets.add(v.secret.secretName);
      }
      const podNonRoot = spec.securityContext?.runAsNonRoot === true;
      for (const c of [...(spec.containers || []), ...(spec.initContainers || [])]) {
        const where = `${idOf(w)} container ${c.name}`;
        if (!podNonRoot && c.securityContext?.runAsNonRoot !== true) errs.push(`${where}: not runAsNonRoot`);
        if (!/^[^/]+\/.+(:[^/:]+|@sha256:[0-9a-f]{64})$/.test(c.image || "")) {
          errs.push(`${where}: image '${c.image}' is not REGISTRY/NAME:TAG (an overlay's images: missing?)`);
        }
        for (const m of c.volumeMounts || []) if (!volumes.has(m.name)) errs.push(`${where}: mounts unknown volume ${m.name}`);
        const defined = new Set((c.env || []).map((e) => e.name));
        for (const ef of c.envFrom || []) {
          const ref = ef.configMapRef?.name;
          const src = byKind("ConfigMap").find((x) => x.metadata.name === ref);
          if (ef.configMapRef && !src) errs.push(`${where}: envFrom: no ConfigMap ${ref}`);
          for (const k of Object.keys(src?.data || {})) defined.add(k);
        }
        const text = [...(c.command || []), ...(c.args || [])].join(" ");
        for (const [, v] of text.matchAll(/\$\{?([A-Z_][A-Z0-9_]*)\}?/g)) {
          if (!defined.has(v)) errs.push(`${where}: the command uses $${v}, defined by no env or envFrom`);
        }
        for (const pn of ["startupProbe", "readinessProbe", "livenessProbe"]) {
          const p = c[pn];
          if (!p) continue;
          const port = p.grpc?.port ?? p.httpGet?.port ?? p.tcpSocket?.port;
          if (port !== undefined && !(c.ports || []).some((cp) => cp.containerPort === port || cp.name === port)) {
            errs.push(`${where}: ${pn} probes port ${port}, which the container does not have`);
          }
          if (p.exec && !(p.exec.command?.[0] || "").startsWith("/")) errs.push(`${where}: ${pn} exec command is not an absolute path`);
        }
      }
      const ann = podAnnotations(w);
      if (ann["prometheus.io/scrape"] === "true" && !hasPort(w, Number(ann["prometheus.io/port"]))) {
        errs.push(`${idOf(w)}: prometheus.io/port ${ann["prometheus.io/port"]} is no container port`);
      }
    }
  }
  for (const s of externalSecrets) notes.push(`Secret ${s} is not part of the manifests: create it first (deploy/KUBERNETES.md)`);
  return { errs, notes };
}

function kubectlRender(dir) {
  try {
    return parseDocs(execFileSync("kubectl", ["kustomize", dir], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] }), "kubectl");
  } catch (e) {
    if (e.code === "ENOENT") return null;
    throw new Error(`kubectl kustomize ${dir}: ${(e.stderr || e.message).split("\n").slice(0, 3).join(" ")}`);
  }
}

let failed = false;
for (const input of inputs) {
  let objects;
  try {
    objects = fs.statSync(input).isDirectory() ? render(input) : parseDocs(fs.readFileSync(input, "utf8"), input);
  } catch (e) {
    console.log(`${input}: ${e instanceof KustomizeError ? e.message : e}`);
    failed = true;
    continue;
  }
  const errs = [];
  for (const o of objects) errs.push(...(await schemaErrors(o)), ...unknownFieldErrors(o));
  const cross = crossChecks(objects);
  errs.push(...cross.errs);
  if (compare && fs.statSync(input).isDirectory()) {
    const theirs = kubectlRender(input);
    if (!theirs) cross.notes.push("kubectl not found: not compared with kubectl kustomize");
    else {
      const mine = new Map(objects.map((o) => [idOf(o), canon(o)]));
      const other = new Map(theirs.map((o) => [idOf(o), canon(o)]));
      for (const k of new Set([...mine.keys(), ...other.keys()])) {
        if (!mine.has(k)) errs.push(`kubectl kustomize renders ${k}, kustomize.mjs does not`);
        else if (!other.has(k)) errs.push(`kustomize.mjs renders ${k}, kubectl kustomize does not`);
        else if (mine.get(k) !== other.get(k)) errs.push(`${k}: kustomize.mjs and kubectl kustomize render it differently`);
      }
      if (theirs.map(idOf).join() !== objects.map(idOf).join()) errs.push("kubectl kustomize orders the objects differently");
      if (!errs.length) cross.notes.push(`same ${theirs.length} objects as kubectl kustomize (${execFileSync("kubectl", ["version", "--client"], { encoding: "utf8" }).split("\n").find((l) => l.startsWith("Kustomize")) || "kustomize"})`);
    }
  }
  const kinds = {};
  for (const o of objects) kinds[o.kind] = (kinds[o.kind] || 0) + 1;
  console.log(`${input}: ${objects.length} objects (${Object.entries(kinds).map(([k, n]) => `${n} ${k}`).join(", ")})`);
  for (const n of cross.notes) console.log(`  note: ${n}`);
  for (const e of errs) console.log(`  error: ${e}`);
  console.log(errs.length ? `  INVALID: ${errs.length} problem(s)` : "  valid");
  failed ||= errs.length > 0;
}
process.exit(failed ? 1 : 0);
