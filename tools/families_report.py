#!/usr/bin/env python3
"""The families' GPU benchmark report (issue 29): bench/results/families_h200.{json,md} from the JSONs that
hypic-bench-prefill-gpu wrote for each model in one session (bench/results/families/*_h200.json).

    python3 tools/families_report.py [--dir bench/results/families] [--out bench/results/families_h200]

Rows: `family` (kimi_linear, minimax, bailing_moe_linear; qwen3_5_moe_text as the reference), `tokens`, `ours_ms`,
`hf_ms` (null where no Hugging Face run exists, with the reason in `hf_note`), the warm 16 x 2k splice, the entry
build and the decode steps. The target check divides each 32k prefill by the model's active parameters per token
outside the embedding and the LM head ("body": count_parameters minus V x H per embedding matrix) and compares the
result with Qwen3.5-35B-A3B's, measured in the same session: within 1.5x passes.
"""
import argparse
import json
import os
import sys

FAMILY = {"kimi_linear": "kimi_linear", "minimax": "minimax", "bailing_moe_linear": "bailing_moe_linear"}
HF_NOTE = ("Ring-linear has no native class in transformers 5.17 (hub remote code): no HF row for it")


def load(path):
    with open(path) as f:
        return json.load(f)


def vocab_hidden(cfg_path):
    """(V, H, tied) from a config path recorded in a benchmark JSON (None when it is not in the tree)."""
    if not os.path.exists(cfg_path):
        return None
    c = load(cfg_path)
    c = c.get("text_config", c)
    return int(c["vocab_size"]), int(c["hidden_size"]), bool(c.get("tie_word_embeddings", False))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="bench/results/families")
    ap.add_argument("--out", default="bench/results/families_h200")
    a = ap.parse_args()
    runs, hf, decode_only = [], {}, []
    for name in sorted(os.listdir(a.dir)):
        if not name.endswith(".json"):
            continue
        if name.startswith("hf_"):  # tools/hf_prefill_bench.py's JSON for the model of the same name
            hf[name[3:].replace(".json", "")] = load(os.path.join(a.dir, name))
        elif name.startswith("decode_"):  # a decode-only run (other contexts): its own table
            decode_only.append((name, load(os.path.join(a.dir, name))))
        else:
            runs.append((name, load(os.path.join(a.dir, name))))
    if not runs:
        sys.exit("families_report: no benchmark JSONs in " + a.dir)
    out = {"source": a.dir, "hf_note": HF_NOTE, "rows": [], "models": [], "targets": [], "decode_runs": []}
    for name, j in decode_only:
        for b in j.get("decode", {}).get("batches", []):
            out["decode_runs"].append({"file": name, "family": FAMILY.get(j["model"]["model_type"], j["model"]["model_type"]),
                                       "batch": b["batch"], "context_tokens": b["mean_context_tokens"], "ms": b["ms"],
                                       "greedy_ms": b["greedy_ms"], "git_commit": j.get("git_commit"), "utc": j.get("utc"),
                                       "kv_used_bytes": j.get("memory", {}).get("kv_used")})
    ref_per_b = None
    per_b = {}
    for name, j in runs:
        m = j["model"]
        mt = m["model_type"]
        fam = FAMILY.get(mt, mt)
        vh = vocab_hidden(m["config"]) or vocab_hidden(m["config"].replace("/tmp/minimax_text_01_8l.json",
                                                                          "bench/gpu/minimax_text_01.json"))
        V, H, tied = vh
        body = m["parameters_active_per_token"] - V * H * (1 if tied else 2)
        dec = {str(b["batch"]): {"ms": b["ms"], "greedy_ms": b["greedy_ms"]} for b in j.get("decode", {}).get("batches", [])}
        sp = j.get("splice", {})
        model = {"file": name, "family": fam, "model_type": mt, "config": m["config"], "layers": m["layers"],
                 "layer_pattern": m["layer_pattern"], "parameters_total": m["parameters_total"],
                 "parameters_active_per_token": m["parameters_active_per_token"], "active_body": body,
                 "git_commit": j.get("git_commit"), "utc": j.get("utc"),
                 "splice_hypic_ms": sp.get("hypic_ttft_ms"), "splice_full_ms": sp.get("full_ms"),
                 "build_ms": j.get("build", {}).get("with_tc_ms"), "decode": dec,
                 "decode_error": j.get("decode", {}).get("error")}
        out["models"].append(model)
        h = hf.get(name.replace("_h200.json", ""))
        if h:
            model["hf"] = {"transformers": h.get("transformers"), "torch": h.get("torch"), "fla": h.get("fla", {}).get("version"),
                           "layers_timed": h.get("layers_timed"), "layers_full": h.get("layers_full"),
                           "scaling": h.get("scaling"), "implementations": h.get("implementations"), "utc": h.get("utc")}
        hf_ms = {e["tokens"]: e.get("hf_ms") for e in (h or {}).get("lengths", [])}
        for r in j.get("rows", []):
            row = {"family": fam, "model": name.replace("_h200.json", ""), "tokens": r["tokens"],
                   "ours_ms": r["ours_ms"], "hf_ms": hf_ms.get(r["tokens"]), "tokens_per_s": r["tokens_per_s"],
                   "splice_hypic_ms": sp.get("hypic_ttft_ms"), "splice_full_ms": sp.get("full_ms"),
                   "decode_b1_ms": dec.get("1", {}).get("ms"), "decode_b64_ms": dec.get("64", {}).get("ms")}
            out["rows"].append(row)
            if r["tokens"] == 32768:
                per_b[fam] = r["ours_ms"] / (body / 1e9)
                if mt.startswith("qwen"):
                    ref_per_b = per_b[fam]
    for fam, v in per_b.items():
        if ref_per_b is None or fam.startswith("qwen"):
            continue
        ratio = v / ref_per_b
        out["targets"].append({"target": f"{fam}: 32k prefill per active body parameter within 1.5x of Qwen3.5-35B-A3B's",
                               "ms_per_active_B": v, "qwen_ms_per_active_B": ref_per_b, "ratio": ratio,
                               "met": ratio <= 1.5})
    md = ["# Hybrid families on the CUDA backend, one H200 (benchmark-only random weights)", ""]
    md.append("Each model at its real layer dimensions, bf16 weights made on the device, measured by "
              "`hypic-bench-prefill-gpu --config CONFIG --skip parts,notc,beside --quick --refresh \"\" "
              "--refresh-tail \"\" --decode-batches ...` in one session (median of 2 runs after 1 warm-up); Hugging "
              "Face by `tools/hf_prefill_bench.py --config CONFIG --layers 8 --quick --no-profile --lengths 4096,32768 "
              "--fla-path FLA` (hf_*.json beside). MiniMax-Text-01: its first 8 of 80 layers (what one H200 holds), "
              "both sides.")
    md.append("")
    md.append("| model | family | layers | active / total params | 4k ms | 16k ms | 32k ms | 32k tokens/s | build 16x2k ms | "
              "warm 16x2k splice ms | full of the same prompt ms | decode b1 ms | decode b64 ms |")
    md.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mod in out["models"]:
        rows = {r["tokens"]: r for r in out["rows"] if r["model"] == mod["file"].replace("_h200.json", "")}
        def ms(t):
            return f'{rows[t]["ours_ms"]:.1f}' if t in rows else "n/a"
        d1 = mod["decode"].get("1", {}).get("ms")
        d64 = mod["decode"].get("64", {}).get("ms")
        dn = "" if d64 is not None else (" (b2 %.2f)" % mod["decode"]["2"]["ms"] if "2" in mod["decode"] else "")
        md.append(f'| {mod["file"].replace("_h200.json", "")} | {mod["family"]} | {mod["layers"]} ({mod["layer_pattern"]}) | '
                  f'{mod["parameters_active_per_token"] / 1e9:.2f}B / {mod["parameters_total"] / 1e9:.1f}B | '
                  f'{ms(4096)} | {ms(16384)} | {ms(32768)} | '
                  f'{rows[32768]["tokens_per_s"]:.0f} | {mod["build_ms"]:.1f} | {mod["splice_hypic_ms"]:.1f} | '
                  f'{mod["splice_full_ms"]:.1f} | {d1:.2f} | '
                  f'{"%.2f" % d64 if d64 is not None else "n/a" + dn} |')
    md.append("")
    md.append("## Next to Hugging Face transformers + flash-linear-attention (same H200, same session day)")
    md.append("")
    md.append("| model | tokens | ours ms | HF ms | HF / ours |")
    md.append("|---|---|---|---|---|")
    for r in out["rows"]:
        if r["hf_ms"]:
            md.append(f'| {r["model"]} | {r["tokens"]} | {r["ours_ms"]:.1f} | {r["hf_ms"]:.1f} | {r["hf_ms"] / r["ours_ms"]:.2f}x |')
    for mod in out["models"]:
        if "hf" in mod:
            x = mod["hf"]
            md.append(f'\n{mod["file"].replace("_h200.json", "")}: transformers {x["transformers"]}, torch {x["torch"]}, fla '
                      f'{x["fla"]} (a checkout put on the path), {x["layers_timed"]} of {x["layers_full"]} layers timed '
                      f'({x["scaling"]}); experts {x["implementations"].get("experts")}, attention '
                      f'{x["implementations"].get("attention")}, causal conv: {x["implementations"].get("conv1d")}.')
    md.append("")
    if out["decode_runs"]:
        md.append("## Decode at shorter contexts")
        md.append("")
        md.append("The same batch sizes at contexts of 4 segments x 512 tokens + the query (`--segments 4 "
                  "--segment-tokens 512`), where the weights rather than the KV dominate each step. (Kimi-Linear's KV "
                  "cache holds MLA's latent, 576 values per token and layer: 8 KB per token over its 7 MLA layers, so "
                  "64 contexts of 32k take 16.9 GB; expanded per head at the attention's padded head size it was "
                  "229 KB per token and did not fit one H200.)")
        md.append("")
        md.append("| run | batch | context tokens | ms per step | greedy ms |")
        md.append("|---|---|---|---|---|")
        for d in out["decode_runs"]:
            md.append(f'| {d["file"].replace("_h200.json", "")} | {d["batch"]} | {d["context_tokens"]:.0f} | '
                      f'{d["ms"]:.2f} | {d["greedy_ms"]:.2f} |')
        md.append("")
    md.append("## Targets (issue 29)")
    md.append("")
    for t in out["targets"]:
        md.append(f'- {t["target"]}: {t["ms_per_active_B"]:.1f} vs {t["qwen_ms_per_active_B"]:.1f} ms per billion '
                  f'active body parameters, ratio {t["ratio"]:.2f} -> {"met" if t["met"] else "MISSED"}')
    for r in out["rows"]:
        if r["hf_ms"]:
            out["targets"].append({"target": f'{r["family"]}: ahead of transformers + fla at {r["tokens"]} tokens',
                                   "ours_ms": r["ours_ms"], "hf_ms": r["hf_ms"], "met": r["ours_ms"] < r["hf_ms"]})
            md.append(f'- {r["family"]} ahead of transformers + fla at {r["tokens"]} tokens: {r["ours_ms"]:.1f} vs '
                      f'{r["hf_ms"]:.1f} ms -> {"met" if r["ours_ms"] < r["hf_ms"] else "MISSED"}')
    md.append("- " + HF_NOTE)
    md.append("")
    md.append("Sources: " + ", ".join(f'{m["file"]} (commit {str(m["git_commit"])[:7]}, {m["utc"]})' for m in out["models"]))
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
