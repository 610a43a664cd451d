#!/usr/bin/env python3
"""The best library kernels at the shapes of hypic's prefill parts, for the `parts_vs_best` table of
bench/gpu/prefill_bench.cpp (which reads this script's JSON through --best-json).

At the dimensions of a model config (default bench/gpu/qwen3_5_35b_a3b.json; flat, or nested with text_config),
for each prompt length T (batch 1, bf16, on cuda), in one process:
  * attention: torch.nn.functional.scaled_dot_product_attention, causal, q [1, heads, T, head_dim], k / v
    [1, kv_heads, T, head_dim], restricted to cuDNN's fused attention (torch.nn.attention.sdpa_kernel with
    SDPBackend.CUDNN_ATTENTION; GQA through enable_gqa, else K/V expanded to every query head outside the timed
    call), then FlashAttention-2 (SDPBackend.FLASH_ATTENTION) for comparison; the fastest that runs is `best`.
    With the config's attn_output_gate (Qwen), the part is what transformers' Qwen3-Next attention runs after its
    projections, as hypic's attention_core does the same work: q in [1, T, heads, head_dim] rows viewed as
    [1, heads, T, head_dim], SDPA, the output back to [1, T, heads x head_dim], times sigmoid(gate) (`ms`; the SDPA
    alone is `sdpa_ms`).
  * moe: one sparse MoE block written in torch the way transformers' grouped_mm experts run it (router linear,
    fp32 softmax, top-k, renormalised when norm_topk_prob, tokens sorted by expert, torch._grouped_mm for the
    gate/up and down projections with SiLU-and-multiply between, weighted index_add combine, the shared expert
    with its sigmoid gate), on random weights; also the two grouped GEMMs alone (`grouped_gemm_ms`). Routing:
    random hidden states, so about uniform.
  * gdn: flash-linear-attention's chunk_gated_delta_rule (when importable: --fla-path DIR puts a checkout on the
    path) at the linear-attention shapes (q / k [1, T, key_heads, d_k] expanded to the value heads as
    transformers does, v [1, T, value_heads, d_v], log-decay g and beta per value head, l2-normalised q / k in the
    kernel). Not run (and said so) without fla.
Timing, as hypic-bench-prefill-gpu times its parts: each part runs once per layer of its kind in the config (full
attention, MoE, linear attention), the layers back to back between two torch.cuda.Events (one layer's inputs and
weights reused); `ms` is the median of --reps such runs after --warmup, `ms_per_layer` that over the layers. One
call timed alone differs from the same call among its layers either way (2026-12-05, cuDNN SDPA at 32k tokens: on
an H100 12.1 ms alone against 13.0 ms each of ten back to back, the GPU clocking down; on the H200 the per-layer
times back to back were at or below the single calls in 11 of 12 parts, host launch gaps amortised:
bench/results/attention_vs_sdpa.md), so both sides are timed the same way; `single_call_ms_per_layer` is one call
timed alone, for reference.

    python3 tools/best_kernels_bench.py --out-json best.json [--config CFG] [--lengths 4096,8192,16384,32768]
                                        [--fla-path DIR] [--warmup 2] [--reps 5]

JSON: `rows`, one per length: {tokens, attention: {ms, ms_per_layer, min_ms_per_layer, single_call_ms_per_layer,
layers, backend, what, sdpa_ms, candidates: {name: {ms, min_ms} per layer or error}}, moe: {ms, ms_per_layer,
min_ms_per_layer, single_call_ms_per_layer, grouped_gemm_ms_per_layer, layers, what}, gdn: {the same without
grouped_gemm_ms_per_layer} or {error}} (attention's sdpa_ms, gate_error only where the output gate was timed or
failed); plus versions, device, command and UTC time.
"""
import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_prefill_bench import timed  # noqa: E402 (median, min, samples) of CUDA-event-timed calls


def timed_layers(torch, fn, layers, warmup, reps, single=True):
    """fn run `layers` times back to back per timed run (as hypic-bench-prefill-gpu times its parts; each call's
    result dropped before the next, as ours reuse one buffer): (median, min) ms per layer of --reps runs after
    `warmup`, and with `single` one call timed alone (median of reps) for reference, else None."""
    def run():
        for _ in range(layers):
            fn()
    med, mn, _ = timed(torch, run, warmup, reps)
    one = timed(torch, fn, 1, reps)[0] if single else None
    return med / layers, mn / layers, one


def log(*a):
    print(*a, flush=True)


def text_config(path):
    with open(path) as f:
        root = json.load(f)
    return dict(root["text_config"]) if "text_config" in root else dict(root)


def layer_counts(cfg):
    types = cfg.get("layer_types") or []
    n = int(cfg["num_hidden_layers"])
    n_attn = sum(1 for t in types if t == "full_attention") if types else n
    n_lin = sum(1 for t in types if t == "linear_attention") if types else 0
    n_moe = n if int(cfg.get("num_experts", 0) or 0) > 0 else 0
    return n_attn, n_lin, n_moe


def bench_attention(torch, F, cfg, T, layers, warmup, reps):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    nh, nkv, hd = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
    q = torch.randn(1, nh, T, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, nkv, T, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, nkv, T, hd, device="cuda", dtype=torch.bfloat16)
    ke, ve = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    cands = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)):
        for gqa in (True, False):
            label = name + ("_gqa" if gqa else "_expanded_kv")
            try:
                with sdpa_kernel([backend]):
                    fn = fn_for(label, F, q, k, v, ke, ve)
                    med, mn, _ = timed_layers(torch, fn, layers, warmup, reps, single=False)
                cands[label] = {"ms": med, "min_ms": mn}
                break  # GQA ran: the expanded variant is not needed
            except Exception as e:  # noqa: BLE001 (reported)
                cands[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    ok = {n: c for n, c in cands.items() if "ms" in c}
    if not ok:
        return {"error": "no SDPA backend ran", "candidates": cands}
    best = min(ok, key=lambda n: ok[n]["ms"])
    backend = SDPBackend.CUDNN_ATTENTION if best.startswith("cudnn") else SDPBackend.FLASH_ATTENTION
    r = {"backend": best, "candidates": cands, "TFLOPs": 4.0 * T * T / 2 * nh * hd / (ok[best]["ms"] * 1e-3) / 1e12}

    def sdpa_only(note=""):
        r.update(ms_per_layer=ok[best]["ms"], min_ms_per_layer=ok[best]["min_ms"],
                 what=f"torch SDPA {best}, {layers} layers back to back" + note)
        with sdpa_kernel([backend]):
            r["single_call_ms_per_layer"] = timed(torch, fn_for(best, F, q, k, v, ke, ve), 1, reps)[0]
        return r

    if not cfg.get("attn_output_gate", False):
        return sdpa_only()
    # transformers' Qwen3-Next attention after its projections: q rows [T, heads, head_dim] viewed head-major, SDPA,
    # the output back to rows, times sigmoid(gate) (hypic's attention_core does this work, the gate fused).
    qr = torch.randn(1, T, nh, hd, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(1, T, nh * hd, device="cuda", dtype=torch.bfloat16)
    gqa = best.endswith("_gqa")
    kk, vv = (k, v) if gqa else (ke, ve)

    def gated():
        o = F.scaled_dot_product_attention(qr.transpose(1, 2), kk, vv, is_causal=True, enable_gqa=gqa)
        return o.transpose(1, 2).contiguous().reshape(1, T, nh * hd) * torch.sigmoid(gate)

    try:
        with sdpa_kernel([backend]):
            med, mn, single = timed_layers(torch, gated, layers, warmup, reps)
    except Exception as e:  # noqa: BLE001 (reported; the SDPA alone stays the library's row)
        r["gate_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return sdpa_only(" (the gated variant failed: gate_error)")
    r.update(sdpa_ms_per_layer=ok[best]["ms"], ms_per_layer=med, min_ms_per_layer=mn, single_call_ms_per_layer=single,
             what=f"torch SDPA {best} + output gate (transformers' Qwen3-Next: out * sigmoid(gate)), {layers} "
                  "layers back to back")
    return r


def fn_for(label, F, q, k, v, ke, ve):
    """The SDPA call of candidate `label` (cudnn_gqa, flash2_expanded_kv, ...)."""
    if label.endswith("_gqa"):
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True)


def bench_moe(torch, F, cfg, T, layers, warmup, reps):
    H, E, k, I = (int(cfg["hidden_size"]), int(cfg["num_experts"]), int(cfg["num_experts_per_tok"]),
                  int(cfg["moe_intermediate_size"]))
    Is = int(cfg.get("shared_expert_intermediate_size", 0) or 0)
    norm = bool(cfg.get("norm_topk_prob", True))
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    rnd = lambda *s: (torch.randn(*s, device=dev, dtype=bf, generator=g) * 0.02)
    x = torch.randn(T, H, device=dev, dtype=bf, generator=g)
    w_router = rnd(E, H)
    w_gu = rnd(E, 2 * I, H)  # transformers' layout [E, out, in]; grouped_mm takes its transpose
    w_dn = rnd(E, H, I)
    w_sgu, w_sdn, w_sg = (rnd(2 * Is, H), rnd(H, Is), rnd(1, H)) if Is else (None, None, None)

    def route(x):
        logits = F.linear(x, w_router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        topv, topi = probs.topk(k, dim=-1)
        if norm:
            topv = topv / topv.sum(dim=-1, keepdim=True)
        flat = topi.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
        return topv.reshape(-1)[order].to(bf), order // k, offs

    def experts(xs, offs):
        h = torch._grouped_mm(xs, w_gu.transpose(-2, -1), offs=offs)
        h = F.silu(h[:, :I]) * h[:, I:]
        return torch._grouped_mm(h, w_dn.transpose(-2, -1), offs=offs)

    def block():
        wts, rows, offs = route(x)
        y = experts(x[rows], offs) * wts[:, None]
        out = torch.zeros_like(x).index_add_(0, rows, y)
        if Is:
            gu = F.linear(x, w_sgu)
            s = F.linear(F.silu(gu[:, :Is]) * gu[:, Is:], w_sdn)
            out = out + s * torch.sigmoid(F.linear(x, w_sg))
        return out

    med, mn, single = timed_layers(torch, block, layers, warmup, reps)
    wts, rows, offs = route(x)
    xs = x[rows].contiguous()
    gmed, _, _ = timed_layers(torch, lambda: experts(xs, offs), layers, warmup, reps)
    return {"ms_per_layer": med, "min_ms_per_layer": mn, "single_call_ms_per_layer": single,
            "grouped_gemm_ms_per_layer": gmed,
            "what": "torch MoE block: router, fp32 softmax, top-k, sort by expert, torch._grouped_mm gate/up and "
                    "down, SiLU-and-multiply, weighted index_add combine, gated shared expert"}


def bench_gdn(torch, cfg, T, layers, warmup, reps, fla_error):
    if fla_error:
        return {"error": fla_error}
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(1, T, nk, dk, device=dev, dtype=bf).repeat_interleave(nv // nk, dim=2)
    kk = torch.randn(1, T, nk, dk, device=dev, dtype=bf).repeat_interleave(nv // nk, dim=2)
    v = torch.randn(1, T, nv, dv, device=dev, dtype=bf)
    gl = -torch.rand(1, T, nv, device=dev, dtype=torch.float32) * 0.1
    beta = torch.rand(1, T, nv, device=dev, dtype=bf)
    fn = lambda: chunk_gated_delta_rule(q, kk, v, g=gl, beta=beta, scale=dk ** -0.5, use_qk_l2norm_in_kernel=True,
                                        output_final_state=True)
    med, mn, single = timed_layers(torch, fn, layers, warmup, reps)
    return {"ms_per_layer": med, "min_ms_per_layer": mn, "single_call_ms_per_layer": single,
            "what": "fla chunk_gated_delta_rule (l2norm in kernel, final state out; no conv1d, no gates' math)"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--config", default="bench/gpu/qwen3_5_35b_a3b.json")
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--fla-path", default="")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if a.warmup < 0 or a.reps < 1:
        sys.exit("--warmup must be >= 0 and --reps >= 1")
    lengths = [int(s) for s in a.lengths.split(",") if s.strip()]
    if not lengths or min(lengths) < 1:
        sys.exit("--lengths: positive integers, comma-separated")
    if a.fla_path:
        sys.path.insert(0, a.fla_path)
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    fla_error = ""
    try:
        import fla  # noqa: F401
    except Exception as e:  # noqa: BLE001 (reported)
        fla_error = f"flash-linear-attention not importable ({type(e).__name__}: {e}); pass --fla-path DIR"
    cfg = text_config(a.config)
    n_attn, n_lin, n_moe = layer_counts(cfg)
    rows = []
    for T in lengths:
        row = {"tokens": T}
        w, n = a.warmup, a.reps
        for name, fn, layers in (("attention", lambda L: bench_attention(torch, F, cfg, T, L, w, n), n_attn),
                                 ("moe", lambda L: bench_moe(torch, F, cfg, T, L, w, n), n_moe),
                                 ("gdn", lambda L: bench_gdn(torch, cfg, T, L, w, n, fla_error), n_lin)):
            if layers == 0:
                continue
            try:
                r = fn(layers)
            except Exception as e:  # noqa: BLE001 (reported)
                traceback.print_exc()
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            r["layers"] = layers
            if "ms_per_layer" in r:
                r["ms"] = r["ms_per_layer"] * layers
            if "sdpa_ms_per_layer" in r:
                r["sdpa_ms"] = r["sdpa_ms_per_layer"] * layers
            row[name] = r
            torch.cuda.empty_cache()
        log(f"best kernels at {T} tokens: " + ", ".join(
            f"{n} {row[n]['ms']:.1f} ms" if "ms" in row.get(n, {}) else f"{n} n/a" for n in ("attention", "moe", "gdn")
            if n in row))
        rows.append(row)
    out = {"rows": rows, "config": a.config, "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "device": torch.cuda.get_device_name(0),
           "command": " ".join(sys.argv), "time_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    with open(a.out_json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
