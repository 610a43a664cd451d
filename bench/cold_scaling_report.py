#!/usr/bin/env python3
"""Writes bench/results/cold_scaling_<host>.{json,md} from the hypic-bench-cluster runs of bench/run_cold_scaling.sh.

Inputs: the scaling scenario with entries over NCCL where possible (--equal-nccl: the scatter workers'
--entry-transport auto) and over gRPC (--equal-grpc), and the schedule scenario (--variable: LPT and round-robin).
Output JSON: `rows`, one per worker count and transport, each with `workers`, `transport`, `ttft_ms` (the mean
client-side TTFT), its p50/p90, `speedup` (the 1-worker row's TTFT over this one's, same transport), `efficiency`
(speedup / workers), the entries' transfer per segment and how much of it compute hid, and the segments by the
transport they actually took; `variable`, the LPT and round-robin rows; `summary`, the issue's targets against the
measurements (speedup at the most workers >= 0.85 x workers; LPT >= 1.5x ahead of round-robin).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def scaling_rows(run: dict, transport: str) -> list[dict]:
    rows = run["scenarios"]["scaling"]["rows"]
    out = []
    for r in rows:
        if r["errors"]:
            raise SystemExit(f"cold_scaling_report: row {r['name']} ({transport}) had {r['errors']} errors: "
                             f"{r['error_examples']}")
        d = r.get("delivery", {})
        out.append({
            "workers": int(r["scatter_workers"]),
            "transport": transport,
            "requests": r["requests"],
            "prompt_tokens": r["prompt_tokens_mean"],
            "ttft_ms": r["ttft_ms"]["mean"],
            "ttft_ms_p50": r["ttft_ms"]["p50"],
            "ttft_ms_p90": r["ttft_ms"]["p90"],
            "server_ttft_ms": r["server_ttft_ms_mean"],
            "segments_by_transport": d.get("segments_by_transport", {}),
            "transfer_ms_per_segment": d.get("transfer_ms_per_segment", 0.0),
            "transfer_bytes_per_segment": d.get("transfer_bytes_per_segment", 0.0),
            "transfer_ms_exposed_per_request": d.get("transfer_ms_exposed_per_request", 0.0),
            "transfer_ms_hidden_per_request": d.get("transfer_ms_hidden_per_request", 0.0),
        })
    base = {r["transport"]: r["ttft_ms"] for r in out if r["workers"] == 1}
    for r in out:
        b = base.get(r["transport"])
        r["speedup"] = b / r["ttft_ms"] if b and r["ttft_ms"] > 0 else None
        r["efficiency"] = r["speedup"] / r["workers"] if r["speedup"] else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--equal-nccl", required=True)
    p.add_argument("--equal-grpc", required=True)
    p.add_argument("--variable", required=True)
    p.add_argument("--devices", required=True, help="the --device list the clusters ran with")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", required=True, help="output stem")
    a = p.parse_args()
    nccl, grpc, var = load(a.equal_nccl), load(a.equal_grpc), load(a.variable)
    rows = scaling_rows(nccl, "auto") + scaling_rows(grpc, "grpc")
    sched = var["scenarios"]["schedule"]
    variable = [{"policy": r["policy"], "workers": int(sched["scatter_workers"]), "ttft_ms": r["ttft_ms"]["mean"],
                 "ttft_ms_p50": r["ttft_ms"]["p50"], "max_worker_tokens": r["max_worker_tokens"]["mean"],
                 "errors": r["errors"]} for r in sched["rows"]]
    by_policy = {v["policy"]: v["ttft_ms"] for v in variable}
    lpt_gain = by_policy["round-robin"] / by_policy["lpt"] if by_policy.get("lpt") else None
    auto_rows = [r for r in rows if r["transport"] == "auto"]
    top = max(auto_rows, key=lambda r: r["workers"])
    summary = {
        "max_workers": top["workers"],
        "speedup_at_max_workers": top["speedup"],
        "speedup_target": 0.85 * top["workers"],
        "speedup_target_met": bool(top["speedup"] and top["speedup"] >= 0.85 * top["workers"]),
        "lpt_over_round_robin": lpt_gain,
        "lpt_target": 1.5,
        "lpt_target_met": bool(lpt_gain and lpt_gain >= 1.5),
    }
    out = {
        "benchmark": "cold_scaling",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": a.commit,
        "devices": a.devices,
        "model": nccl.get("model"),
        "host": nccl.get("host"),
        "equal_workload": {k: v for k, v in nccl["scenarios"]["scaling"].items() if k != "rows"},
        "variable_workload": {k: v for k, v in sched.items() if k != "rows"},
        "rows": rows,
        "variable": variable,
        "summary": summary,
        "notes": ["ttft_ms: client-side time to first token, mean over the row's requests (every segment cold).",
                  "transfer_ms_per_segment: combine-side, from an entry's header to its acceptance; hidden: the "
                  "summed transfers of a request minus its exposed transfer phase (after the last compute).",
                  "transport 'auto': the scatter workers' --entry-transport auto (NCCL where both ends can); "
                  "segments_by_transport says which each took (a scatter worker on the combine worker's GPU uses "
                  "gRPC)."]
                 + nccl.get("notes", []),
    }
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    lines = [f"# Cold-path scaling across GPUs ({out['date_utc']}, commit {a.commit})", "",
             f"Devices: {a.devices}. Workload: {out['equal_workload']}.", "",
             "| workers | transport | TTFT ms (mean) | p50 | speedup | efficiency | transfer ms / segment | "
             "hidden ms / request | exposed ms / request | segments by transport |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    def ratio(x: float | None, unit: str = "") -> str:
        return "-" if x is None else f"{x:.2f}{unit}"

    for r in rows:
        lines.append(f"| {r['workers']} | {r['transport']} | {ms(r['ttft_ms'])} | {ms(r['ttft_ms_p50'])} | "
                     f"{ratio(r['speedup'], 'x')} | {ratio(r['efficiency'])} | "
                     f"{ms(r['transfer_ms_per_segment'])} | {ms(r['transfer_ms_hidden_per_request'])} | "
                     f"{ms(r['transfer_ms_exposed_per_request'])} | {json.dumps(r['segments_by_transport'])} |")
    lines += ["", f"Variable-length segments ({out['variable_workload'].get('pattern', '')}):", "",
              "| policy | workers | TTFT ms (mean) | p50 | max tokens on one worker |", "|---|---|---|---|---|"]
    for v in variable:
        lines.append(f"| {v['policy']} | {v['workers']} | {ms(v['ttft_ms'])} | {ms(v['ttft_ms_p50'])} | "
                     f"{v['max_worker_tokens']:.0f} |")
    s = summary
    lines += ["", f"Speedup at {s['max_workers']} workers: {ms(s['speedup_at_max_workers'])}x (target "
              f"{s['speedup_target']:.2f}x: {'met' if s['speedup_target_met'] else 'missed'}); LPT over round-robin: "
              f"{ratio(lpt_gain)}x (target 1.5x: "
              f"{'met' if s['lpt_target_met'] else 'missed'})."]
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
