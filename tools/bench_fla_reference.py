#!/usr/bin/env python3
"""Interleaved prefill benchmark: hypic's CUDA gated-delta kernels against flash-linear-attention.

On Qwen3.5-35B-A3B's linear-attention shapes (16 key heads, 32 value heads, d_k = d_v = 128, bf16;
1x4k, 1x16k, 1x32k tokens and 16 segments of 2k) this script, in ONE process:
  * calls our prefill through the C entry points of bench/gpu/gdn_capi.cu (ctypes,
    --ours-lib build/bin/libhypic_gdn_capi.so) and flash-linear-attention's chunk_gated_delta_rule
    (when importable; never vendored here, pass --fla-path to a checkout) on the same torch tensors
    and the same CUDA stream;
  * warms both up, then times them in interleaved rounds (A/B/C/D, the order reversed every other
    round): ours without T_C, fla, ours with T_C in the same pass, and fla's second pass that gives
    T_C the reference system's way (from S0 = I with v = 0). Each sample is one call between two CUDA
    events, synchronised (so a launch-bound call shows its host overhead). Reported per variant: the
    median and min of all samples; per round: the ratio of the round medians; and the ratios' spread;
  * checks ours (and fla) at 4k tokens and on 16 ragged segments against an fp32 PyTorch reference
    (the chunked gated delta rule written here from docs/research/hybrid_models.md 5.2 / 5.4), and times
    that reference;
  * optionally (--layouts) sweeps our scan's block layouts, and (--profile) prints per-kernel GPU
    times of ours and fla from torch.profiler;
then merges gdn_bench's JSON (--ours-json: ceilings, composition, decode, conv) into one JSON and a
Markdown table.

Usage: bench_fla_reference.py --ours-lib LIB --ours-json ours.json --out-json res.json --out-md res.md
                              [--fla-path DIR] [--rounds N] [--reps N] [--layouts] [--profile]
"""
import argparse
import ctypes
import json
import math
import statistics
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


def event_time_ms(fn):
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def median_time_ms(fn, reps, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_time_ms(fn) for _ in range(reps))


def capture_graph(fn, warm):
    """fn captured once in a CUDA graph after `warm` calls on a side stream (Triton compiles and
    autotunes, our workspace builds its plan); returns (graph, fn's result at capture), to keep alive."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


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
    g = torch.where(u < 0.01, -0.5 * w, -0.01 * w)  # as gdn_bench's inputs: slow decays, 1% strong
    beta = 0.05 + 0.9 * torch.rand(T, HV, device="cuda", generator=gen)
    return q, k, v, g, beta


class Ours:
    """hypic's gdn_prefill through bench/gpu/gdn_capi.cu, on torch tensors and torch's current stream."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.hypic_gdn_workspace_create.restype = ctypes.c_void_p
        self.lib.hypic_gdn_workspace_destroy.argtypes = [ctypes.c_void_p]
        p = ctypes.c_void_p
        self.lib.hypic_gdn_prefill.argtypes = [p, ctypes.c_int, p, ctypes.c_int, ctypes.c_int, p, p, p, p, p,
                                               ctypes.c_int, ctypes.c_float, p, p, p, p, ctypes.c_int, ctypes.c_int, p,
                                               ctypes.c_char_p, ctypes.c_int]
        self.lib.hypic_gdn_prefill.restype = ctypes.c_int
        self.ws = ctypes.c_void_p(self.lib.hypic_gdn_workspace_create())
        self.err = ctypes.create_string_buffer(512)

    def close(self):
        """Frees the workspace (device memory); the object is unusable afterwards."""
        if self.ws:
            torch.cuda.synchronize()
            self.lib.hypic_gdn_workspace_destroy(self.ws)
            self.ws = None

    def prefill(self, cu_host, q, k, v, g, beta, scale, final=None, tc=None, out=None, initial=None, layout=0,
                parts=0):
        """cu_host: ctypes int array of num_seqs + 1 offsets; tensors as in gated_delta.h (contiguous)."""
        ptr = lambda t: ctypes.c_void_p(t.data_ptr()) if t is not None else None  # noqa: E731
        rc = self.lib.hypic_gdn_prefill(
            self.ws, len(cu_host) - 1, ctypes.cast(cu_host, ctypes.c_void_p), HK, HV, ptr(q), ptr(k), ptr(v), ptr(g),
            ptr(beta), 1, scale, ptr(initial), ptr(final), ptr(tc), ptr(out), layout, parts,
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), self.err, len(self.err))
        if rc != 0:
            raise RuntimeError("hypic_gdn_prefill: " + self.err.value.decode())


def cu_array(nseq, L):
    return (ctypes.c_int * (nseq + 1))(*[s * L for s in range(nseq + 1)])


def case_tensors(nseq, L, seed):
    """Inputs of nseq segments of L tokens, their offsets (host ctypes array for ours, device tensor or
    None for fla) and output buffers: (q, k, v, g, beta, cu, cu_dev, out, final, tc)."""
    T = nseq * L
    q, k, v, g, beta = make_inputs(T, seed)
    cu_dev = torch.arange(0, nseq + 1, device="cuda", dtype=torch.long) * L if nseq > 1 else None
    o = torch.empty(T, HV, D, device="cuda", dtype=torch.bfloat16)
    s = torch.empty(nseq, HV, D, D, device="cuda")
    t = torch.empty(nseq, HV, D, D, device="cuda")
    return q, k, v, g, beta, cu_array(nseq, L), cu_dev, o, s, t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours-lib", required=True)
    ap.add_argument("--ours-json", required=True)
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--out-md", required=True)
    ap.add_argument("--fla-path")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layouts", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    with open(args.ours_json) as f:
        ours_json = json.load(f)
    res = {"ours": ours_json, "torch_version": torch.__version__, "reference": {}, "fla": {}, "checks": {},
           "interleaved": {}, "method": {"rounds": args.rounds, "reps_per_round": args.reps}}
    ours = Ours(args.ours_lib)

    chunk_gdr = None
    if args.fla_path:
        sys.path.insert(0, args.fla_path)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk_gdr  # noqa: F811
        import fla
        res["fla"]["version"] = getattr(fla, "__version__", "?")
    except Exception as e:  # not installed: ours and the reference alone are reported
        res["fla"]["error"] = f"not importable: {type(e).__name__}: {e}"
        chunk_gdr = None
    scale = D ** -0.5

    def fla_run(q, k, v, g, beta, cu_dev, initial=None):
        o, s = chunk_gdr(q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=initial,
                         output_final_state=True, cu_seqlens=cu_dev, use_qk_l2norm_in_kernel=True)
        return o[0], s

    # ---- correctness against the fp32 reference: 1x4k and 16 ragged-free segments of 256 ---------
    for name, nseq, L in [("1x4k", 1, 4096), ("16x256", 16, 256)]:
        q, k, v, g, beta, cu, cu_dev, o, s, t = case_tensors(nseq, L, 99 + nseq * L)
        ours.prefill(cu, q, k, v, g, beta, scale, final=s, tc=t, out=o)
        torch.cuda.synchronize()
        o_ref, s_ref = reference_chunked(q, k, v, g, beta, scale, nseq)
        t_ref = reference_tc(k, g, beta, nseq)
        chk = {"ours_out_rel": rel(o.float(), o_ref), "ours_state_rel": rel(s, s_ref), "ours_tc_rel": rel(t, t_ref),
               "ref_tc_frobenius_norm": float(t_ref.norm())}
        # T_C applied to a random prefix state reproduces the state from that prefix (composition law).
        p = torch.randn(nseq, HV, D, D, device="cuda") * 0.3
        _, s_from_p = reference_chunked(q, k, v, g, beta, scale, nseq, initial=p, with_output=False)
        chk["ours_composition_rel"] = rel(t @ p + s, s_from_p)
        if chunk_gdr is not None:
            try:
                o_f, s_f = fla_run(q, k, v, g, beta, cu_dev)
                eye = torch.eye(D, device="cuda").expand(nseq, HV, D, D).contiguous()
                _, t_f = fla_run(q, k, torch.zeros_like(v), g, beta, cu_dev, initial=eye)
                chk.update({"fla_out_rel": rel(o_f.float(), o_ref), "fla_state_rel": rel(s_f, s_ref),
                            "fla_tc_rel": rel(t_f, t_ref), "ours_vs_fla_out_rel": rel(o.float(), o_f.float())})
            except Exception as e:
                chk["fla_error"] = f"{type(e).__name__}: {e}"
        res["checks"][name] = chk
        print(f"{name} correctness vs fp32 reference:", json.dumps(chk), flush=True)
        del q, k, v, g, beta, o, s, t, o_ref, s_ref, t_ref
        torch.cuda.empty_cache()

    # ---- interleaved timings ----------------------------------------------------------------------
    for name, nseq, L in CASES:
        q, k, v, g, beta, cu, cu_dev, o, s, t = case_tensors(nseq, L, 1234 + nseq * L)
        # One workspace per variant of ours, as in a forward pass (its plan is kept across calls of
        # one shape): a shared one would rebuild its plan whenever the variant changes.
        ws_tc, ws_whole = Ours(args.ours_lib), Ours(args.ours_lib)
        variants = {
            "ours": lambda: ours.prefill(cu, q, k, v, g, beta, scale, final=s, out=o),
            "ours_tc": lambda: ws_tc.prefill(cu, q, k, v, g, beta, scale, final=s, tc=t, out=o),
            # the whole-sequence scan (no sequence-parallel parts), for the split's gain
            "ours_whole": lambda: ws_whole.prefill(cu, q, k, v, g, beta, scale, final=s, out=o, parts=1),
        }
        # Ours captured in a CUDA graph (a warm-up call builds the plan; the captured call only
        # launches kernels), to compare with fla's graph without host overhead on either side. The
        # graph gets a workspace of its own: the other variants change the shared one's plan.
        try:
            graph_ws = Ours(args.ours_lib)
            ours_graph, _ = capture_graph(
                lambda: graph_ws.prefill(cu, q, k, v, g, beta, scale, final=s, out=o), warm=2)
            variants["ours_graph"] = ours_graph.replay
        except Exception as e:
            print(name, "ours CUDA graph capture failed:", type(e).__name__, e, flush=True)
        if chunk_gdr is not None:
            eye = torch.eye(D, device="cuda").expand(nseq, HV, D, D).contiguous()
            v0 = torch.zeros_like(v)
            variants["fla"] = lambda: fla_run(q, k, v, g, beta, cu_dev)
            variants["fla_tc2"] = lambda: fla_run(q, k, v0, g, beta, cu_dev, initial=eye)
            # fla without its Python/launch overhead: the same call (equal lengths as a [nseq, L]
            # batch, no cu_seqlens) captured once in a CUDA graph and replayed.
            try:
                qb, kb, vb = q.view(nseq, L, HK, D), k.view(nseq, L, HK, D), v.view(nseq, L, HV, D)
                gb, bb = g.view(nseq, L, HV), beta.view(nseq, L, HV)
                fb = lambda: chunk_gdr(qb, kb, vb, gb, bb, scale=scale, output_final_state=True,  # noqa: E731
                                       use_qk_l2norm_in_kernel=True)
                graph, graph_out = capture_graph(fb, warm=3)  # noqa: F841 (graph_out lives with the graph)
                variants["fla_graph"] = graph.replay
            except Exception as e:
                print(name, "fla CUDA graph capture failed:", type(e).__name__, e, flush=True)
        order = [x for x in ("ours", "fla", "ours_tc", "fla_tc2", "ours_whole", "fla_graph", "ours_graph")
                 if x in variants]
        try:
            for x in order:  # warm-up (fla: Triton compile and autotune on its first calls)
                for _ in range(5):
                    variants[x]()
            torch.cuda.synchronize()
            samples = {x: [] for x in order}
            rounds = []
            for r in range(args.rounds):
                med = {}
                for x in (order if r % 2 == 0 else order[::-1]):
                    ts = [event_time_ms(variants[x]) for _ in range(args.reps)]
                    samples[x] += ts
                    med[x] = statistics.median(ts)
                rnd = {"median_ms": med, "tc_overhead": med["ours_tc"] / med["ours"],
                       "whole_over_ours": med["ours_whole"] / med["ours"]}
                if "fla_graph" in med:
                    rnd["fla_graph_over_ours"] = med["fla_graph"] / med["ours"]
                    if "ours_graph" in med:
                        rnd["fla_graph_over_ours_graph"] = med["fla_graph"] / med["ours_graph"]
                if "fla" in med:
                    rnd["fla_over_ours"] = med["fla"] / med["ours"]
                    rnd["fla_plus_2nd_pass_over_ours_tc"] = (med["fla"] + med["fla_tc2"]) / med["ours_tc"]
                rounds.append(rnd)
            entry = {x: {"median_ms": statistics.median(samples[x]), "min_ms": min(samples[x]),
                         "max_ms": max(samples[x])} for x in order}
            entry["rounds"] = rounds
            for key in ("fla_over_ours", "tc_overhead", "fla_plus_2nd_pass_over_ours_tc", "whole_over_ours",
                        "fla_graph_over_ours", "fla_graph_over_ours_graph"):
                vals = [rd[key] for rd in rounds if key in rd]
                if vals:
                    entry[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
                                  "per_round": vals}
            res["interleaved"][name] = entry
        except Exception as e:
            res["interleaved"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(name, "timing failed:", res["interleaved"][name]["error"], flush=True)
            raise
        line = f"{name}: ours {entry['ours']['median_ms']:.3f} (min {entry['ours']['min_ms']:.3f}) ms, " \
               f"ours+T_C {entry['ours_tc']['median_ms']:.3f} ms (x{entry['tc_overhead']['median']:.3f}, " \
               f"rounds {entry['tc_overhead']['min']:.3f}..{entry['tc_overhead']['max']:.3f})"
        if "fla" in entry:
            line += f", fla {entry['fla']['median_ms']:.3f} (min {entry['fla']['min_ms']:.3f}) ms, " \
                    f"fla/ours x{entry['fla_over_ours']['median']:.2f} " \
                    f"(rounds {entry['fla_over_ours']['min']:.2f}..{entry['fla_over_ours']['max']:.2f})"
        if "ours_graph" in entry and "fla_graph" in entry:
            line += (f", CUDA graphs: ours {entry['ours_graph']['median_ms']:.3f} ms, fla "
                     f"{entry['fla_graph']['median_ms']:.3f} ms (fla/ours x{entry['fla_graph_over_ours_graph']['median']:.2f})")
        print(line, flush=True)

        if args.layouts:  # our scan's block layouts, interleaved, 3 rounds
            lay = {}
            for rnd in range(3):
                for layout in (1, 2):
                    for tc_on in (False, True):
                        fn = lambda: ours.prefill(cu, q, k, v, g, beta, scale, final=s, tc=t if tc_on else None,  # noqa: E731
                                                  out=o, layout=layout)
                        lay.setdefault(f"layout{layout}_{'tc' if tc_on else 'notc'}", []).append(
                            median_time_ms(fn, args.reps, warm=1))
            res["interleaved"][name]["layouts"] = {x: statistics.median(vals) for x, vals in lay.items()}
            print(f"{name} layouts:", {x: round(val, 3) for x, val in res["interleaved"][name]["layouts"].items()},
                  flush=True)

        try:  # GPU kernel time per call (torch.profiler), every variant
            from torch.profiler import ProfilerActivity, profile
            prof_out = {}
            for x in order:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        variants[x]()
                    torch.cuda.synchronize()
                per = {}
                for ev in prof.events():
                    if str(getattr(ev, "device_type", "")).endswith("CUDA"):
                        per[ev.name[:60]] = per.get(ev.name[:60], 0.0) + ev.time_range.elapsed_us() / 3000.0
                prof_out[x] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
                if args.profile:
                    print(f"{name} {x} per-call kernel ms:",
                          {kk: round(vv, 4) for kk, vv in prof_out[x].items()}, flush=True)
            res["interleaved"][name]["profile_ms_per_call"] = prof_out
            # all GPU work of a call: kernels and device-side copies (ours' split path copies part
            # states device to device)
            ksum = {x: sum(per_x.values()) for x, per_x in prof_out.items()}
            res["interleaved"][name]["kernel_ms_per_call"] = ksum
            print(f"{name} kernel ms per call:", {x: round(vv, 3) for x, vv in ksum.items()}, flush=True)
        except Exception as e:
            print("profile failed:", type(e).__name__, e, flush=True)

        t_ref = median_time_ms(lambda: reference_chunked(q, k, v, g, beta, scale, nseq), 2, warm=1)
        res["reference"][name] = {"ms": t_ref}
        del q, k, v, g, beta, o, s, t, variants
        ws_tc.close()
        ws_whole.close()
        del ws_tc, ws_whole
        if "graph_ws" in locals():
            if "ours_graph" in locals():
                del ours_graph
            graph_ws.close()
            del graph_ws
        torch.cuda.empty_cache()

    # ---- merged table -----------------------------------------------------------------------------
    ceil = ours_json.get("ceiling", {})
    peak_tf, peak_bw = ceil.get("bf16_gemm_TFLOPs", float("nan")), ceil.get("copy_GBps", float("nan"))
    n_r, n_s = args.rounds, args.reps
    lines = [
        f"# Gated delta rule on {ours_json.get('device', '?')} (Qwen3.5-35B-A3B linear attention: 16 key heads, "
        f"32 value heads, d_k = d_v = 128, bf16 in, fp32 state)",
        "",
        f"Measured ceilings in the same run: copy {peak_bw:.0f} GB/s, bf16 GEMM {peak_tf:.0f} TFLOP/s. "
        f"One layer, ms. Ours and fla ran interleaved in one process on the same inputs and stream: after "
        f"warm-up, {n_r} rounds of {n_s} synchronised calls per variant (order reversed every other round); "
        f"median / min over all {n_r * n_s} calls; ratios are of round medians (median, min..max over rounds).",
        "",
        "| shape | ours no T_C: median / min | ours T_C in pass: median / min | T_C overhead (rounds) "
        "| ours whole-sequence scan (rounds) | fla: median / min | fla / ours (rounds) | CUDA graphs: ours / fla "
        "median | fla graph / ours graph (rounds) | GPU ms per call (kernels + copies) ours / fla "
        "| fla + T_C 2nd pass | PyTorch fp32 ref "
        "| ours TFLOP/s | ours GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    prefill_by_shape = {p["shape"]: p for p in ours_json.get("prefill", [])}
    for name, nseq, L in CASES:
        e = res["interleaved"].get(name, {})
        if "ours" not in e:
            continue
        T = nseq * L
        chunks, Cc = T / CHUNK * HV, CHUNK
        flops = chunks * (10 * Cc * Cc * D + 6 * Cc * D * D)
        byts = T * (2.0 * HK * D * 2 + HV * D * 2 * 2 + HV * 8) + nseq * HV * D * D * 4
        om = e["ours"]["median_ms"]
        tf, bw = flops / (om * 1e-3) / 1e12, byts / (om * 1e-3) / 1e9
        e["ours_TFLOPs"], e["ours_GBps"] = tf, bw
        tco = e["tc_overhead"]
        row = (f"| {name} | {om:.3f} / {e['ours']['min_ms']:.3f} | {e['ours_tc']['median_ms']:.3f} / "
               f"{e['ours_tc']['min_ms']:.3f} | {100 * (tco['median'] - 1):+.1f}% ({100 * (tco['min'] - 1):+.1f}.."
               f"{100 * (tco['max'] - 1):+.1f}%) | ")
        wo = e["whole_over_ours"]
        row += f"{e['ours_whole']['median_ms']:.3f} ({wo['median']:.2f}x, {wo['min']:.2f}..{wo['max']:.2f}) | "
        ks = e.get("kernel_ms_per_call", {})
        if "fla" in e:
            fo = e["fla_over_ours"]
            row += (f"{e['fla']['median_ms']:.3f} / {e['fla']['min_ms']:.3f} | {fo['median']:.2f}x "
                    f"({fo['min']:.2f}..{fo['max']:.2f}) | ")
            if "fla_graph" in e and "ours_graph" in e:
                fg = e["fla_graph_over_ours_graph"]
                row += (f"{e['ours_graph']['median_ms']:.3f} / {e['fla_graph']['median_ms']:.3f} | {fg['median']:.2f}x "
                        f"({fg['min']:.2f}..{fg['max']:.2f}) | ")
            else:
                row += "n/a | n/a | "
            row += (f"{ks.get('ours', float('nan')):.3f} / {ks.get('fla', float('nan')):.3f} | "
                    f"{e['fla']['median_ms'] + e['fla_tc2']['median_ms']:.3f} | ")
        else:
            row += f"n/a | n/a | n/a | n/a | {ks.get('ours', float('nan')):.3f} / n/a | n/a | "
        row += (f"{res['reference'].get(name, {}).get('ms', float('nan')):.1f} | {tf:.1f} ({100 * tf / peak_tf:.1f}%) | "
                f"{bw:.0f} ({100 * bw / peak_bw:.1f}%) |")
        lines.append(row)
    if prefill_by_shape:
        lines += ["", "gdn_bench (C++, same run, no fla in the process; median of its own calls, ms): " + ", ".join(
            f"{p['shape']} {p['ms_without_tc']:.3f} / {p['ms_with_tc']:.3f} with T_C" for p in prefill_by_shape.values())
            + "."]
    gates = [p for p in prefill_by_shape.values() if "ms_gates_fused" in p]
    if gates:
        lines += ["", "Gates (gdn_bench, same run): a separate gdn_gates kernel + prefill vs the gates fused into the "
                  "prefill, ms: " + ", ".join(
                      f"{p['shape']} {p['ms_gates_separate_kernel_plus_prefill']:.3f} vs {p['ms_gates_fused']:.3f}"
                      for p in gates) + "."]
    comp = ours_json.get("composition", {})
    if comp:
        lines += ["", f"Composition, {comp['pairs']} (layer, head) pairs (30 layers x 32 heads) folding "
                  f"{comp['segments']} segments, fp32: own kernel {comp['own_ms_per_segment']:.3f} ms/segment "
                  f"({comp['own_TFLOPs']:.1f} TFLOP/s), cuBLAS strided-batched SGEMM {comp['cublas_ms_per_segment']:.3f} "
                  f"ms/segment ({comp['cublas_TFLOPs']:.1f} TFLOP/s)."]
    if "decode" in ours_json:
        dec = ours_json["decode"]
        line = (f"Decode step, {dec['batch']} requests x 32 heads: {dec['ms']:.3f} ms "
                f"({dec['state_GBps']:.0f} GB/s of state traffic)")
        if "ms_gates_fused" in dec:
            line += (f"; with its gates: gdn_gates + decode {dec['ms_gates_separate_kernel_plus_decode']:.3f} ms, "
                     f"fused {dec['ms_gates_fused']:.3f} ms")
        lines.append(line + ".")
    if "conv_prefill" in ours_json:
        c = ours_json["conv_prefill"]
        lines.append(f"Conv1d + SiLU prefill, {c['tokens']} tokens x {c['channels']} channels: {c['ms']:.3f} ms "
                     f"({c['GBps']:.0f} GB/s).")
    for name, chk in res["checks"].items():
        lines += ["", f"{name} check against the fp32 PyTorch reference (relative Frobenius error): "
                  + ", ".join(f"{k_} {v_:.2e}" if isinstance(v_, float) else f"{k_} {v_}" for k_, v_ in chk.items())
                  + "."]
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
