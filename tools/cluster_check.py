#!/usr/bin/env python3
"""Drives a running hypic cluster through hypic-client: for every mode (hypic, transition, naive, prefix, full),
a multi-document request cold (documents never seen), then warm (the same request again), then reordered (the
documents in another order), and prints a table and a JSON summary with each run's TTFT, hits, devices and tokens.

    python3 tools/cluster_check.py --client BIN/hypic-client --router HOST:PORT [--out FILE.json] [--docs N]
                                   [--words W] [--max-tokens T]

Run it under deploy/local_cluster.py (which puts the router address in {router}), e.g. on a GPU host:
    python3 deploy/local_cluster.py --bin-dir BIN --model MODEL --tokenizer TOKENIZER --device cuda -- \\
        python3 tools/cluster_check.py --client BIN/hypic-client --router {router} --out OUT/cluster.json

Checks (exit status 1 when one fails, each printed): every request succeeds; in the modes that splice cached
entries (hypic, transition, naive) a warm request returns exactly the tokens of its cold run (a hit and a miss give
the same numbers, DESIGN.md 3.3); a warm request reuses every document (cache or worker memory) and a cold one none;
a reordered request in those modes reuses every document too; prefix mode's warm run reuses every document.
"""
import argparse
import json
import random
import subprocess
import sys

MODES = ["hypic", "transition", "naive", "prefix", "full"]
WORDS = ("river mountain copper lantern orchard harbor violet meadow falcon granite ember willow quartz canyon "
         "saffron tundra beacon cobalt prairie lagoon").split()


def make_doc(rng, tag, n_words):
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return f"Document {tag}. The key of {tag} is {rng.randint(1000, 9999)}. " + " ".join(words) + "."


def run(client, router, segments, query, mode, max_tokens):
    spec = {"segments": [{"text": s} for s in segments], "query": query}
    with open("/tmp/cluster_check_request.json", "w") as f:
        json.dump(spec, f)
    cmd = [client, "generate", "--router", router, "--segments-json", "/tmp/cluster_check_request.json",
           "--mode", mode, "--max-tokens", str(max_tokens), "--json", "--ignore-eos"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip()[-2000:]}
    return json.loads(p.stdout)


def reused(report):
    """Segments the report says were reused: a cache or worker-memory hit, a shared build or a repeat, or restored
    from a prefix checkpoint (the report's `reused`)."""
    return sum(1 for s in report.get("segments", []) if s.get("reused"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client", required=True)
    ap.add_argument("--router", required=True)
    ap.add_argument("--out")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    rng = random.Random(1234)
    rows, failures = [], []
    for mode in MODES:
        docs = [make_doc(rng, f"{mode}-{i}", args.words) for i in range(args.docs)]
        query = f"Which document mentions {rng.choice(WORDS)} first, and what is its key?"
        order = list(range(args.docs))
        rng.shuffle(order)
        runs = {}
        for phase, segs in (("cold", docs), ("warm", docs), ("reordered", [docs[i] for i in order])):
            out = run(args.client, args.router, segs, query, mode, args.max_tokens)
            runs[phase] = out
            if "error" in out:
                failures.append(f"{mode} {phase}: {out['error']}")
                rows.append({"mode": mode, "phase": phase, "error": out["error"]})
                continue
            rep = out.get("report", {})
            row = {"mode": mode, "phase": phase, "ttft_ms": rep.get("ttft", {}).get("total_ms"), "reused": reused(rep),
                   "segments": len(rep.get("segments", [])), "tokens": out.get("token_ids"),
                   "devices": sorted({s.get("device") or "-" for s in rep.get("segments", [])}),
                   "combine_device": rep.get("combine_device") or rep.get("device"), "report": rep}
            rows.append(row)
        ok = all("error" not in runs[p] for p in runs)
        if ok and mode in ("hypic", "transition", "naive"):
            if runs["cold"]["token_ids"] != runs["warm"]["token_ids"]:
                failures.append(f"{mode}: warm tokens differ from the cold run's (hit vs miss)")
        if ok:
            cold_r = reused(runs["cold"]["report"])
            warm_r = reused(runs["warm"]["report"])
            if mode != "full" and cold_r != 0:
                failures.append(f"{mode}: the cold run reused {cold_r} documents")
            if mode != "full" and warm_r != args.docs:
                failures.append(f"{mode}: the warm run reused {warm_r} of {args.docs} documents")
            if mode in ("hypic", "transition", "naive") and reused(runs["reordered"]["report"]) != args.docs:
                failures.append(f"{mode}: the reordered run reused {reused(runs['reordered']['report'])} of "
                                f"{args.docs} documents")
    print(f"{'mode':<11} {'phase':<10} {'TTFT ms':>9} {'reused':>7}  devices / combine   first tokens")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<11} {r['phase']:<10} ERROR {r['error'][:200]}")
            continue
        ttft = r["ttft_ms"]
        ttft_s = f"{ttft:9.1f}" if isinstance(ttft, (int, float)) else f"{str(ttft):>9}"
        print(f"{r['mode']:<11} {r['phase']:<10} {ttft_s} {r['reused']:>3}/{r['segments']:<3}  "
              f"{','.join(r['devices'])} / {r['combine_device']}   {r['tokens'][:8]}")
    for f in failures:
        print("FAILED:", f)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
