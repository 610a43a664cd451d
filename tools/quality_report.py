#!/usr/bin/env python3
"""Merges `hypic-eval --dataset --json-out` shards into the answer-quality results (issue 12):
OUT.json (per model and mode: accuracy, accuracy per kind, points against full, flips, KL on the answer, answer
top-1, tokens computed, per-layer state error), OUT.md (the tables) and OUT.png (accuracy against the seam width w,
drawn with gnuplot, Debian package gnuplot-nox).

    tools/quality_report.py --out bench/results/quality \\
        --model next-moe=shards/next-moe-0.json,shards/next-moe-1.json --model qwen35-dense=shards/q-*.json \\
        [--commit SHA] [--note TEXT]

Each --model NAME=FILES takes a comma-separated list of shard files (globs allowed) of one model on one dataset;
the shards must not overlap (a prompt index twice is an error) and must agree on the dataset, the modes and the
settings that change results. Summaries are recomputed here from the per-prompt rows, so they cover exactly the
merged prompts. Python 3 standard library only; exit status 1 with a message on bad input or a gnuplot failure.
"""
from __future__ import annotations

import argparse
import glob
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS_THAT_MATTER = ("dataset", "seam_widths", "max_new_tokens", "modes", "model", "tokenizer")


def fail(msg: str) -> None:
    print(f"quality_report.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


def load_model(name: str, spec: str) -> dict:
    files = []
    for part in spec.split(","):
        hits = sorted(glob.glob(part))
        if not hits:
            fail(f"--model {name}: no file matches {part!r}")
        files += hits
    rows, first = {}, None
    for f in files:
        try:
            d = json.loads(Path(f).read_text())
        except (OSError, json.JSONDecodeError) as e:
            fail(f"--model {name}: cannot read {f}: {e}")
        for key in ("modes", "prompts", "settings"):
            if key not in d:
                fail(f"--model {name}: {f} is not a hypic-eval --dataset report (no '{key}')")
        if first is None:
            first = d
        else:
            for k in SETTINGS_THAT_MATTER:
                if d["settings"].get(k) != first["settings"].get(k):
                    fail(f"--model {name}: {f} differs from {files[0]} in settings.{k}: "
                         f"{d['settings'].get(k)!r} vs {first['settings'].get(k)!r}")
            if d["modes"] != first["modes"]:
                la, lb = (x["settings"].get("local_position_ablations") for x in (first, d))
                why = f" (local_position_ablations {lb} vs {la})" if la != lb else ""
                fail(f"--model {name}: {f} evaluated other modes than {files[0]}{why}: "
                     f"{d['modes']} vs {first['modes']}")
        for p in d["prompts"]:
            if p["index"] in rows:
                fail(f"--model {name}: prompt {p['index']} appears twice (overlapping shards; the second in {f})")
            rows[p["index"]] = p
    return {"files": files, "report": first, "prompts": [rows[i] for i in sorted(rows)]}


def summarize(modes: list[str], prompts: list[dict]) -> dict:
    out = {}
    n = len(prompts)
    for m in modes:
        right = [bool(p["modes"][m]["exact_match"]) for p in prompts]
        full_right = [bool(p["modes"]["full"]["exact_match"]) for p in prompts]
        kinds: dict[str, list[bool]] = {}
        for p, r in zip(prompts, right):
            kinds.setdefault(p["kind"], []).append(r)
        errs = [p["modes"][m]["state_rel_err"] for p in prompts]
        layers = len(errs[0]) if errs else 0
        out[m] = {
            "accuracy": sum(right) / n,
            "accuracy_by_kind": {k: sum(v) / len(v) for k, v in sorted(kinds.items())},
            "prompts_by_kind": {k: len(v) for k, v in sorted(kinds.items())},
            "points_vs_full": 100.0 * (sum(right) - sum(full_right)) / n,
            "flips_right_to_wrong": sum(f and not r for f, r in zip(full_right, right)),
            "flips_wrong_to_right": sum(r and not f for f, r in zip(full_right, right)),
            "mean_kl": sum(p["modes"][m]["answer_kl"] for p in prompts) / n,
            "mean_answer_top1": sum(p["modes"][m]["answer_top1"] for p in prompts) / n,
            "mean_computed_tokens": sum(p["modes"][m]["computed_tokens"] for p in prompts) / n,
            "mean_prompt_tokens": sum(p["modes"][m]["prompt_tokens"] for p in prompts) / n,
            "mean_state_rel_err": [sum(e[l] for e in errs) / n for l in range(layers)],
            "seconds": sum(p["modes"][m]["seconds"] for p in prompts),
        }
    return out


def seam_width(mode: str) -> int | None:
    m = re.fullmatch(r"hypic_w(\d+)", mode)
    return int(m.group(1)) if m else None


def markdown(res: dict) -> str:
    lines = [f"# Answer quality of the splice modes against full recomputation",
             "",
             f"Measured {res['date_utc']} UTC" + (f" at commit {res['commit']}" if res.get("commit") else "") +
             f" with `hypic-eval --dataset` (CPU engine, fp32) and `tools/quality_report.py`.", ""]
    if res.get("note"):
        lines += [res["note"], ""]
    lines += ["Modes (DESIGN.md 3.4): `full` recomputes the whole prompt (the reference); `prefix` reuses a warm chain "
              "of whole segments from the start (warmed in another document order); `naive` adds the segments' "
              "zero-start states, S <- S + S(C|0), no T_C, no seam; `transition` composes them exactly, "
              "S <- T_C S + S(C|0), no seam (the same splice as `hypic_w0`); `hypic_w<w>` composes and recomputes a "
              "seam window of w tokens at each boundary." +
              (" Evaluation ablations: `naive_local` and `transition_local` are naive and transition with every "
               "segment's cached K left at its local positions (no RoPE fix), as the reference implementation's "
               "`addition` and `transition` modes are taken to splice; `naive_local` stands for the paper's Naive "
               "Addition baseline." if any("naive_local" in m["modes"] or "transition_local" in m["modes"]
                                            for m in res["models"].values()) else "") +
              (" `hypic_w<w>_r<k>` is hypic_w<w> with the query-aware refresh (SpliceRequest::refresh_segments): the "
               "k later segments that the query's last token attends to most are recomputed whole in context, after "
               "a first splice that measures that attention (tokens computed count both passes)."
               if any(re.fullmatch(r"hypic_w\d+_r\d+", k) for m in res["models"].values() for k in m["modes"])
               else "") +
              (" `hypic_w<w>_t<t>` recomputes the last t segments whole in context (SpliceRequest::refresh_tail; no "
               "probe), and `hypic_w<w>_r<k>_t<t>` does both: the tail first, then the k segments the probe ranks "
               "highest among the others."
               if any(re.fullmatch(r"hypic_w\d+(_r\d+)?_t\d+", k) for m in res["models"].values() for k in m["modes"])
               else ""), ""]
    for name, m in res["models"].items():
        s = m["settings"]
        lines += [f"## {name}", "",
                  f"Checkpoint `{s.get('model')}`, dataset `{s.get('dataset')}`: {m['prompts']} prompts, "
                  f"{m['mean_prompt_tokens']:.0f} prompt tokens on average; greedy, at most {s.get('max_new_tokens')}"
                  f" new tokens; exact match of the answer text.", ""]
        if m.get("random_weights"):
            lines += ["**RANDOM WEIGHTS: these figures say nothing about answer quality.**", ""]
        kinds = sorted(next(iter(m["modes"].values()))["accuracy_by_kind"])
        lines.append("| mode | accuracy | points vs full | " + " | ".join(kinds) +
                     " | flips (right->wrong / wrong->right) | KL on answer | answer top-1 | tokens computed | "
                     "max state err |")
        lines.append("|---" * (8 + len(kinds)) + "|")
        for mode, r in m["modes"].items():
            lines.append(
                f"| {mode} | {r['accuracy']:.3f} | {r['points_vs_full']:+.1f} | " +
                " | ".join(f"{r['accuracy_by_kind'][k]:.3f}" for k in kinds) +
                f" | {r['flips_right_to_wrong']} / {r['flips_wrong_to_right']} | {r['mean_kl']:.2e} | "
                f"{r['mean_answer_top1']:.3f} | {r['mean_computed_tokens']:.0f} | "
                f"{max(r['mean_state_rel_err'] or [0]):.2e} |")
        lines.append("")
    lines += ["Commands:", ""] + [f"    {c}" for c in res["commands"]] + [""]
    return "\n".join(lines)


def plot(res: dict, png: Path) -> None:
    gp = shutil.which("gnuplot")
    if not gp:
        fail("gnuplot not found (apt install gnuplot-nox)")
    with tempfile.TemporaryDirectory() as tmp:
        cmds = ["set terminal pngcairo size 900,520 font ',11'" if subprocess.run(
                    [gp, "-e", "set terminal pngcairo"], capture_output=True).returncode == 0
                else "set terminal png size 900,520",
                "set termoption noenhanced",   # mode names hold underscores, not subscripts
                f"set output '{png}'", "set title 'Answer accuracy against the seam width w (hypic mode)'",
                "set xlabel 'seam width w (tokens)'", "set ylabel 'exact-match accuracy'", "set key outside right",
                "set yrange [0:1.05]", "set grid", "set logscale x 2", "set xrange [0.4:48]",
                "set xtics ('0' 0.5, '1' 1, '2' 2, '4' 4, '8' 8, '16' 16, '32' 32)"]
        series = []
        for i, (name, m) in enumerate(res["models"].items()):
            pts = sorted((seam_width(k), v["accuracy"]) for k, v in m["modes"].items() if seam_width(k) is not None)
            f = Path(tmp) / f"m{i}.dat"
            # w = 0 drawn at 0.5 on the log axis
            f.write_text("".join(f"{max(w, 0.5)} {a}\n" for w, a in pts))
            series.append(f"'{f}' using 1:2 with linespoints lw 2 pt 7 lc {i + 1} title '{name}: hypic'")
            for mode, dt in (("full", 2), ("naive", 3), ("naive_local", 4)):
                if mode in m["modes"]:
                    series.append(f"{m['modes'][mode]['accuracy']} with lines dt {dt} lc {i + 1} "
                                  f"title '{name}: {mode}'")
        cmds.append("plot " + ", ".join(series))
        r = subprocess.run([gp], input="\n".join(cmds), text=True, capture_output=True)
        if r.returncode != 0:
            fail(f"gnuplot failed: {r.stderr.strip()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output path without extension (writes .json, .md, .png)")
    ap.add_argument("--model", action="append", required=True, help="NAME=FILE[,FILE...] (globs allowed)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--note", default="")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    res = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": args.commit, "note": args.note,
           "models": {}, "commands": []}
    for spec in args.model:
        if "=" not in spec:
            fail(f"--model {spec!r}: want NAME=FILES")
        name, files = spec.split("=", 1)
        m = load_model(name, files)
        rep = m["report"]
        modes = rep["modes"]
        if "full" not in modes:
            fail(f"--model {name}: no full mode in the reports")
        summary = summarize(modes, m["prompts"])
        res["models"][name] = {
            "settings": rep["settings"], "files": m["files"], "prompts": len(m["prompts"]),
            "dataset_prompts": rep.get("dataset_prompts"), "random_weights": bool(rep.get("random_weights")),
            "mean_prompt_tokens": sum(p["prompt_tokens"] for p in m["prompts"]) / len(m["prompts"]),
            "modes": summary,
        }
        res["commands"] += sorted({json.loads(Path(f).read_text())["settings"]["command"] for f in m["files"]})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    if not args.no_plot:
        plot(res, out.with_suffix(".png"))
    for name, m in res["models"].items():
        print(f"{name}: " + ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in m["modes"].items()))


if __name__ == "__main__":
    main()
