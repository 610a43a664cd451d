#!/usr/bin/env python3
"""Side-by-side encode throughput: hypic-bench-tokenizer vs Hugging Face `tokenizers`, single-threaded.

    bench_tokenizer_hf.py --tokenizer tokenizer.json --ours build/bin/hypic-bench-tokenizer \
        --text docs.txt [--text code.txt ...] [--passes 5] [--chunk-bytes 65536] [--out-dir DIR]

Runs our binary first (it cuts every file into segments and reports the boundaries), then times
`tokenizers.Tokenizer.encode(segment, add_special_tokens=False)` on exactly the same segments with
the same protocol: per file a freshly loaded tokenizer (empty BPE cache) for pass 1 ("cold"), then
passes 2..N on it ("warm", best kept). HF is pinned to one thread (RAYON_NUM_THREADS=1,
TOKENIZERS_PARALLELISM=false; a single encode() call does not use rayon anyway). It also compares
every id of pass 1 with ours and reports the first mismatch per file.

Prints a table on stderr and one JSON object on stdout; with --out-dir also writes ours.json,
hf.json (with the per-file results), ours_ids.bin and hf_ids.bin (int32 little-endian).
"""
import os

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import array  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402


def run_ours(args, out_dir):
    ours_json = os.path.join(out_dir, "ours.json")
    ours_ids = os.path.join(out_dir, "ours_ids.bin")
    cmd = [args.ours, "--tokenizer", args.tokenizer, "--passes", str(args.passes), "--chunk-bytes",
           str(args.chunk_bytes), "--json", ours_json, "--ids-out", ours_ids]
    for t in args.text:
        cmd += ["--text", t]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(ours_json, encoding="utf-8") as f:
        ours = json.load(f)
    ids = array.array("i")
    with open(ours_ids, "rb") as f:
        ids.frombytes(f.read())
    if sys.byteorder != "little":
        ids.byteswap()
    return ours, ids


def run_hf(args, ours):
    import tokenizers
    from tokenizers import Tokenizer

    files = []
    all_ids = array.array("i")
    for entry in ours["files"]:
        with open(entry["file"], "rb") as f:
            data = f.read()
        segs = [data[b:e].decode("utf-8") for b, e in entry["segment_bounds"]]
        t0 = time.perf_counter()
        tok = Tokenizer.from_file(args.tokenizer)
        load_s = time.perf_counter() - t0
        times = []
        ids = []
        for p in range(args.passes):
            out = []
            t0 = time.perf_counter()
            for s in segs:
                out.append(tok.encode(s, add_special_tokens=False).ids)
            times.append(time.perf_counter() - t0)
            if p == 0:
                ids = [i for seg in out for i in seg]
        mb = len(data) / 1e6
        cold, warm = times[0], min(times[1:])
        files.append({"file": entry["file"], "bytes": len(data), "segments": len(segs), "tokens": len(ids),
                      "load_seconds": load_s, "cold_seconds": cold, "warm_seconds": warm, "all_seconds": times,
                      "cold_mb_per_s": mb / cold, "warm_mb_per_s": mb / warm,
                      "cold_tokens_per_s": len(ids) / cold, "warm_tokens_per_s": len(ids) / warm})
        all_ids.extend(ids)
    return {"tool": "tokenizers", "tokenizers_version": tokenizers.__version__, "files": files}, all_ids


def compare_ids(ours, hf, ours_ids, hf_ids):
    """Per file: equal or the first differing index with both id windows."""
    out = []
    o = h = 0
    for fo, fh in zip(ours["files"], hf["files"]):
        a = ours_ids[o:o + fo["tokens"]]
        b = hf_ids[h:h + fh["tokens"]]
        o += fo["tokens"]
        h += fh["tokens"]
        if a == b:
            out.append({"file": fo["file"], "equal": True, "tokens": len(a)})
            continue
        k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        out.append({"file": fo["file"], "equal": False, "ours_tokens": len(a), "hf_tokens": len(b),
                    "first_diff": k, "ours": list(a[max(0, k - 5):k + 10]), "hf": list(b[max(0, k - 5):k + 10])})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--ours", required=True, help="path to hypic-bench-tokenizer")
    ap.add_argument("--text", action="append", required=True)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--chunk-bytes", type=int, default=65536)
    ap.add_argument("--out-dir")
    args = ap.parse_args()
    if args.passes < 2:
        ap.error("--passes must be at least 2 (one cold, at least one warm)")

    out_dir = args.out_dir or tempfile.mkdtemp(prefix="tokbench")
    os.makedirs(out_dir, exist_ok=True)
    ours, ours_ids = run_ours(args, out_dir)
    hf, hf_ids = run_hf(args, ours)
    if args.out_dir:
        with open(os.path.join(out_dir, "hf.json"), "w", encoding="utf-8") as f:
            json.dump(hf, f, indent=1)
        with open(os.path.join(out_dir, "hf_ids.bin"), "wb") as f:
            ids = array.array("i", hf_ids)
            if sys.byteorder != "little":
                ids.byteswap()
            f.write(ids.tobytes())
    cmp = compare_ids(ours, hf, ours_ids, hf_ids)

    rows = []
    hdr = "%-12s %9s %9s | %8s %8s %6s | %8s %8s %6s | %5s" % (
        "file", "bytes", "tokens", "ours cold", "HF cold", "ratio", "ours warm", "HF warm", "ratio", "ids")
    print(hdr, file=sys.stderr)
    print("%-12s %9s %9s | %26s | %26s |" % ("", "", "", "MB/s", "MB/s"), file=sys.stderr)
    tot = {"bytes": 0, "ours_cold": 0.0, "hf_cold": 0.0, "ours_warm": 0.0, "hf_warm": 0.0}
    for fo, fh, c in zip(ours["files"], hf["files"], cmp):
        name = os.path.basename(fo["file"])
        r_cold = fo["cold_mb_per_s"] / fh["cold_mb_per_s"]
        r_warm = fo["warm_mb_per_s"] / fh["warm_mb_per_s"]
        print("%-12s %9d %9d | %8.2f %8.2f %5.2fx | %8.2f %8.2f %5.2fx | %5s" % (
            name, fo["bytes"], fo["tokens"], fo["cold_mb_per_s"], fh["cold_mb_per_s"], r_cold,
            fo["warm_mb_per_s"], fh["warm_mb_per_s"], r_warm, "same" if c["equal"] else "DIFF"), file=sys.stderr)
        rows.append({"file": fo["file"], "bytes": fo["bytes"], "tokens_ours": fo["tokens"], "tokens_hf": fh["tokens"],
                     "ours_cold_mb_per_s": fo["cold_mb_per_s"], "hf_cold_mb_per_s": fh["cold_mb_per_s"],
                     "ours_warm_mb_per_s": fo["warm_mb_per_s"], "hf_warm_mb_per_s": fh["warm_mb_per_s"],
                     "ours_warm_tokens_per_s": fo["warm_tokens_per_s"], "hf_warm_tokens_per_s": fh["warm_tokens_per_s"],
                     "ratio_cold": r_cold, "ratio_warm": r_warm, "ids_equal": c["equal"]})
        tot["bytes"] += fo["bytes"]
        tot["ours_cold"] += fo["cold_seconds"]
        tot["hf_cold"] += fh["cold_seconds"]
        tot["ours_warm"] += fo["warm_seconds"]
        tot["hf_warm"] += fh["warm_seconds"]
    total = {"bytes": tot["bytes"],
             "ours_cold_mb_per_s": tot["bytes"] / 1e6 / tot["ours_cold"], "hf_cold_mb_per_s": tot["bytes"] / 1e6 / tot["hf_cold"],
             "ours_warm_mb_per_s": tot["bytes"] / 1e6 / tot["ours_warm"], "hf_warm_mb_per_s": tot["bytes"] / 1e6 / tot["hf_warm"]}
    total["ratio_cold"] = total["ours_cold_mb_per_s"] / total["hf_cold_mb_per_s"]
    total["ratio_warm"] = total["ours_warm_mb_per_s"] / total["hf_warm_mb_per_s"]
    print("%-12s %9d %9s | %8.2f %8.2f %5.2fx | %8.2f %8.2f %5.2fx |" % (
        "all", tot["bytes"], "", total["ours_cold_mb_per_s"], total["hf_cold_mb_per_s"], total["ratio_cold"],
        total["ours_warm_mb_per_s"], total["hf_warm_mb_per_s"], total["ratio_warm"]), file=sys.stderr)
    for c in cmp:
        if not c["equal"]:
            print("ids differ in %s: %s" % (c["file"], json.dumps(c)), file=sys.stderr)
    print(json.dumps({"tokenizers_version": hf["tokenizers_version"], "passes": args.passes,
                      "chunk_bytes": args.chunk_bytes, "files": rows, "total": total, "id_comparison": cmp}))


if __name__ == "__main__":
    main()
