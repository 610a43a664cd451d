#!/usr/bin/env python3
"""Reference fixtures for the Kimi-Linear, MiniMax and Ring-linear-2.0 families (issue 14).

Run on the GPU host (PyTorch 2.11, transformers 5.17) WITHOUT the `fla` and `causal_conv1d` packages, so
transformers runs its pure-torch fallbacks; everything runs on the CPU in fp32, no TF32, eager attention,
eager experts (the conventions of tools/make_fixtures.py, whose helpers this script reuses):

    python3 tools/make_family_fixtures.py --out DIR [--tar FILE] [--families kimi_linear,minimax,bailing_moe_linear]

For every config it writes DIR/<name>/ with config.json + model.safetensors and reference.safetensors
(tests/fixtures/README.md documents every tensor), plus DIR/NOTES.txt (versions, classes, which fallback ran,
the tensor names save_pretrained wrote, self-checks, cross-checks):
    kimi_linear_grouped  KimiLinearForCausalLM, K K M K (K = KDA, M = MLA), dense layer 0, 8 experts in 4 groups
                         (top-2 groups, top-3), renormalised, shared expert; save_pretrained
    kimi_linear_qlora    KimiLinearForCausalLM, K M K K M, q_lora_rank 20, dense layers 0-1, 6 experts top-2, NOT
                         renormalised, 2 shared experts, 3 KDA heads of 12
    minimax_blocks       MiniMaxForCausalLM, L L F L, block_size 32 < prompt (2 blocks + 19), GQA 4:2, head_dim 12
                         (H*D = 48 != hidden), alpha/beta != 1, 6 experts top-2
    minimax_h3           MiniMaxForCausalLM, L L F L F, 3 heads (not a power of 2), block_size 16 (5 blocks + 3),
                         MQA, 4 experts top-3
    ring_linear_grouped  tools/ring_linear_reference.py (transformers has no bailing_moe_linear), its own save
    ring_linear_tail     idem (see that file's CONFIGS)
transformers 5.17's Kimi-Linear MLA has NO RoPE at all (KimiLinearAttention keeps the qk_rope slice of the
shared key unrotated; the config has no mla_use_nope / rope fields), so only the NoPE form can be made here.
Cross-checks (printed, not fixtures): the Ring reference's simple-GLA kernels against transformers'
MiniMaxLightningAttention (block path and per-token path), and against transformers' bailing_hybrid
lightning layer where transformers has it (5.17 does not).
"""
import argparse
import dataclasses
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tarfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import make_fixtures as mf            # noqa: E402  (force_eager, greedy, as_tensor, layer_cache, describe_modules)
import ring_linear_reference as ring  # noqa: E402

PROMPT_LEN = 83          # > 64 (KDA chunk, Ring chunk) and > the MiniMax block sizes, a multiple of none of them
GREEDY_TOKENS = mf.GREEDY_TOKENS
VOCAB = 256
HIDDEN = 64
INIT_STD = 0.1
NORM_NOISE = 0.1
FAMILIES = ("kimi_linear", "minimax", "bailing_moe_linear")

L, F = "linear_attention", "full_attention"

# (name, config kwargs, expected numbers read back from the built modules)
KIMI = [
    ("kimi_linear_grouped", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, layer_types=[L, L, F, L],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], intermediate_size=32,
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=24,
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20,
        num_local_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
        moe_intermediate_size=8, norm_topk_prob=True, routed_scaling_factor=2.446,
        rms_norm_eps=1e-5, hidden_act="silu", initializer_range=INIT_STD, tie_word_embeddings=False,
        max_position_embeddings=4096, pad_token_id=None, bos_token_id=1, eos_token_id=2),
     dict(experts=8, top_k=3, n_group=4, topk_group=2, shared_width=8, norm=True, scale=2.446)),
    ("kimi_linear_qlora", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=5, layer_types=[L, F, L, L, F],
        mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"], intermediate_size=32,
        linear_num_heads=3, linear_head_dim=12, linear_conv_kernel_dim=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
        num_local_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=2,
        moe_intermediate_size=8, norm_topk_prob=False, routed_scaling_factor=1.5,
        rms_norm_eps=1e-5, hidden_act="silu", initializer_range=INIT_STD, tie_word_embeddings=False,
        max_position_embeddings=4096, pad_token_id=None, bos_token_id=1, eos_token_id=2),
     dict(experts=6, top_k=2, n_group=1, topk_group=1, shared_width=16, norm=False, scale=1.5)),
]
MINIMAX = [
    ("minimax_blocks", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, layer_types=[L, L, F, L],
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, block_size=32,
        num_local_experts=6, num_experts_per_tok=2, intermediate_size=8,
        linear_attn_alpha_factor=1.3, linear_attn_beta_factor=0.8, full_attn_alpha_factor=1.6,
        full_attn_beta_factor=0.9, mlp_alpha_factor=1.2, mlp_beta_factor=1.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5, hidden_act="silu",
        initializer_range=INIT_STD, tie_word_embeddings=False, max_position_embeddings=4096,
        pad_token_id=None, bos_token_id=1, eos_token_id=2),
     dict(experts=6, top_k=2, block=32)),
    ("minimax_h3", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=5, layer_types=[L, L, F, L, F],
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, block_size=16,
        num_local_experts=4, num_experts_per_tok=3, intermediate_size=8,
        linear_attn_alpha_factor=2.0, linear_attn_beta_factor=1.0, full_attn_alpha_factor=0.7,
        full_attn_beta_factor=1.3, mlp_alpha_factor=1.5, mlp_beta_factor=0.6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-5, hidden_act="silu",
        initializer_range=INIT_STD, tie_word_embeddings=False, max_position_embeddings=4096,
        pad_token_id=None, bos_token_id=1, eos_token_id=2),
     dict(experts=4, top_k=3, block=16)),
]


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------------
# introspection of what this transformers has

def require_classes(tf, names, family):
    missing = [n for n in names if not hasattr(tf, n)]
    if missing:
        raise RuntimeError(f"transformers {getattr(tf, '__version__', '?')} has no {', '.join(missing)}: the "
                           f"{family} fixtures need it (transformers 5.17 ships them; is this the GPU host's venv?)")
    return [getattr(tf, n) for n in names]


def config_fields(cls):
    """Names a config class declares: dataclass fields, annotations along the MRO, explicit __init__ args."""
    names = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    for klass in inspect.getmro(cls):
        names |= set(getattr(klass, "__annotations__", {}) or {})
    try:
        params = inspect.signature(cls.__init__).parameters
        names |= {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    except (TypeError, ValueError):
        pass
    return names


def make_config(cls, kwargs):
    """cls(**kwargs) after checking every key is a field the class declares (a clear error otherwise)."""
    fields = config_fields(cls)
    unknown = sorted(k for k in kwargs if k not in fields)
    if unknown:
        raise RuntimeError(f"{cls.__name__} has no field(s) {unknown}; it declares: {sorted(fields)}")
    return cls(**kwargs)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def check_kimi_modules(model, cfg, exp):
    """The built modules carry the numbers the config was meant to give (guards attribute_map aliasing)."""
    for i, layer in enumerate(model.model.layers):
        lt, mt = cfg.layer_types[i], cfg.mlp_layer_types[i]
        attn = layer.self_attn
        if lt == L:
            check(type(attn).__name__ == "KimiLinearDeltaAttention", f"layer {i}: {type(attn).__name__}")
            check(attn.num_heads == cfg.linear_num_heads and attn.head_dim == cfg.linear_head_dim, f"layer {i} KDA dims")
            check(tuple(attn.conv1d.weight.shape) == (3 * attn.num_heads * attn.head_dim, 1, cfg.linear_conv_kernel_dim),
                  f"layer {i} conv1d {tuple(attn.conv1d.weight.shape)}")
        else:
            check(type(attn).__name__ == "KimiLinearAttention", f"layer {i}: {type(attn).__name__}")
            check(attn.kv_lora_rank == cfg.kv_lora_rank and attn.qk_rope_head_dim == cfg.qk_rope_head_dim and
                  attn.v_head_dim == cfg.v_head_dim and attn.qk_nope_head_dim == cfg.qk_nope_head_dim, f"layer {i} MLA dims")
            check((attn.q_proj is None) == (cfg.q_lora_rank is not None), f"layer {i} q_lora")
            check(not hasattr(attn, "rotary_emb"), f"layer {i}: MLA has a rotary_emb in this version: add RoPE")
        mlp = layer.mlp
        if mt == "sparse":
            g = mlp.gate
            check(mlp.experts.num_experts == exp["experts"], f"layer {i} experts {mlp.experts.num_experts}")
            check(g.top_k == exp["top_k"] and g.num_group == exp["n_group"] and g.topk_group == exp["topk_group"],
                  f"layer {i} router top_k {g.top_k} groups {g.num_group}/{g.topk_group}")
            check(bool(g.norm_topk_prob) == exp["norm"] and abs(g.routed_scaling_factor - exp["scale"]) < 1e-12,
                  f"layer {i} router norm {g.norm_topk_prob} scale {g.routed_scaling_factor}")
            check(mlp.shared_experts.gate_proj.weight.shape[0] == exp["shared_width"],
                  f"layer {i} shared width {mlp.shared_experts.gate_proj.weight.shape[0]}")
        else:
            check(type(mlp).__name__ == "KimiLinearMLP" and mlp.gate_proj.weight.shape[0] == cfg.intermediate_size,
                  f"layer {i} dense MLP")


def check_minimax_modules(model, cfg, exp):
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        want = "MiniMaxLightningAttention" if cfg.layer_types[i] == L else "MiniMaxAttention"
        check(type(attn).__name__ == want, f"layer {i}: {type(attn).__name__}")
        check(attn.head_dim == cfg.head_dim, f"layer {i} head_dim {attn.head_dim}")
        if cfg.layer_types[i] == L:
            check(attn.block_size == exp["block"], f"layer {i} block {attn.block_size}")
        check(layer.mlp.experts.num_experts == exp["experts"] and layer.mlp.gate.top_k == exp["top_k"],
              f"layer {i} MoE {layer.mlp.experts.num_experts}/{layer.mlp.gate.top_k}")


# ------------------------------------------------------------------------------------------------------
# weights

def randomise(torch, model, seed):
    """Noise on every norm weight; the decay parameters and router biases away from their HF init (A_log
    log U(1,16) -> log U(0.1,1), dt_bias -> N(-1.5,0.5), e_score_correction_bias 0 -> N(0,0.1)) so the KDA decay
    keeps a memory over the prompt and the bias changes expert choices; short-conv weights N(0, 0.3)."""
    g = torch.Generator().manual_seed(seed + 1)
    named = list(model.named_parameters()) + list(model.named_buffers())
    done = []
    with torch.no_grad():
        for name, p in named:
            if not p.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * NORM_NOISE)
            elif name.endswith("A_log"):
                p.copy_(torch.log(0.1 + 0.9 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(-1.5 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias") or name.endswith("expert_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                continue
            done.append(name.rsplit(".", 1)[-1] if "norm" not in name else "norm.weight")
    return sorted(set(done))


# ------------------------------------------------------------------------------------------------------
# cache -> states

def kimi_states(torch, pkv, cfg):
    """KDA: recurrent_state [H, K, V], conv_state [3*H*K, kernel] (channel-major, last column = last token);
    MLA: kv_latent [T, kv_lora_rank] (after kv_a_layernorm) and k_rope [T, qk_rope_head_dim] (never rotated)."""
    out = {}
    for i, t in enumerate(cfg.layer_types):
        lc = mf.layer_cache(pkv, i)
        if t == L:
            rec = mf.as_tensor(getattr(lc, "recurrent_states", None))
            conv = mf.as_tensor(getattr(lc, "conv_states", None))
            H, K = cfg.linear_num_heads, cfg.linear_head_dim
            rec, conv = rec.reshape(rec.shape[-3:]), conv.reshape(conv.shape[-2:])
            check(tuple(rec.shape) == (H, K, K), f"layer {i} recurrent state {tuple(rec.shape)}")
            check(tuple(conv.shape) == (3 * H * K, cfg.linear_conv_kernel_dim), f"layer {i} conv state {tuple(conv.shape)}")
            out[f"layers.{i}.recurrent_state"], out[f"layers.{i}.conv_state"] = rec, conv
        else:
            k, v = getattr(lc, "keys", None), getattr(lc, "values", None)
            if k is None:
                k, v = pkv.key_cache[i], pkv.value_cache[i]
            k, v = k.reshape(k.shape[-2:]), v.reshape(v.shape[-2:])
            check(k.shape[-1] == cfg.kv_lora_rank and v.shape[-1] == cfg.qk_rope_head_dim,
                  f"layer {i} MLA cache {tuple(k.shape)} {tuple(v.shape)}")
            out[f"layers.{i}.kv_latent"], out[f"layers.{i}.k_rope"] = k, v
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def minimax_states(torch, pkv, cfg, model):
    """Lightning: recurrent_state [H, D, D] (HF's KV = sum decay k^T v: [d_k][d_v]) and slope_rate [H] (per-step
    decay exp(-slope_rate)); softmax: key [KV, T, D] (after RoPE), value [KV, T, D]."""
    out = {}
    for i, t in enumerate(cfg.layer_types):
        if t == L:
            s = pkv.get_linear_cache(i) if hasattr(pkv, "get_linear_cache") else pkv.linear_cache[i]
            s = s.reshape(s.shape[-3:])
            check(s.shape[-1] == s.shape[-2] == cfg.head_dim, f"layer {i} lightning state {tuple(s.shape)}")
            out[f"layers.{i}.recurrent_state"] = s
            out[f"layers.{i}.slope_rate"] = model.model.layers[i].self_attn.slope_rate.reshape(-1)
        else:
            lc = mf.layer_cache(pkv, i)
            k, v = getattr(lc, "keys", None), getattr(lc, "values", None)
            if k is None:
                k, v = pkv.key_cache[i], pkv.value_cache[i]
            out[f"layers.{i}.key"], out[f"layers.{i}.value"] = k[0], v[0]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


# ------------------------------------------------------------------------------------------------------
# which fallback ran

class CallCounter:
    """Wraps module-level functions (looked up at call time by the layers' forward) and counts calls."""

    def __init__(self, module, names):
        self.module, self.counts, self.saved = module, {n: 0 for n in names}, {}
        for n in names:
            fn = getattr(module, n, None)
            if fn is None:
                self.counts[n] = None
                continue
            self.saved[n] = fn

            def wrapped(*a, _fn=fn, _name=n, **kw):
                self.counts[_name] += 1
                return _fn(*a, **kw)
            setattr(module, n, wrapped)

    def take(self):
        c = dict(self.counts)
        for n in self.counts:
            if self.counts[n] is not None:
                self.counts[n] = 0
        return c

    def restore(self):
        for n, fn in self.saved.items():
            setattr(self.module, n, fn)


class MiniMaxPathCounter:
    """Counts MiniMaxLightningAttention calls by path: 'block' (no linear cache yet: the block-wise prefill)
    or 'recurrent' (a cached state: the per-token loop), with the token counts."""

    def __init__(self, cls):
        self.cls, self.orig, self.counts = cls, cls.forward, {"block": 0, "block_tokens": 0, "recurrent": 0,
                                                               "recurrent_tokens": 0}
        counter = self

        def forward(self_, hidden_states, *a, **kw):
            pkv = kw.get("past_key_values")
            cached = pkv is not None and pkv.get_linear_cache(self_.layer_idx) is not None
            key = "recurrent" if cached else "block"
            counter.counts[key] += 1
            counter.counts[key + "_tokens"] += hidden_states.shape[1]
            return counter.orig(self_, hidden_states, *a, **kw)
        cls.forward = forward

    def take(self):
        c = dict(self.counts)
        for k in self.counts:
            self.counts[k] = 0
        return c

    def restore(self):
        self.cls.forward = self.orig


# ------------------------------------------------------------------------------------------------------
# one HF fixture

def make_hf_fixture(torch, tf, st, family, name, cls, cfg, exp, seed, out_dir, notes):
    notes.append(f"== {name}: {cls.__name__} ({type(cfg).__name__}) seed {seed}")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    mf.force_eager(model, notes)
    changed = randomise(torch, model, seed)
    notes.append(f"randomised: {changed}")
    if family == "kimi_linear":
        check_kimi_modules(model, model.config, exp)
    else:
        check_minimax_modules(model, model.config, exp)
    mf.describe_modules(model, notes)
    d = os.path.join(out_dir, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    model.save_pretrained(d)
    saved = st.load_file(os.path.join(d, "model.safetensors"))
    notes.append(f"save_pretrained wrote {len(saved)} tensors: " +
                 ", ".join(f"{k} {list(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in sorted(saved.items())))
    with open(os.path.join(d, "config.json")) as f:
        notes.append(f"config.json: {f.read()}")

    mod = sys.modules[type(model).__module__]
    if family == "kimi_linear":
        counter = CallCounter(mod, ["chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
                                    "causal_conv1d_fn", "causal_conv1d_update"])
    else:
        counter = MiniMaxPathCounter(mod.MiniMaxLightningAttention)
    meta = {"transformers": tf.__version__, "torch": torch.__version__, "seed": str(seed),
            "layer_types": ",".join(model.config.layer_types)}
    try:
        g = torch.Generator().manual_seed(seed + 2)
        ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=g, dtype=torch.int64)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            meta["prefill_path"] = json.dumps(counter.take(), sort_keys=True)
            ref = {"input_ids": ids[0].clone(), "logits": out.logits[0].to(torch.float32).contiguous().clone()}
            if family == "kimi_linear":
                ref.update(kimi_states(torch, out.past_key_values, model.config))
            else:
                ref.update(minimax_states(torch, out.past_key_values, model.config, model))
            counter.take()
            new, glogits = mf.greedy(torch, model, ids, notes)
            meta["decode_path"] = json.dumps(counter.take(), sort_keys=True)
    finally:
        counter.restore()
    notes.append(f"prefill ran {meta['prefill_path']}; greedy (generate + cache-free check) ran {meta['decode_path']}")
    ref["greedy"] = new.contiguous()
    ref["greedy_logits"] = glogits
    # written by the reference's codec: tensors and metadata in sorted order, so reruns give the same bytes
    # (safetensors' own writer orders the metadata map differently from run to run)
    ring.save_safetensors(ref, os.path.join(d, "reference.safetensors"), metadata=meta)
    lg = ref["logits"]
    notes.append(f"logits [{lg.shape[0]}, {lg.shape[1]}] std {lg.std().item():.4f} absmax {lg.abs().max().item():.4f}; "
                 f"greedy {new.tolist()}; states " +
                 ", ".join(f"{k} {list(v.shape)}" for k, v in sorted(ref.items()) if k.startswith("layers.")))

    # the saved layout loads back into the same model (what a loader of save_pretrained output relies on)
    try:
        try:
            back = cls.from_pretrained(d, dtype=torch.float32)
        except TypeError:
            back = cls.from_pretrained(d, torch_dtype=torch.float32)
        back = back.eval()
        mf.force_eager(back, [])
        with torch.no_grad():
            relog = back(ids, use_cache=False).logits[0].to(torch.float32)
        notes.append(f"from_pretrained(save_pretrained output): max |logit diff| {(relog - lg).abs().max().item():.3e}")
    except Exception:
        notes.append(f"from_pretrained of the saved folder FAILED:\n{traceback.format_exc()}")
    sizes = {fn: os.path.getsize(os.path.join(d, fn)) for fn in sorted(os.listdir(d))}
    notes.append(f"files {sizes}")


# ------------------------------------------------------------------------------------------------------
# cross-checks of the Ring reference's lightning kernels

def crosscheck_minimax_lightning(torch, tf, notes):
    """transformers' MiniMaxLightningAttention (block path, then its per-token path through a MiniMaxCache)
    vs the same layer written with ring_linear_reference's chunk_simple_gla / recurrent_simple_gla."""
    import torch.nn.functional as nnf
    mod = importlib.import_module(tf.MiniMaxForCausalLM.__module__)
    H, D, T, blk = 4, 12, PROMPT_LEN, 32
    cfg = make_config(tf.MiniMaxConfig, dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4,
                                              layer_types=[L, L, F, L], num_attention_heads=H, num_key_value_heads=2,
                                              head_dim=D, block_size=blk, intermediate_size=8, num_local_experts=2))
    layer = mod.MiniMaxLightningAttention(cfg, 1).eval()
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for _, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
        x = torch.randn(1, T, HIDDEN, generator=g)
        hf_block, _ = layer(x, None, None)
        cache = mod.MiniMaxCache()
        steps = [layer(x[:, :1], None, None, past_key_values=cache)[0]]
        for t in range(1, T):
            steps.append(layer(x[:, t:t + 1], None, None, past_key_values=cache)[0])
        hf_rec = torch.cat(steps, dim=1)
        qkv = nnf.silu(layer.qkv_proj(x[0])).view(T, H, 3 * D)
        q, k, v = qkv[..., :D], qkv[..., D:2 * D], qkv[..., 2 * D:]
        gdec = -layer.slope_rate.reshape(H).to(torch.float32)
        res = {}
        for kname, fn in (("chunk", ring.chunk_simple_gla), ("recurrent", ring.recurrent_simple_gla)):
            kw = {"chunk_size": blk} if kname == "chunk" else {}
            o, S = fn(q, k, v, gdec, 1.0, **kw)
            y = layer.out_proj(torch.sigmoid(layer.output_gate(x[0])) * layer.norm(o.reshape(T, H * D)))
            res[kname] = y
            res[kname + "_state"] = S
        e = {"ref chunk vs HF block": (res["chunk"] - hf_block[0]).abs().max().item(),
             "ref recurrent vs HF block": (res["recurrent"] - hf_block[0]).abs().max().item(),
             "ref recurrent vs HF per-token": (res["recurrent"] - hf_rec[0]).abs().max().item(),
             "HF block vs HF per-token": (hf_block - hf_rec).abs().max().item(),
             "final state ref vs HF": (res["chunk_state"] - cache.get_linear_cache(1)[0]).abs().max().item()}
    scale = hf_block.abs().max().item()
    line = (f"cross-check lightning (H={H}, D={D}, T={T}, block {blk}; output |max| {scale:.3f}): " +
            "; ".join(f"{k} {v:.3e}" for k, v in e.items()))
    notes.append(line)
    log(line)
    return e


def crosscheck_bailing_hybrid(torch, tf, notes):
    """transformers' BailingHybridLightningAttention (Ling 2.6) vs the Ring reference's LightningAttention with
    the same weights, where this transformers has it."""
    if not hasattr(tf, "BailingHybridConfig"):
        line = f"cross-check bailing_hybrid: transformers {tf.__version__} has no BailingHybridConfig: skipped"
        notes.append(line)
        log(line)
        return None
    try:
        mod = importlib.import_module(tf.BailingHybridConfig.__module__.replace("configuration_", "modeling_"))
        H, Lyr, li, T = 4, 4, 2, PROMPT_LEN
        want = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=Lyr, num_attention_heads=H,
                    num_key_value_heads=H, num_kv_heads_for_linear_attn=H, group_norm_size=2, use_qk_norm=True,
                    partial_rotary_factor=0.5, rms_norm_eps=1e-6, linear_silu=False, attention_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
        fields = config_fields(tf.BailingHybridConfig)
        hcfg = tf.BailingHybridConfig(**{k: v for k, v in want.items() if k in fields})
        hl = mod.BailingHybridLightningAttention(hcfg, li).eval()
        rot = mod.BailingHybridLinearRotaryEmbedding(hcfg)
        rcfg = ring.RingConfig(dict(ring.SMALL, num_hidden_layers=Lyr, num_attention_heads=H, num_key_value_heads=H,
                                    head_dim=HIDDEN // H, group_norm_size=2, use_qk_norm=True,
                                    partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1e-6))
        rl = ring.LightningAttention(rcfg, li).eval()
        g = torch.Generator().manual_seed(98)
        with torch.no_grad():
            for _, p in hl.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
            pairs = {"query_key_value": "query_key_value", "g_proj": "g_proj", "dense": "o_proj", "g_norm": "g_norm",
                     "query_layernorm": "query_layernorm", "key_layernorm": "key_layernorm"}
            for mine, theirs in pairs.items():
                getattr(rl, mine).weight.copy_(getattr(hl, theirs).weight)
            x = torch.randn(1, T, HIDDEN, generator=g)
            pos = torch.arange(T).view(1, T)
            hf = hl(x, rot(x, pos))
            mine_out = rl(x[0], torch.arange(T), {}, "chunk")
        err = (mine_out - hf[0]).abs().max().item()
        dec = (rl.log_decay - hl.slope).abs().max().item()
        line = f"cross-check bailing_hybrid lightning layer: max |out diff| {err:.3e} (|out| {hf.abs().max().item():.3f}); slopes diff {dec:.3e}"
    except Exception:
        line = f"cross-check bailing_hybrid FAILED:\n{traceback.format_exc()}"
    notes.append(line)
    log(line)
    return line


# ------------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (one sub-folder per fixture)")
    ap.add_argument("--tar", help="also pack the output folder into this tar file")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {','.join(FAMILIES)}")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        sys.exit(f"unknown famil{'y' if len(bad) == 1 else 'ies'} {bad}; known: {list(FAMILIES)}")

    torch = mf.reference_numerics()
    from safetensors import torch as st
    os.makedirs(args.out, exist_ok=True)
    tf = None
    if any(f in families for f in ("kimi_linear", "minimax")):
        import transformers as tf
    notes = [f"torch {torch.__version__}, transformers {getattr(tf, '__version__', '(not imported)')}, "
             f"python {sys.version.split()[0]}"]
    log(notes[0])
    failed = []

    jobs = []
    if "kimi_linear" in families:
        cfg_cls, model_cls = require_classes(tf, ["KimiLinearConfig", "KimiLinearForCausalLM"], "kimi_linear")
        jobs += [("kimi_linear", name, cfg_cls, model_cls, kw, exp, n) for n, (name, kw, exp) in enumerate(KIMI)]
    if "minimax" in families:
        cfg_cls, model_cls = require_classes(tf, ["MiniMaxConfig", "MiniMaxForCausalLM"], "minimax")
        jobs += [("minimax", name, cfg_cls, model_cls, kw, exp, n) for n, (name, kw, exp) in enumerate(MINIMAX)]
    for family, name, cfg_cls, model_cls, kw, exp, n in jobs:
        start = len(notes)
        try:
            cfg = make_config(cfg_cls, kw)
            make_hf_fixture(torch, tf, st, family, name, model_cls, cfg, exp, args.seed + 100 * n, args.out, notes)
        except Exception:
            notes.append(f"!! {name} FAILED:\n{traceback.format_exc()}")
            failed.append(name)
        for line in notes[start:]:
            log(line[:3000])

    if "bailing_moe_linear" in families:
        for n, name in enumerate(ring.CONFIGS):
            start = len(notes)
            notes.append(f"== {name}: ring_linear_reference.RingLinearForCausalLM seed {args.seed + 100 * n}")
            try:
                d = os.path.join(args.out, name)
                if os.path.isdir(d):
                    shutil.rmtree(d)
                ring.write_fixture(args.out, name, ring.CONFIGS[name], args.seed + 100 * n, log=notes.append)
                back = st.load_file(os.path.join(d, "reference.safetensors"))   # the codec writes valid files
                mdl = st.load_file(os.path.join(d, "model.safetensors"))
                notes.append(f"{name}: safetensors package reads reference ({len(back)} tensors) and model "
                             f"({len(mdl)} tensors)")
            except Exception:
                notes.append(f"!! {name} FAILED:\n{traceback.format_exc()}")
                failed.append(name)
            for line in notes[start:]:
                log(line[:3000])
        if tf is None:
            try:
                import transformers as tf
            except ImportError:
                notes.append("cross-checks skipped: no transformers")
        if tf is not None:
            for fn in (crosscheck_minimax_lightning, crosscheck_bailing_hybrid):
                try:
                    fn(torch, tf, notes)
                except Exception:
                    notes.append(f"!! {fn.__name__} FAILED:\n{traceback.format_exc()}")
                    log(notes[-1])

    total = 0
    for root, _, files in os.walk(args.out):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    notes.append(f"total size {total} bytes; failed: {failed or 'none'}")
    log(notes[-1])
    with open(os.path.join(args.out, "NOTES.txt"), "w") as f:
        f.write("\n".join(notes) + "\n")
    if args.tar:
        with tarfile.open(args.tar, "w") as t:
            t.add(args.out, arcname="fixtures")
    log("done")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
