#!/usr/bin/env python3
"""tools/ncu_kernel_table.py on a hand-made ncu summary: totals, units, ordering, names and errors.

The expected numbers are worked out by hand from the CSV below (Invocations x Average / calls)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import ncu_kernel_table as t  # noqa: E402

CSV = """==PROF== Connected to process 1 (bench)
device NVIDIA H200 (132 SMs)
"Process ID","Process Name","Host Name","Kernel Name","Block Size","Grid Size","Device","CC","Invocations","Section Name","Metric Name","Metric Unit","Minimum","Maximum","Average"
"1","b","h","void ns::a_kernel<4>(int, const float *)","(128, 1, 1)","(8, 1, 1)","0","9.0","6","S","gpu__time_duration.sum","ns","1,000.00","3,000.00","2,000.00"
"1","b","h","ns::<unnamed>::b_kernel(int)","(256, 1, 1)","(1, 32, 1)","0","9.0","30","S","gpu__time_duration.sum","usecond","1.00","2.00","1.50"
"1","b","h","void cutlass::Kernel2<gemm_128x64>(T1::Params)","(384, 1, 1)","(264, 1, 1)","0","9.0","3","S","gpu__time_duration.sum","ns","100,000.00","100,000.00","100,000.00"
"1","b","h","ignored_kernel(void)","(32, 1, 1)","(1, 1, 1)","0","9.0","3","S","dram__bytes.sum","byte","1","1","1"
"""


def close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def main():
    rows = t.parse(CSV)
    assert len(rows) == 3, rows  # the dram__bytes row is not a time
    out, total = t.table(rows, calls=3, top=0)
    # a: 6 x 2000 ns / 3 = 4 us = 0.004 ms; b: 30 x 1.5 us / 3 = 15 us = 0.015 ms; Kernel2: 3 x 100 us / 3 = 0.1 ms.
    assert [r["kernel"] for r in out] == ["Kernel2<gemm_128x64>", "b_kernel", "a_kernel<4>"], out
    assert close(out[0]["ms_per_call"], 0.1) and close(out[1]["ms_per_call"], 0.015) and close(out[2]["ms_per_call"], 0.004)
    assert close(out[1]["calls_per_call"], 10.0) and close(out[1]["us_per_launch"], 1.5)
    assert close(total, 0.119), total
    top1, total1 = t.table(rows, calls=3, top=1)
    assert len(top1) == 1 and close(total1, 0.119)  # the total counts every row, not only the printed ones
    md = t.markdown(out, total)
    assert "| Kernel2<gemm_128x64> | (264, 1, 1) | 1.0 | 100.00 | 0.100 | 84.0% |" in md, md
    for bad, what in (("no header here\n", "header"), (CSV.replace("gpu__time_duration.sum", "x"), "no gpu__time")):
        try:
            t.parse(bad)
        except ValueError as e:
            assert what.split()[0] in str(e) or "summary" in str(e), e
        else:
            raise AssertionError("parse accepted " + what)
    try:
        t.table(rows, calls=0, top=0)
    except ValueError:
        pass
    else:
        raise AssertionError("calls = 0 accepted")
    # --parts: by the first pattern a short name matches (the attention split combine is attention's, the MoE
    # combine the MoE's); unmatched names are "other". ms per call by hand: 1 call, Invocations x Average.
    named = [{"kernel": k, "grid": "", "block": "", "invocations": n, "avg_ns": ns} for k, n, ns in (
        ("void ns::attn_split_combine_kernel<256>(P)", 2, 1e6),  # 2 ms
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_kernel0_0", 1, 3e6),  # 3 ms
        ("void ns::combine_kernel(int)", 4, 1e6),  # 4 ms
        ("ns::moe_detail::moe_wgmma_kernel<C, 1>(A)", 1, 5e6),  # 5 ms
        ("ns::<unnamed>::gdn_scan_kernel(P)", 1, 6e6),  # 6 ms
        ("void ns::rms_norm_gated_kernel<0>(int)", 1, 1e6),  # 1 ms: linear attention's output norm
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 7, 1e6),  # 7 ms
        ("void ns::rms_norm_residual_kernel<1, 0>(int)", 8, 1e5),  # 0.8 ms
        ("void ns::embed_gather_kernel(int)", 1, 2e5))]  # 0.2 ms
    prow, ptotal = t.table(named, calls=1, top=0)
    assert close(ptotal, 29.0), ptotal
    got = {p: (ms, sh) for p, ms, sh in t.parts(prow, ptotal)}
    want = {"attention": 5.0, "moe": 9.0, "linear attention (GDN / KDA / lightning)": 7.0,
            "cuBLASLt GEMMs (projections, router, shared expert, LM head)": 7.0, "norms": 0.8, "other": 0.2}
    assert set(got) == set(want), got
    for p, ms in want.items():
        assert close(got[p][0], ms) and close(got[p][1], 100.0 * ms / 29.0), (p, got[p])
    assert [p for p, _, _ in t.parts(prow, ptotal)][0] == "moe"  # largest first
    assert "| moe | 9.000 | 31.0% |" in t.parts_markdown(t.parts(prow, ptotal))
    # DRAM traffic: a_kernel reads 3.0 MB and writes 1.0 MB per launch on average in 2000 ns: 4e6 / 2000 = 2000 GB/s;
    # b_kernel has only dram__bytes.sum, 0.3 Mbyte in 1.5 us: 200 GB/s; Kernel2 none ("n/a").
    dcsv = CSV + "".join(
        f'"1","b","h","{k}","{blk}","{grid}","0","9.0","{n}","S","{m}","{u}","0","0","{v}"\n' for k, blk, grid, n, m, u, v in (
            ("void ns::a_kernel<4>(int, const float *)", "(128, 1, 1)", "(8, 1, 1)", 6, "dram__bytes_read.sum", "byte",
             "3,000,000.00"),
            ("void ns::a_kernel<4>(int, const float *)", "(128, 1, 1)", "(8, 1, 1)", 6, "dram__bytes_write.sum", "byte",
             "1,000,000.00"),
            ("ns::<unnamed>::b_kernel(int)", "(256, 1, 1)", "(1, 32, 1)", 30, "dram__bytes.sum", "Mbyte", "0.30")))
    drows = t.parse(dcsv)
    dout, dtotal = t.table(drows, calls=3, top=0)
    by = {r["kernel"]: r for r in dout}
    assert close(by["a_kernel<4>"]["dram_gb_per_s"], 2000.0), by["a_kernel<4>"]
    assert close(by["b_kernel"]["dram_gb_per_s"], 200.0), by["b_kernel"]
    assert "dram_gb_per_s" not in by["Kernel2<gemm_128x64>"]
    dmd = t.markdown(dout, dtotal)
    assert "| a_kernel<4> | (8, 1, 1) | 2.0 | 2.00 | 0.004 | 3.4% | 2000 |" in dmd, dmd
    assert "| Kernel2<gemm_128x64> | (264, 1, 1) | 1.0 | 100.00 | 0.100 | 84.0% | n/a |" in dmd, dmd
    assert "DRAM GB/s" not in md  # no DRAM metrics: the old columns only
    try:
        t.parse(dcsv.replace('"Mbyte"', '"furlong"'))
    except ValueError as e:
        assert "byte unit" in str(e), e
    else:
        raise AssertionError("parse accepted an unknown byte unit")
    print("ncu_kernel_table: all checks passed")


if __name__ == "__main__":
    main()
