#!/usr/bin/env python3
"""Per-kernel table of an Nsight Compute summary: where a decode step's or a splice's GPU time goes.

Input: the CSV that `ncu --metrics gpu__time_duration.sum --print-summary per-kernel --csv ...` writes to stdout
(one row per kernel name and launch shape with `Invocations` and the metric's `Average` in ns; the tool's own log
lines before the header are skipped). Output: a Markdown table, largest total first, with each kernel's calls and
microseconds per profiled call of the section (`--calls N`: e.g. 6 decode steps, 3 splices inside an NVTX range),
and optionally the same rows as JSON, and (--parts) the time by part of the forward pass: attention, MoE, linear
attention, cuBLASLt GEMMs, norms, other (tools/ncu_kernel_table.py PARTS).

    ncu --nvtx --nvtx-include "hypic_splice/" --clock-control none --metrics gpu__time_duration.sum \\
        --print-summary per-kernel --csv hypic-bench-prefill-gpu ... > splice.csv
    tools/ncu_kernel_table.py splice.csv --calls 3 --top 25 [--json rows.json] [--parts]

Times are serialised kernel times (ncu runs one kernel at a time): their sum exceeds the section's wall time when
kernels overlap, and misses host gaps. When the summary also holds DRAM traffic (`--metrics
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum`, or `dram__bytes.sum`), the table adds each
kernel's DRAM GB/s: its average bytes read plus written per launch over its average time (bytes per ns = GB/s).
"""
import argparse
import csv
import io
import json
import re
import sys


def short_name(full):
    """'void ns::kernel<4>(int, float*)' -> 'kernel<4>'; cuBLAS / CUTLASS names are kept whole up to '('."""
    name = full.split("(")[0].strip()
    if name.startswith("void "):
        name = name[5:]
    # Drop namespaces but keep template arguments.
    depth, cut = 0, 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == ":" and depth == 0:
            cut = i + 1
    return name[cut:] or name


def parse(text):
    """Rows {kernel, grid, block, invocations, avg_ns[, dram_bytes]} of the gpu__time_duration.sum summary (dram_bytes:
    average DRAM bytes per launch, where the summary has them)."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if '"Kernel Name"' in l or l.startswith("Kernel Name")
                  or ",Kernel Name," in l), None)
    if start is None:
        raise ValueError("no ncu per-kernel summary header (a 'Kernel Name' column) in the input")
    rows = []
    records = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    # DRAM bytes per launch by (kernel, grid, block): read + write where either is given, else dram__bytes.sum.
    rw, total = {}, {}
    for r in records:
        name = r.get("Metric Name")
        if name not in ("dram__bytes_read.sum", "dram__bytes_write.sum", "dram__bytes.sum"):
            continue
        unit = (r.get("Metric Unit") or "byte").strip()
        scale = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}.get(unit)
        if scale is None:
            raise ValueError(f"unknown byte unit {unit!r}")
        key = (r["Kernel Name"], r.get("Grid Size", ""), r.get("Block Size", ""))
        value = float(r["Average"].replace(",", "")) * scale
        if name == "dram__bytes.sum":
            total[key] = value
        else:
            rw[key] = rw.get(key, 0.0) + value
    for r in records:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = (r.get("Metric Unit") or "ns").strip()
        scale = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}.get(unit)
        if scale is None:
            raise ValueError(f"unknown time unit {unit!r}")
        rows.append({
            "kernel": r["Kernel Name"],
            "grid": r.get("Grid Size", ""),
            "block": r.get("Block Size", ""),
            "invocations": int(r["Invocations"].replace(",", "")),
            "avg_ns": float(r["Average"].replace(",", "")) * scale,
        })
        key = (r["Kernel Name"], r.get("Grid Size", ""), r.get("Block Size", ""))
        if key in rw or key in total:
            rows[-1]["dram_bytes"] = rw.get(key, total.get(key))
    if not rows:
        raise ValueError("the summary has no gpu__time_duration.sum rows")
    return rows


def table(rows, calls, top):
    """One row per ncu row (a kernel at one launch shape): launches and ms per profiled call, largest first; and the
    grand total in ms per call."""
    if calls <= 0:
        raise ValueError("--calls must be positive")
    out = []
    for r in rows:
        total_us = r["invocations"] * r["avg_ns"] / 1e3
        row = {"kernel": short_name(r["kernel"]), "grid": r["grid"],
               "calls_per_call": r["invocations"] / calls, "us_per_launch": r["avg_ns"] / 1e3,
               "ms_per_call": total_us / calls / 1e3}
        if r.get("dram_bytes") is not None and r["avg_ns"] > 0:
            row["dram_gb_per_s"] = r["dram_bytes"] / r["avg_ns"]
        out.append(row)
    out.sort(key=lambda x: -x["ms_per_call"])
    total_ms = sum(x["ms_per_call"] for x in out)
    return out[:top] if top > 0 else out, total_ms


def markdown(rows, total_ms):
    """The table; with a DRAM GB/s column when any row has DRAM bytes ("n/a" in the rows without)."""
    dram = any("dram_gb_per_s" in r for r in rows)
    lines = [f"Kernel time per profiled call: {total_ms:.2f} ms (serialised kernels).", "",
             "| kernel | grid | launches per call | us per launch | ms per call | share |" +
             (" DRAM GB/s (read + write) |" if dram else ""),
             "|---|---|---|---|---|---|" + ("---|" if dram else "")]
    for r in rows:
        share = 100.0 * r["ms_per_call"] / total_ms if total_ms > 0 else 0.0
        line = (f"| {r['kernel']} | {r['grid']} | {r['calls_per_call']:.1f} | {r['us_per_launch']:.2f} | "
                f"{r['ms_per_call']:.3f} | {share:.1f}% |")
        if dram:
            line += f" {r['dram_gb_per_s']:.0f} |" if "dram_gb_per_s" in r else " n/a |"
        lines.append(line)
    return "\n".join(lines)


# --parts: each kernel's part of a hypic forward pass, by the first pattern its short name matches (order matters:
# attention's split combine before the MoE combine). cuBLASLt's kernels (nvjet, cutlass, xmma) are the dense
# projections plus, in a MoE layer, the router and the shared expert; "other" holds what no pattern names.
PARTS = [
    ("attention", r"^(attn_|cudnn_generated.*sdpa|gather_kv|output_gate|mla_|attention_)"),
    ("moe", r"^(moe_|grouped_gemm|decode_gemm|combine_kernel|route_|scatter_kernel|offsets_kernel|chunk_scan_kernel|"
            r"silu_mul|gather_rows)"),
    ("linear attention (GDN / KDA / lightning)", r"^(gdn_|conv_|compose_fold|rms_norm_gated|affine_chain|chain_|kda_|"
                                               r"lightning_)"),
    ("cuBLASLt GEMMs (projections, router, shared expert, LM head)", r"^(nvjet|cutlass|sm90_xmma|.*gemm.*cublas|"
                                                                     r"decode_linear)"),
    ("norms", r"^rms_norm_residual"),
]


def parts(rows, total_ms):
    """Sums of ms per call by part (PARTS, then "other"), largest first: [(part, ms, share %)]."""
    acc = {}
    for r in rows:
        name = next((p for p, pat in PARTS if re.search(pat, r["kernel"])), "other")
        acc[name] = acc.get(name, 0.0) + r["ms_per_call"]
    out = [(p, ms, 100.0 * ms / total_ms if total_ms > 0 else 0.0) for p, ms in acc.items()]
    out.sort(key=lambda x: -x[1])
    return out


def parts_markdown(part_rows):
    lines = ["| part | ms per call | share |", "|---|---|---|"]
    lines += [f"| {p} | {ms:.3f} | {sh:.1f}% |" for p, ms, sh in part_rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --print-summary per-kernel --csv output (file, or - for stdin)")
    ap.add_argument("--calls", type=float, default=1.0, help="profiled calls of the section (divides the totals)")
    ap.add_argument("--top", type=int, default=30, help="rows to print (0 = all)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--parts", action="store_true",
                    help="also print the time by part of the forward pass (attention, MoE, linear attention, "
                         "cuBLASLt GEMMs, norms, other), over every row")
    a = ap.parse_args(argv)
    text = sys.stdin.read() if a.csv == "-" else open(a.csv, encoding="utf-8", errors="replace").read()
    try:
        parsed = parse(text)
        rows, total = table(parsed, a.calls, a.top)
    except ValueError as e:
        print(f"ncu_kernel_table: {e}", file=sys.stderr)
        return 2
    print(markdown(rows, total))
    if a.parts:
        print()
        print(parts_markdown(parts(table(parsed, a.calls, 0)[0], total)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"total_ms_per_call": total, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
