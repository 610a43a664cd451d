#!/usr/bin/env python3
"""Trains small hybrid checkpoints from scratch on the multi-document task (tools/multidoc_task.py), for a GPU
host with PyTorch 2.11, transformers 5.17 and tokenizers (issue 12).

The models are transformers' own classes (Qwen3NextForCausalLM, Qwen3_5ForCausalLM); flash-linear-attention's
Gated DeltaNet kernels are used only when `fla` is importable from a checkout given with --fla-path (it is put
on sys.path before transformers is imported, since transformers binds its kernels at import), else
transformers' torch fallback runs. Training prompts are assembled exactly as hypic's router assembles a request:
every document tokenised on its own (add_special_tokens=False), then the query, then the answer and
<|endoftext|>; the loss is the next-token loss, weighted 1 on the answer tokens and <|endoftext|> and --lm-weight
(0.2) elsewhere (names recur across documents, which is what teaches a model to look them up); the curve and
final_loss report the answer tokens' loss alone.

Subcommands (each writes what it made and how into its output):
    tokenizer  --out tokenizer.json                      byte-level BPE for the task (HF tokenizers)
    heldout    --tokenizer T --out set.jsonl --prompts N --docs 4:32 --doc-tokens 128:1024 --seed S
               held-out prompts for `hypic-eval --dataset` (token counts exact under T)
    train      --preset next-moe|qwen35-dense --tokenizer T --out DIR --minutes M --seed S [--fla-path DIR]
               writes DIR/config.json, model.safetensors (bf16), tokenizer.json, training.json (command, seed,
               steps, wall time, loss curve, final loss, accuracy)
    eval       --model DIR --dataset set.jsonl [--limit N]   greedy exact-match accuracy of HF's full recomputation

Training: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), fp32 master weights under bf16 autocast, linear
warm-up then cosine decay over the time budget (the schedule follows wall time, so a run ends on time whatever
the machine's speed); batches of about --tokens-per-step tokens of prompts of one shape (document count and
length), right-padded, with up to --questions questions each. A curriculum (LEVELS) starts with 2-3 documents
of 48-96 tokens and moves up a level, to the benchmark's 4-32 documents of 128-1024 tokens, each time the
answers' exact-match rate at the current level reaches --advance-at; a fifth of the batches review a lower level.
A run continued with --init-from starts at the level where the earlier run stopped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import multidoc_task as task  # noqa: E402

EOS = "<|endoftext|>"


def log(*a):
    print(*a, flush=True)


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(":"))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: want LO:HI with 1 <= LO <= HI")
    return lo, hi


# ---- tokenizer --------------------------------------------------------------------------------------------

def cmd_tokenizer(args):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    rng = random.Random(args.seed)

    def corpus():
        for _ in range(args.corpus_prompts):
            p = task.make_prompt(rng, task.sample_shape(rng, (2, 8), (64, 512)), 8)
            yield from p.documents
            for q in p.questions:
                yield q.query
                yield q.answer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.save(args.out)
    sample = task.make_prompt(random.Random(args.seed + 1), [400, 400], 2)
    n_chars = sum(len(d) for d in sample.documents)
    n_tok = sum(len(tok.encode(d, add_special_tokens=False).ids) for d in sample.documents)
    log(f"tokenizer: {tok.get_vocab_size()} tokens, {EOS} = {tok.token_to_id(EOS)}, "
        f"{n_chars / n_tok:.2f} characters per token on task documents -> {args.out}")


def load_tokenizer(path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path))
    if tok.token_to_id(EOS) is None:
        raise SystemExit(f"{path}: no {EOS} token")
    return tok


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


# ---- held-out sets ----------------------------------------------------------------------------------------

def cmd_heldout(args):
    tok = load_tokenizer(args.tokenizer)
    rng = random.Random(args.seed)
    count = lambda s: len(encode(tok, s))  # noqa: E731
    with open(args.out, "w") as f:
        for i in range(args.prompts):
            rec = task.heldout_record(rng, i, args.docs, args.doc_tokens, count, args.id_prefix)
            f.write(json.dumps(rec) + "\n")
    log(f"heldout: {args.prompts} prompts, {args.docs[0]}-{args.docs[1]} documents of "
        f"{args.doc_tokens[0]}-{args.doc_tokens[1]} tokens, seed {args.seed} -> {args.out}")


# ---- models -----------------------------------------------------------------------------------------------

def build_config(tf, preset: str, vocab_size: int, eos_id: int):
    common = dict(vocab_size=vocab_size, hidden_size=256, rms_norm_eps=1e-6, hidden_act="silu",
                  initializer_range=0.02, max_position_embeddings=65536, attention_bias=False,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)
    if preset == "next-moe":
        # Qwen3-Next layout: 3 Gated DeltaNet layers then one gated-attention layer, twice; MoE in every layer.
        c = tf.Qwen3NextConfig(
            **common, num_hidden_layers=8, full_attention_interval=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=192,
            intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            output_router_logits=False)
        return c, tf.Qwen3NextForCausalLM
    if preset == "qwen35-dense":
        # Qwen3.5 dense: attention every 3rd layer, one key head / two value heads, 2 x 128-dim attention heads.
        c = tf.Qwen3_5TextConfig(
            **common, num_hidden_layers=6,
            layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=128,
            linear_num_key_heads=1, linear_num_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [6, 5, 5], "mrope_interleaved": True},
            intermediate_size=768)
        return c, tf.Qwen3_5ForCausalLM
    raise SystemExit(f"unknown preset {preset!r}: next-moe or qwen35-dense")


def import_transformers(fla_path):
    info = {"requested": bool(fla_path)}
    if fla_path:
        sys.path.insert(0, os.path.abspath(fla_path))
        try:
            import fla  # noqa: F401
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
            info.update(importable=True, version=getattr(fla, "__version__", "?"))
        except Exception as e:  # fall back to transformers' torch implementation
            info.update(importable=False, error=f"{type(e).__name__}: {e}")
    import transformers as tf
    return tf, info


# ---- Gated DeltaNet for training --------------------------------------------------------------------------

def chunked_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=False, chunk_size=128, **_):
    """The gated delta rule in chunks, for training (fla's backward kernels refuse Triton < 3.7.1 on Hopper).

    Same contract as transformers' torch_chunk_gated_delta_rule (modeling_qwen3_next.py): query/key [B, T, H, K],
    value [B, T, H, V], g (log decay) and beta [B, T, H]; state S [B, H, K, V]; per token (fla's convention)
        S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t / sqrt(K)
    with q, k l2-normalised when use_qk_l2norm_in_kernel. Per chunk of C tokens with in-chunk cumulative decay G:
    (I + A) U = beta (V - e^G K S0), A_ij = beta_i e^(G_i - G_j) k_i.k_j (j < i), solved for all chunks at once
    (torch.linalg.solve_triangular) as U = Uv - Uk S0; each chunk is then the affine map
    S_end = (e^(G_C) I - Kd^T Uk) S0 + Kd^T Uv (Kd_j = e^(G_C - G_j) k_j), so only S <- M S + R runs chunk after
    chunk; the outputs o = e^G (Q S0) + ((Q K^T) o L) U (L_ij = e^(G_i - G_j), j <= i) are again parallel.
    Computed in fp32 with autocast off; returns (o [B, T, H, V] in query's dtype, S [B, H, K, V] fp32 or None).
    Checked against transformers' implementation by check_gated_delta_rule before every training run."""
    import torch
    import torch.nn.functional as F
    dtype = query.dtype
    with torch.autocast("cuda", enabled=False):
        q, k, v, b, gg = (x.float() for x in (query, key, value, beta, g))
        if use_qk_l2norm_in_kernel:
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        if q.shape[2] != v.shape[2]:
            r = v.shape[2] // q.shape[2]
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        B, T, H, K = k.shape
        V = v.shape[-1]
        C = chunk_size
        pad = (C - T % C) % C
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        b, gg = (F.pad(x, (0, 0, 0, pad)) for x in (b, gg))
        N = (T + pad) // C
        # [B, H, N, C, D]
        q, k, v = (x.view(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
        b, gg = (x.view(B, N, C, H).permute(0, 3, 1, 2) for x in (b, gg))
        q = q * K ** -0.5
        G = gg.cumsum(-1)                                            # [B, H, N, C]
        diff = G.unsqueeze(-1) - G.unsqueeze(-2)                     # G_i - G_j
        tril = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        L = torch.where(tril, diff, torch.full_like(diff, -float("inf"))).exp()      # j <= i
        kk = k @ k.transpose(-1, -2)
        A = (b.unsqueeze(-1) * kk * L).tril(-1)
        eye = torch.eye(C, device=q.device)
        rhs = torch.cat([b.unsqueeze(-1) * v, (b * G.exp()).unsqueeze(-1) * k], dim=-1)
        sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        Uv, Uk = sol[..., :V], sol[..., V:]
        Kd = (G[..., -1:] - G).exp().unsqueeze(-1) * k                # [B, H, N, C, K]
        M = G[..., -1].exp()[..., None, None] * torch.eye(K, device=q.device) - Kd.transpose(-1, -2) @ Uk
        R = Kd.transpose(-1, -2) @ Uv                                # [B, H, N, K, V]
        S = (initial_state.float() if initial_state is not None
             else torch.zeros(B, H, K, V, device=q.device))
        starts = []
        for c in range(N):
            starts.append(S)
            S = M[:, :, c] @ S + R[:, :, c]
        S0 = torch.stack(starts, dim=2)                              # [B, H, N, K, V]
        U = Uv - Uk @ S0
        o = G.exp().unsqueeze(-1) * (q @ S0) + ((q @ k.transpose(-1, -2)) * L) @ U
        o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(dtype), (S if output_final_state else None)


def check_gated_delta_rule():
    """Our chunked rule against transformers' torch_chunk_gated_delta_rule: outputs, final states and the
    gradients of a random loss, on random inputs with a length that is not a multiple of either chunk size
    and an initial state; raises RuntimeError past 1e-4 relative error. Returns the errors."""
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as ref
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, K, V = 2, 301, 3, 32, 48
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, V)
    g = -torch.nn.functional.softplus(mk(B, T, H)) * 0.3
    beta = torch.sigmoid(mk(B, T, H))
    s0 = mk(B, H, K, V) * 0.1
    w = mk(B, T, H, V)
    errs = {}
    outs = []
    for fn in (chunked_gated_delta_rule, ref):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        o, s = fn(*xs[:3], g=xs[3], beta=xs[4], initial_state=s0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        ((o * w).sum() + s.square().sum()).backward()
        outs.append([o.detach(), s.detach()] + [x.grad for x in xs])
    names = ["output", "final_state", "dq", "dk", "dv", "dg", "dbeta"]
    for n, a, r in zip(names, *outs):
        errs[n] = ((a - r).norm() / r.norm()).item()
    if max(errs.values()) > 1e-4:
        raise RuntimeError(f"chunked_gated_delta_rule disagrees with transformers: {errs}")
    return errs


GDN_CALLS = [0]


def _counted_gdn(*a, **kw):
    GDN_CALLS[0] += 1
    return chunked_gated_delta_rule(*a, **kw)


def use_chunked_gdn(model):
    """Points the Gated DeltaNet layers of a transformers model at chunked_gated_delta_rule: the module-level
    kernel names of the Qwen3-Next / Qwen3.5 modeling files (transformers 5.17 resolves its kernels there) and
    any per-layer attribute. Returns the number of layer calls that reached it in a 16-token forward pass (0:
    the patch did not take and transformers' own implementation runs)."""
    import importlib
    import torch
    for name in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        except ImportError:
            continue
        for fn in ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"):
            if hasattr(mod, fn):
                setattr(mod, fn, _counted_gdn)
    for m in model.modules():
        if hasattr(m, "chunk_gated_delta_rule"):
            m.chunk_gated_delta_rule = _counted_gdn
    GDN_CALLS[0] = 0
    with torch.no_grad():
        model(torch.zeros(1, 16, dtype=torch.int64, device=next(model.parameters()).device), use_cache=False)
    return GDN_CALLS[0]


# ---- batches ----------------------------------------------------------------------------------------------

def assemble(tok, eos_id, prompt, questions):
    """ids and next-token targets (-100 outside the answers) of documents + questions, router-style."""
    ids: list[int] = []
    for enc in tok.encode_batch(prompt.documents, add_special_tokens=False):
        ids += enc.ids
    tgt = [-100] * len(ids)
    for q in questions:
        qi, ai = encode(tok, q.query), encode(tok, q.answer) + [eos_id]
        ids += qi
        tgt += [-100] * (len(qi) - 1) + [ai[0]]
        ids += ai
        tgt += ai[1:] + [-100]
    return ids, tgt


# Curriculum levels: (document count range, document token range). Level 0 is short prompts with few distractors,
# where the lookup is learnt quickly; the last level is the benchmark's shape (4-32 documents of 128-1024 tokens).
LEVELS = [((2, 3), (48, 96)), ((2, 4), (64, 160)), ((3, 6), (96, 256)), ((4, 8), (128, 384)),
          ((4, 12), (128, 512)), ((4, 16), (128, 768)), ((4, 24), (128, 1024)), ((4, 32), (128, 1024))]


class Batches:
    """An endless stream of (input_ids, answer targets, next tokens, level): the tensors [B, T] int64 on the CPU,
    made in a worker; answer targets are -100 outside the answers, next tokens -100 past each prompt's end.
    The shape of each batch's prompts is drawn from curriculum level `level.value` (a multiprocessing.Value the
    training loop raises as the model learns), or with probability `review` from a random lower level, so that
    what was learnt on short prompts is kept."""

    def __init__(self, tok_path, seed, tokens_per_step, questions, level, review=0.2):
        self.tok_path, self.seed, self.budget, self.questions = tok_path, seed, tokens_per_step, questions
        self.level, self.review = level, review

    def __iter__(self):
        import torch
        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        tok = load_tokenizer(self.tok_path)
        eos_id = tok.token_to_id(EOS)
        rng = random.Random(self.seed * 1000 + wid)
        while True:
            top = min(len(LEVELS) - 1, max(0, self.level.value))
            lv = rng.randrange(top) if top and rng.random() < self.review else top
            docs, doc_tokens = LEVELS[lv]
            n_docs = task.log_uniform_int(rng, *docs)
            scale = task.log_uniform_int(rng, *doc_tokens)
            b = max(1, self.budget // (n_docs * scale + 24 * self.questions))
            seqs = []
            for _ in range(b):
                lens = [max(24, int(scale * rng.uniform(0.6, 1.4))) for _ in range(n_docs)]
                p = task.make_prompt(rng, lens, self.questions)
                seqs.append(assemble(tok, eos_id, p, p.questions))
            t = max(len(s[0]) for s in seqs)
            ids = torch.full((len(seqs), t), eos_id, dtype=torch.int64)
            tgt = torch.full((len(seqs), t), -100, dtype=torch.int64)
            nxt = torch.full((len(seqs), t), -100, dtype=torch.int64)
            for i, (a, c) in enumerate(seqs):
                ids[i, :len(a)] = torch.tensor(a)
                tgt[i, :len(c)] = torch.tensor(c)
                nxt[i, :len(a) - 1] = torch.tensor(a[1:])
            yield ids, tgt, nxt, lv


def cmd_train(args):
    import torch
    import torch.nn.functional as F
    tf, fla_info = import_transformers(args.fla_path)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    tok = load_tokenizer(args.tokenizer)
    eos_id = tok.token_to_id(EOS)
    cfg, cls = build_config(tf, args.preset, tok.get_vocab_size(), eos_id)
    model = cls(cfg)
    if args.init_from:
        src = Path(args.init_from)
        if (src / "fp32_weights.safetensors").exists():   # our own state_dict dump: the model's own names
            from safetensors.torch import load_file
            state = load_file(str(src / "fp32_weights.safetensors"))
            missing, unexpected = model.load_state_dict(state, strict=False)
            missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
            if missing or unexpected:
                raise SystemExit(f"--init-from {args.init_from}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        else:   # a save_pretrained checkpoint: transformers maps its per-expert tensors onto the fused experts
            model = cls.from_pretrained(str(src), dtype=torch.float32)
            if model.config.to_dict().get("num_hidden_layers") != cfg.num_hidden_layers:
                raise SystemExit(f"--init-from {args.init_from}: not a {args.preset} checkpoint")
        log(f"weights from {args.init_from}")
    model = model.cuda()
    experts = "none (dense)"
    if getattr(cfg, "num_experts", 0) and hasattr(model, "set_experts_implementation"):
        for impl in ([args.experts] if args.experts != "auto" else ["grouped_mm", "eager"]):
            try:
                model.set_experts_implementation(impl)
                experts = impl
                break
            except Exception as e:  # not available in this build: try the next
                log(f"experts implementation {impl!r} refused: {type(e).__name__}: {e}")
    n_params = sum(p.numel() for p in model.parameters())
    gdn = "fla chunk_gated_delta_rule (forward and backward)"
    if not args.fla_backward:
        gdn_check = check_gated_delta_rule()
        calls = use_chunked_gdn(model)
        gdn = (f"chunked_gated_delta_rule (this script), reached by {calls} layer calls per forward pass; vs "
               f"transformers' torch_chunk_gated_delta_rule, max rel. error {max(gdn_check.values()):.1e}"
               if calls else "transformers' torch_chunk_gated_delta_rule (the patch did not take)")
    log(f"train {args.preset}: {cls.__name__}, {n_params / 1e6:.2f} M parameters, GDN: {gdn}, fla: {fla_info}")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)
    budget_s = args.minutes * 60.0
    import multiprocessing as mp
    start_level = args.start_level
    if start_level < 0:   # continue where the run we start from stopped, else from the first level
        prev = Path(args.init_from or "") / "training.json"
        start_level = json.loads(prev.read_text()).get("final_level", 0) if args.init_from and prev.exists() else 0
    level = mp.Value("i", min(start_level, len(LEVELS) - 1))
    t0 = time.time()

    class Stream(Batches, torch.utils.data.IterableDataset):
        pass

    loader = torch.utils.data.DataLoader(
        Stream(args.tokenizer, args.seed, args.tokens_per_step, args.questions, level),
        batch_size=None, num_workers=args.workers, pin_memory=True, prefetch_factor=4)
    curve, step, tokens_seen, level_steps, level_log = [], 0, 0, 0, [(0, level.value)]
    dev = "cuda"
    # window sums on the GPU (read once per log row, so steps do not wait for each other)
    w_loss, w_acc, w_right, w_answers = (torch.zeros((), device=dev) for _ in range(4))
    w_top = [torch.zeros((), device=dev) for _ in range(2)]   # answers right / answers at the current level
    win_n = 0
    t_wait = t_fwd = t_bwd = 0.0   # seconds waiting for batches, in forward, in backward + optimizer
    t_mark = time.time()
    for ids, tgt, nxt, lv in loader:
        t_got = time.time()
        t_wait += t_got - t_mark
        elapsed = t_got - t0
        if elapsed >= budget_s or (args.max_steps and step >= args.max_steps):
            break
        frac = elapsed / budget_s
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, tgt, nxt = (x.cuda(non_blocking=True) for x in (ids, tgt, nxt))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.model(input_ids=ids, use_cache=False).last_hidden_state
            logits_all = model.lm_head(h).float().flatten(0, 1)
        y_all, t_all = nxt.flatten(), tgt.flatten()
        per_token = F.cross_entropy(logits_all, y_all, reduction="none", ignore_index=-100)
        is_answer = t_all != -100
        weight = torch.where(is_answer, 1.0, torch.where(y_all != -100, args.lm_weight, 0.0))
        loss = (per_token * weight).sum() / weight.sum()
        if args.profile:
            torch.cuda.synchronize()
        t_f = time.time()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            hit = (logits_all.argmax(-1) == y_all) & is_answer
            n_ans_tok = is_answer.sum()
            # one answer = one run of answer tokens; it is right when every token of the run is
            start = is_answer & ~torch.cat([is_answer.new_zeros(1), is_answer[:-1]])
            aid = torch.cumsum(start.long(), 0) - 1
            wrong = torch.zeros(is_answer.numel(), device=dev).index_add_(
                0, aid.clamp(min=0), (is_answer & ~hit).float())
            n_ans = start.sum()
            right = n_ans - (wrong[:is_answer.numel()] > 0).logical_and(
                torch.arange(is_answer.numel(), device=dev) < n_ans).sum()
            w_loss += (per_token * is_answer).sum() / n_ans_tok.clamp(min=1)
            w_acc += hit.sum() / n_ans_tok.clamp(min=1)
            w_right += right
            w_answers += n_ans
            if lv == level.value:
                w_top[0] += right
                w_top[1] += n_ans
        step += 1
        level_steps += 1
        tokens_seen += ids.numel()
        t_mark = time.time()
        t_fwd += t_f - t_got
        t_bwd += t_mark - t_f
        win_n += 1
        if step % args.log_every == 0:
            top_em = (w_top[0] / w_top[1].clamp(min=1)).item()
            row = {"step": step, "seconds": round(time.time() - t0, 1), "loss": w_loss.item() / win_n,
                   "answer_token_accuracy": w_acc.item() / win_n,
                   "answer_exact_match": (w_right / w_answers.clamp(min=1)).item(),
                   "level": level.value, "level_exact_match": top_em, "lr": lr, "tokens": tokens_seen,
                   "batch_shape": list(ids.shape), "data_wait_s": round(t_wait, 1),
                   "forward_s": round(t_fwd, 1), "backward_step_s": round(t_bwd, 1)}
            curve.append(row)
            log(json.dumps(row))
            if (top_em >= args.advance_at and level_steps >= args.min_level_steps
                    and level.value < min(args.max_level, len(LEVELS) - 1)):
                level.value += 1
                level_steps = 0
                level_log.append((step, level.value))
                log(f"curriculum: level {level.value} {LEVELS[level.value]} at step {step}")
            for w in (w_loss, w_acc, w_right, w_answers, *w_top):
                w.zero_()
            win_n = 0
    wall = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.save_fp32:  # to continue training elsewhere (--init-from) without bf16 rounding of the weights
        from safetensors.torch import save_file
        save_file({k: v.detach().float().contiguous() for k, v in model.state_dict().items()
                   if not (cfg.tie_word_embeddings and k == "lm_head.weight")}, str(out / "fp32_weights.safetensors"))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    final = curve[-1] if curve else {}
    report = {
        "preset": args.preset, "class": cls.__name__, "parameters": n_params,
        "command": "python3 " + " ".join(shlex.quote(a) for a in sys.argv),
        "seed": args.seed, "steps": step, "wall_seconds": round(wall, 1), "tokens_seen": tokens_seen,
        "final_loss": final.get("loss"), "final_answer_token_accuracy": final.get("answer_token_accuracy"),
        "final_answer_exact_match": final.get("answer_exact_match"), "final_level": level.value,
        "levels": [{"level": i, "documents": list(d), "document_tokens": list(t)} for i, (d, t) in enumerate(LEVELS)],
        "level_changes": [{"step": s_, "level": l_} for s_, l_ in level_log],
        "lr": args.lr, "warmup_steps": args.warmup, "tokens_per_step": args.tokens_per_step,
        "questions_per_prompt": args.questions, "lm_weight": args.lm_weight, "experts": experts,
        "init_from": args.init_from, "seconds_waiting_for_data": round(t_wait, 1),
        "seconds_forward": round(t_fwd, 1), "seconds_backward_and_step": round(t_bwd, 1), "gated_delta_rule": gdn, "fla": fla_info,
        "torch": torch.__version__, "transformers": tf.__version__, "device": torch.cuda.get_device_name(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "curve": curve,
    }
    # a continued run carries the record of the runs before it, so one file gives the whole training
    history = []
    prev = Path(args.init_from or "") / "training.json"
    if args.init_from and prev.exists():
        p = json.loads(prev.read_text())
        history = p.get("earlier_runs", []) + [{k: p.get(k) for k in (
            "command", "seed", "steps", "wall_seconds", "tokens_seen", "final_loss", "final_answer_exact_match",
            "final_level", "date_utc", "device")}]
    report["earlier_runs"] = history
    report["total_steps"] = step + sum(h.get("steps") or 0 for h in history)
    report["total_wall_seconds"] = round(wall + sum(h.get("wall_seconds") or 0 for h in history), 1)
    report["total_tokens_seen"] = tokens_seen + sum(h.get("tokens_seen") or 0 for h in history)
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"saved {out}: {step} steps in {wall:.0f} s, final loss {final.get('loss')}")


# ---- HF evaluation ----------------------------------------------------------------------------------------

def cmd_eval(args):
    import torch
    tf, fla_info = import_transformers(args.fla_path)
    tok = load_tokenizer(Path(args.model) / "tokenizer.json")
    eos_id = tok.token_to_id(EOS)
    arch = json.loads((Path(args.model) / "config.json").read_text())["architectures"][0]
    model = getattr(tf, arch).from_pretrained(args.model, dtype=torch.float32).cuda().eval()
    if not fla_info.get("importable"):
        use_chunked_gdn(model)  # prefill through ours (checked against transformers'); decode stays HF's
    rows = [json.loads(line) for line in open(args.dataset)]
    if args.limit:
        rows = rows[:args.limit]
    right, by_kind = 0, {}
    t0 = time.time()
    for r in rows:
        ids = []
        for d in r["documents"]:
            ids += encode(tok, d)
        ids += encode(tok, r["query"])
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                               eos_token_id=eos_id, pad_token_id=eos_id)
        new = g[0, len(ids):].tolist()
        if eos_id in new:
            new = new[:new.index(eos_id)]
        text = tok.decode(new)
        ok = text.strip() == r["answer"].strip()
        right += ok
        k = by_kind.setdefault(r["kind"], [0, 0])
        k[0] += ok
        k[1] += 1
    res = {"model": args.model, "dataset": args.dataset, "prompts": len(rows), "accuracy": right / len(rows),
           "by_kind": {k: v[0] / v[1] for k, v in by_kind.items()}, "seconds": round(time.time() - t0, 1),
           "numerics": "HF fp32 (bf16 checkpoint)", "fla": fla_info}
    log(json.dumps(res))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(res, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("tokenizer")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--corpus-prompts", type=int, default=3000)
    p.add_argument("--seed", type=int, default=20261201)
    p = sub.add_parser("heldout")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, required=True)
    p.add_argument("--docs", type=parse_range, default=(4, 32))
    p.add_argument("--doc-tokens", type=parse_range, default=(128, 1024))
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--id-prefix", default="q")
    p = sub.add_parser("train")
    p.add_argument("--preset", required=True, choices=["next-moe", "qwen35-dense"])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--tokens-per-step", type=int, default=131072)
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--start-level", type=int, default=-1,
                   help="first curriculum level (default: the final level of --init-from's training.json, else 0)")
    p.add_argument("--max-level", type=int, default=len(LEVELS) - 1)
    p.add_argument("--advance-at", type=float, default=0.8,
                   help="answer exact-match rate at the current level that moves the curriculum up a level")
    p.add_argument("--min-level-steps", type=int, default=100)
    p.add_argument("--lm-weight", type=float, default=0.2,
                   help="weight of the next-token loss on the documents and queries (answers weigh 1)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--fla-path")
    p.add_argument("--init-from", help="start from the weights of a checkpoint directory (its fp32_weights.safetensors "
                                       "when present, else model*.safetensors)")
    p.add_argument("--save-fp32", action="store_true", help="also write fp32_weights.safetensors (for --init-from)")
    p.add_argument("--experts", default="auto", help="MoE experts implementation: auto (grouped_mm, else eager), "
                                                     "grouped_mm, eager")
    p.add_argument("--profile", action="store_true", help="synchronise after the forward pass so that forward_s and "
                                                          "backward_step_s split the GPU time correctly")
    p.add_argument("--fla-backward", action="store_true",
                   help="train through fla's kernels (needs --fla-path; its backward refuses Triton < 3.7.1 on "
                        "Hopper); default: chunked_gated_delta_rule of this script")
    p = sub.add_parser("eval")
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--out-json")
    p.add_argument("--fla-path")
    args = ap.parse_args()
    {"tokenizer": cmd_tokenizer, "heldout": cmd_heldout, "train": cmd_train, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    main()
