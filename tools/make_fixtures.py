#!/usr/bin/env python3
"""Builds the Hugging Face reference fixtures hypic's CPU engine is tested against.

Run on a host with PyTorch 2.11 and transformers 5.17 and WITHOUT the `fla` and `causal_conv1d`
packages, so transformers uses its pure-torch fallbacks (torch_chunk_gated_delta_rule, ...), which
compute in fp32 exactly like our CPU path (docs/research/hybrid_models.md section 0):

    python3 tools/make_fixtures.py --out DIR [--tar DIR.tar]

For every model it writes DIR/<name>/ with config.json + model.safetensors (save_pretrained) and
reference.safetensors (see tests/fixtures/README.md for every tensor's name, shape and layout):
    qwen3_next_moe   Qwen3NextForCausalLM, MoE, one dense layer (mlp_only_layers), no renormalisation
    qwen3_5_dense    Qwen3_5ForCausalLM (Qwen3_5TextConfig), dense MLP, tied embeddings
    qwen3_5_moe      Qwen3_5MoeForCausalLM (Qwen3_5MoeTextConfig)
transformers 5.17's save_pretrained writes MoE experts per expert (mlp.experts.{e}.gate_proj.weight ...,
reverting its load-time fusion), so the fused layout is covered by the re-saved Qwen3.5 copy below.
The same weights re-saved in released-checkpoint layouts (no reference file: same model):
    qwen3_5_moe_released    nested qwen3_5_moe config, `model.language_model.` prefix, fused experts
                            (gate_up_proj / down_proj without .weight, as the bf16 release), plus mtp.* and
                            model.visual.* tensors that a loader must ignore
    qwen3_next_moe_released legacy config (full_attention_interval, top-level rope_theta), per-expert
                            tensors, grouped in_proj_qkvz / in_proj_ba, two shards + index, mtp.* tensors
Everything runs on the CPU in fp32 (no TF32), eager attention, eager experts.
"""
import argparse
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tarfile
import traceback

PROMPT_LEN = 83          # > 64 and not a multiple of the 64-token chunk: two chunks, the second partial
GREEDY_TOKENS = 16
VOCAB = 256
HIDDEN = 64
INIT_STD = 0.1           # larger than HF's 0.02 so logits and states are far from trivial
NORM_NOISE = 0.1         # std of the noise added to every norm weight (they start at 0 or 1)
VERBOSE = False          # --verbose: also record the source of the HF functions that decide the math

COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4,      # GVA ratio 2
    linear_key_head_dim=16, linear_value_head_dim=24,      # d_k != d_v catches transposed states
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu", initializer_range=INIT_STD,
    max_position_embeddings=4096, attention_bias=False,
)


def log(*a):
    print(*a, flush=True)


def build_configs(tf):
    """(name, config, model class) for the three reference models."""
    out = []
    c = tf.Qwen3NextConfig(
        **COMMON, num_hidden_layers=4, full_attention_interval=2,  # L F L F
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        intermediate_size=96, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[2],
        tie_word_embeddings=False)
    out.append(("qwen3_next_moe", c, tf.Qwen3NextForCausalLM))
    c = tf.Qwen3_5TextConfig(
        **COMMON, num_hidden_layers=5,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        intermediate_size=96, tie_word_embeddings=True)
    out.append(("qwen3_5_dense", c, tf.Qwen3_5ForCausalLM))
    c = tf.Qwen3_5MoeTextConfig(
        **COMMON, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        tie_word_embeddings=False)
    out.append(("qwen3_5_moe", c, tf.Qwen3_5MoeForCausalLM))
    return out


def force_eager(model, notes):
    """Eager attention and eager experts; records what the model reports."""
    for setter, attr in (("set_attn_implementation", "_attn_implementation"),
                         ("set_experts_implementation", "_experts_implementation")):
        fn = getattr(model, setter, None)
        if fn is not None:
            try:
                fn("eager")
            except Exception as e:  # not every model has experts
                notes.append(f"{setter}('eager') raised {type(e).__name__}: {e}")
        else:
            setattr(model.config, attr, "eager")
    notes.append(f"config._attn_implementation={getattr(model.config, '_attn_implementation', None)!r} "
                 f"config._experts_implementation={getattr(model.config, '_experts_implementation', None)!r}")
    assert getattr(model.config, "_attn_implementation", "eager") == "eager"


def describe_modules(model, notes):
    """Records the classes (and the forward source) of the MoE pieces that decide the reference math."""
    for layer in model.model.layers:
        mlp = layer.mlp
        experts, gate = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
        if experts is None:
            continue
        for label, mod in (("experts", experts), ("router", gate)):
            if not VERBOSE:
                notes.append(f"{label} class {type(mod).__module__}.{type(mod).__name__}")
                continue
            try:
                src = inspect.getsource(type(mod).forward)
            except (OSError, TypeError) as e:
                src = f"<no source: {e}>"
            notes.append(f"{label} class {type(mod).__module__}.{type(mod).__name__}; forward:\n{src}")
        return


def randomise(torch, model, seed):
    """Noise on every norm weight (HF initialises them to 0 or 1) and on dt_bias (1)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.add_(torch.randn(p.shape, generator=g) * NORM_NOISE)


def as_tensor(x):
    """State 0 of a cache slot: transformers 5.17 keeps {state_idx: tensor [B, ...]}; older caches a list."""
    if isinstance(x, dict):
        return x[0] if 0 in x else next(iter(x.values()))
    return x[0] if isinstance(x, (list, tuple)) else x


def layer_cache(pkv, i):
    """(layer object or None) for cache layer i, across cache layouts."""
    layers = getattr(pkv, "layers", None)
    return layers[i] if layers is not None and i < len(layers) else None


def extract_states(torch, pkv, cfg, notes):
    """Per-layer final states from the HF cache after prefill, batch dim dropped, fp32 contiguous."""
    out = {}
    for i, t in enumerate(cfg.layer_types):
        lc = layer_cache(pkv, i)
        if t == "linear_attention":
            rec = as_tensor(getattr(lc, "recurrent_states", None)) if lc is not None else None
            conv = as_tensor(getattr(lc, "conv_states", None)) if lc is not None else None
            if rec is None:
                rec = as_tensor(pkv.recurrent_states[i])
                conv = as_tensor(pkv.conv_states[i])
            # batch size 1: keep the trailing [nv, dk, dv] and [conv_dim, K] (the cache may add leading dims)
            out[f"layers.{i}.recurrent_state"] = rec.reshape(rec.shape[-3:])
            out[f"layers.{i}.conv_state"] = conv.reshape(conv.shape[-2:])
        else:
            k = getattr(lc, "keys", None) if lc is not None else None
            v = getattr(lc, "values", None) if lc is not None else None
            if k is None:
                k, v = pkv.key_cache[i], pkv.value_cache[i]
            out[f"layers.{i}.key"] = k[0]
            out[f"layers.{i}.value"] = v[0]
    lc0 = next((layer_cache(pkv, i) for i, t in enumerate(cfg.layer_types) if t == "linear_attention"), None)
    if lc0 is not None:
        notes.append(f"linear cache layer class {type(lc0).__module__}.{type(lc0).__name__}, attributes "
                     f"{sorted(a for a in vars(lc0))}")
        for meth in ("update_conv_state", "update_recurrent_state") if VERBOSE else ():
            fn = getattr(type(lc0), meth, None) or getattr(type(pkv), meth, None)
            if fn is not None:
                try:
                    notes.append(f"{meth} source:\n{inspect.getsource(fn)}")
                except (OSError, TypeError):
                    pass
    shapes = {k: list(v.shape) for k, v in out.items()}
    notes.append(f"cache type {type(pkv).__module__}.{type(pkv).__name__}; state shapes {shapes}")
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def greedy(torch, model, ids, notes):
    """16 greedy tokens through HF generate (cached decode: the recurrent path), plus their logits;
    checked against argmax of a cache-free forward over prompt + continuation."""
    n = ids.shape[1]
    try:
        return greedy_generate(torch, model, ids, notes)
    except Exception:
        notes.append(f"generate failed, falling back to a cache-free greedy loop:\n{traceback.format_exc()}")
    seq, rows = ids, []
    for _ in range(GREEDY_TOKENS):
        last = model(seq, use_cache=False).logits[0, -1].to(torch.float32)
        rows.append(last)
        seq = torch.cat([seq, last.argmax().view(1, 1)], dim=1)
    return seq[0, n:].to(torch.int64), torch.stack(rows).contiguous()


def greedy_generate(torch, model, ids, notes):
    n = ids.shape[1]
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                         min_new_tokens=GREEDY_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    new = gen.sequences[0, n:]
    logits = torch.stack([l[0] for l in gen.logits]).to(torch.float32)
    assert new.shape[0] == GREEDY_TOKENS, new.shape
    full = model(gen.sequences[:, :-1], use_cache=False).logits[0, n - 1:].to(torch.float32)
    nocache = full.argmax(-1)
    diff = (full - logits).abs().max().item()
    notes.append(f"greedy: cached decode == cache-free argmax: {bool((nocache == new).all())}; "
                 f"max |logit diff| cached vs cache-free {diff:.3e}")
    return new.to(torch.int64), logits.contiguous()


def unfuse_experts(torch, sd):
    """Fused mlp.experts.gate_up_proj [E,2I,H] / down_proj [E,H,I] -> per-expert *.weight (released layout)."""
    out = {}
    for k, v in sd.items():
        base = k[:-len(".weight")] if k.endswith(".weight") else k
        if base.endswith("mlp.experts.gate_up_proj"):
            pre = base[:-len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{pre}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif base.endswith("mlp.experts.down_proj"):
            pre = base[:-len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def save_released_qwen35(torch, st, model, src_dir, dst_dir, seed):
    """Layout of the bf16 Qwen3.5-MoE releases (kept fp32 here so weights compare exactly): nested config,
    `model.language_model.` prefix, experts FUSED as mlp.experts.gate_up_proj [E,2I,H] / down_proj [E,H,I]
    with no `.weight` suffix (the module's own parameters), plus mtp.* / model.visual.* to ignore."""
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd), "experts module is no longer fused"
    out = {}
    for k, v in sd.items():
        out[("model.language_model." + k[len("model."):]) if k.startswith("model.") else k] = v
    g = torch.Generator().manual_seed(seed + 7)
    out["mtp.fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g)
    out["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(24, HIDDEN, generator=g)
    out["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 4, 4, generator=g)
    os.makedirs(dst_dir, exist_ok=True)
    st.save_file(out, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src_dir, "config.json")) as f:
        text = json.load(f)
    text.pop("architectures", None)
    text["model_type"] = "qwen3_5_moe_text"
    top = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "tie_word_embeddings": text.get("tie_word_embeddings", False), "text_config": text,
           "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 16}}
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(top, f, indent=2)
    return sorted(out)


def group_qwen3_next(torch, sd, cfg):
    """Flat in_proj_qkv/z/b/a -> Qwen3-Next's grouped in_proj_qkvz / in_proj_ba (per key head h:
    [q_h | k_h | v of value heads h*r..h*r+r-1 | z of those heads] and [b of those heads | a of those]).
    A no-op when the module already holds the grouped tensors."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    out = {}
    for k, v in sd.items():
        if not k.endswith("linear_attn.in_proj_qkv.weight"):
            if not any(k.endswith(f"linear_attn.in_proj_{x}.weight") for x in ("z", "b", "a")):
                out[k] = v
            continue
        pre = k[:-len("in_proj_qkv.weight")]
        q, kk, vv = v[:nk * dk], v[nk * dk:2 * nk * dk], v[2 * nk * dk:]
        z, b, a = sd[pre + "in_proj_z.weight"], sd[pre + "in_proj_b.weight"], sd[pre + "in_proj_a.weight"]
        rows, ba = [], []
        for h in range(nk):
            rows += [q[h * dk:(h + 1) * dk], kk[h * dk:(h + 1) * dk],
                     vv[h * r * dv:(h + 1) * r * dv], z[h * r * dv:(h + 1) * r * dv]]
            ba += [b[h * r:(h + 1) * r], a[h * r:(h + 1) * r]]
        out[pre + "in_proj_qkvz.weight"] = torch.cat(rows).contiguous()
        out[pre + "in_proj_ba.weight"] = torch.cat(ba).contiguous()
    return out


def save_released_qwen3_next(torch, st, model, src_dir, dst_dir, seed):
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    sd = group_qwen3_next(torch, unfuse_experts(torch, sd), model.config)
    g = torch.Generator().manual_seed(seed + 7)
    sd["mtp.fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g)
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    os.makedirs(dst_dir, exist_ok=True)
    weight_map, total = {}, 0
    for fname, keys in shards.items():
        st.save_file({k: sd[k] for k in keys}, os.path.join(dst_dir, fname), metadata={"format": "pt"})
        for k in keys:
            weight_map[k] = fname
            total += sd[k].numel() * sd[k].element_size()
    with open(os.path.join(dst_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(src_dir, "config.json")) as f:
        cfg = json.load(f)
    # Legacy style of the released Qwen3-Next config.json: no layer_types, top-level RoPE fields.
    cfg.pop("layer_types", None)
    cfg["full_attention_interval"] = 2
    rope = cfg.pop("rope_parameters", {}) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["partial_rotary_factor"] = rope.get("partial_rotary_factor", 0.25)
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return names


def reference_numerics():
    """Asserts that fla and causal_conv1d are absent (transformers then runs its pure-torch fallbacks), turns TF32
    off and sets the CPU threads (at most 8); returns the torch module. Shared with tools/make_family_fixtures.py."""
    for pkg in ("fla", "causal_conv1d"):
        assert importlib.util.find_spec(pkg) is None, f"{pkg} is installed: the reference must use the torch fallbacks"
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    return torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (one sub-folder per fixture)")
    ap.add_argument("--tar", help="also pack the output folder into this tar file")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--verbose", action="store_true", help="record HF source excerpts in NOTES.txt (not for committing)")
    args = ap.parse_args()
    global VERBOSE
    VERBOSE = args.verbose

    torch = reference_numerics()
    import transformers as tf
    from safetensors import torch as st

    os.makedirs(args.out, exist_ok=True)
    notes = [f"torch {torch.__version__}, transformers {tf.__version__}, python {sys.version.split()[0]}"]
    log(notes[0])

    for n, (name, cfg, cls) in enumerate(build_configs(tf)):
        try:
            seed = args.seed + 100 * n
            notes.append(f"== {name}: {cls.__name__} ({type(cfg).__name__}) seed {seed}")
            torch.manual_seed(seed)
            model = cls(cfg).to(torch.float32).eval()
            force_eager(model, notes)
            randomise(torch, model, seed)
            describe_modules(model, notes)
            d = os.path.join(args.out, name)
            if os.path.isdir(d):
                shutil.rmtree(d)
            model.save_pretrained(d)
            saved = st.load_file(os.path.join(d, "model.safetensors"))
            notes.append(f"save_pretrained wrote {len(saved)} tensors: " +
                         ", ".join(f"{k} {list(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in sorted(saved.items())))

            g = torch.Generator().manual_seed(seed + 2)
            ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=g, dtype=torch.int64)
            with torch.no_grad():
                out = model(ids, use_cache=True)
                ref = {"input_ids": ids[0].clone(), "logits": out.logits[0].to(torch.float32).contiguous().clone()}
                ref.update(extract_states(torch, out.past_key_values, model.config, notes))
                new, glogits = greedy(torch, model, ids, notes)
            ref["greedy"] = new.contiguous()
            ref["greedy_logits"] = glogits
            st.save_file(ref, os.path.join(d, "reference.safetensors"),
                         metadata={"transformers": tf.__version__, "torch": torch.__version__, "seed": str(seed)})
            lg = ref["logits"]
            notes.append(f"logits [{lg.shape[0]}, {lg.shape[1]}] std {lg.std().item():.4f} absmax {lg.abs().max().item():.4f}; "
                         f"greedy {new.tolist()}")

            if name == "qwen3_5_moe":
                keys = save_released_qwen35(torch, st, model, d, os.path.join(args.out, name + "_released"), seed)
                notes.append(f"qwen3_5_moe_released: {len(keys)} tensors, e.g. {keys[:4]}")
            if name == "qwen3_next_moe":
                keys = save_released_qwen3_next(torch, st, model, d, os.path.join(args.out, name + "_released"), seed)
                notes.append(f"qwen3_next_moe_released: {len(keys)} tensors in 2 shards, e.g. {keys[:4]}")
            for line in notes[-4:]:
                log(line[:2000])
        except Exception:
            notes.append(f"!! {name} FAILED:\n{traceback.format_exc()}")
            log(notes[-1])

    with open(os.path.join(args.out, "NOTES.txt"), "w") as f:
        f.write("\n".join(notes) + "\n")
    if args.tar:
        with tarfile.open(args.tar, "w") as t:
            t.add(args.out, arcname="fixtures")
    log("done")


if __name__ == "__main__":
    main()
