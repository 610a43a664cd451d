#!/usr/bin/env python3
"""Seed corpus of the libFuzzer targets (tests/fuzz), assembled from the repository's fixtures by scripts/fuzz.sh.

  fuzz_safetensors       each fixture *.safetensors cut down to its first tensors (header rewritten, offsets
                         re-tiled), plus the smallest whole files
  fuzz_config_json       every config.json of tests/fixtures, tests/integration/tiny_model.json, deploy/models/*
  fuzz_tokenizer_load    tests/fixtures/tokenizer/tiny_*.json; the Qwen3 tokenizer.json and its golden variants
                         (variants.json) with the vocabulary cut to the byte tokens and the first merges
  fuzz_tokenizer_encode  the golden corpus texts and fuzz strings, prefixed with each tokenizer selector byte
(fuzz_entry and fuzz_chunks write their own seeds: HYPIC_FUZZ_WRITE_SEEDS, see tests/fuzz/fuzz_common.h.)
"""
import argparse
import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from make_tokenizer_golden import merge_patch  # noqa: E402  (RFC 7386, as nlohmann's merge_patch)


def shrink_safetensors(data: bytes, keep: int, max_tensor_bytes: int = 4096) -> bytes | None:
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    meta = header.pop("__metadata__", None)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    out_h, out_b = {}, b""
    for name, t in items:
        b, e = t["data_offsets"]
        if e - b > max_tensor_bytes:
            continue
        out_h[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [len(out_b), len(out_b) + e - b]}
        out_b += body[b:e]
        if len(out_h) >= keep:
            break
    if not out_h:
        return None
    if meta:
        out_h["__metadata__"] = meta
    h = json.dumps(out_h, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h)) + h + out_b


def reduce_tokenizer(j: dict, n_merges: int = 400) -> dict | None:
    """The tokenizer with its BPE vocabulary cut to the single-character tokens and the first merges whose parts are
    kept, ids renumbered densely; added tokens and post-processor ids renumbered after it (Hugging Face's id rule)."""
    model = j["model"]
    vocab = model["vocab"]
    merges = model["merges"]
    keep = {t for t in vocab if len(t) == 1}
    kept_merges = []
    for m in merges:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        merged = a + b
        if a in keep and b in keep and merged in vocab:
            kept_merges.append(m)
            keep.add(merged)
            if len(kept_merges) >= n_merges:
                break
    order = sorted(keep, key=lambda t: vocab[t])
    new_vocab = {t: i for i, t in enumerate(order)}
    next_id = len(new_vocab)
    by_content = {}
    added = []
    for t in j.get("added_tokens") or []:
        t = dict(t)
        if t["content"] in by_content:
            t["id"] = by_content[t["content"]]
        elif t["content"] in new_vocab:
            t["id"] = new_vocab[t["content"]]
        else:
            t["id"] = next_id
            next_id += 1
        by_content[t["content"]] = t["id"]
        added.append(t)
    out = dict(j)
    out["model"] = dict(model, vocab=new_vocab, merges=kept_merges)
    out["added_tokens"] = added

    def fix_pp(pp):
        if not isinstance(pp, dict):
            return pp
        pp = dict(pp)
        if pp.get("type") == "Sequence":
            pp["processors"] = [fix_pp(p) for p in pp.get("processors", [])]
        if pp.get("type") == "TemplateProcessing":
            st = {}
            for name, spec in pp.get("special_tokens", {}).items():
                spec = dict(spec)
                spec["ids"] = [by_content.get(tok, new_vocab.get(tok, 0)) for tok in spec.get("tokens", [])]
                st[name] = spec
            pp["special_tokens"] = st
        for key in ("cls", "sep"):
            if isinstance(pp.get(key), list) and len(pp[key]) == 2:
                tok = pp[key][0]
                pp[key] = [tok, by_content.get(tok, new_vocab.get(tok, 0))]
        return pp

    out["post_processor"] = fix_pp(j.get("post_processor"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True, type=Path)
    ap.add_argument("--qwen3", type=Path, help="the real Qwen3 tokenizer.json")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    src, out = a.source, a.out
    fx = src / "tests" / "fixtures"
    count = {}

    def put(target: str, name: str, data: bytes) -> None:
        d = out / target
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
        count[target] = count.get(target, 0) + 1

    for f in sorted(fx.rglob("*.safetensors")):
        data = f.read_bytes()
        tag = f"{f.parent.name}-{f.stem}"
        for keep in (1, 3, 8):
            s = shrink_safetensors(data, keep)
            if s:
                put("fuzz_safetensors", f"{tag}-{keep}.safetensors", s)
    put("fuzz_safetensors", "empty-header.safetensors", struct.pack("<Q", 2) + b"{}")

    configs = sorted(fx.rglob("config.json")) + [src / "tests" / "integration" / "tiny_model.json"]
    configs += sorted((src / "deploy" / "models").rglob("*.json")) if (src / "deploy" / "models").exists() else []
    for f in configs:
        put("fuzz_config_json", f"{f.parent.name}-{f.name}", f.read_bytes())

    tk = fx / "tokenizer"
    for f in sorted(tk.glob("tiny_*.json")):
        if f.name != "tiny_cases.json":
            put("fuzz_tokenizer_load", f.name, f.read_bytes())
    if a.qwen3 and a.qwen3.exists():
        base = json.loads(a.qwen3.read_text())
        variants = json.loads((tk / "variants.json").read_text())
        for name, patch in [("qwen3", None)] + sorted(variants.items()):
            j = merge_patch(base, patch) if patch else base
            r = reduce_tokenizer(j)
            if r:
                put("fuzz_tokenizer_load", f"{name}-reduced.json", json.dumps(r, ensure_ascii=False).encode())

    texts = [(f.stem, f.read_bytes()) for f in sorted((tk / "corpus").glob("*.txt"))]
    for i, line in enumerate((tk / "fuzz.jsonl").read_text().splitlines()):
        texts.append((f"fuzz_{i:03d}", json.loads(line).encode("utf-8", "surrogatepass")))
    for name, text in texts:
        text = text[:4000]
        for sel in range(5):  # fuzz_tokenizer_encode's tokenizers (fewer without HYPIC_FUZZ_QWEN3: modulo)
            put("fuzz_tokenizer_encode", f"{sel}-{name}", bytes([sel]) + text)
    print("seeds: " + ", ".join(f"{k} {v}" for k, v in sorted(count.items())))


if __name__ == "__main__":
    main()
