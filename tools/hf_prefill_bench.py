#!/usr/bin/env python3
"""Prefill time of the same model in Hugging Face transformers (bf16, on the GPU), for the ratio next to
hypic's CUDA backend (bench/gpu/prefill_bench.cpp, which reads this script's JSON through --hf-json).

The model is Qwen3.5-35B-A3B's text model built from a config (default bench/gpu/qwen3_5_35b_a3b.json: flat
qwen3_5_moe_text, or a nested qwen3_5_moe whose text_config is used; any model_type transformers knows, e.g. minimax
or kimi_linear, whose released linear_attn_config is mapped to transformers' names) with from_config: random weights (HF's own
init), dtype bfloat16, on cuda. Only --layers of its layers are instantiated (default 8, the first 8 of the
config's layer_types: 6 Gated DeltaNet + 2 gated attention, the 3:1 pattern kept), and the measured time is
scaled to the full layer count:

    hf_ms = fixed_ms + (hf_ms_measured - fixed_ms) * layers_full / layers_timed

where fixed_ms (embedding + final norm + LM head of the one logits row) is timed standalone and counted once.
What runs, in the fastest configuration transformers 5.17 offers here:
  * Gated DeltaNet: flash-linear-attention's chunk_gated_delta_rule when `fla` is importable (put a checkout on
    the path with --fla-path DIR: it is added to sys.path BEFORE transformers is imported, since transformers
    binds the fla kernels when its modeling module is imported); else transformers' torch fallback
    (torch_chunk_gated_delta_rule), and the output says so. What actually ran is also read back from the GPU
    kernel names of a profiled forward (fla's Triton kernels vs the fallback's triangular solves);
  * causal conv1d: the causal_conv1d package when installed, else transformers' F.conv1d fallback (reported);
  * attention: SDPA (attn_implementation="sdpa"; the SDPA kernels seen are reported);
  * experts: experts_implementation "grouped_mm" (torch grouped GEMM), falling back to "eager" if it fails to
    run (reported, with the error).
Timing: a forward of T tokens (batch 1, use_cache=False, logits_to_keep=1) under torch.inference_mode,
torch.cuda.Event around each call, median (and min) of --reps calls after --warmup calls.

    python3 tools/hf_prefill_bench.py --out-json hf.json [--fla-path DIR] [--lengths 4096,16384,32768]
                                      [--layers 8] [--warmup 2] [--reps 5] [--quick]

JSON (--out-json): per length `tokens`, `hf_ms` (scaled to the full layer count), `hf_ms_measured` (the
--layers model), `hf_ms_measured_min`, `fixed_ms`, `layers_timed`; plus `implementations` (what ran),
`scaling`, versions, device, command, UTC time. Memory: the 8-layer model holds about 15 GB of bf16 weights;
a 32k-token forward adds a few GB of activations (the grouped experts GEMM gathers T x top-k rows).
"""
import argparse
import importlib
import importlib.util
import json
import os
import re
import statistics
import sys
import time
import traceback


def log(*a):
    print(*a, flush=True)


def load_text_config(path, layers):
    """The text config's fields (nested configs: text_config), cut to `layers` layers of the same pattern."""
    with open(path) as f:
        root = json.load(f)
    text = dict(root["text_config"]) if "text_config" in root else dict(root)
    if "tie_word_embeddings" in root and "text_config" in root:
        text.setdefault("tie_word_embeddings", root["tie_word_embeddings"])
    text.pop("_comment", None)
    full = int(text["num_hidden_layers"])
    lac = text.pop("linear_attn_config", None)
    if lac is not None:  # Kimi-Linear's released config.json -> transformers' KimiLinearConfig names (1-based lists)
        text["linear_num_heads"] = lac["num_heads"]
        text["linear_head_dim"] = lac["head_dim"]
        text["linear_conv_kernel_dim"] = lac["short_conv_kernel_size"]
        full_attn = set(lac["full_attn_layers"])
        text["layer_types"] = ["full_attention" if i + 1 in full_attn else "linear_attention" for i in range(full)]
    if "first_k_dense_replace" in text and text.get("model_type") == "kimi_linear" and "mlp_layer_types" not in text:
        k = int(text["first_k_dense_replace"])
        text["mlp_layer_types"] = ["dense" if i < k else "sparse" for i in range(full)]
    types = text.get("layer_types")
    if not types:
        interval = int(text.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(full)]
    if layers > full:
        raise SystemExit(f"--layers {layers} exceeds the config's {full} layers")
    cut = list(types[:layers])
    n_attn_full, n_attn_cut = types.count("full_attention"), cut.count("full_attention")
    if n_attn_cut * full != n_attn_full * layers:
        log(f"warning: the first {layers} layers hold {n_attn_cut} attention layers, not the config's ratio "
            f"{n_attn_full}/{full}: the scaled time assumes the ratio")
    text["num_hidden_layers"] = layers
    text["layer_types"] = cut
    if "mlp_layer_types" in text:
        text["mlp_layer_types"] = list(text["mlp_layer_types"][:layers])
    text.pop("architectures", None)
    return text, full, types, cut


def make_config(tf, text):
    model_type = text.pop("model_type", "qwen3_5_moe_text")
    try:
        return tf.AutoConfig.for_model(model_type, **text), model_type
    except Exception:
        cls = getattr(tf, "Qwen3_5MoeTextConfig")
        return cls(**text), model_type


def build_model(torch, tf, conf, attn, experts, notes):
    """from_config on cuda in bf16 with the given attention / experts implementations (whatever this
    transformers accepts: `dtype` or `torch_dtype`, experts_implementation at construction or set after)."""
    last = None
    for dtype_kw in ("dtype", "torch_dtype"):
        for with_experts in (True, False):
            kw = {dtype_kw: torch.bfloat16, "attn_implementation": attn}
            if with_experts:
                kw["experts_implementation"] = experts
            try:
                with torch.device("cuda"):
                    try:
                        model = tf.AutoModelForCausalLM.from_config(conf, **kw)
                    except (ValueError, KeyError) as e:  # no auto mapping for this config class
                        notes.append(f"AutoModelForCausalLM.from_config: {e}; using Qwen3_5MoeForCausalLM")
                        model = tf.Qwen3_5MoeForCausalLM._from_config(conf, **kw)
                if not with_experts:
                    set_experts(model, experts, notes)
                return model.to(device="cuda", dtype=torch.bfloat16).eval()
            except (TypeError, ValueError) as e:  # an argument this transformers does not take
                last = e
                notes.append(f"from_config({', '.join(kw)}) raised {type(e).__name__}: {e}")
    raise last


def set_experts(model, impl, notes):
    fn = getattr(model, "set_experts_implementation", None)
    if fn is not None:
        fn(impl)
    else:
        model.config._experts_implementation = impl
        notes.append("no set_experts_implementation: set config._experts_implementation")


def experts_impl(model):
    fn = getattr(model, "get_experts_implementation", None)
    if fn is not None:
        try:
            return fn()
        except Exception as e:
            return f"? ({type(e).__name__}: {e})"
    return getattr(model.config, "_experts_implementation", "?")


def describe_fn(fn):
    """module.qualname of a function and of what it wraps (decorators keep __wrapped__)."""
    out, seen = [], 0
    while fn is not None and seen < 6:
        out.append(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}")
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return " <- ".join(out) if out else "?"


def event_ms(torch, fn):
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def timed(torch, fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = [event_ms(torch, fn) for _ in range(reps)]
    return statistics.median(t), min(t), t


def kernel_names(torch, fn):
    """GPU kernel names and total ms of one call of fn, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            per[ev.name] = per.get(ev.name, 0.0) + ev.time_range.elapsed_us() / 1000.0
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


FLA_KERNELS = re.compile(r"chunk_gated_delta_rule|kda|chunk_fwd_kernel|recompute_w_u|kkt|solve_tril|chunk_local_cumsum|"
                         r"l2norm_fwd|fused_recurrent", re.I)
FALLBACK_KERNELS = re.compile(r"trsm|triangular", re.I)
ATTN_KERNELS = re.compile(r"flash|fmha|sdpa|cudnn|attention|efficient", re.I)
CONV_KERNELS = re.compile(r"causal_conv1d|conv1d|conv_depthwise|depthwise", re.I)
GROUPED_KERNELS = re.compile(r"grouped|group_gemm|ptr_array|GroupedGemm", re.I)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="bench/gpu/qwen3_5_35b_a3b.json")
    ap.add_argument("--lengths", default="4096,16384,32768", help="prompt lengths, tokens, comma-separated")
    ap.add_argument("--layers", type=int, default=8, help="layers instantiated and timed (scaled to the config's)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="1 warm-up, 2 timed calls per length")
    ap.add_argument("--fla-path", help="a flash-linear-attention checkout to import fla from")
    ap.add_argument("--experts", default="grouped_mm", help="experts_implementation to try first (then eager)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled forward that tells what ran")
    ap.add_argument("--out-json", required=True)
    args = ap.parse_args()
    if args.quick:
        args.warmup, args.reps = 1, 2
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    res = {"tool": "tools/hf_prefill_bench.py", "command": " ".join([sys.executable] + sys.argv),
           "utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "config": args.config,
           "warmup": args.warmup, "reps": args.reps, "lengths": [], "notes": []}
    notes = res["notes"]

    # fla first: transformers binds its kernels when the modeling module is imported.
    fla_info = {}
    if args.fla_path:
        sys.path.insert(0, os.path.abspath(args.fla_path))
        fla_info["path"] = os.path.abspath(args.fla_path)
    try:
        import fla  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
        fla_info.update({"importable": True, "version": getattr(fla, "__version__", "?"),
                         "file": getattr(fla, "__file__", "?")})
    except Exception as e:
        fla_info.update({"importable": False, "error": f"{type(e).__name__}: {e}"})
    res["fla"] = fla_info
    conv_pkg = importlib.util.find_spec("causal_conv1d") is not None

    import torch
    import transformers as tf
    res.update({"torch": torch.__version__, "transformers": tf.__version__,
                "device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda})
    log(f"torch {torch.__version__}, transformers {tf.__version__}, {res['device']}; fla: "
        + (f"{fla_info.get('version')} from {fla_info.get('file')}" if fla_info["importable"]
           else f"not importable ({fla_info['error']}): the torch fallback of the Gated DeltaNet runs"))

    text, full_layers, full_types, cut = load_text_config(args.config, args.layers)
    res.update({"layers_full": full_layers, "layers_timed": args.layers, "layer_types_timed": cut,
                "linear_layers_timed": cut.count("linear_attention"), "attention_layers_timed": cut.count("full_attention")})
    conf, model_type = make_config(tf, dict(text))
    res["model_type"] = model_type
    torch.manual_seed(args.seed)
    t0 = time.time()
    model = build_model(torch, tf, conf, args.attn, args.experts, notes)
    res["build_s"] = time.time() - t0
    n_params = sum(p.numel() for p in model.parameters())
    res["parameters_instantiated"] = n_params
    log(f"built {type(model).__name__} with {args.layers} of {full_layers} layers ({' '.join(t[0].upper() for t in cut)}), "
        f"{n_params / 1e9:.2f}B parameters in {res['build_s']:.1f} s")
    V = conf.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(args.seed)

    impl = {"attention": args.attn, "experts_requested": args.experts}
    with torch.inference_mode():
        # The experts implementation: the requested one if a forward runs, else eager.
        probe = torch.randint(0, V, (1, 256), device="cuda", generator=gen)
        try:
            model(input_ids=probe, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
        except Exception as e:
            impl["experts_fallback_reason"] = f"{type(e).__name__}: {e}"
            log(f"experts_implementation {args.experts!r} failed ({e}); falling back to eager")
            notes.append(traceback.format_exc())
            set_experts(model, "eager", notes)
            model(input_ids=probe, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
        impl["experts"] = experts_impl(model)
        impl["attention_config"] = getattr(model.config, "_attn_implementation", "?")

        # The Gated DeltaNet functions the modeling module holds.
        lin = next((layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")), None)
        if lin is not None:
            mod = sys.modules.get(type(lin).__module__)
            for name in ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule", "causal_conv1d_fn"):
                fn = getattr(lin, name, None) or getattr(mod, name, None)
                if fn is not None:
                    impl[f"bound_{name}"] = describe_fn(fn)

        # Fixed cost counted once: embedding + final norm + LM head of one row.
        emb, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head

        if not args.no_profile:
            try:
                ids = torch.randint(0, V, (1, min(lengths)), device="cuda", generator=gen)
                model(input_ids=ids, use_cache=False, logits_to_keep=1)  # compile / autotune before profiling
                kn = kernel_names(torch, lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1))
                names = list(kn)
                fla_seen = [n for n in names if FLA_KERNELS.search(n)]
                fb_seen = [n for n in names if FALLBACK_KERNELS.search(n)]
                impl["fla_kernels_seen"] = bool(fla_seen)
                impl["fallback_kernels_seen"] = bool(fb_seen)
                impl["attention_kernels"] = [n[:100] for n in names if ATTN_KERNELS.search(n)][:4]
                impl["conv_kernels"] = [n[:100] for n in names if CONV_KERNELS.search(n)][:3]
                impl["grouped_gemm_kernels"] = [n[:100] for n in names if GROUPED_KERNELS.search(n)][:3]
                res["profile_top_kernels_ms"] = {n[:120]: round(v, 4) for n, v in list(kn.items())[:25]}
                res["profile_tokens"] = min(lengths)
            except Exception as e:
                notes.append(f"profile failed: {type(e).__name__}: {e}")
        if fla_info["importable"] and impl.get("fla_kernels_seen", True):
            impl["gdn"] = f"fla {fla_info.get('version')} chunk_gated_delta_rule"
        elif fla_info["importable"]:
            impl["gdn"] = "torch fallback (torch_chunk_gated_delta_rule): fla was importable but its kernels did not run"
        else:
            impl["gdn"] = "torch fallback (torch_chunk_gated_delta_rule): fla not importable"
        impl["conv1d"] = "causal_conv1d package" if conv_pkg else "torch F.conv1d fallback (causal_conv1d not installed)"
        res["implementations"] = impl
        log("implementations: " + json.dumps(impl))

        for T in lengths:
            entry = {"tokens": T, "layers_timed": args.layers}
            try:
                ids = torch.randint(0, V, (1, T), device="cuda", generator=gen)
                torch.cuda.reset_peak_memory_stats()
                fwd = lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
                med, mn, allt = timed(torch, fwd, args.warmup, args.reps)
                fixed = lambda: head(norm(emb(ids)[:, -1:, :]))  # noqa: E731
                fmed, _, _ = timed(torch, fixed, args.warmup, args.reps)
                scaled = fmed + (med - fmed) * full_layers / args.layers
                entry.update({"hf_ms": scaled, "hf_ms_measured": med, "hf_ms_measured_min": mn,
                              "hf_ms_measured_all": allt, "fixed_ms": fmed,
                              "peak_memory_bytes": torch.cuda.max_memory_allocated()})
                log(f"{T:6d} tokens: {med:9.2f} ms measured ({args.layers} layers, min {mn:.2f}), fixed part "
                    f"{fmed:.2f} ms -> {scaled:9.2f} ms scaled to {full_layers} layers; peak memory "
                    f"{entry['peak_memory_bytes'] / 2**30:.1f} GiB")
                del ids
            except Exception as e:  # e.g. out of memory at 32k: record and go on
                entry["error"] = f"{type(e).__name__}: {e}"
                log(f"{T} tokens: FAILED: {entry['error']}")
            torch.cuda.empty_cache()
            res["lengths"].append(entry)

    res["scaling"] = (f"hf_ms = fixed_ms + (hf_ms_measured - fixed_ms) x {full_layers} / {args.layers}, with "
                      f"{args.layers} layers instantiated (first {args.layers} of the config's pattern) and timed; "
                      f"fixed_ms = embedding + final norm + LM head (1 row) timed standalone, counted once")
    with open(args.out_json, "w") as f:
        json.dump(res, f, indent=2)
    log(f"wrote {args.out_json}")
    return 0 if all("error" not in e for e in res["lengths"]) else 1


if __name__ == "__main__":
    sys.exit(main())
