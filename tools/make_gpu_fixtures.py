#!/usr/bin/env python3
"""Hugging Face bf16 reference fixtures for the GPU tests (tests/gpu), made on the GPU host.

For each checkpoint directory given (made there by
    build/bin/hypic-model init --config tests/gpu/configs/<name>.json --seed <seed> --std 0.1 --out DIR
), in ONE process:
  * loads it with transformers (AutoModelForCausalLM, or the config's architecture class when the auto
    mapping lacks its model_type), dtype bfloat16, attn_implementation "eager", experts "eager", on cuda,
    WITHOUT the `fla` and `causal_conv1d` packages (asserted, as tools/make_fixtures.py does), so the
    Gated DeltaNet and the conv run transformers' torch fallbacks; loading must find every tensor (missing
    or unexpected keys are an error: HF would otherwise initialise them at random);
  * runs a fixed prompt of token ids (--ids, or --tokens ids drawn from --seed, recorded in the file) once
    without a cache for the logits of every position, and greedily continues it for --greedy tokens through
    generate (use_cache=True: the recurrent decode path);
  * reloads the same checkpoint in float32 (TF32 off) on the same GPU and repeats both, so a test can state
    how far HF bf16 is from fp32;
  * writes OUT/<name>_hf_bf16.safetensors:
        ids            [T]        int32  the prompt
        logits         [T, V]     fp32   bf16 model output (all positions) cast to fp32
        greedy         [G]        int32  greedy continuation of the bf16 model (G = --greedy, default 32)
        greedy_logits  [G, V]     fp32   the bf16 logits each greedy token was taken from
        logits_fp32    [T, V]     fp32   the same prompt through the fp32 model
        greedy_fp32    [G]        int32  the fp32 model's greedy continuation
    and metadata (strings): transformers / torch versions, device, seed, ids source, checkpoint path,
    model_type, command, implementations, and bf16-vs-fp32 summary numbers (max |diff|, relative Frobenius
    error, argmax agreement). <name> is NAME from a NAME=DIR argument, else the directory's base name.

    python3 tools/make_gpu_fixtures.py --out DIR_OUT [--tokens 150 --seed 7 | --ids 1,2,3] [--greedy 32]
                                       qwen3_next_gpu=CKPT_DIR qwen3_5_moe_gpu=CKPT_DIR2 ...
"""
import argparse
import importlib.util
import json
import os
import sys
import time
import traceback


def log(*a):
    print(*a, flush=True)


def load(torch, tf, path, dtype, notes):
    """The checkpoint in `dtype` on cuda, eager attention and experts; raises if tensors are missing."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))
    last = None
    for dtype_kw in ("dtype", "torch_dtype"):
        for experts in (True, False):
            k = {"attn_implementation": "eager", "output_loading_info": True, dtype_kw: dtype}
            if experts:
                k["experts_implementation"] = "eager"
            try:
                try:
                    model, info = tf.AutoModelForCausalLM.from_pretrained(path, **k)
                except (ValueError, KeyError) as e:  # no auto mapping: the config's architecture class
                    arch = cfg["architectures"][0]
                    notes.append(f"AutoModelForCausalLM: {type(e).__name__}: {e}; using {arch}")
                    model, info = getattr(tf, arch).from_pretrained(path, **k)
            except (TypeError, ValueError) as e:  # an argument this transformers does not take
                last = e
                notes.append(f"from_pretrained({', '.join(k)}): {type(e).__name__}: {e}")
                continue
            if not experts and hasattr(model, "set_experts_implementation"):
                try:
                    model.set_experts_implementation("eager")
                except Exception as e:  # a model without experts
                    notes.append(f"set_experts_implementation('eager'): {type(e).__name__}: {e}")
            bad = {}
            for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
                v = [x for x in (info.get(key) or []) if not (tied and key == "missing_keys" and x == "lm_head.weight")]
                if v:
                    bad[key] = v
            if bad:
                raise RuntimeError(f"{path}: loading did not match the checkpoint (HF would initialise these at "
                                   f"random): {bad}")
            return model.to("cuda").eval()
    raise last


def impl_of(model):
    attn = getattr(model.config, "_attn_implementation", "?")
    fn = getattr(model, "get_experts_implementation", None)
    experts = fn() if fn is not None else getattr(model.config, "_experts_implementation", "?")
    return {"attention": attn, "experts": experts}


def run(torch, model, ids, n_greedy):
    """(logits [T, V] fp32 of every prompt position, greedy [G] int32, greedy_logits [G, V] fp32)."""
    x = ids.view(1, -1).to("cuda", torch.int64)
    logits = model(input_ids=x, use_cache=False).logits[0].float().cpu().contiguous()
    gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_greedy, min_new_tokens=n_greedy,
                         do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0, eos_token_id=None)
    new = gen.sequences[0, x.shape[1]:].to(torch.int32).cpu().contiguous()
    glog = torch.stack([l[0] for l in gen.logits]).float().cpu().contiguous()
    assert new.shape[0] == n_greedy, new.shape
    return logits, new, glog


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="NAME=DIR or DIR (name = the directory's base name)")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--ids", help="comma-separated prompt token ids (the same for every checkpoint)")
    ap.add_argument("--tokens", type=int, default=150, help="prompt length when --ids is not given")
    ap.add_argument("--seed", type=int, default=7, help="seed of the prompt ids when --ids is not given")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens")
    args = ap.parse_args()

    for pkg in ("fla", "causal_conv1d"):
        assert importlib.util.find_spec(pkg) is None, f"{pkg} is installed: the reference must use the torch fallbacks"
    import torch
    import transformers as tf
    from safetensors.torch import save_file

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    command = " ".join([sys.executable] + sys.argv)
    log(f"torch {torch.__version__}, transformers {tf.__version__}, {torch.cuda.get_device_name(0)}")
    failed = 0
    for spec in args.checkpoints:
        name, path = spec.split("=", 1) if "=" in spec else (os.path.basename(os.path.normpath(spec)), spec)
        notes = []
        try:
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
            text = cfg.get("text_config", cfg)
            vocab = int(text["vocab_size"])
            if args.ids:
                ids = torch.tensor([int(v) for v in args.ids.split(",")], dtype=torch.int32)
                source = "--ids"
            else:
                g = torch.Generator().manual_seed(args.seed)
                ids = torch.randint(0, vocab, (args.tokens,), generator=g, dtype=torch.int64).to(torch.int32)
                source = f"torch.randint(0, {vocab}, ({args.tokens},), Generator().manual_seed({args.seed}))"
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise ValueError(f"prompt ids outside [0, {vocab})")
            out = {"ids": ids.contiguous()}
            with torch.inference_mode():
                m16 = load(torch, tf, path, torch.bfloat16, notes)
                impl = impl_of(m16)
                out["logits"], out["greedy"], out["greedy_logits"] = run(torch, m16, ids, args.greedy)
                del m16
                torch.cuda.empty_cache()
                m32 = load(torch, tf, path, torch.float32, notes)
                out["logits_fp32"], out["greedy_fp32"], _ = run(torch, m32, ids, args.greedy)
                del m32
                torch.cuda.empty_cache()
            a, b = out["logits"].double(), out["logits_fp32"].double()
            summary = {
                "bf16_vs_fp32_max_abs_diff": float((a - b).abs().max()),
                "bf16_vs_fp32_rel_frobenius": float((a - b).norm() / b.norm().clamp_min(1e-30)),
                "bf16_vs_fp32_argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
                "greedy_bf16_vs_fp32_equal_prefix": int(next((i for i, (x, y) in enumerate(
                    zip(out["greedy"].tolist(), out["greedy_fp32"].tolist())) if x != y), args.greedy)),
                "fp32_logits_std": float(b.std()),
            }
            meta = {"transformers": tf.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                    "seed": str(args.seed), "ids_source": source, "checkpoint": os.path.abspath(path),
                    "model_type": str(cfg.get("model_type")), "command": command,
                    "utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "implementations": json.dumps(impl), "fla": "absent (torch fallbacks)",
                    "summary": json.dumps(summary), "notes": json.dumps(notes)}
            dst = os.path.join(args.out, f"{name}_hf_bf16.safetensors")
            save_file(out, dst, metadata=meta)
            log(f"{name}: wrote {dst}: T={ids.numel()}, V={vocab}, greedy {out['greedy'].tolist()}; {json.dumps(summary)}")
        except Exception:
            failed += 1
            log(f"!! {name} ({path}) FAILED:\n{traceback.format_exc()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
