#!/usr/bin/env python3
"""Reference side of the GPU gated-delta benchmark (bench/gpu/gdn_bench.cu).

On the same shapes as gdn_bench (Qwen3.5-35B-A3B linear attention: 16 key heads, 32 value heads,
d_k = d_v = 128, bf16; 1x4k, 1x16k, 1x32k tokens and 16 segments of 2k) it times
  * a PyTorch reference: the chunked gated delta rule in fp32 (chunk 64, UT transform through
    torch.linalg.solve_triangular, a Python loop over chunks), written here from the math of
    research/hybrid_models.md 5.2 / 5.4;
  * flash-linear-attention's chunk_gated_delta_rule when `fla` is importable (never vendored in
    this repository; pass --fla-path to a checkout), and the reference system's way of getting
    T_C with it: a second run from S0 = I with v = 0;
checks gdn_bench's 4k-token outputs (--dump DIR) against the fp32 reference (and fla against the
same reference), then merges gdn_bench's JSON (--ours) into one JSON and a Markdown table.

Usage: bench_fla_reference.py --ours ours.json --dump DIR --out-json res.json --out-md res.md
                              [--fla-path DIR] [--reps N]
"""
import argparse
import json
import math
import os
import sys
import time

import torch

HK, HV, D, CHUNK = 16, 32, 128, 64
CASES = [("1x4k", 1, 4096), ("1x16k", 1, 16384), ("1x32k", 1, 32768), ("16x2k", 16, 2048)]


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def reference_chunked(q, k, v, g, beta, scale, num_seqs, initial=None, with_output=True):
    """fp32 chunked gated delta rule over num_seqs equal-length segments packed along T.

    q, k: [T, HK, D] (raw, l2-normalised here); v: [T, HV, D]; g, beta: [T, HV].
    initial: [N, HV, D, D] or None. Returns (out [T, HV, D] fp32 or None, final [N, HV, D, D]).
    State convention of hypic: S is [d_k][d_v], S_t = T_t S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t.
    """
    T = q.shape[0]
    L = T // num_seqs
    r = HV // HK
    qf = (l2norm(q.float()) * scale).repeat_interleave(r, dim=1)
    kf = l2norm(k.float()).repeat_interleave(r, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    pad = (-L) % CHUNK
    n = (L + pad) // CHUNK

    def prep(x):  # [T, H, *] -> [N, H, n, C, *] with zero padding at each segment's end
        x = x.reshape(num_seqs, L, *x.shape[1:])
        if pad:
            x = torch.cat([x, x.new_zeros(num_seqs, pad, *x.shape[2:])], dim=1)
        x = x.reshape(num_seqs, n, CHUNK, *x.shape[2:])
        return x.movedim(3, 1)  # heads first

    Q, K, V, G, B = prep(qf), prep(kf), prep(vf), prep(gf), prep(bf)
    G = G.cumsum(-1)
    idx = torch.arange(CHUNK, device=q.device)
    strict = idx[:, None] > idx[None, :]
    causal = idx[:, None] >= idx[None, :]
    diff = G[..., :, None] - G[..., None, :]
    A = (K * B[..., None]) @ K.transpose(-1, -2) * torch.exp(diff.masked_fill(~strict, -math.inf))
    eye = torch.eye(CHUNK, device=q.device)
    IA = A + eye
    W = torch.linalg.solve_triangular(IA, K * (B * torch.exp(G))[..., None], upper=False, unitriangular=True)
    U = torch.linalg.solve_triangular(IA, V * B[..., None], upper=False, unitriangular=True)
    Kt = K * torch.exp(G[..., -1:] - G)[..., None]
    S = initial.clone() if initial is not None else q.new_zeros(num_seqs, HV, D, D, dtype=torch.float32)
    outs = []
    decay_qk = torch.exp(diff.masked_fill(~causal, -math.inf)) if with_output else None
    for c in range(n):
        vn = U[:, :, c] - W[:, :, c] @ S
        if with_output:
            qc = Q[:, :, c]
            o = (qc @ S) * torch.exp(G[:, :, c])[..., None] + ((qc @ K[:, :, c].transpose(-1, -2)) * decay_qk[:, :, c]) @ vn
            outs.append(o)
        S = S * torch.exp(G[:, :, c, -1])[..., None, None] + Kt[:, :, c].transpose(-1, -2) @ vn
    out = None
    if with_output:
        out = torch.stack(outs, dim=2).reshape(num_seqs, HV, n * CHUNK, D)[:, :, :L]
        out = out.movedim(1, 2).reshape(T, HV, D)
    return out, S


def reference_tc(k, g, beta, num_seqs):
    """T_C by the second-pass construction: the same recurrence from S0 = I with v = 0."""
    T = k.shape[0]
    eye = torch.eye(D, device=k.device).expand(num_seqs, HV, D, D).contiguous()
    v0 = torch.zeros(T, HV, D, device=k.device, dtype=k.dtype)
    _, tc = reference_chunked(k, k, v0, g, beta, 1.0, num_seqs, initial=eye, with_output=False)
    return tc


def cuda_time_ms(fn, reps, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_inputs(T, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, HK, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(T, HK, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(T, HV, D, device="cuda", generator=gen).bfloat16()
    u = torch.rand(T, HV, device="cuda", generator=gen)
    w = torch.rand(T, HV, device="cuda", generator=gen)
    g = torch.where(u < 0.01, -0.5 * w, -0.01 * w)  # as gdn_bench's inputs
    beta = 0.05 + 0.9 * torch.rand(T, HV, device="cuda", generator=gen)
    return q, k, v, g, beta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--dump")
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--out-md", required=True)
    ap.add_argument("--fla-path")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    with open(args.ours) as f:
        ours = json.load(f)
    res = {"ours": ours, "torch_version": torch.__version__, "reference": {}, "fla": {}, "checks": {}}

    chunk_gdr = None
    if args.fla_path:
        sys.path.insert(0, args.fla_path)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk_gdr  # noqa: F811
        import fla
        res["fla"]["version"] = getattr(fla, "__version__", "?")
    except Exception as e:  # not installed: the reference alone is reported
        res["fla"]["error"] = f"not importable: {type(e).__name__}: {e}"
        chunk_gdr = None
    scale = D ** -0.5

    def fla_run(q, k, v, g, beta, nseq, L, initial=None):
        cu = None
        if nseq > 1:
            cu = torch.arange(0, nseq + 1, device="cuda", dtype=torch.long) * L
        o, s = chunk_gdr(q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=initial,
                         output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        return o[0], s

    # ---- correctness of our 4k outputs against the fp32 reference (and fla against it) ----------
    if args.dump and os.path.exists(os.path.join(args.dump, "q.bin")):
        T = 4096
        ld = lambda name, dt, shape: torch.from_numpy(  # noqa: E731
            __import__("numpy").fromfile(os.path.join(args.dump, name), dtype=dt)).reshape(shape)
        import numpy as np
        q = ld("q.bin", np.int16, (T, HK, D)).cuda().view(torch.bfloat16)
        k = ld("k.bin", np.int16, (T, HK, D)).cuda().view(torch.bfloat16)
        v = ld("v.bin", np.int16, (T, HV, D)).cuda().view(torch.bfloat16)
        g = ld("g.bin", np.float32, (T, HV)).cuda()
        beta = ld("beta.bin", np.float32, (T, HV)).cuda()
        o_ours = ld("out.bin", np.int16, (T, HV, D)).cuda().view(torch.bfloat16).float()
        s_ours = ld("final.bin", np.float32, (1, HV, D, D)).cuda()
        t_ours = ld("tc.bin", np.float32, (1, HV, D, D)).cuda()
        o_ref, s_ref = reference_chunked(q, k, v, g, beta, scale, 1)
        t_ref = reference_tc(k, g, beta, 1)
        chk = {"ours_out_rel": rel(o_ours, o_ref), "ours_state_rel": rel(s_ours, s_ref), "ours_tc_rel": rel(t_ours, t_ref),
               "ref_tc_frobenius_norm": float(t_ref.norm())}
        # T_C applied to a random prefix state reproduces the state from that prefix (composition law).
        p = torch.randn(1, HV, D, D, device="cuda") * 0.3
        _, s_from_p = reference_chunked(q, k, v, g, beta, scale, 1, initial=p, with_output=False)
        chk["ours_composition_rel"] = rel(t_ours @ p + s_ours, s_from_p)
        if chunk_gdr is not None:
            try:
                o_f, s_f = fla_run(q, k, v, g, beta, 1, T)
                eye = torch.eye(D, device="cuda").expand(1, HV, D, D).contiguous()
                _, t_f = fla_run(q, k, torch.zeros_like(v), g, beta, 1, T, initial=eye)
                chk.update({"fla_out_rel": rel(o_f.float(), o_ref), "fla_state_rel": rel(s_f, s_ref),
                            "fla_tc_rel": rel(t_f, t_ref), "ours_vs_fla_out_rel": rel(o_ours, o_f.float())})
            except Exception as e:
                chk["fla_error"] = f"{type(e).__name__}: {e}"
        res["checks"] = chk
        print("4k correctness vs fp32 reference:", json.dumps(chk, indent=1))
        del q, k, v, g, beta, o_ours, s_ours, t_ours, o_ref, s_ref, t_ref
        torch.cuda.empty_cache()

    # ---- timings --------------------------------------------------------------------------------
    for name, nseq, L in CASES:
        T = nseq * L
        q, k, v, g, beta = make_inputs(T, 1234 + T)
        ref_reps = 3
        t_ref = cuda_time_ms(lambda: reference_chunked(q, k, v, g, beta, scale, nseq), ref_reps, warm=1)
        t_ref_tc = cuda_time_ms(lambda: reference_tc(k, g, beta, nseq), ref_reps, warm=1)
        res["reference"][name] = {"ms": t_ref, "ms_tc_second_pass": t_ref_tc}
        if chunk_gdr is not None:
            try:
                eye = torch.eye(D, device="cuda").expand(nseq, HV, D, D).contiguous()
                v0 = torch.zeros_like(v)
                t_f = cuda_time_ms(lambda: fla_run(q, k, v, g, beta, nseq, L), args.reps, warm=3)
                t_f2 = cuda_time_ms(lambda: fla_run(q, k, v0, g, beta, nseq, L, initial=eye), args.reps, warm=3)
                res["fla"][name] = {"ms": t_f, "ms_tc_second_pass": t_f2, "tc_overhead_pct": 100.0 * t_f2 / t_f}
            except Exception as e:
                res["fla"][name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, res["reference"][name], res["fla"].get(name))
        del q, k, v, g, beta
        torch.cuda.empty_cache()

    # ---- merged table ---------------------------------------------------------------------------
    ceil = ours.get("ceiling", {})
    lines = [
        f"# Gated delta rule on {ours.get('device', '?')} (Qwen3.5-35B-A3B linear attention: 16 key heads, "
        f"32 value heads, d_k = d_v = 128, bf16 in, fp32 state)",
        "",
        f"Measured ceilings in the same run: copy {ceil.get('copy_GBps', float('nan')):.0f} GB/s, "
        f"bf16 GEMM {ceil.get('bf16_gemm_TFLOPs', float('nan')):.0f} TFLOP/s. Times are medians of CUDA-event "
        f"timings, one layer, ms.",
        "",
        "| shape | ours, no T_C | ours, T_C in pass | T_C overhead | fla | fla + T_C 2nd pass | fla T_C overhead "
        "| PyTorch fp32 ref | ours vs fla | ours TFLOP/s | ours GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in ours.get("prefill", []):
        name = p["shape"]
        f = res["fla"].get(name, {})
        r = res["reference"].get(name, {})
        fms = f.get("ms")
        f2 = f.get("ms_tc_second_pass")
        lines.append(
            f"| {name} | {p['ms_without_tc']:.3f} | {p['ms_with_tc']:.3f} | {p['tc_overhead_pct']:.1f}% | "
            + (f"{fms:.3f} | {fms + f2:.3f} | {100 * f2 / fms:.1f}% | " if fms else "n/a | n/a | n/a | ")
            + f"{r.get('ms', float('nan')):.1f} | "
            + (f"{fms / p['ms_without_tc']:.2f}x | " if fms else "n/a | ")
            + f"{p['TFLOPs']:.1f} ({100 * p['TFLOPs'] / ceil.get('bf16_gemm_TFLOPs', 1):.1f}%) | "
            f"{p['GBps']:.0f} ({100 * p['GBps'] / ceil.get('copy_GBps', 1):.1f}%) |")
        if fms:
            res["fla"][name]["ours_speedup_no_tc"] = fms / p["ms_without_tc"]
            res["fla"][name]["ours_with_tc_vs_fla_plus_second_pass"] = (fms + f2) / p["ms_with_tc"]
    comp = ours.get("composition", {})
    if comp:
        lines += ["", f"Composition, {comp['pairs']} (layer, head) pairs (30 layers x 32 heads) folding "
                  f"{comp['segments']} segments, fp32: own kernel {comp['own_ms_per_segment']:.3f} ms/segment "
                  f"({comp['own_TFLOPs']:.1f} TFLOP/s), cuBLAS strided-batched SGEMM {comp['cublas_ms_per_segment']:.3f} "
                  f"ms/segment ({comp['cublas_TFLOPs']:.1f} TFLOP/s)."]
    if "decode" in ours:
        lines.append(f"Decode step, {ours['decode']['batch']} requests x 32 heads: {ours['decode']['ms']:.3f} ms "
                     f"({ours['decode']['state_GBps']:.0f} GB/s of state traffic).")
    if "conv_prefill" in ours:
        c = ours["conv_prefill"]
        lines.append(f"Conv1d + SiLU prefill, {c['tokens']} tokens x {c['channels']} channels: {c['ms']:.3f} ms "
                     f"({c['GBps']:.0f} GB/s).")
    if res["checks"]:
        lines += ["", "4k-token check against the fp32 PyTorch reference (relative Frobenius error): "
                  + ", ".join(f"{k_} {v_:.2e}" if isinstance(v_, float) else f"{k_} {v_}"
                              for k_, v_ in res["checks"].items()) + "."]
    if "error" in res["fla"]:
        lines += ["", f"flash-linear-attention: {res['fla']['error']}"]
    elif "version" in res["fla"]:
        lines += ["", f"flash-linear-attention {res['fla']['version']} (run from a checkout, not vendored)."]
    res["generated"] = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(args.out_json, "w") as f:
        json.dump(res, f, indent=2)
    with open(args.out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
