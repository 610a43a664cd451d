// A small Kustomize: the subset that deploy/k8s uses, so that the overlays render where no kustomize or kubectl is
// installed (Debian 12 has none recent; `kubectl kustomize` is used instead when present, and validate.mjs
// --compare-kubectl checks that both agree).
//
// Supported kustomization.yaml fields (anything else is an error, never silently ignored):
//   resources   files (one or more YAML documents) and directories holding a kustomization.yaml
//   patches     strategic-merge patches given by `path` (one or more documents; each names its target by
//               apiVersion, kind and metadata.name); `$patch: delete` on a whole document deletes the object
//               (one per file, as Kustomize only honours it there)
//   images      name -> newName / newTag / digest, in every container and init container
// Strategic merge: maps merge; a null value deletes the key; lists of containers, initContainers, env, volumes,
// imagePullSecrets merge by name, volumeMounts by mountPath, container ports by containerPort, Service ports by
// port (the patch's elements first, then the others, as Kustomize orders them); an element with `$patch: delete`
// is removed; every other list is replaced (as Kubernetes' own patch
// strategies say for the fields used here: args, command, tolerations, volumeClaimTemplates, ...).
import fs from "node:fs";
import path from "node:path";
import YAML from "yaml";

export class KustomizeError extends Error {}

const SUPPORTED = new Set(["apiVersion", "kind", "resources", "patches", "images"]);

export function parseDocs(text, where) {
  const docs = YAML.parseAllDocuments(text);
  const out = [];
  for (const d of docs) {
    if (d.errors.length) throw new KustomizeError(`${where}: ${d.errors[0].message}`);
    const v = d.toJS();
    if (v !== null && v !== undefined) out.push(v);
  }
  return out;
}

function readDocs(file) {
  return parseDocs(fs.readFileSync(file, "utf8"), file);
}

const idOf = (o) => `${o.kind}/${o.metadata?.name}`;
const group = (apiVersion) => (apiVersion && apiVersion.includes("/") ? apiVersion.split("/")[0] : "");

const MERGE_KEYS = {
  containers: "name",
  initContainers: "name",
  ephemeralContainers: "name",
  env: "name",
  volumes: "name",
  imagePullSecrets: "name",
  volumeMounts: "mountPath",
};

function mergeKeyFor(field, elems) {
  if (MERGE_KEYS[field]) return MERGE_KEYS[field];
  if (field === "ports") return elems.some((e) => e && "containerPort" in e) ? "containerPort" : "port";
  return null;
}

const isMap = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

export function strategicMerge(base, patch, field = "") {
  if (isMap(patch)) {
    if (patch.$patch === "replace") {
      const { $patch, ...rest } = patch;
      return structuredClone(rest);
    }
    const out = isMap(base) ? structuredClone(base) : {};
    for (const [k, v] of Object.entries(patch)) {
      if (k === "$patch") continue;
      if (v === null) delete out[k];
      else out[k] = strategicMerge(out[k], v, k);
    }
    return out;
  }
  if (Array.isArray(patch)) {
    const key = mergeKeyFor(field, patch);
    if (!key || !Array.isArray(base) || !patch.every(isMap)) return structuredClone(patch);
    // Kustomize's order (kyaml): the patch's elements first (merged into their originals), then the originals
    // the patch does not name, as they were.
    const out = [];
    const named = new Set(patch.map((el) => el[key]));
    for (const el of patch) {
      if (el.$patch === "delete") continue;
      const orig = base.find((b) => isMap(b) && b[key] === el[key]);
      if (orig) out.push(strategicMerge(orig, el, field));
      else {
        const { $patch, ...rest } = el;
        out.push(structuredClone(rest));
      }
    }
    for (const b of base) if (!(isMap(b) && named.has(b[key]))) out.push(structuredClone(b));
    return out;
  }
  return patch;
}

function podSpecs(o) {
  const specs = [];
  if (o.kind === "Pod") specs.push(o.spec);
  if (o.spec?.template?.spec) specs.push(o.spec.template.spec);
  if (o.spec?.jobTemplate?.spec?.template?.spec) specs.push(o.spec.jobTemplate.spec.template.spec);
  return specs.filter(Boolean);
}

function splitImage(image) {
  // name[:tag][@digest]; a port in the registry host ("host:5000/x") is not a tag
  let digest = "";
  let rest = image;
  const at = rest.indexOf("@");
  if (at >= 0) [rest, digest] = [rest.slice(0, at), rest.slice(at + 1)];
  const slash = rest.lastIndexOf("/");
  const colon = rest.lastIndexOf(":");
  if (colon > slash) return { name: rest.slice(0, colon), tag: rest.slice(colon + 1), digest };
  return { name: rest, tag: "", digest };
}

function applyImages(objects, images, where) {
  for (const im of images) {
    if (!im.name) throw new KustomizeError(`${where}: images: an entry without name`);
    for (const k of Object.keys(im)) {
      if (!["name", "newName", "newTag", "digest"].includes(k)) throw new KustomizeError(`${where}: images.${k}: not supported`);
    }
  }
  for (const o of objects) {
    for (const spec of podSpecs(o)) {
      for (const c of [...(spec.containers || []), ...(spec.initContainers || [])]) {
        if (typeof c.image !== "string") continue;
        const cur = splitImage(c.image);
        const im = images.find((i) => i.name === cur.name);
        if (!im) continue;
        const name = im.newName ?? cur.name;
        if (im.digest) c.image = `${name}@${im.digest}`;
        else {
          const tag = im.newTag ?? cur.tag;
          c.image = tag ? `${name}:${tag}` : name;
          if (cur.digest && im.newTag === undefined) c.image += `@${cur.digest}`;
        }
      }
    }
  }
}

// The order Kustomize's "legacy" sort gives (kinds not listed follow, by kind name).
const ORDER = ["Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
  "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap", "Secret", "Endpoints",
  "Service", "LimitRange", "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "Deployment", "StatefulSet",
  "CronJob", "PodDisruptionBudget"];
const LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"];

export function sortLegacy(objects) {
  const rank = (k) => {
    const i = ORDER.indexOf(k);
    if (i >= 0) return [0, i, ""];
    const j = LAST.indexOf(k);
    if (j >= 0) return [2, j, ""];
    return [1, 0, k];
  };
  return [...objects].sort((a, b) => {
    const ra = rank(a.kind), rb = rank(b.kind);
    for (let i = 0; i < 3; i++) if (ra[i] !== rb[i]) return ra[i] < rb[i] ? -1 : 1;
    const na = `${a.metadata?.namespace ?? ""}/${a.metadata?.name ?? ""}`;
    const nb = `${b.metadata?.namespace ?? ""}/${b.metadata?.name ?? ""}`;
    return na < nb ? -1 : na > nb ? 1 : 0;
  });
}

/** Renders the kustomization in `dir`: the list of objects, in Kustomize's legacy order. */
export function render(dir, seen = new Set()) {
  const real = fs.realpathSync(dir);
  if (seen.has(real)) throw new KustomizeError(`${dir}: kustomization cycle`);
  seen = new Set([...seen, real]);
  const kfile = ["kustomization.yaml", "kustomization.yml", "Kustomization"].map((f) => path.join(dir, f))
    .find((f) => fs.existsSync(f));
  if (!kfile) throw new KustomizeError(`${dir}: no kustomization.yaml`);
  const [k] = readDocs(kfile);
  for (const key of Object.keys(k || {})) {
    if (!SUPPORTED.has(key)) throw new KustomizeError(`${kfile}: field '${key}' is not supported by this renderer`);
  }
  let objects = [];
  for (const r of k.resources || []) {
    const p = path.join(dir, r);
    if (!fs.existsSync(p)) throw new KustomizeError(`${kfile}: resource ${r} not found`);
    const docs = fs.statSync(p).isDirectory() ? render(p, seen) : readDocs(p);
    for (const d of docs) {
      if (objects.some((o) => idOf(o) === idOf(d))) throw new KustomizeError(`${kfile}: ${idOf(d)} defined twice`);
      objects.push(d);
    }
  }
  for (const p of k.patches || []) {
    const extra = Object.keys(p).filter((x) => x !== "path");
    if (extra.length) throw new KustomizeError(`${kfile}: patches: only 'path' is supported (got ${extra.join(", ")})`);
    const file = path.join(dir, p.path);
    const docs = readDocs(file);
    for (const patch of docs) {
      const i = objects.findIndex((o) => idOf(o) === idOf(patch) && group(o.apiVersion) === group(patch.apiVersion));
      if (i < 0) throw new KustomizeError(`${file}: the patch's target ${idOf(patch)} does not exist`);
      if (patch.$patch === "delete") {
        if (docs.length > 1) throw new KustomizeError(`${file}: $patch: delete must be the file's only document`);
        objects.splice(i, 1);
      } else {
        objects[i] = strategicMerge(objects[i], patch);
      }
    }
  }
  if (k.images) applyImages(objects, k.images, kfile);
  return sortLegacy(objects);
}

export function toYaml(objects) {
  return objects.map((o) => YAML.stringify(o, { lineWidth: 0 })).join("---\n");
}
